"""Flat wrappers of the native CPU kernels: tensors and plain numbers in, tensors out.

No ``CacheBatch`` here: a paged cache layer is described by :class:`PagedLayer`. Arguments
are assumed validated (``openmla.validate``); these wrappers only put tensors in the layouts
the kernels read (compute dtype, contiguity, int32 indices).

Compute types: bfloat16 when the inputs are bfloat16 (or fp8 / NVFP4 caches with a bfloat16 query)
and the CPU runs bf16 brgemm, float32 otherwise (float16 and float32 inputs). float64 is not
taken (:func:`compute_dtype` returns None; the adapter falls back to the torch backend).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ... import workspace
from ...workspace import empty_output
from ...kernel_codes import FORMAT_CODES, MASK_CODES  # the kernels' format and mask codes (the C++ enums are generated from them)
from ...masks import MaskVariant
from . import build

__all__ = ["PagedLayer", "MASK_CODES", "FORMAT_CODES", "available", "compute_dtype", "decode", "write_cache", "write_rows", "gather",
           "prefill", "prefill_chunk", "pack_heads", "heads_gemm", "own_amx_runs", "shared_kv"]

_bf16_gemm: list[bool] = []


def own_amx_runs() -> bool:
    """Whether bf16 decode runs on the own AMX micro-kernel now (CPU, build and switch)."""
    return bool(build.ops().own_amx_runs())


def available() -> bool:
    """True when the kernels are built and loaded (builds them on first call)."""
    return build.load()


def bf16_gemm() -> bool:
    """Whether this CPU runs bf16 brgemm (oneDNN needs AVX-512; else bf16 inputs compute in float32)."""
    if not _bf16_gemm:
        _bf16_gemm.append(bool(build.ops().bf16_gemm_supported()))
    return _bf16_gemm[0]


_COMPUTE: dict[tuple[torch.dtype, ...], torch.dtype | None] = {}  # compute_dtype's answers (asked per layer and step)


def compute_dtype(*dtypes: torch.dtype) -> torch.dtype | None:
    """The kernels' matmul dtype for inputs of ``dtypes`` (fp8 caches count as bfloat16)."""
    known = _COMPUTE.get(dtypes, False)
    if known is not False:
        return known
    _COMPUTE[dtypes] = known = _compute_dtype(dtypes)
    return known


def _compute_dtype(dtypes: tuple[torch.dtype, ...]) -> torch.dtype | None:
    dtype = dtypes[0]
    for d in dtypes[1:]:
        dtype = torch.promote_types(dtype, d)
    if dtype == torch.bfloat16:
        return torch.bfloat16 if bf16_gemm() else torch.float32
    if dtype in (torch.float16, torch.float32):
        return torch.float32
    return None


class PagedLayer(NamedTuple):
    """One layer of a paged latent cache and the batch's page table.

    ``pages [num_pages, page_size, W]`` (rows contiguous; W = L+R values, or the fp8_ds_mla /
    NVFP4 record bytes), ``block_table`` int32 ``[B, max_pages]``, ``cache_lengths`` int32 ``[B]``,
    ``offsets`` int32 ``[B+1]`` (query rows per sequence), ``fmt`` a ``FORMAT_CODES`` value,
    ``kv_scale`` the fp8_e4m3 scale of this layer.
    """

    pages: torch.Tensor
    block_table: torch.Tensor
    cache_lengths: torch.Tensor
    offsets: torch.Tensor
    fmt: int
    kv_scale: float = 1.0


