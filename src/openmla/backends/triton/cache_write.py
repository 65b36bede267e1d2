"""Cache write: RMSNorm + RoPE + paged scatter of a ragged batch, and q's RoPE, in one launch.

Grid ``(T, cdiv(H, BLOCK_H))``: program ``(t, j)`` rotates the rope part of heads
``j*BLOCK_H ...`` of token ``t`` (copying the nope part through), and program ``(t, 0)``
also normalises ``kv[t]``'s latent, rotates its key rope part and stores the 576-wide
entry at the token's physical cache row. Everything is computed in float32.

Cache formats (``FMT``), quantised in the kernel to the bytes ``CacheBatch.write_rows``
stores for the same float32 entry:
- native: the entry in the cache's dtype;
- fp8_e4m3: ``clamp(x / kv_scale[layer], -448, 448)`` as float8_e4m3fn, latent and rope;
- fp8_ds_mla: per 128-value group of the latent, ``scale = amax / 448`` (1 for an all-zero
  group), ``clamp(x / scale)`` as float8_e4m3fn, the float32 scales, and the rope part as
  bfloat16; written through three typed views of the uint8 record (``openmla.fp8.ds_mla_views``).

RoPE pairs: interleaved ``(x[2i], x[2i+1])`` (DeepSeek) or half-split ``(x[i], x[i+R/2])``;
either way pair ``i`` turns by ``(freqs_cis[p, 2i], freqs_cis[p, 2i+1]) = (cos, sin)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...cache import CacheBatch
from ...fp8 import DS_MLA_GROUP
from . import _common
from ._common import FP8_MAX_C, cast_to, find_sequence, next_pow2, physical_row, quantize_e4m3, search_steps


@triton.jit
def _rope_pair_index(HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, INTERLEAVED: tl.constexpr):
    """Indices ``(a, b)`` of the two members of each rotated pair, and the lane mask."""
    i = tl.arange(0, BLOCK_HALF)
    if INTERLEAVED:
        a = 2 * i
        b = 2 * i + 1
    else:
        a = i
        b = i + HALF
    return a, b, i < HALF


@triton.jit
def _cache_write_kernel(
    q_ptr, q_out_ptr, kv_ptr, freqs_ptr, gamma_ptr, lat_ptr, rope_ptr, scales_ptr, kv_scale_ptr,
    block_table_ptr, cache_lens_ptr, offsets_ptr,
    num_seqs, num_heads, page_size, max_pages, num_pages, num_positions, eps,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kvt, stride_freqs, stride_bt,
    stride_lat, stride_rope, stride_scales,
    L: tl.constexpr, R: tl.constexpr, DN: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_DN: tl.constexpr, BLOCK_H: tl.constexpr,
    INTERLEAVED: tl.constexpr, STEPS: tl.constexpr,
    FMT: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
):
    t = tl.program_id(0)
    head_block = tl.program_id(1)
    seq = find_sequence(offsets_ptr, t, num_seqs, STEPS)
    pos = tl.load(cache_lens_ptr + seq) + t - tl.load(offsets_ptr + seq)

    # cos/sin of this position, one per rotated pair (a position outside freqs_cis, from
    # metadata corrupted after validation, reads zeros instead of foreign memory).
    a_idx, b_idx, pair_ok = _rope_pair_index(R // 2, BLOCK_HALF, INTERLEAVED)
    pair = tl.arange(0, BLOCK_HALF)
    pos_ok = (pos >= 0) & (pos < num_positions)
    freqs_row = freqs_ptr + tl.where(pos_ok, pos, 0).to(tl.int64) * stride_freqs
    cos = tl.load(freqs_row + 2 * pair, mask=tl.where(pos_ok, pair_ok, False), other=0.0).to(tl.float32)
    sin = tl.load(freqs_row + 2 * pair + 1, mask=tl.where(pos_ok, pair_ok, False), other=0.0).to(tl.float32)

    # q: copy the nope part, rotate the rope part, for a block of heads.
    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < num_heads
    q_row = q_ptr + t.to(tl.int64) * stride_qt + heads[:, None] * stride_qh
    o_row = q_out_ptr + t.to(tl.int64) * stride_ot + heads[:, None] * stride_oh
    d = tl.arange(0, BLOCK_DN)
    nope_ok = head_ok[:, None] & (d[None, :] < DN)
    nope = tl.load(q_row + d[None, :], mask=nope_ok, other=0.0)
    tl.store(o_row + d[None, :], nope, mask=nope_ok)
    rope_ok = head_ok[:, None] & pair_ok[None, :]
    qa = tl.load(q_row + DN + a_idx[None, :], mask=rope_ok, other=0.0).to(tl.float32)
    qb = tl.load(q_row + DN + b_idx[None, :], mask=rope_ok, other=0.0).to(tl.float32)
    out_ty = q_out_ptr.dtype.element_ty
    tl.store(o_row + DN + a_idx[None, :], cast_to(qa * cos[None, :] - qb * sin[None, :], out_ty), mask=rope_ok)
    tl.store(o_row + DN + b_idx[None, :], cast_to(qa * sin[None, :] + qb * cos[None, :], out_ty), mask=rope_ok)

    if head_block == 0:
        # Latent: x * rsqrt(mean(x^2) + eps) * gamma.
        kv_row = kv_ptr + t.to(tl.int64) * stride_kvt
        lane = tl.arange(0, BLOCK_L)
        lane_ok = lane < L
        x = tl.load(kv_row + lane, mask=lane_ok, other=0.0).to(tl.float32)
        gamma = tl.load(gamma_ptr + lane, mask=lane_ok, other=0.0).to(tl.float32)
        inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / L + eps)
        y = x * inv_rms * gamma
        # A row outside the cache (corrupt page table or length) is not written at all.
        row, row_ok = physical_row(block_table_ptr + seq.to(tl.int64) * stride_bt, pos, page_size, max_pages, num_pages,
                                   pos_ok)
        # (``tl.where`` spreads the scalar flag: the interpreter cannot ``&`` a scalar with a block.)
        lane_ok = tl.where(row_ok, lane_ok, False)
        pair_ok = tl.where(row_ok, pair_ok, False)
        lat_dst = lat_ptr + row * stride_lat
        rope_dst = rope_ptr + row * stride_rope
        # Key rope part, rotated like q's.
        ka = tl.load(kv_row + L + a_idx, mask=pair_ok, other=0.0).to(tl.float32)
        kb = tl.load(kv_row + L + b_idx, mask=pair_ok, other=0.0).to(tl.float32)
        ra = ka * cos - kb * sin
        rb = ka * sin + kb * cos
        if FMT == 0:  # native
            cache_ty = lat_ptr.dtype.element_ty
            tl.store(lat_dst + lane, cast_to(y, cache_ty), mask=lane_ok)
            tl.store(rope_dst + a_idx, cast_to(ra, cache_ty), mask=pair_ok)
            tl.store(rope_dst + b_idx, cast_to(rb, cache_ty), mask=pair_ok)
        elif FMT == 1:  # fp8_e4m3: one scale per layer for the whole entry
            kv_scale = tl.load(kv_scale_ptr)
            tl.store(lat_dst + lane, quantize_e4m3(y, kv_scale), mask=lane_ok)
            tl.store(rope_dst + a_idx, quantize_e4m3(ra, kv_scale), mask=pair_ok)
            tl.store(rope_dst + b_idx, quantize_e4m3(rb, kv_scale), mask=pair_ok)
        else:  # fp8_ds_mla: a scale per GROUP latent values, the rope part in bfloat16
            y2 = tl.reshape(y, (BLOCK_G, GROUP))  # BLOCK_L == BLOCK_G * GROUP; padded lanes are 0
            g = tl.arange(0, BLOCK_G)
            amax = tl.max(tl.abs(y2), axis=1)
            scale = tl.where(amax > 0, tl.math.div_rn(amax, FP8_MAX_C), 1.0)
            col = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
            tl.store(lat_dst + col, quantize_e4m3(y2, scale[:, None]), mask=tl.where(row_ok, col < L, False))
            tl.store(scales_ptr + row * stride_scales + g, scale, mask=tl.where(row_ok, g * GROUP < L, False))
            tl.store(rope_dst + a_idx, cast_to(ra, tl.bfloat16), mask=pair_ok)
            tl.store(rope_dst + b_idx, cast_to(rb, tl.bfloat16), mask=pair_ok)


def write_cache(
    q: torch.Tensor,
    kv: torch.Tensor,
    freqs_cis: torch.Tensor,
    kv_norm_gamma: torch.Tensor,
    batch: CacheBatch,
    layer_idx: int,
    epsilon: float,
    interleaved: bool = True,
) -> torch.Tensor:
    """Store ``kv [T, L+R]`` at each new token's cache row and return roped ``q [T, H, Dn+R]``.

    ``freqs_cis [max_pos, R]`` (float32; float64 is narrowed), ``kv_norm_gamma [L]``. The
    result has q's dtype; the cache ``batch.blocks[layer_idx]`` is written in place.
    Launch needs no host value beyond tensor shapes (capturable in a CUDA graph).
    """
    _common.check_device(q)
    T, H, QD = q.shape
    L = kv_norm_gamma.shape[0]
    R = kv.shape[1] - L
    DN = QD - R
    if DN < 0:  # the kernel would address q_out's rope part before the row: refuse (host shapes only)
        raise ValueError(f"q: depth {QD} is smaller than the rope width {R} (kv width minus kv_norm_gamma's)")
    q_out = _common.empty_output((T, H, QD), q.dtype, q.device)
    if T == 0:
        return q_out
    q = q.contiguous() if q.stride(2) != 1 else q
    kv = kv.contiguous()
    freqs = freqs_cis.to(torch.float32).contiguous()
    views = _common.batch_views(batch, layer_idx, L)
    block_table = _common.as_index(batch.block_table)
    BLOCK_H = min(16, triton.next_power_of_2(H))
    grid = (T, triton.cdiv(H, BLOCK_H))
    _cache_write_kernel[grid](
        q, q_out, kv, freqs, kv_norm_gamma.contiguous(), views.latent, views.rope, views.scales, views.kv_scale,
        block_table, _common.as_index(batch.cache_lengths), _common.as_index(batch.input_row_offsets),
        batch.batch_size, H, batch.page_size, block_table.shape[1], views.latent.shape[0], freqs.shape[0], float(epsilon),
        q.stride(0), q.stride(1), q_out.stride(0), q_out.stride(1), kv.stride(0), freqs.stride(0),
        block_table.stride(0), views.latent.stride(1), views.rope.stride(1), views.scales.stride(1),
        L=L, R=R, DN=DN,
        BLOCK_L=next_pow2(L, 1), BLOCK_HALF=next_pow2(R // 2, 1), BLOCK_DN=next_pow2(DN, 1), BLOCK_H=BLOCK_H,
        INTERLEAVED=bool(interleaved), STEPS=search_steps(batch.batch_size),
        FMT=views.fmt, GROUP=DS_MLA_GROUP, BLOCK_G=max(1, next_pow2(L, 1) // DS_MLA_GROUP),
    )
    return q_out
