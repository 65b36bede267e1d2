"""Absorbed (MQA) MLA decode over the paged latent cache, split-KV.

Every query head attends to the same 576-wide cache rows: the score of a key is
``q_lat . latent + q_rope . k_rope`` (two dot products, 512 + 64 wide for DeepSeek) and its
value is the latent itself, so each key tile is loaded once and used for both.

Stage 1 (``_decode_split_kernel``), grid ``(T * cdiv(H, BLOCK_H), num_splits)``: a program
takes one query token, a block of its heads and one slice of the keys that token sees, and
writes that slice's normalised output and float32 LSE. Heads vary fastest in the grid so
the programs sharing a token's key tiles run together and hit L2.
Stage 2 (``merge.merge_parts``) folds the slices together and applies the attention sink.

The keys a token sees: dense, the mask's contiguous range ``[lo, hi)`` of its sequence's
positions (several new tokens per sequence are simply several rows, each with its own
position, so multi-token decode is causal among them); sparse, the entries of its
``sparse_indices`` row (up to ``topk_lengths[b]``, ``-1`` skipped), read as physical rows or
as logical positions that must also lie in ``[lo, hi)``. A row with no visible key gives
zeros and LSE ``-inf``.

FP8 caches: fp8_e4m3 runs ``_decode_split_kernel`` on the float8 entries (they widen
exactly to the dot type) and applies the layer's ``kv_scale`` to the float32 logits and
output; fp8_ds_mla runs ``_decode_split_ds_mla_kernel``, which keeps the latent in groups of
128 so each group's float32 scale multiplies that group's float32 partial scores and the
probabilities it weights (the bf16 rope part enters unscaled). Softmax and accumulation are
float32 for every format.

CUDA graphs: ``decode_into`` reads nothing from the host: the sequence of each row, its
position and key range are computed in the kernel from the device ``input_row_offsets``,
``cache_lengths`` and ``block_table`` (and ``topk_lengths``), and the grid depends only on
T, H and ``num_splits``. With fixed-shape metadata tensors (padded ``block_table``), a fixed
``num_splits`` and preallocated outputs/workspace, both launches can be captured and replayed
after the metadata tensors are updated in place.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ...fp8 import CACHE_FORMATS, DS_MLA_GROUP
from ...masks import MaskVariant
from . import _common
from ._common import find_sequence, key_range, natural_lse, online_softmax_step, next_pow2, physical_row, search_steps
from .merge import merge_parts

SPARSE_NONE, SPARSE_PHYSICAL, SPARSE_LOGICAL = 0, 1, 2


@triton.jit
def split_program(num_heads, BLOCK_H: tl.constexpr):
    """``(t, head_block, split)`` of a split kernel's program (decode, shared-KV). Axis 0
    enumerates (row, head block) with head blocks fastest: it allows 2^31 - 1 programs where
    axis 1 would stop at 65535 rows (sparse prefill sends many); axis 1 is the split."""
    num_head_blocks = tl.cdiv(num_heads, BLOCK_H)
    return tl.program_id(0) // num_head_blocks, tl.program_id(0) % num_head_blocks, tl.program_id(1)


@triton.jit
def _split_span(offsets_ptr, cache_lens_ptr, block_table_ptr, topk_ptr, t, split, num_seqs, num_splits, window, chunk,
                sparse_width, stride_bt, max_pages, page_size, MASK: tl.constexpr, SPARSE: tl.constexpr,
                HAS_TOPK: tl.constexpr, BLOCK_N: tl.constexpr, STEPS: tl.constexpr):
    """Row ``t``'s visible key range ``[lo, hi)``, its page-table row, and the items
    ``[start, end)`` (key positions, or slots of the sparse row) that ``split`` walks.
    Positions stop at the page table's reach (``max_pages * page_size``), so corrupt lengths
    cannot make the loop long."""
    seq = find_sequence(offsets_ptr, t, num_seqs, STEPS)
    row_start = tl.load(offsets_ptr + seq)
    cache_len = tl.load(cache_lens_ptr + seq)
    kv_len = cache_len + tl.load(offsets_ptr + seq + 1) - row_start
    q_pos = cache_len + t - row_start
    lo, hi = key_range(q_pos, kv_len, MASK, window, chunk)
    lo = tl.maximum(lo, 0)
    hi = tl.minimum(hi, max_pages * page_size)
    hi = tl.maximum(hi, lo)
    table = block_table_ptr + seq.to(tl.int64) * stride_bt
    if SPARSE == 0:
        first = lo
        count = hi - lo
    else:
        first = lo * 0
        count = first + sparse_width
        if HAS_TOPK:
            count = tl.minimum(count, tl.load(topk_ptr + seq))
    per_split = tl.cdiv(tl.cdiv(count, num_splits), BLOCK_N) * BLOCK_N  # whole tiles per split
    start = first + split * per_split
    end = tl.minimum(start + per_split, first + count)
    return lo, hi, table, start, end


@triton.jit
def _tile_rows(n0, end, lo, hi, table, sparse_row, page_size, max_pages, num_pages, SPARSE: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """Physical cache rows (int64) of the tile's items starting at ``n0``, and which are keys.
    A page or row outside the cache (metadata corrupted after validation) is no key."""
    items = n0 + tl.arange(0, BLOCK_N)
    in_split = items < end
    if SPARSE == 0:
        rows, valid = physical_row(table, items, page_size, max_pages, num_pages, in_split)
    elif SPARSE == 1:
        idx = tl.load(sparse_row + items, mask=in_split, other=-1).to(tl.int64)
        valid = (idx >= 0) & (idx // page_size < num_pages)
        rows = tl.where(valid, idx, 0)
    else:
        idx = tl.load(sparse_row + items, mask=in_split, other=-1)
        valid = (idx >= lo) & (idx < hi)  # lo >= 0, so -1 slots fail too
        rows, valid = physical_row(table, tl.where(valid, idx, 0), page_size, max_pages, num_pages, valid)
    return rows, valid


@triton.jit
def _decode_split_kernel(
    q_ptr, lat_ptr, rope_ptr, kv_scale_ptr, block_table_ptr, cache_lens_ptr, offsets_ptr, sparse_ptr, topk_ptr,
    o_part_ptr, lse_part_ptr,
    num_seqs, num_heads, num_splits, page_size, max_pages, num_pages, sm_scale_log2, window, chunk, sparse_width,
    stride_qt, stride_qh, stride_lat, stride_rope, stride_bt, stride_sparse_t,
    stride_ps, stride_pt, stride_ph, stride_ls, stride_lt,
    L: tl.constexpr, R: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
    MASK: tl.constexpr, SPARSE: tl.constexpr, HAS_TOPK: tl.constexpr, STEPS: tl.constexpr,
    KV_SCALED: tl.constexpr, DOT_T: tl.constexpr, PRECISION: tl.constexpr,
):
    t, head_block, split = split_program(num_heads, BLOCK_H)
    lo, hi, table, start, end = _split_span(offsets_ptr, cache_lens_ptr, block_table_ptr, topk_ptr, t, split, num_seqs,
                                            num_splits, window, chunk, sparse_width, stride_bt, max_pages, page_size, MASK,
                                            SPARSE, HAS_TOPK, BLOCK_N, STEPS)

    # fp8_e4m3 keys are ``stored * kv_scale`` with one scale for the whole entry: the stored
    # values widen exactly to DOT_T, and the scale multiplies the float32 scores and output.
    qk_scale = sm_scale_log2
    if KV_SCALED:
        kv_scale = tl.load(kv_scale_ptr)
        qk_scale = qk_scale * kv_scale

    # This token's absorbed query for a block of heads, split into latent and rope parts.
    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < num_heads
    dl = tl.arange(0, BLOCK_L)
    dr = tl.arange(0, BLOCK_R)
    q_row = q_ptr + t.to(tl.int64) * stride_qt + heads[:, None] * stride_qh
    q_lat = tl.load(q_row + dl[None, :], mask=head_ok[:, None] & (dl[None, :] < L), other=0.0).to(DOT_T)
    if R > 0:  # R = 0: MLA without a rope part, no rope loads or dot at all
        q_rope = tl.load(q_row + L + dr[None, :], mask=head_ok[:, None] & (dr[None, :] < R), other=0.0).to(DOT_T)

    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_L), tl.float32)
    sparse_row = sparse_ptr + t.to(tl.int64) * stride_sparse_t
    for n0 in range(start, end, BLOCK_N):
        rows, valid = _tile_rows(n0, end, lo, hi, table, sparse_row, page_size, max_pages, num_pages, SPARSE, BLOCK_N)
        k_lat = tl.load(lat_ptr + rows[:, None] * stride_lat + dl[None, :], mask=valid[:, None] & (dl[None, :] < L),
                        other=0.0).to(DOT_T)

        s = tl.dot(q_lat, tl.trans(k_lat), input_precision=PRECISION)
        if R > 0:
            k_rope = tl.load(rope_ptr + rows[:, None] * stride_rope + dr[None, :], mask=valid[:, None] & (dr[None, :] < R),
                             other=0.0).to(DOT_T)
            s += tl.dot(q_rope, tl.trans(k_rope), input_precision=PRECISION)
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))  # base-2 logits

        p, alpha, l_i, m_new = online_softmax_step(s, m_i, l_i)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_T), k_lat, input_precision=PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i == 0, 1.0, l_i)[:, None]  # no key: acc is 0, out stays 0 (a NaN sum: NaN)
    if KV_SCALED:
        out = out * kv_scale
    lse = natural_lse(m_i, l_i)
    part = split.to(tl.int64) * stride_ps + t.to(tl.int64) * stride_pt
    tl.store(o_part_ptr + part + heads[:, None] * stride_ph + dl[None, :], out,
             mask=head_ok[:, None] & (dl[None, :] < L))
    tl.store(lse_part_ptr + split.to(tl.int64) * stride_ls + t.to(tl.int64) * stride_lt + heads, lse, mask=head_ok)


@triton.jit
def _decode_split_ds_mla_kernel(
    q_ptr, lat_ptr, rope_ptr, scales_ptr, block_table_ptr, cache_lens_ptr, offsets_ptr, sparse_ptr, topk_ptr,
    o_part_ptr, lse_part_ptr,
    num_seqs, num_heads, num_splits, page_size, max_pages, num_pages, sm_scale_log2, window, chunk, sparse_width,
    stride_qt, stride_qh, stride_lat, stride_rope, stride_scales, stride_bt, stride_sparse_t,
    stride_ps, stride_pt, stride_ph, stride_ls, stride_lt,
    L: tl.constexpr, R: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_R: tl.constexpr,
    MASK: tl.constexpr, SPARSE: tl.constexpr, HAS_TOPK: tl.constexpr, STEPS: tl.constexpr,
    DOT_T: tl.constexpr, PRECISION: tl.constexpr,
):
    """``_decode_split_kernel`` over fp8_ds_mla records: the latent is held as ``BLOCK_G``
    groups of ``GROUP`` values (3-D tiles, group first) so each group's float32 scale can act
    on float32 results: ``score = sum_g scale_g * (q_g . fp8_g) + q_rope . rope`` and
    ``acc_g += (p * scale_g) @ fp8_g``. The fp8 values widen exactly to DOT_T (no rounding
    of a dequantised product); the rope part is bfloat16."""
    t, head_block, split = split_program(num_heads, BLOCK_H)
    lo, hi, table, start, end = _split_span(offsets_ptr, cache_lens_ptr, block_table_ptr, topk_ptr, t, split, num_seqs,
                                            num_splits, window, chunk, sparse_width, stride_bt, max_pages, page_size, MASK,
                                            SPARSE, HAS_TOPK, BLOCK_N, STEPS)

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < num_heads
    g = tl.arange(0, BLOCK_G)
    g_ok = g * GROUP < L
    col = g[:, None, None] * GROUP + tl.arange(0, GROUP)[None, None, :]  # [BLOCK_G, 1, GROUP] latent column
    dr = tl.arange(0, BLOCK_R)
    q_base = q_ptr + t.to(tl.int64) * stride_qt
    q_lat = tl.load(q_base + heads[None, :, None] * stride_qh + col, mask=g_ok[:, None, None] & head_ok[None, :, None],
                    other=0.0).to(DOT_T)  # [BLOCK_G, BLOCK_H, GROUP]
    q_rope = tl.load(q_base + heads[:, None] * stride_qh + L + dr[None, :], mask=head_ok[:, None] & (dr[None, :] < R),
                     other=0.0).to(DOT_T)

    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_H, GROUP), tl.float32)
    sparse_row = sparse_ptr + t.to(tl.int64) * stride_sparse_t
    for n0 in range(start, end, BLOCK_N):
        rows, valid = _tile_rows(n0, end, lo, hi, table, sparse_row, page_size, max_pages, num_pages, SPARSE, BLOCK_N)
        k_lat = tl.load(lat_ptr + rows[None, :, None] * stride_lat + col,
                        mask=g_ok[:, None, None] & valid[None, :, None], other=0.0).to(DOT_T)  # [BLOCK_G, BLOCK_N, GROUP]
        k_scale = tl.load(scales_ptr + rows[None, :] * stride_scales + g[:, None], mask=g_ok[:, None] & valid[None, :],
                          other=0.0)  # [BLOCK_G, BLOCK_N] float32
        k_rope = tl.load(rope_ptr + rows[:, None] * stride_rope + dr[None, :], mask=valid[:, None] & (dr[None, :] < R),
                         other=0.0).to(DOT_T)

        s_g = tl.dot(q_lat, tl.trans(k_lat, (0, 2, 1)), input_precision=PRECISION)  # [BLOCK_G, BLOCK_H, BLOCK_N]
        s = tl.sum(s_g * k_scale[:, None, :], axis=0)
        s += tl.dot(q_rope, tl.trans(k_rope), input_precision=PRECISION)
        s = tl.where(valid[None, :], s * sm_scale_log2, float("-inf"))  # base-2 logits

        p, alpha, l_i, m_new = online_softmax_step(s, m_i, l_i)
        p_g = (p[None, :, :] * k_scale[:, None, :]).to(DOT_T)
        acc = acc * alpha[None, :, None] + tl.dot(p_g, k_lat, input_precision=PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i == 0, 1.0, l_i)[None, :, None]  # no key: acc is 0, out stays 0 (a NaN sum: NaN)
    lse = natural_lse(m_i, l_i)
    part = split.to(tl.int64) * stride_ps + t.to(tl.int64) * stride_pt
    tl.store(o_part_ptr + part + heads[None, :, None] * stride_ph + col, out,
             mask=g_ok[:, None, None] & head_ok[None, :, None])
    tl.store(lse_part_ptr + split.to(tl.int64) * stride_ls + t.to(tl.int64) * stride_lt + heads, lse, mask=head_ok)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: a few splits still exercise the merge


# Stage-1 tiles (BLOCK_H, BLOCK_N, num_warps, num_stages), per GPU kind (``_common.gpu_kind``).
# Half-precision dots: by (cache format, more than 16 heads); float32 dots (FMA loops: 16 x 16):
# by cache format. Every entry compiles without spills as launched, on sm_90 and
# sm_100 ("nvidia") or gfx942 ("amd"): ``openmla compile-report``. Not yet tuned
# by measurement on a GPU.
_TILE_KEYS = ("BLOCK_H", "BLOCK_N", "num_warps", "num_stages")
DECODE_TILES = {
    "nvidia": {
        ("native", False): (16, 32, 4, 2),
        ("native", True): (32, 32, 8, 2),  # 32 heads per block: half the key re-reads across head blocks
        ("fp8_e4m3", False): (16, 32, 8, 2),  # fp8 -> bf16 widening takes registers: 8 warps
        ("fp8_e4m3", True): (32, 32, 8, 2),
        ("fp8_ds_mla", False): (16, 32, 8, 2),  # and fp8_ds_mla's per-group partial scores
        ("fp8_ds_mla", True): (32, 16, 8, 2),
    },
    # gfx942: 8-wave work-groups cap a wave at 256 VGPRs (the 512 of a SIMD lane shared by two waves)
    # and spill every 32-key or 2-stage tile; 4 waves, 16 keys, one stage spill nowhere.
    "amd": {(fmt, wide): (32 if wide else 16, 16, 4, 1) for fmt in CACHE_FORMATS for wide in (False, True)},
}
DECODE_TILES_F32 = {
    # float32 dots hold q_lat, k_lat and acc (16 x 512 each) in float32: 64 registers apiece per thread on
    # 4 warps, where sm_90/sm_100 spill 312-368 bytes (compile report, 2026-12-06). On 8 warps:
    "nvidia": {
        "native": (16, 16, 8, 2),  # 114-166 regs; 1 stage leaves the dense variants 8-12 spilled bytes at 128 regs
        "fp8_e4m3": (16, 16, 8, 1),  # 126-128 regs; 2 stages spill 2-5 KB (fp8 tiles in flight plus their widening)
        "fp8_ds_mla": (16, 16, 8, 1),  # its per-group partial scores need 8 warps at 1 stage too
    },
    # gfx942 keeps them in 512 unified VGPRs on 4 waves (an 8-wave work-group caps a wave at 256);
    # fp8_ds_mla's 3-D group tiles fit 8 waves' 256.
    "amd": {"native": (16, 16, 4, 1), "fp8_e4m3": (16, 16, 4, 1), "fp8_ds_mla": (16, 16, 8, 1)},
}


def decode_config(dtype: torch.dtype, device: torch.device, num_heads: int = 16, cache_format: str = "native") -> dict:
    """Tile sizes and launch settings of stage 1 (BLOCK_H/BLOCK_N >= 16 for ``tl.dot``) from
    ``DECODE_TILES`` / ``DECODE_TILES_F32``; ``dtype``: the compute type (``CacheViews.compute_dtype``).
    The interpreter (CPU tensors): 16 x 16."""
    gpu = _common.gpu_kind(device)
    if gpu is None:
        return dict(BLOCK_H=16, BLOCK_N=16)
    if dtype in (torch.float32, torch.float64):
        return dict(zip(_TILE_KEYS, DECODE_TILES_F32[gpu][cache_format]))
    return dict(zip(_TILE_KEYS, DECODE_TILES[gpu][(cache_format, num_heads > 16)]))


def default_num_splits(num_tokens: int, num_heads: int, max_keys: int, device: torch.device,
                       block_h: int | None = None) -> int:
    """Split-KV heuristic: enough programs for ~2 waves over the SMs, each split >= 256 keys.

    ``max_keys`` is the most keys one token sees (host value, e.g. from the batch's lists);
    ``block_h`` defaults to the bfloat16 ``decode_config``'s.
    """
    block_h = block_h or decode_config(torch.bfloat16, device, num_heads)["BLOCK_H"]
    programs = max(1, num_tokens * triton.cdiv(num_heads, block_h))
    want = triton.cdiv(2 * _num_sms(device), programs)
    return int(max(1, min(want, triton.cdiv(max(max_keys, 1), 256), 64)))


def decode_into(
    q: torch.Tensor,
    cache_layer: torch.Tensor,
    block_table: torch.Tensor,
    cache_lengths: torch.Tensor,
    input_row_offsets: torch.Tensor,
    page_size: int,
    *,
    scale: float,
    kv_lora_rank: int,
    mask: MaskVariant = MaskVariant(),
    sparse_indices: torch.Tensor | None = None,
    topk_lengths: torch.Tensor | None = None,
    physical_indices: bool = True,
    attn_sink: torch.Tensor | None = None,
    num_splits: int = 1,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
    config: dict | None = None,
    cache_format: str = "native",
    kv_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode without host reads (the CUDA-graph-capturable entry; no argument checks).

    ``q [T, H, L+R]`` absorbed and roped; ``cache_layer [num_pages, page_size, width]``
    (contiguous) in ``cache_format``: native entries ``L+R`` wide, fp8_e4m3 (float8_e4m3fn
    entries; ``kv_scale``: this layer's float32 scale as a 1-element device tensor) or
    fp8_ds_mla (uint8 records); ``block_table [B, max_pages]``, ``cache_lengths [B]``,
    ``input_row_offsets [B+1]`` int32 on q's device; ``sparse_indices [T, stride]`` int32
    (``topk_lengths [B]``). Returns ``out [T, H, L]`` (q's dtype unless ``out`` is given) and
    float32 ``lse [T, H]``. ``workspace`` = (``o_part [S, T, H, L]``, ``lse_part [S, T, H]``)
    float32 with ``S >= num_splits``. ``config`` overrides ``decode_config`` (tuning).
    """
    T, H, D = q.shape
    L, R = kv_lora_rank, D - kv_lora_rank
    dev = q.device
    out = out if out is not None else _common.empty_output((T, H, L), q.dtype, dev)
    lse = lse if lse is not None else _common.empty_output((T, H), torch.float32, dev)
    if workspace is None:
        workspace = (_common.empty_output((num_splits, T, H, L), torch.float32, dev),
                     _common.empty_output((num_splits, T, H), torch.float32, dev))
    o_part, lse_part = workspace[0][:num_splits], workspace[1][:num_splits]
    if T == 0:
        return out, lse
    # Layout the kernels index with unit inner strides (host-side shape facts: no sync).
    views = _common.cache_views(cache_layer, cache_format, L, kv_scale)
    if o_part.stride(3) != 1 or lse_part.stride(2) != 1 or out.stride(2) != 1 or lse.stride(1) != 1:
        raise ValueError("workspace/out/lse: the last dimension must be contiguous")
    if q.stride(2) != 1:
        q = q.contiguous()
    if sparse_indices is None:
        sparse_mode, sparse = SPARSE_NONE, block_table  # unused pointer
    else:
        sparse_mode = SPARSE_PHYSICAL if physical_indices else SPARSE_LOGICAL
        sparse = sparse_indices
    mask_code, window, chunk = _common.mask_args(mask)
    dot_t = views.dot_dtype(q.dtype)
    cfg = dict(config) if config is not None else decode_config(views.compute_dtype(q.dtype), dev, H, cache_format)
    block_h, block_n = cfg.pop("BLOCK_H"), cfg.pop("BLOCK_N")
    B = cache_lengths.shape[0]
    grid = (triton.cdiv(H, block_h) * T, num_splits)
    common = (block_table, cache_lengths, input_row_offsets, sparse, topk_lengths if topk_lengths is not None else cache_lengths,
              o_part, lse_part,
              B, H, num_splits, page_size, block_table.shape[1], cache_layer.shape[0], float(scale) / math.log(2.0),
              window, chunk,
              sparse.shape[1] if sparse_indices is not None else 0)
    strides_out = (o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0), lse_part.stride(1))
    meta = dict(BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_R=next_pow2(R), MASK=mask_code, SPARSE=sparse_mode,
                HAS_TOPK=topk_lengths is not None, STEPS=search_steps(B), DOT_T=dot_t,
                PRECISION=_common.dot_precision(dot_t), **cfg)
    sparse_stride = sparse.stride(0) if sparse_indices is not None else 0
    if views.fmt == _common.FMT_DS_MLA:
        _decode_split_ds_mla_kernel[grid](
            q, views.latent, views.rope, views.scales, *common,
            q.stride(0), q.stride(1), views.latent.stride(1), views.rope.stride(1), views.scales.stride(1),
            block_table.stride(0), sparse_stride, *strides_out,
            L=L, R=R, GROUP=DS_MLA_GROUP, BLOCK_G=next_pow2(L, 1) // DS_MLA_GROUP, **meta,
        )
    else:
        _decode_split_kernel[grid](
            q, views.latent, views.rope, views.kv_scale, *common,
            q.stride(0), q.stride(1), views.latent.stride(1), views.rope.stride(1), block_table.stride(0), sparse_stride,
            *strides_out,
            L=L, R=R, BLOCK_L=next_pow2(L), KV_SCALED=views.fmt == _common.FMT_E4M3, **meta,
        )
    return merge_parts(o_part, lse_part, input_row_offsets, attn_sink=attn_sink, out=out, lse_out=lse)
