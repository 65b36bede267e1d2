"""The ``openmla`` command's whole-model verbs (``generate``, ``models``, ``demo --model``), on ``openmla.hf``."""
