"""``openmla accuracy`` writing into bench/out/ (the RESULTS.md runs): see openmla/accuracy.py."""

import sys

from openmla.accuracy import main

if __name__ == "__main__":
    main(sys.argv[1:], out="bench/out/cache_accuracy")
