"""Scratch memory reused across calls: one pool per thread, one cap, for every backend.

A fresh multi-MB tensor costs a page fault per 4 KiB on first touch, on every call (a page
gather into a new tensor ran at a third of the speed of one into a reused buffer; bench/RESULTS.md),
so kernels take their temporaries from here. ``scratch(name, shape, dtype, device)`` returns a
view of this thread's byte buffer for ``name``: views of one name share bytes (a later call for
the same name overwrites an earlier view), contents are undefined, and a result must never
outlive the step that asked for it. Buffers made under ``torch.inference_mode`` cannot be
written outside it, so each mode has its own.

Every buffer a kernel fills completely (outputs, split partials, packed operands), on every
backend, comes from ``empty_output``. With ``POISON`` set (the tests' ``nan_buffers`` fixture
sets it and calls ``clear``) those buffers and new scratch buffers start as NaN, so an element a
kernel leaves unwritten, or scratch read before it is written, shows.
"""

from __future__ import annotations

import math
import threading

import torch

CAP_BYTES = 256 << 20  # buffers up to this size are kept between calls; larger ones are allocated per call
MAX_VIEWS = 256  # cached views per thread (ragged batches make many shapes; the table stays small)

POISON = False  # tests only: new buffers start as NaN (all bits set), see the module docstring

_local = threading.local()


def empty_output(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """A buffer a kernel fills completely: uninitialised, or with ``POISON`` NaN (-1 in an
    integer dtype)."""
    if POISON:
        return torch.full(shape, math.nan if dtype.is_floating_point else -1, dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def _new(nbytes: int, device: torch.device) -> torch.Tensor:
    """Every scratch buffer comes from here (with ``POISON``: 0xFF bytes, NaN in every float dtype)."""
    if POISON:
        return torch.full((nbytes,), 0xFF, dtype=torch.uint8, device=device)
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def _pools() -> tuple[dict, dict]:
    if not hasattr(_local, "bufs"):
        _local.bufs, _local.views = {}, {}
    return _local.bufs, _local.views


def scratch(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """A ``shape`` x ``dtype`` view of this thread's reused buffer ``name`` on ``device`` (contents undefined)."""
    device = torch.device(device)
    bufs, views = _pools()
    name_key = (name, device, torch.is_inference_mode_enabled())
    key = (name_key, shape, dtype)
    view = views.get(key)
    if view is not None:
        return view
    nbytes = math.prod(shape) * dtype.itemsize
    buf = bufs.get(name_key)
    if buf is None or buf.numel() < nbytes:
        buf = _new(max(nbytes, 1), device)
        if nbytes > CAP_BYTES:
            return buf[:nbytes].view(dtype).view(shape)
        bufs[name_key] = buf
        for k in [k for k in views if k[0] == name_key]:
            del views[k]  # they point at the old buffer
    view = buf[:nbytes].view(dtype).view(shape)
    if len(views) >= MAX_VIEWS:
        views.clear()
    views[key] = view
    return view


def clear() -> None:
    """Drop this thread's buffers (the next calls allocate afresh)."""
    bufs, views = _pools()
    bufs.clear()
    views.clear()
