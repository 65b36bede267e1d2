"""The ``openmla`` command's demo on a ``tp x cp`` grid (``torchrun -m openmla_tools demo --tp 2 --cp 2``), on ``openmla.distributed``."""
