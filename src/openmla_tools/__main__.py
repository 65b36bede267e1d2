"""``python -m openmla_tools`` (and ``torchrun -m openmla_tools``): the ``openmla`` command."""

import sys

from .cli import main

sys.exit(main())
