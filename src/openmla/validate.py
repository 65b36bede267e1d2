"""Argument checks shared by every public op, run once before any backend work or cache write.

Every failure is a ``ValueError`` whose message starts with the argument's name.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch

from .basics import FLOAT_DTYPES, INDEX_DTYPES
from .cache import STORAGE_DTYPES, CacheBatch, HostLists, index_tensors_ok
from .formats import CACHE_FORMATS, RECORDS
from .fp8 import FP8, dequantize_q

HOST_TABLE_MAX = 1024  # page-table entries read to the host with the lengths (below this, min/max on a list beat an aminmax read)


def check_tensor(
    name: str,
    t: object,
    *,
    rank: int | None = None,
    shape: Sequence[int | None] | None = None,
    dtypes: Sequence[torch.dtype] | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Type, rank, shape (``None`` = any size), dtype and device of one tensor argument."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if shape is not None:
        rank = len(shape)
    if rank is not None and t.dim() != rank:
        raise ValueError(f"{name}: expected rank {rank}, got shape {tuple(t.shape)}")
    if shape is not None:
        for i, (want, got) in enumerate(zip(shape, t.shape)):
            if want is not None and want != got:
                raise ValueError(f"{name}: expected shape {tuple('*' if s is None else s for s in shape)}, got {tuple(t.shape)} (dim {i})")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{name}: dtype {t.dtype} not supported; expected one of {[str(d) for d in dtypes]}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: on {t.device}, expected {device} (all tensors must share a device)")
    return t


def check_int(name: str, value: object, lo: int | None = None, hi: int | None = None) -> int:
    """An int in ``[lo, hi)``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}: expected an int, got {value!r}")
    if lo is not None and value < lo:
        raise ValueError(f"{name}: must be >= {lo}, got {value}")
    if hi is not None and value >= hi:
        raise ValueError(f"{name}: must be < {hi}, got {value}")
    return value


