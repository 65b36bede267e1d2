"""``openmla accuracy`` writing into bench/out/ (the RESULTS.md runs): see src/openmla_tools/accuracy.py."""

import sys

from openmla_tools.accuracy import main

if __name__ == "__main__":
    main(sys.argv[1:], out="bench/out/cache_accuracy")
