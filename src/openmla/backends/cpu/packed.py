"""Packed copies of the absorption weights (``w_uk``, ``w_uv``), one per weight tensor.

The per-head kernel reads a weight ``w [H, M, K]`` as brgemm's B operand, ``w[h]^T`` (bf16 in
VNNI pairs): a transposed copy of the weight. Packing is a pass over the whole weight, which at
decode sizes costs as much as the product itself, so it is done once per weight and kept; the
copy is as large as the weight (H=128 DeepSeek dims: 16 MiB per weight, 32 MiB per layer).

An entry is keyed by the weight's address, shape, strides and dtype, and remembers its version
counter and a weak reference to the tensor that owns the memory (the view's base):

- an in-place edit of the weight (or of its base) bumps the version: the next call repacks;
- a weight that is freed drops its entry, and a new tensor at the same address is not mistaken
  for it (the weak reference is dead);
- edits the version counter does not see are not seen either: writes through ``.data``, and
  inference tensors (``torch.inference_mode``), which track no version, so those are packed
  on every call and never cached.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import torch

from . import kernels

__all__ = ["packed", "clear"]


@dataclass(frozen=True)
class _Entry:
    owner: weakref.ref  # the tensor that owns the weight's memory
    version: int
    packed: torch.Tensor


_entries: dict[tuple, _Entry] = {}
_lock = threading.Lock()


def _key(w: torch.Tensor) -> tuple:
    return (w.data_ptr(), tuple(w.shape), tuple(w.stride()), w.dtype)


def _drop(key: tuple, ref: weakref.ref) -> None:
    with _lock:
        if (e := _entries.get(key)) is not None and e.owner is ref:
            del _entries[key]


def packed(w: torch.Tensor) -> torch.Tensor:
    """:func:`kernels.pack_heads` of ``w [H, M, K]``, from the cache while ``w`` is unchanged."""
    if w.is_inference():
        return kernels.pack_heads(w)
    owner = w if w._base is None else w._base
    key, version = _key(w), w._version
    e = _entries.get(key)
    if e is not None and e.owner() is owner and e.version == version:
        return e.packed
    p = kernels.pack_heads(w)
    ref = weakref.ref(owner, lambda r, key=key: _drop(key, r))
    with _lock:
        _entries[key] = _Entry(ref, version, p)
    return p


def clear() -> None:
    """Forget every packed weight (they are rebuilt on next use)."""
    with _lock:
        _entries.clear()
