"""``python -m openmla`` (and ``torchrun -m openmla``): the ``openmla`` command."""

import sys

from .cli import main

sys.exit(main())
