"""Argument checks shared by every public op, run once before any backend work or cache write.

Every failure is a ``ValueError`` whose message starts with the argument's name.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from .cache import CacheBatch
from .fp8 import CACHE_FORMATS
from .masks import MaskVariant

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64, torch.uint32)


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


def check_scale(scale: object) -> float:
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(float(scale)):
        raise ValueError(f"scale: expected a finite float, got {scale!r}")
    return float(scale)


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


def check_cache_batch(kv_collection: object, layer_idx: object, device: torch.device, head_dim: int | None = None) -> CacheBatch:
    """The cache view: storage shape, lengths, page table entries the batch will touch, layer."""
    if not isinstance(kv_collection, CacheBatch):
        raise ValueError(f"kv_collection: expected a CacheBatch, got {type(kv_collection).__name__}")
    b = kv_collection
    check_tensor("kv_collection.blocks", b.blocks, rank=4, device=device)
    if b.cache_format not in CACHE_FORMATS:
        raise ValueError(f"kv_collection.cache_format: {b.cache_format!r} is not one of {CACHE_FORMATS}")
    if b.cache_format == "fp8_e4m3":
        check_tensor("kv_collection.kv_scale", b.kv_scale, shape=(b.num_layers,), dtypes=(torch.float32,), device=device)
    if b.cache_format == "fp8_ds_mla" and (not isinstance(b.rope_dim, int) or b.rope_dim < 2):
        raise ValueError(f"kv_collection.rope_dim: fp8_ds_mla records need the rope width, got {b.rope_dim!r}")
    if head_dim is not None and b.head_dim != head_dim:
        raise ValueError(f"kv_collection.blocks: entry width {b.head_dim}, expected {head_dim} (L+R)")
    if b.blocks.shape[2] != b.page_size:
        raise ValueError(f"kv_collection.page_size: {b.page_size} but blocks hold pages of {b.blocks.shape[2]}")
    check_int("layer_idx", layer_idx, 0, b.num_layers)
    nb = b.batch_size
    check_tensor("kv_collection.cache_lengths", b.cache_lengths, rank=1, dtypes=INDEX_DTYPES, device=device)
    check_tensor("kv_collection.block_table", b.block_table, shape=(nb, None), dtypes=INDEX_DTYPES, device=device)
    check_offsets("kv_collection.input_row_offsets", b.input_row_offsets, int(b.input_row_offsets[-1]) if b.input_row_offsets.numel() else 0, device)
    if b.input_row_offsets.shape[0] != nb + 1:
        raise ValueError(f"kv_collection.input_row_offsets: {b.input_row_offsets.shape[0]} entries for {nb} sequences")
    if any(c < 0 for c in b.cache_lengths_list):
        raise ValueError(f"kv_collection.cache_lengths: negative length in {b.cache_lengths_list}")
    table = b.block_table.to("cpu", torch.int64)
    for i, n in enumerate(b.seq_lens_list):
        pages = -(-n // b.page_size)
        if pages > table.shape[1]:
            raise ValueError(f"kv_collection.block_table: sequence {i} needs {pages} pages, the table has {table.shape[1]}")
        used = table[i, :pages]
        if pages and (int(used.min()) < 0 or int(used.max()) >= b.num_pages):
            raise ValueError(f"kv_collection.block_table: sequence {i} has a page outside the pool [0, {b.num_pages})")
    return b


def check_sparse(
    sparse_indices: object,
    topk_lengths: object,
    physical_indices: bool,
    batch: CacheBatch,
    offsets: list[int],
    num_rows: int,
    device: torch.device,
) -> None:
    """Sparse top-k indices ``[T, stride]`` (-1 = unused) and optional ``topk_lengths [B]``."""
    if sparse_indices is None:
        if topk_lengths is not None:
            raise ValueError("topk_lengths: given without sparse_indices")
        return
    check_tensor("sparse_indices", sparse_indices, rank=2, dtypes=INDEX_DTYPES, device=device)
    if sparse_indices.shape[0] != num_rows:
        raise ValueError(f"sparse_indices: {sparse_indices.shape[0]} rows for {num_rows} query tokens")
    stride = int(sparse_indices.shape[1])
    idx = sparse_indices.to("cpu", torch.int64)
    if idx.numel() and int(idx.min()) < -1:
        raise ValueError("sparse_indices: entries must be >= -1 (-1 marks an unused slot)")
    if physical_indices:
        limit = batch.num_pages * batch.page_size
        if idx.numel() and int(idx.max()) >= limit:
            raise ValueError(f"sparse_indices: physical row {int(idx.max())} outside the cache ({limit} rows)")
    else:
        seq_of_row = torch.repeat_interleave(torch.arange(len(offsets) - 1), torch.tensor([b - a for a, b in zip(offsets, offsets[1:])]))
        limits = torch.tensor(batch.seq_lens_list, dtype=torch.int64)[seq_of_row]
        if idx.numel() and bool((idx >= limits[:, None]).any()):
            raise ValueError("sparse_indices: a logical index is at or past its sequence's length")
    if topk_lengths is not None:
        check_tensor("topk_lengths", topk_lengths, shape=(len(offsets) - 1,), dtypes=INDEX_DTYPES, device=device)
        tl = [int(v) for v in topk_lengths.tolist()]
        if any(v < 0 or v > stride for v in tl):
            raise ValueError(f"topk_lengths: entries must lie in [0, {stride}] (the stride), got {tl}")


def check_attn_sink(attn_sink: object, num_heads: int, batch_size: int, device: torch.device) -> None:
    if attn_sink is None:
        return
    check_tensor("attn_sink", attn_sink, dtypes=(torch.float32,), device=device)
    if tuple(attn_sink.shape) not in ((num_heads,), (batch_size, num_heads)):
        raise ValueError(f"attn_sink: expected shape ({num_heads},) or ({batch_size}, {num_heads}), got {tuple(attn_sink.shape)}")
    if bool(torch.isnan(attn_sink).any()):
        raise ValueError("attn_sink: contains NaN")


def check_optional_positive(name: str, value: object) -> int | None:
    return None if value is None else check_int(name, value, 1)


def check_attention_common(
    *,
    q_rows: int,
    num_heads: int,
    batch: CacheBatch,
    offsets: list[int],
    scale: object,
    mask: object,
    window_size: object,
    chunk_size: object,
    sparse_indices: object,
    topk_lengths: object,
    physical_indices: object,
    attn_sink: object,
    device: torch.device,
) -> tuple[float, MaskVariant]:
    """Checks shared by the decode, prefill and fused entry points."""
    scale = check_scale(scale)
    variant = MaskVariant.parse(mask, window_size, chunk_size)
    if not isinstance(physical_indices, bool):
        raise ValueError(f"physical_indices: expected a bool, got {physical_indices!r}")
    check_sparse(sparse_indices, topk_lengths, physical_indices, batch, offsets, q_rows, device)
    check_attn_sink(attn_sink, num_heads, batch.batch_size, device)
    return scale, variant
