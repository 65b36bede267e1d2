"""The ``cpu`` backend: native C++ kernels (oneDNN brgemm through ATen, one parallel region
per call), built on first use; see ``backend`` for what runs natively and ``build`` for how it is
compiled and cached.

- ``build``: compile/load ``csrc/`` with ``torch.utils.cpp_extension`` (cached per torch
  version and CPU flags), after writing ``codes.h`` (the format and mask codes,
  ``openmla.kernel_codes``); :func:`available` is False (after one warning) where that fails.
- ``kernels``: flat wrappers (tensors and ints, no ``CacheBatch``).
- ``backend``: ``CpuBackend``, the backend interface of ``openmla.backends``.
"""

from __future__ import annotations


def available() -> bool:
    """True when the native kernels are built and loaded here (compiles them on first call)."""
    from . import build

    return build.load()
