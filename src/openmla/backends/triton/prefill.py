"""Up-projected (MHA) MLA prefill: a flash-attention forward over a ragged batch, and the
chunked driver that feeds it.

``_flare_prefill_kernel``, grid ``(cdiv(max_new_tokens, BLOCK_M), H, B)``: a program takes
``BLOCK_M`` new tokens of one sequence and one head. The q/k depth is split in two dot
products: ``q_nope . k_nope`` (Dn = 128, k_nope from the up-projected buffer) and
``q_rope . k_rope`` (R = 64, k_rope read straight from the paged cache, shared by all
heads); v (Dv = 128) comes from the buffer. The buffer holds, in rows
``buffer_row_offsets[b]:[b+1]``, sequence b's keys at positions ``cache_offsets[b] + j``;
the queries sit at ``cache_lengths[b] + i``. Key tiles outside the mask's range for the
whole query block are skipped; inside, each (query, key) pair is tested against the
query's ``[lo, hi)``. Online softmax in float32 (base 2), LSE out (natural log).

``prefill`` (the full form): the step's chunk plan (made once per step by ``openmla.plan``)
cuts the keys every sequence sees into chunks of at most ``buffer_size`` rows; per chunk the latent rows are gathered
through the page table, up-projected with two torch matmuls (cuBLAS on GPU) and attended
by the kernel; chunk results fold into a running result with ``merge.merge_parts``, and
the attention sink is applied once at the end. Memory is bounded by ``buffer_size`` rows
of K/V plus two float32 ``[T, H, Dv]`` slots, whatever the context length.

FP8 caches: the latent gather dequantises (``CacheBatch.read_rows``) before the
up-projection; the kernel reads k_rope through a typed view of the cache (fp8_e4m3: the
float8 values, times the layer's ``kv_scale`` on the float32 rope scores; fp8_ds_mla: the
record's bfloat16 rope part).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ...cache import CacheBatch
from ...masks import MaskVariant
from . import _common
from ._common import cast_to, key_range, natural_lse, next_pow2, online_softmax_step, physical_row
from .merge import merge_parts


@triton.jit
def _flare_prefill_kernel(
    q_ptr, k_ptr, v_ptr, rope_ptr, kv_scale_ptr, block_table_ptr, cache_lens_ptr, q_offsets_ptr, buf_offsets_ptr,
    cache_offsets_ptr, o_ptr, lse_ptr,
    num_q_rows, num_buf_rows, page_size, max_pages, num_pages, sm_scale_log2, window, chunk,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_rope, stride_bt,
    stride_ot, stride_oh, stride_lt,
    DN: tl.constexpr, R: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DN: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DV: tl.constexpr,
    MASK: tl.constexpr, ROPE_SCALED: tl.constexpr, DOT_T: tl.constexpr, PRECISION: tl.constexpr,
):
    m_block = tl.num_programs(0) - 1 - tl.program_id(0)  # causal: the longest rows start first
    h = tl.program_id(1)
    seq = tl.program_id(2)

    # This block's query rows and their positions. Rows, buffer rows and cache pages named by
    # metadata are bounded by the tensors' sizes: metadata corrupted after validation can
    # neither read nor write outside q/out, k/v or the cache (such rows and keys drop out).
    q_start = tl.load(q_offsets_ptr + seq)
    num_q = tl.load(q_offsets_ptr + seq + 1) - q_start
    cache_len = tl.load(cache_lens_ptr + seq)
    i = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    q_ok = (i < num_q) & (q_start + i >= 0) & (q_start + i < num_q_rows)
    q_pos = cache_len + i
    lo, hi = key_range(q_pos, cache_len + num_q, MASK, window, chunk)

    # This chunk's keys of the sequence: buffer rows buf_start + j at positions key_base + j.
    buf_start = tl.load(buf_offsets_ptr + seq)
    num_keys = tl.minimum(tl.load(buf_offsets_ptr + seq + 1) - buf_start, num_buf_rows)
    key_base = tl.load(cache_offsets_ptr + seq)
    # Only tiles some query of the block can see (an empty block loops zero times).
    j_lo = tl.maximum(tl.min(tl.where(q_ok, lo, 2147483647), axis=0) - key_base, 0)
    j_hi = tl.minimum(tl.max(tl.where(q_ok, hi, -2147483647), axis=0) - key_base, num_keys)

    dn = tl.arange(0, BLOCK_DN)
    dr = tl.arange(0, BLOCK_R)
    dv = tl.arange(0, BLOCK_DV)
    q_row = q_ptr + (q_start + i).to(tl.int64)[:, None] * stride_qt + h * stride_qh
    q_nope = tl.load(q_row + dn[None, :], mask=q_ok[:, None] & (dn[None, :] < DN), other=0.0).to(DOT_T)
    if R > 0:  # R = 0: MLA without a rope part, no rope loads or dot at all
        q_rope = tl.load(q_row + DN + dr[None, :], mask=q_ok[:, None] & (dr[None, :] < R), other=0.0).to(DOT_T)
    table = block_table_ptr + seq.to(tl.int64) * stride_bt
    if ROPE_SCALED:  # fp8_e4m3: stored rope * kv_scale; the scale multiplies the float32 rope scores
        rope_scale = tl.load(kv_scale_ptr)

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
    for j0 in range(j_lo, j_hi, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        buf_row = (buf_start + j).to(tl.int64)
        k_ok = (j < j_hi) & (buf_row >= 0) & (buf_row < num_buf_rows)
        key_pos = key_base + j
        k_nope = tl.load(k_ptr + buf_row[:, None] * stride_kt + h * stride_kh + dn[None, :],
                         mask=k_ok[:, None] & (dn[None, :] < DN), other=0.0).to(DOT_T)
        rows, k_ok = physical_row(table, key_pos, page_size, max_pages, num_pages, k_ok)
        v = tl.load(v_ptr + buf_row[:, None] * stride_vt + h * stride_vh + dv[None, :],
                    mask=k_ok[:, None] & (dv[None, :] < DV), other=0.0).to(DOT_T)

        s = tl.dot(q_nope, tl.trans(k_nope), input_precision=PRECISION)
        if R > 0:
            k_rope = tl.load(rope_ptr + rows[:, None] * stride_rope + dr[None, :],
                             mask=k_ok[:, None] & (dr[None, :] < R), other=0.0).to(DOT_T)
            s_rope = tl.dot(q_rope, tl.trans(k_rope), input_precision=PRECISION)
            if ROPE_SCALED:
                s_rope = s_rope * rope_scale
            s = s + s_rope
        visible = k_ok[None, :] & (key_pos[None, :] >= lo[:, None]) & (key_pos[None, :] < hi[:, None])
        s = tl.where(visible, s * sm_scale_log2, float("-inf"))  # base-2 logits

        # A NaN / inf value counts as 0 (a query that does not see its key would get 0 x NaN; the
        # reference's NaN / inf for the queries that see it needs a second accumulator, and the
        # registers hold none: docs/api.md). A NaN / +inf score still makes its row NaN.
        v = tl.where(tl.abs(v.to(tl.float32)) < float("inf"), v, 0.0).to(DOT_T)
        p, alpha, l_i, m_new = online_softmax_step(s, m_i, l_i)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_T), v, input_precision=PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i == 0, 1.0, l_i)[:, None]  # no key: acc is 0, out stays 0 (a NaN sum: NaN)
    lse = natural_lse(m_i, l_i)
    rows_out = (q_start + i).to(tl.int64)
    tl.store(o_ptr + rows_out[:, None] * stride_ot + h * stride_oh + dv[None, :], cast_to(out, o_ptr.dtype.element_ty),
             mask=q_ok[:, None] & (dv[None, :] < DV))
    tl.store(lse_ptr + rows_out * stride_lt + h, lse, mask=q_ok)


# (BLOCK_M, BLOCK_N, num_warps, num_stages) per GPU kind (``_common.gpu_kind``), for half-precision
# dots and for float32 dots (FMA loops: small tiles; 8 warps on fp8_ds_mla caches, where 4 spill
# 8 bytes on sm_90). Every entry compiles without spills as launched on sm_90 and sm_100
# ("nvidia") or gfx942 ("amd"): ``openmla compile-report``. gfx942 takes one
# stage: with 3 the 128 x 32 tile spills 2-32 VGPRs, with 2 one.
_TILE_KEYS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")
PREFILL_TILES = {
    "nvidia": {"half": (128, 32, 8, 3), "float32": (16, 16, 4, 1), "float32 fp8_ds_mla": (16, 16, 8, 1)},
    "amd": {"half": (128, 32, 8, 1), "float32": (16, 16, 4, 1), "float32 fp8_ds_mla": (16, 16, 8, 1)},
}


def prefill_config(dtype: torch.dtype, device: torch.device, tile=None, cache_format: str = "native") -> dict:
    """``BLOCK_M``/``BLOCK_N`` and launch settings for ``tl.dot`` operands of ``dtype`` (float32 or a
    half type) on a ``cache_format`` cache, from ``PREFILL_TILES``; ``tile`` (an ``MlaConfigV2``)
    overrides the block sizes (>= 16 for ``tl.dot``). The interpreter (CPU tensors): 16 x 32."""
    gpu = _common.gpu_kind(device)
    if gpu is None:
        cfg = dict(BLOCK_M=16, BLOCK_N=32)
    else:
        kind = "half" if dtype not in (torch.float32, torch.float64) else \
            "float32 fp8_ds_mla" if cache_format == "fp8_ds_mla" else "float32"
        cfg = dict(zip(_TILE_KEYS, PREFILL_TILES[gpu][kind]))
    if tile is not None:
        cfg.update(BLOCK_M=max(16, tile.block_m), BLOCK_N=max(16, tile.block_n))
    return cfg


def flare_prefill_into(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    buffer_row_offsets: torch.Tensor,
    cache_offsets: torch.Tensor,
    batch: CacheBatch,
    layer_idx: int,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    scale: float,
    mask: MaskVariant,
    max_new_tokens: int,
    tile=None,
    config: dict | None = None,
) -> None:
    """One chunk: ``q [T, H, Dn+R]``, ``k [S, H, Dn]``, ``v [S, H, Dv]`` into ``out [T, H, Dv]``
    (any float dtype) and ``lse [T, H]`` float32. Offsets are int32 on q's device.
    ``config`` (``BLOCK_M``, ``BLOCK_N``, launch settings) overrides ``prefill_config``."""
    T, H, QD = q.shape
    DN, DV = k.shape[2], v.shape[2]
    R = QD - DN
    B = batch.batch_size
    if T == 0 or max_new_tokens == 0:
        return
    views = _common.batch_views(batch, layer_idx, batch.head_dim - R)
    block_table = _common.as_index(batch.block_table)
    mask_code, window, chunk = _common.mask_args(mask)
    dot_t = views.dot_dtype(q.dtype, k.dtype, v.dtype)
    # Tiles follow the dot type, not q's: float16 q on fp8_ds_mla's bfloat16 rope dots in float32.
    compute = torch.float32 if dot_t == tl.float32 else q.dtype
    cfg = dict(config) if config is not None else prefill_config(compute, q.device, tile, batch.cache_format)
    grid = (triton.cdiv(max_new_tokens, cfg["BLOCK_M"]), H, B)
    _flare_prefill_kernel[grid](
        q, k, v, views.rope, views.kv_scale, block_table, _common.as_index(batch.cache_lengths),
        _common.as_index(batch.input_row_offsets), buffer_row_offsets, cache_offsets, out, lse,
        T, k.shape[0], batch.page_size, block_table.shape[1], views.rope.shape[0], float(scale) / math.log(2.0),
        window, chunk,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), views.rope.stride(1),
        block_table.stride(0), out.stride(0), out.stride(1), lse.stride(0),
        DN=DN, R=R, DV=DV, BLOCK_DN=next_pow2(DN), BLOCK_R=next_pow2(R), BLOCK_DV=next_pow2(DV),
        MASK=mask_code, ROPE_SCALED=views.fmt == _common.FMT_E4M3, DOT_T=dot_t, PRECISION=_common.dot_precision(dot_t),
        **cfg,
    )


def flare_mla_prefill(q, k, v, buffer_row_offsets, cache_offsets, batch: CacheBatch, layer_idx: int, *,
                      scale: float, mask: MaskVariant, tile=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel-level entry: one chunk of up-projected keys; returns ``out [T, H, Dv]`` (q's dtype)
    and float32 ``lse [T, H]`` over this chunk's keys."""
    _common.check_device(q)
    T, H, _ = q.shape
    out = _common.empty_output((T, H, v.shape[2]), q.dtype, q.device)
    lse = _common.empty_output((T, H), torch.float32, q.device)
    q, k, v = (x if x.stride(2) == 1 else x.contiguous() for x in (q, k, v))
    flare_prefill_into(q, k, v, _common.as_index(buffer_row_offsets), _common.as_index(cache_offsets), batch, layer_idx,
                       out, lse, scale=scale, mask=mask, max_new_tokens=batch.max_new_tokens, tile=tile)
    return out, lse


