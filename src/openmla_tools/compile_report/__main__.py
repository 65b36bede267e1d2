"""``python -m openmla_tools.compile_report``: the Triton compile report (``command``)."""

import sys

from .command import main

sys.exit(main())