def _no_grad(fn):
    """``torch.no_grad`` for a kernel wrapper (inference kernels: outputs carry no autograd graph),
    entered only while grad mode is on: the context manager costs microseconds per call, and engines
    call under inference mode or no_grad, once per layer and step."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if torch.is_grad_enabled():
            with torch.no_grad():
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)
    return wrapper


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()


def _mask_args(mask: MaskVariant) -> tuple[int, int, int]:
    return MASK_CODES[mask.kind], int(mask.window_size or 0), int(mask.chunk_size or 0)


@_no_grad
def decode(
    q: torch.Tensor, cache: PagedLayer, *, kv_lora_rank: int, scale: float, mask: MaskVariant,
    sparse_indices: torch.Tensor | None = None, topk_lengths: torch.Tensor | None = None, physical: bool = True,
    attn_sink: torch.Tensor | None = None, num_partitions: int | None = None, dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed attention: ``q [T, H, L+R]`` -> ``out [T, H, L]`` (``dtype``, the compute type)
    and float32 ``lse [T, H]`` (natural log, sink excluded; -inf and zeros for rows without a
    visible key). ``attn_sink`` float32 ``[H]`` or ``[B, H]``; ``num_partitions`` None picks."""
    sink = None if attn_sink is None else attn_sink.to(torch.float32).contiguous()
    idx = None if sparse_indices is None else _int32(sparse_indices)
    topk = None if topk_lengths is None else _int32(topk_lengths)
    T, H, _ = q.shape
    out, lse = empty_output((T, H, kv_lora_rank), dtype), empty_output((T, H), torch.float32)
    q = (q if q.dtype == dtype else q.to(dtype)).contiguous()
    build.ops().decode(
        q, cache.pages, _int32(cache.block_table), _int32(cache.cache_lengths), _int32(cache.offsets),
        cache.fmt, float(cache.kv_scale), kv_lora_rank, float(scale), *_mask_args(mask), idx, topk, bool(physical), sink,
        int(num_partitions or 0), out, lse,
    )
    return out, lse


@_no_grad
def pack_heads(w: torch.Tensor) -> torch.Tensor:
    """``w [H, M, K]`` (bf16 or float32, any strides) -> brgemm B operands of every ``w[h]^T``:
    ``[H, K*M]``, per head and block of n rows of ``w[h]``, ``[K/2][n][2]`` pairs for bf16 (even K)
    or ``[K][n]`` for float32 (only :func:`heads_gemm` reads it)."""
    H, M, K = w.shape
    odd = w.dtype == torch.bfloat16 and any(s % 2 for s in (*w.stride()[:2], w.storage_offset()))
    if w.stride(-1) != 1 or odd:  # the kernel reads bf16 rows as 32-bit pairs
        w = w.clone(memory_format=torch.contiguous_format)
    packed = empty_output((H, K * M), w.dtype)
    build.ops().pack_heads(w, packed)
    return packed


def heads_gemm(x: torch.Tensor, packed: torch.Tensor, m: int, k: int) -> torch.Tensor:
    """Per-head products: ``x [T, H, k+c]`` and ``packed`` = :func:`pack_heads` of ``w [H, m, k]``
    (one dtype, bf16 or float32) -> ``out [T, H, m+c]`` with ``out[t, h, :m] = w[h] @ x[t, h, :k]``
    (float32 accumulation) and x's last ``c`` columns copied: ``combine.absorb`` with c = R,
    ``combine.unabsorb`` with c = 0. No ``torch.no_grad`` here (it costs microseconds per call, a
    decode step makes two calls per layer): inputs must not require grad."""
    T, H, D = x.shape
    if x.stride(-1) != 1 or (T > 1 and x.stride(0) < k):  # rows are brgemm's A: unit stride, not overlapping
        x = x.contiguous()
    out = empty_output((T, H, m + D - k), x.dtype)
    build.ops().heads_gemm(x, packed, m, k, out)
    return out


@_no_grad
def write_cache(q: torch.Tensor, kv: torch.Tensor, freqs_cis: torch.Tensor, gamma: torch.Tensor, cache: PagedLayer, *,
                epsilon: float, interleaved: bool) -> torch.Tensor:
    """One pass over the new tokens: RMSNorm(kv[:, :L]) * gamma and RoPE(kv[:, L:]) stored at each
    token's row of ``cache`` (quantised for the fp8 and NVFP4 formats); returns q ``[T, H, Dn+R]`` (q's dtype,
    bf16/fp16/fp32) with its rope part rotated. Token i of sequence b sits at
    ``cache_lengths[b] + i``."""
    kv = kv if kv.stride(-1) == 1 else kv.contiguous()
    freqs = freqs_cis if freqs_cis.stride(-1) == 1 else freqs_cis.contiguous()
    q = q.contiguous()
    q_rot = empty_output(tuple(q.shape), q.dtype)
    build.ops().write_cache(
        q, kv, freqs, gamma.to(torch.float32).contiguous(), cache.pages, _int32(cache.block_table),
        _int32(cache.cache_lengths), _int32(cache.offsets), cache.fmt, float(cache.kv_scale), gamma.shape[0], float(epsilon),
        bool(interleaved), q_rot,
    )
    return q_rot