def check_float(name: str, value: object, lo: float | None = None) -> float:
    """A finite real number (not a bool), optionally ``>= lo``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
        raise ValueError(f"{name}: expected a finite float, got {value!r}")
    if lo is not None and value < lo:
        raise ValueError(f"{name}: must be >= {lo}, got {value!r}")
    return float(value)


def check_query(q: object, q_scale: object, num_tokens: int, device: torch.device,
                depth: int | None = None) -> tuple[torch.Tensor, torch.dtype]:
    """A query ``[T, H, depth]`` of a float dtype or float8_e4m3fn (with ``q_scale``: scalar, ``[1]``
    or per token, float32). Returns the query to compute with (an fp8 one dequantised to bfloat16)
    and the output dtype. Shapes only: no tensor value is read."""
    if (q_scale is None and type(q) is torch.Tensor and q.dtype in FLOAT_DTYPES and q.dim() == 3 and q.shape[0] == num_tokens
            and (depth is None or q.shape[2] == depth) and q.device == device):
        return q, q.dtype  # the common case, checked in one expression (per layer, every step)
    check_tensor("q", q, shape=(num_tokens, None, depth), dtypes=FLOAT_DTYPES + (FP8,), device=device)
    if q.dtype != FP8:
        if q_scale is not None:
            raise ValueError("q_scale: only a float8_e4m3fn q takes a scale")
        return q, q.dtype
    if isinstance(q_scale, torch.Tensor):
        check_tensor("q_scale", q_scale, dtypes=(torch.float32,), device=device)
        if q_scale.numel() not in (1, q.shape[0]) or q_scale.dim() > 1:
            raise ValueError(f"q_scale: expected a scalar, [1] or per-token [{q.shape[0]}], got {tuple(q_scale.shape)}")
    elif q_scale is not None:
        check_float("q_scale", q_scale)
    return dequantize_q(q, q_scale, torch.bfloat16), torch.bfloat16


def check_offsets(name: str, offsets: object, total: int, device: torch.device) -> list[int]:
    """Ragged row offsets ``[B+1]``: 0 first, non-decreasing, ``total`` last. Returns them as ints."""
    check_tensor(name, offsets, rank=1, dtypes=INDEX_DTYPES, device=device)
    if offsets.shape[0] < 2:
        raise ValueError(f"{name}: needs B+1 >= 2 entries, got {offsets.shape[0]}")
    vals = [int(v) for v in offsets.tolist()]
    if vals[0] != 0:
        raise ValueError(f"{name}: must start at 0, got {vals[0]}")
    if any(b < a for a, b in zip(vals, vals[1:])):
        raise ValueError(f"{name}: must be non-decreasing, got {vals}")
    if vals[-1] != total:
        raise ValueError(f"{name}: must end at {total} (the number of rows), got {vals[-1]}")
    return vals


def _host_ints(name: str, t: torch.Tensor) -> list[int]:
    """Values of a small index tensor on the host (one transfer)."""
    return [int(v) for v in t.to("cpu", torch.int64).tolist()]


def check_storage(batch: CacheBatch, device: torch.device | None = None) -> None:
    """The cache storage of a batch view: rank, dtype for its format, page size, scales."""
    check_tensor("kv_collection.blocks", batch.blocks, rank=4, device=device)
    fmt = batch.cache_format
    if fmt not in CACHE_FORMATS:
        raise ValueError(f"kv_collection.cache_format: {fmt!r} is not one of {CACHE_FORMATS}")
    want = STORAGE_DTYPES[fmt]
    if batch.blocks.dtype not in want:
        raise ValueError(f"kv_collection.blocks: a {fmt} cache is stored as {[str(d) for d in want]}, got {batch.blocks.dtype}")
    if isinstance(batch.page_size, bool) or not isinstance(batch.page_size, int) or batch.page_size != batch.blocks.shape[2]:
        raise ValueError(f"kv_collection.page_size: {batch.page_size!r} but blocks hold pages of {batch.blocks.shape[2]}")
    dev = batch.blocks.device
    if fmt == "fp8_e4m3":
        check_tensor("kv_collection.kv_scale", batch.kv_scale, shape=(batch.num_layers,), dtypes=(torch.float32,), device=dev)
    if fmt in RECORDS and (isinstance(batch.rope_dim, bool) or not isinstance(batch.rope_dim, int) or batch.rope_dim < 2
                           or not RECORDS[fmt].fits(int(batch.blocks.shape[3]), batch.rope_dim)):
        raise ValueError(f"kv_collection.rope_dim: {fmt} records of {batch.blocks.shape[3]} bytes need the rope width that splits "
                         f"them, got {batch.rope_dim!r}")


def snapshot_batch(kv_collection: object, head_dim: int | None = None) -> CacheBatch:
    """Validate a ``CacheBatch`` and return a view over private int32 copies of its metadata, with
    host lists read from those copies (what is validated is exactly what the kernels read).

    Checks: storage (``check_storage``), metadata ranks/dtypes/devices, ``input_row_offsets`` (0
    first, non-decreasing, ``B+1`` entries), ``cache_lengths >= 0``, and every page-table entry a
    sequence will touch inside the pool.
    """
    if not isinstance(kv_collection, CacheBatch):
        raise ValueError(f"kv_collection: expected a CacheBatch, got {type(kv_collection).__name__}")
    b = kv_collection
    check_storage(b)
    dev = b.blocks.device
    if head_dim is not None and b.head_dim != head_dim:
        raise ValueError(f"kv_collection.blocks: entry width {b.head_dim}, expected {head_dim} (L+R)")
    cl, bt, offs = b.cache_lengths, b.block_table, b.input_row_offsets
    if not (index_tensors_ok(dev, (cl, 1), (bt, 2), (offs, 1)) and bt.shape[0] == cl.shape[0] == offs.shape[0] - 1):
        check_tensor("kv_collection.cache_lengths", cl, rank=1, dtypes=INDEX_DTYPES, device=dev)
        check_tensor("kv_collection.block_table", bt, shape=(cl.shape[0], None), dtypes=INDEX_DTYPES, device=dev)
        check_tensor("kv_collection.input_row_offsets", offs, shape=(cl.shape[0] + 1,), dtypes=INDEX_DTYPES, device=dev)
    B, W = bt.shape
    # One private copy of all three first, then every check reads it (one host transfer: the
    # lengths, and the page table too when it is small).
    parts = [cl, offs, bt.reshape(-1)]
    if not cl.dtype == offs.dtype == bt.dtype == torch.int32:
        parts = [t.to(torch.int32) for t in parts]  # (cat does not promote uint32)
    meta = torch.cat(parts)
    cl, offs, bt = meta.split([B, B + 1, B * W])
    bt = bt.view(B, W)
    table_on_host = B * W <= HOST_TABLE_MAX
    host = (meta if table_on_host else meta[: 2 * B + 1]).tolist()
    cache_lens, offsets = host[:B], host[B:2 * B + 1]
    if offsets[0] != 0:
        raise ValueError(f"kv_collection.input_row_offsets: must start at 0, got {offsets[0]}")
    seq_lens = [c + e - s for c, s, e in zip(cache_lens, offsets, offsets[1:])]  # per sequence, never per token
    if any(e < s for s, e in zip(offsets, offsets[1:])):
        raise ValueError(f"kv_collection.input_row_offsets: must be non-decreasing, got {offsets}")
    if B and min(cache_lens) < 0:
        raise ValueError(f"kv_collection.cache_lengths: negative length in {cache_lens}")
    width, ps = bt.shape[1], b.page_size
    longest = max(seq_lens, default=0)
    if -(-longest // ps) > width:
        i = next(i for i, n in enumerate(seq_lens) if -(-n // ps) > width)
        raise ValueError(f"kv_collection.block_table: sequence {i} needs {-(-seq_lens[i] // ps)} pages, the table has {width}")
    if B * W:
        pages = host[2 * B + 1:]
        lo, hi = (min(pages), max(pages)) if table_on_host else torch.stack(torch.aminmax(bt)).tolist()
        if not (0 <= lo and hi < b.num_pages):  # else every entry is in the pool
            _check_pages_in_pool(bt.cpu().numpy(), seq_lens, ps, b.num_pages)
    # The fields were checked by the constructor: a shallow copy with the private metadata.
    return b.checked_copy(block_table=bt, cache_lengths=cl, input_row_offsets=offs,
                          _host=HostLists(cache_lens, offsets, longest))


def _check_pages_in_pool(table: np.ndarray, seq_lens: list[int], page_size: int, num_pages: int) -> None:
    """Every page a sequence touches (its first ceil(len / page_size) entries) in ``[0, num_pages)``."""
    pages = -(-np.asarray(seq_lens, dtype=np.int64) // page_size)
    used = np.arange(table.shape[1])[None, :] < pages[:, None]
    bad = used & ((table < 0) | (table >= num_pages))
    if bad.any():
        i = int(np.argmax(bad.any(axis=1)))
        raise ValueError(f"kv_collection.block_table: sequence {i} has a page outside the pool [0, {num_pages})")


def check_sparse(
    sparse_indices: object,
    topk_lengths: object,
    physical_indices: bool,
    batch: CacheBatch,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sparse top-k indices ``[T, stride]`` (-1 = unused) and optional ``topk_lengths [B]``, against
    a validated batch. Returns private int32 copies (what the kernels will read)."""
    if sparse_indices is None:
        raise ValueError("topk_lengths: given without sparse_indices")
    T = batch.offsets_list[-1]
    idx = check_tensor("sparse_indices", sparse_indices, rank=2, dtypes=INDEX_DTYPES, device=device)
    if idx.shape[0] != T:
        raise ValueError(f"sparse_indices: {idx.shape[0]} rows for {T} query tokens")
    idx = idx.to(torch.int32, copy=True).contiguous()
    stride = int(idx.shape[1])
    if idx.numel():
        if physical_indices:
            limit = batch.num_pages * batch.page_size
            lo, hi = _host_ints("sparse_indices", torch.stack([idx.min(), idx.max()]))
            if lo < -1:
                raise ValueError("sparse_indices: entries must be >= -1 (-1 marks an unused slot)")
            if hi >= limit:
                raise ValueError(f"sparse_indices: physical row {hi} outside the cache ({limit} rows)")
        else:
            seq, _ = batch.token_positions()
            limits = torch.tensor(batch.seq_lens_list, dtype=torch.int32, device=device)[seq]
            low, past = _host_ints("sparse_indices", torch.stack([(idx < -1).any(), (idx >= limits[:, None]).any()]))
            if low:
                raise ValueError("sparse_indices: entries must be >= -1 (-1 marks an unused slot)")
            if past:
                raise ValueError("sparse_indices: a logical index is at or past its sequence's length")
    topk = None
    if topk_lengths is not None:
        B = batch.batch_size
        topk = check_tensor("topk_lengths", topk_lengths, shape=(B,), dtypes=INDEX_DTYPES, device=device)
        topk = topk.to(torch.int32, copy=True).contiguous()
        tl = _host_ints("topk_lengths", topk)
        if any(v < 0 or v > stride for v in tl):
            raise ValueError(f"topk_lengths: entries must lie in [0, {stride}] (the stride), got {tl}")
    return idx, topk


def check_attn_sink(attn_sink: object, num_heads: int | None, batch_size: int, device: torch.device,
                    check_values: bool = True) -> None:
    """float32 ``[H]`` or ``[B, H]`` (``num_heads`` None: any H); NaN-free when ``check_values``."""
    check_tensor("attn_sink", attn_sink, dtypes=(torch.float32,), device=device)
    shape = tuple(attn_sink.shape)
    ok = (len(shape) == 1 or (len(shape) == 2 and shape[0] == batch_size)) and (num_heads is None or shape[-1] == num_heads)
    if not ok or shape[-1] < 1:
        h = "H" if num_heads is None else num_heads
        raise ValueError(f"attn_sink: expected shape ({h},) or ({batch_size}, {h}), got {shape}")
    if check_values and bool(torch.isnan(attn_sink).any()):
        raise ValueError("attn_sink: contains NaN")


def check_optional_positive(name: str, value: object) -> int | None:
    return None if value is None else check_int(name, value, 1)
