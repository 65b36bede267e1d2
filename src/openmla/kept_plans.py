"""The plan of a MAX-named op (``openmla.compat.max``), kept for its ``CacheBatch`` (checks once per metadata object).

The plans are kept here, not on the batch: a weak mapping from the batch's host lists
(``CacheBatch._host``, shared by the batch's shallow copies, as the batch's metadata is) to the
plans made for it; they go with that object, and a ``HostLists.refill`` drops them.

Every layer of a step calls the one-shot ops with the same batch and options; the first call
validates and plans, the next ones reuse that plan after checking that the batch still holds the
same storage (identity and layout) and the same metadata (compared by value, so edits through a
numpy view count too). Anything changed, or per-call tensor options, plan again.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import NamedTuple

import torch

from .backends import load_backend, resolve_backend_name
from .cache import CacheBatch, HostLists
from .planning import MLAPlan, plan

__all__ = ["kept_plan"]

_TENSOR_OPTIONS = ("sparse_indices", "topk_lengths", "attn_sink")  # per-call tensors: planned every call
_METADATA = ("block_table", "cache_lengths", "input_row_offsets")  # compared by value
_KEPT_PLANS = 4  # option sets remembered per batch
_kept: "weakref.WeakKeyDictionary[HostLists, tuple[int, dict]]" = weakref.WeakKeyDictionary()  # host lists -> (refills, plans)


class _Kept(NamedTuple):
    plan: MLAPlan
    fields: tuple  # the batch's other fields, compared by identity, and its storage's layout
    metadata: tuple[torch.Tensor, ...]  # copies of the metadata as validated


def _fields(batch: CacheBatch) -> tuple:
    blocks = batch.blocks
    layout = (tuple(blocks.shape), blocks.stride(), blocks.data_ptr()) if isinstance(blocks, torch.Tensor) else None
    return (*(getattr(batch, f.name) for f in dataclasses.fields(batch) if f.name not in _METADATA and f.compare), layout)


def _same(batch: CacheBatch, kept: _Kept) -> bool:
    now = _fields(batch)
    if now[-1] != kept.fields[-1] or any(a is not b for a, b in zip(now[:-1], kept.fields[:-1])):
        return False
    for name, was in zip(_METADATA, kept.metadata):
        now = getattr(batch, name)
        if not (isinstance(now, torch.Tensor) and now.dtype == was.dtype and now.device == was.device
                and now.shape == was.shape and torch.equal(now, was)):
            return False
    return True


def kept_plan(kv_collection: object, scale: object, options: dict) -> MLAPlan:
    """``openmla.plan(kv_collection, scale=scale, **options)``, kept on the batch for the next call
    with the same options while its storage and metadata stay the same."""
    if (not isinstance(kv_collection, CacheBatch) or torch.compiler.is_compiling()
            or any(options.get(k) is not None for k in _TENSOR_OPTIONS)):
        return plan(kv_collection, scale=scale, **options)
    try:  # the backend as resolved now (OPENMLA_BACKEND, device), so a change of either plans again
        be = load_backend(resolve_backend_name(options.get("backend"), kv_collection.blocks.device))
        key = (scale, be, tuple(sorted(options.items())))
        hash(key)
    except (AttributeError, TypeError, ValueError):  # a bad option or batch: plan() names it
        return plan(kv_collection, scale=scale, **options)
    kept = _plans_for(kv_collection._host)
    hit = kept.get(key)
    if hit is not None and _same(kv_collection, hit):
        return hit.plan
    if not all(isinstance(getattr(kv_collection, n), torch.Tensor) for n in _METADATA):
        return plan(kv_collection, scale=scale, **options)  # it names the bad field
    fields = _fields(kv_collection)
    metadata = tuple(getattr(kv_collection, n).clone() for n in _METADATA)  # before plan() reads them
    step = plan(kv_collection, scale=scale, **options)
    if len(kept) >= _KEPT_PLANS:
        kept.clear()
    kept[key] = _Kept(step, fields, metadata)
    return step


def _plans_for(host: HostLists) -> dict:
    """The plans kept for the batches over ``host`` (emptied when ``host`` was refilled since)."""
    entry = _kept.get(host)
    if entry is None or entry[0] != host.refills:
        entry = _kept[host] = (host.refills, {})
    return entry[1]