ROWS_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # entry dtypes write_rows reads


@_no_grad
def write_rows(entries: torch.Tensor, pages: torch.Tensor, rows: torch.Tensor, *, fmt: int, kv_scale: float,
               kv_lora_rank: int) -> None:
    """Store ``entries [n, L+R]`` (bf16, fp16 or float32) at physical ``rows`` (int ``[n]``; a negative
    row is skipped) of one layer's ``pages [num_pages, page_size, W]`` in format code ``fmt``,
    quantised as ``write_cache`` stores (in place)."""
    entries = entries if entries.stride(-1) == 1 else entries.contiguous()
    rows = rows if rows.dtype == torch.int64 and rows.is_contiguous() else rows.to(torch.int64).contiguous()
    build.ops().write_rows(entries, pages, rows, int(fmt), float(kv_scale), int(kv_lora_rank))


@_no_grad
def gather(cache: PagedLayer, spans: list[tuple[int, int, int]], *, kv_lora_rank: int, rope_dim: int,
           cols: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """Entry columns ``cols`` of the cache rows of ``spans`` (sequence, first position, count),
    end to end: ``[sum(count), cols[1]-cols[0]]`` in ``dtype``, dequantised (a reused buffer: valid
    until the next call)."""
    idx = torch.tensor(spans, dtype=torch.int64).reshape(-1, 3).t().contiguous()
    out = workspace.scratch("cpu.gather", (int(idx[2].sum()), cols[1] - cols[0]), dtype)
    build.ops().gather(cache.pages, _int32(cache.block_table), idx[0], idx[1], idx[2], cache.fmt, float(cache.kv_scale),
                       kv_lora_rank, rope_dim, cols[0], cols[1], out)
    return out


@dataclass
class PrefillState:
    """Running attention state of every query row across the chunks of one prefill (float32)."""

    o: torch.Tensor  # [T*H, Dv]
    ref: torch.Tensor  # [T*H]
    sum: torch.Tensor  # [T*H]

    @classmethod
    def empty(cls, rows: int, v_depth: int) -> "PrefillState":
        """Undefined contents: the first chunk writes every row."""
        f32 = torch.float32
        return cls(empty_output((rows, v_depth), f32), empty_output((rows,), f32), empty_output((rows,), f32))


@_no_grad
def prefill_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: torch.Tensor, *, offsets: torch.Tensor,
    cache_lengths: torch.Tensor, spans: torch.Tensor, scale: float, mask: MaskVariant, attn_sink: torch.Tensor | None,
    state: PrefillState | None = None, first: bool = True, last: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q [T, H, Dn+R]`` over one chunk of up-projected keys: ``k [S, H*Dn]``,
    ``v [S, H*Dv]``, rope keys ``rope [S, R]`` (all the compute dtype, rows contiguous).
    ``spans`` int64 ``[3, B]``: sequence b's keys are buffer rows ``spans[0,b] ..
    + spans[2,b]`` at positions ``spans[1,b] ..``. Queries of sequence b sit at
    ``cache_lengths[b] + i``. Several chunks share ``state`` (``first``/``last``); the last
    returns ``out [T, H, Dv]`` (compute dtype) and float32 ``lse [T, H]``."""
    sink = None if attn_sink is None else attn_sink.to(torch.float32).contiguous()
    st = (None, None, None) if state is None else (state.o, state.ref, state.sum)
    T, H, _ = q.shape
    rows = T if last else 0
    out, lse = empty_output((rows, H, v.shape[1] // H), q.dtype), empty_output((rows, H), torch.float32)
    build.ops().prefill_chunk(
        q, k, v, rope, _int32(offsets), _int32(cache_lengths), spans[0].contiguous(), spans[1].contiguous(),
        spans[2].contiguous(), float(scale), *_mask_args(mask), *st, bool(first), bool(last), sink, out, lse,
    )
    return out, lse


@_no_grad
def prefill(
    q: torch.Tensor, cache: PagedLayer, w_k: torch.Tensor, w_uv: torch.Tensor, *, chunks: list[tuple[list[int], list[int]]],
    offsets: list[int], cache_lens: list[int], scale: float, mask: MaskVariant, attn_sink: torch.Tensor | None,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill form over the paged cache: ``q [T, H, Dn+R]`` (roped), ``w_k [H*Dn, L]``,
    ``w_uv [H, Dv, L]``. ``chunks``: per chunk of keys, ``(buffer_row_offsets [B+1],
    cache_offsets [B])`` from the plan's chunk plan; ``offsets``/``cache_lens`` the
    batch's host lists. Per chunk, only the keys some query of a sequence can see are
    gathered (dequantised) and up-projected (two matmuls), then attended natively.
    Returns ``out [T, H, Dv]`` (``dtype``) and float32 ``lse [T, H]``."""
    T, H, Dq = q.shape
    Dv, L = w_uv.shape[1], w_uv.shape[2]
    R = Dq - w_k.shape[0] // H
    B = len(cache_lens)
    q = q.to(dtype).contiguous()
    w_k, w_v = w_k.to(dtype), w_uv.reshape(H * Dv, L).to(dtype)
    offs_t, lens_t = torch.tensor(offsets, dtype=torch.int32), torch.tensor(cache_lens, dtype=torch.int32)
    work = []  # per chunk: (b, first position, count) of the keys its queries can see
    for bro, co in chunks:
        spans = []
        for b in range(B):
            n_q, n_k = offsets[b + 1] - offsets[b], bro[b + 1] - bro[b]
            if n_q and n_k:
                c = cache_lens[b]
                lo, hi = mask.key_range(c, c + n_q - 1, c + n_q)
                lo, hi = max(lo, co[b]), min(hi, co[b] + n_k)
                if lo < hi:
                    spans.append((b, lo, hi - lo))
        if spans:
            work.append(spans)
    state = PrefillState.empty(T * H, Dv) if len(work) > 1 else None
    out = lse = None
    for i, spans in enumerate(work or [[]]):
        table = torch.zeros(3, B, dtype=torch.int64)
        row = 0
        for b, lo, n in spans:
            table[:, b] = torch.tensor([row, lo, n])
            row += n
        entries = gather(cache, spans, kv_lora_rank=L, rope_dim=R, cols=(0, L + R), dtype=dtype)
        latent = entries[:, :L]
        S = latent.shape[0]
        k = torch.mm(latent, w_k.t(), out=workspace.scratch("cpu.k", (S, w_k.shape[0]), dtype))
        v = torch.mm(latent, w_v.t(), out=workspace.scratch("cpu.v", (S, w_v.shape[0]), dtype))
        out, lse = prefill_chunk(q, k, v, entries[:, L:], offsets=offs_t, cache_lengths=lens_t, spans=table, scale=scale,
                                 mask=mask, attn_sink=attn_sink, state=state, first=i == 0, last=i == max(len(work), 1) - 1)
    return out, lse


SHARED_KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # entry dtypes shared_kv reads (products in float32)


@_no_grad
def shared_kv(q: torch.Tensor, raw_blocks: torch.Tensor, raw_table: torch.Tensor, token_seq: torch.Tensor,
              token_pos: torch.Tensor, *, window: int, scale: float, comp_blocks: torch.Tensor | None = None,
              comp_table: torch.Tensor | None = None, rate: int = 0, indices: torch.Tensor | None = None,
              attn_sink: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V4 shared-KV attention (``csrc/shared_kv.h``): ``q [T, H, D]``, entries
    ``[num_pages, page_size, D]`` (one of ``SHARED_KV_DTYPES``, rows with unit stride; the
    compressed store in the raw one's dtype), page tables ``[B, max_pages]``, each query row's
    sequence and position (int ``[T]``), ``rate`` 0 for no compressed stream, ``indices``
    int ``[T, K]`` (-1 unused) or None for every entry the rule allows. Returns float32
    ``out [T, H, D]`` and ``lse [T, H]`` (sink excluded; zeros and -inf for a row without a key)."""
    T, H, D = q.shape
    out, lse = empty_output((T, H, D), torch.float32), empty_output((T, H), torch.float32)
    if T == 0:
        return out, lse
    sink = None if attn_sink is None else attn_sink.to(torch.float32).contiguous()
    comp = rate > 0
    build.ops().shared_kv(
        q.to(torch.float32).contiguous(), raw_blocks, _int32(raw_table), token_seq.to(torch.int64).contiguous(),
        token_pos.to(torch.int64).contiguous(), int(window), float(scale), comp_blocks if comp else None,
        _int32(comp_table) if comp else None, int(rate), _int32(indices) if comp and indices is not None else None, sink, out, lse,
    )
    return out, lse
