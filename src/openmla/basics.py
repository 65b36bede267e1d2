"""What every layer checks with, defined once: the dtype sets and the error helper (imports torch only).

- ``FLOAT_DTYPES``: the float dtypes a kernel input (and a native cache entry) may have.
- ``INDEX_DTYPES``: index metadata ``openmla.plan`` copies into private int32 tensors before any
  kernel reads it (a ``CacheBatch``'s tables, lengths and offsets, sparse lists, chunk offsets;
  MAX passes uint32 offsets), so uint32 is taken.
- ``SIGNED_INDEX_DTYPES``: index tensors a kernel reads in place and that may hold -1 (DeepSeek-V4's
  page tables, lengths, offsets and top-k picks, ``openmla.v4``): int32 or int64. Its kernels and
  its validation compare with -1 and 0, which uint32 has no operators for in torch, so V4 refuses
  uint32 with a ``ValueError`` naming the tensor (``tests/test_dispatch.py``).
- ``fail(name, why)``: the ``ValueError`` whose message starts with the argument's name.
"""

from __future__ import annotations

from typing import NoReturn

import torch

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
SIGNED_INDEX_DTYPES = (torch.int32, torch.int64)
INDEX_DTYPES = SIGNED_INDEX_DTYPES + (torch.uint32,)


def fail(name: str, why: str) -> NoReturn:
    """Raise the ``ValueError`` ``"{name}: {why}"``."""
    raise ValueError(f"{name}: {why}")


__all__ = ["FLOAT_DTYPES", "INDEX_DTYPES", "SIGNED_INDEX_DTYPES", "fail"]