def default_buffer_size(num_heads: int, dn: int, dv: int, dtype: torch.dtype) -> int:
    """Rows of up-projected K/V per chunk: about 512 MiB of buffer, at least 1024 rows."""
    row_bytes = num_heads * (dn + dv) * torch.empty((), dtype=dtype).element_size()
    return max(1024, (512 << 20) // max(row_bytes, 1))


def _chunk_rows(batch: CacheBatch, bro: list[int], co: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence and key position of every buffer row of one chunk (host-built, int64)."""
    counts = torch.tensor([bro[b + 1] - bro[b] for b in range(batch.batch_size)], dtype=torch.int64)
    seq = torch.repeat_interleave(torch.arange(batch.batch_size), counts)
    starts = torch.tensor(bro[:-1], dtype=torch.int64)
    pos = torch.tensor(co[: batch.batch_size], dtype=torch.int64)[seq] + torch.arange(int(bro[-1])) - starts[seq]
    return seq, pos


def gather_up_project(batch: CacheBatch, layer_idx: int, seq: torch.Tensor, pos: torch.Tensor, w_k: torch.Tensor,
                      w_uv: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Latent rows of ``(seq, pos)`` pairs through the page table, up-projected:
    ``k_nope [S, H, Dn] = latent W_UK^T`` and ``v [S, H, Dv] = latent W_UV^T`` in ``dtype``.
    An fp8 cache is dequantised on the gather (``CacheBatch.read_rows``)."""
    H, DV, L = w_uv.shape
    dev = batch.blocks.device
    seq, pos = seq.to(dev), pos.to(dev)
    # Table columns and page ids are clamped into range and the rows they would name zeroed:
    # a page table corrupted after validation reads no memory outside the table or the cache.
    table = batch.block_table
    col = pos // batch.page_size
    ok = (col >= 0) & (col < table.shape[1])
    pages = table[seq, col.clamp(0, table.shape[1] - 1)].long()
    ok &= (pages >= 0) & (pages < batch.num_pages)
    rows = torch.where(ok, pages * batch.page_size + pos % batch.page_size, 0)
    if batch.is_native:
        latent = batch.blocks[layer_idx].reshape(-1, batch.blocks.shape[3])[rows, :L].to(dtype)
    else:
        latent = batch.read_rows(layer_idx, rows, dtype)[:, :L]
    latent = latent.masked_fill(~ok[:, None], 0)
    k_nope = (latent @ w_k.to(dtype).t()).view(-1, H, w_k.shape[0] // H)
    v = (latent @ w_uv.to(dtype).reshape(H * DV, L).t()).view(-1, H, DV)
    return k_nope, v


def prefill(q: torch.Tensor, batch: CacheBatch, layer_idx: int, w_k: torch.Tensor, w_uv: torch.Tensor, *,
            scale: float, mask: MaskVariant, attn_sink: torch.Tensor | None, chunks) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense prefill form, chunked: ``q [T, H, Dn+R]`` (roped) -> ``out [T, H, Dv]``, ``lse [T, H]``.

    ``chunks``: the step's chunk plan (``openmla.plan.ChunkPlan``, host lists made once per step;
    its per-chunk offset tensors are copied to the device once and shared by every layer).
    """
    _common.check_device(q)
    T, H, _ = q.shape
    DV = w_uv.shape[1]
    dev = q.device
    if q.stride(2) != 1:
        q = q.contiguous()
    # Slot 0 holds the running result, slot 1 the newest chunk; merge_parts folds 1 into 0.
    o_parts = _common.empty_output((2, T, H, DV), torch.float32, dev)
    lse_parts = _common.empty_output((2, T, H), torch.float32, dev)
    for c in range(chunks.num_chunks):
        if chunks.lengths[c] <= 0 and c > 0:
            break
        bro, co = chunks.buffer_row_offsets[c], chunks.cache_offsets[c]
        seq, pos = _chunk_rows(batch, bro, co)
        k_nope, v = gather_up_project(batch, layer_idx, seq, pos, w_k, w_uv, q.dtype)
        slot = min(c, 1)
        bro_t, co_t = chunks.chunk_tensors(c, dev)
        flare_prefill_into(q, k_nope, v, bro_t, co_t, batch, layer_idx, o_parts[slot], lse_parts[slot], scale=scale, mask=mask,
                           max_new_tokens=batch.max_new_tokens)
        if c > 0:
            merge_parts(o_parts, lse_parts, batch.input_row_offsets, out=o_parts[0], lse_out=lse_parts[0])
    if attn_sink is None:
        return o_parts[0], lse_parts[0]
    return merge_parts(o_parts[:1], lse_parts[:1], batch.input_row_offsets, attn_sink=attn_sink, out_dtype=q.dtype)
