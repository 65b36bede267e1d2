"""Shared-KV (DeepSeek-V4) attention: a sliding window of raw entries plus compressed entries, split-KV.

Every query head reads the same entries of width ``D`` and the value is the whole entry (K = V),
so a key tile is loaded once and used for the scores and the output, as in the absorbed decode
(``decode``). The keys of the query at position ``t`` (``openmla.shared_kv_spec``):

- window: raw entries at positions ``max(0, t - window + 1) .. t``;
- compressed: entries ``w < (t + 1) // rate``: all of them (``indices`` None, HCA), or the
  entries of row ``t`` of ``indices`` (-1 unused; a repeated entry counts twice; CSA).

Stage 1 (``_shared_kv_split_kernel``), grid ``(T * cdiv(H, BLOCK_H), num_splits)``: a program
takes one query row, a block of its heads and one slice of that row's items. The items are the
window's positions, padded to whole ``BLOCK_N`` tiles, then the compressed slots, so a tile is
wholly raw or wholly compressed and each stream keeps its own page table. The program writes its
slice's normalised output and float32 LSE. Heads vary fastest in the grid so the programs sharing
a row's key tiles run together.
Stage 2 (``merge.merge_parts``) folds the slices together and applies the per-head sink.

Host reads: none. Each row's sequence and position come from the plan (``SharedKVPlan.token_seq``
/ ``token_pos``, device tensors made once per step), the grid from T, H and ``num_splits``; the
split size from the plan's host bounds (``window_keys``, ``compressed_keys``).
Bounds: a row whose window reaches a freed page (-1) or a page outside the store, or a
compressed entry outside its page table, reads nothing (the plan has proved a validated step
never does). Float64 is computed in float32 (the kernels' accumulation type).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import _common
from ._common import natural_lse, next_pow2, online_softmax_step, physical_row
from .decode import _num_sms, split_program
from .merge import merge_parts

# Compressed stream as the kernel's ``COMP`` constexpr.
COMP_NONE, COMP_RULE, COMP_INDICES = 0, 1, 2


@triton.jit
def _attend_tile(q, keys, valid, m_i, l_i, acc, qk_scale, DOT_T: tl.constexpr, PRECISION: tl.constexpr):
    """One key tile of the online softmax: ``keys [BLOCK_N, BLOCK_D]`` are both key and value."""
    s = tl.dot(q, tl.trans(keys), input_precision=PRECISION)
    s = tl.where(valid[None, :], s * qk_scale, float("-inf"))  # base-2 logits
    p, alpha, l_i, m_new = online_softmax_step(s, m_i, l_i)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_T), keys, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _shared_kv_split_kernel(
    q_ptr, raw_ptr, raw_table_ptr, comp_ptr, comp_table_ptr, idx_ptr, seq_ptr, pos_ptr,
    o_part_ptr, lse_part_ptr,
    num_heads, num_splits, window, rate, win_items, comp_items, sm_scale_log2,
    raw_page, raw_max_pages, raw_num_pages, comp_page, comp_max_pages, comp_num_pages,
    stride_qt, stride_qh, stride_raw, stride_raw_bt, stride_comp, stride_comp_bt, stride_idx_t,
    stride_ps, stride_pt, stride_ph, stride_ls, stride_lt,
    D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    COMP: tl.constexpr, DOT_T: tl.constexpr, PRECISION: tl.constexpr,
):
    # Step 1: which row, which heads, which slice of the items.
    t, head_block, split = split_program(num_heads, BLOCK_H)
    seq = tl.load(seq_ptr + t).to(tl.int64)
    pos = tl.load(pos_ptr + t)
    # Items: the window's positions lo .. pos in [0, win_items) (win_items: the plan's window
    # keys, padded to whole tiles), then compressed slots in [win_items, win_items + comp_items).
    lo = tl.maximum(pos - window + 1, 0)
    limit = (pos + 1) // rate  # compressed entries w < limit are visible
    total = win_items + comp_items
    per_split = tl.cdiv(tl.cdiv(total, num_splits), BLOCK_N) * BLOCK_N  # whole tiles per split
    start = split * per_split
    end = tl.minimum(start + per_split, total)

    # Step 2: this row's query for a block of heads (normed and roped by the caller).
    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < num_heads
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = tl.load(q_ptr + t.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=head_ok[:, None] & d_ok[None, :], other=0.0).to(DOT_T)

    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_D), tl.float32)

    # Step 3: window tiles (raw entries at lo + item; items past pos are no key).
    raw_table = raw_table_ptr + seq * stride_raw_bt
    for n0 in range(start, tl.minimum(end, win_items), BLOCK_N):
        kpos = lo + n0 + tl.arange(0, BLOCK_N)
        rows, valid = physical_row(raw_table, kpos, raw_page, raw_max_pages, raw_num_pages, kpos <= pos)
        keys = tl.load(raw_ptr + rows[:, None] * stride_raw + d[None, :], mask=valid[:, None] & d_ok[None, :],
                       other=0.0).to(DOT_T)
        m_i, l_i, acc = _attend_tile(q, keys, valid, m_i, l_i, acc, sm_scale_log2, DOT_T, PRECISION)

    # Step 4: compressed tiles (entry w = the slot, or indices[t, slot]; visible iff 0 <= w < limit).
    if COMP != 0:
        comp_table = comp_table_ptr + seq * stride_comp_bt
        for n0 in range(tl.maximum(start, win_items), end, BLOCK_N):
            slot = n0 - win_items + tl.arange(0, BLOCK_N)
            in_row = slot < comp_items
            if COMP == 1:
                ent = slot
            else:
                ent = tl.load(idx_ptr + t.to(tl.int64) * stride_idx_t + slot, mask=in_row, other=-1).to(tl.int32)
            ok = in_row & (ent >= 0) & (ent < limit)
            rows, valid = physical_row(comp_table, tl.where(ok, ent, 0), comp_page, comp_max_pages, comp_num_pages, ok)
            keys = tl.load(comp_ptr + rows[:, None] * stride_comp + d[None, :], mask=valid[:, None] & d_ok[None, :],
                           other=0.0).to(DOT_T)
            m_i, l_i, acc = _attend_tile(q, keys, valid, m_i, l_i, acc, sm_scale_log2, DOT_T, PRECISION)

    # Step 5: this slice's normalised output and LSE (no key: zeros, -inf).
    out = acc / tl.where(l_i == 0, 1.0, l_i)[:, None]
    lse = natural_lse(m_i, l_i)
    part = split.to(tl.int64) * stride_ps + t.to(tl.int64) * stride_pt
    tl.store(o_part_ptr + part + heads[:, None] * stride_ph + d[None, :], out, mask=head_ok[:, None] & d_ok[None, :])
    tl.store(lse_part_ptr + split.to(tl.int64) * stride_ls + t.to(tl.int64) * stride_lt + heads, lse, mask=head_ok)


# Stage-1 tiles (BLOCK_H, BLOCK_N, num_warps, num_stages), per GPU kind (``_common.gpu_kind``):
# for half-precision dots by "more than 16 heads", for float32 dots (FMA loops) 16 x 16 on one
# stage. The entry is as wide as decode's latent (512 for V4), so these are decode's native
# tiles (``decode.DECODE_TILES``); compiled for sm_90, sm_100 and gfx942 by
# ``openmla compile-report``. Not yet tuned by measurement on a GPU.
_TILE_KEYS = ("BLOCK_H", "BLOCK_N", "num_warps", "num_stages")
SHARED_KV_TILES = {
    "nvidia": {False: (16, 32, 4, 2), True: (32, 32, 8, 2), "float32": (16, 16, 4, 1)},
    # float32 on gfx942: 2 stages. With 1, the window-only variant (COMP none) has 36 scratch bytes (its
    # SGPR spills find no free VGPR lane); with 2 none has scratch (380-398 VGPRs); 8 waves spill 73-92 VGPRs.
    "amd": {False: (16, 16, 4, 1), True: (32, 16, 4, 1), "float32": (16, 16, 4, 2)},
}


def shared_kv_config(dtype: torch.dtype, device: torch.device, num_heads: int) -> dict:
    """Tile sizes and launch settings (BLOCK_H/BLOCK_N >= 16 for ``tl.dot``) for ``tl.dot``
    operands of ``dtype`` from ``SHARED_KV_TILES``. The interpreter (CPU tensors): 16 x 16."""
    gpu = _common.gpu_kind(device)
    if gpu is None:
        return dict(BLOCK_H=16, BLOCK_N=16)
    key = "float32" if dtype in (torch.float32, torch.float64) else num_heads > 16
    return dict(zip(_TILE_KEYS, SHARED_KV_TILES[gpu][key]))


def default_num_splits(num_tokens: int, num_heads: int, max_keys: int, device: torch.device, block_h: int) -> int:
    """Split-KV heuristic (decode's): enough programs for ~2 waves over the SMs, each split >= 256 keys."""
    programs = max(1, num_tokens * triton.cdiv(num_heads, block_h))
    want = triton.cdiv(2 * _num_sms(device), programs)
    return int(max(1, min(want, triton.cdiv(max(max_keys, 1), 256), 64)))


def shared_kv_into(q: torch.Tensor, plan, *, num_splits: int | None = None, config: dict | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [T, H, D]`` over ``plan``'s (a validated ``openmla.v4.SharedKVPlan``) window and
    compressed entries -> ``out [T, H, D]`` in q's dtype (float32 for float64 q), ``lse [T, H]``
    float32 with the sink left out. ``num_splits`` None: ``default_num_splits``; ``config``
    overrides ``shared_kv_config`` (tuning)."""
    spec = plan.spec
    T, H, D = q.shape
    dev = q.device
    out_dtype = torch.float32 if q.dtype == torch.float64 else q.dtype
    dot_t = _common.dot_dtype(q.dtype)
    compute = torch.float32 if dot_t == tl.float32 else q.dtype
    cfg = dict(config) if config is not None else shared_kv_config(compute, dev, H)
    block_h, block_n = cfg.pop("BLOCK_H"), cfg.pop("BLOCK_N")
    win_items = triton.cdiv(plan.window_keys, block_n) * block_n
    ck = spec.compressed
    comp_items = plan.compressed_keys if ck is not None else 0
    if num_splits is None:
        num_splits = default_num_splits(T, H, plan.window_keys + comp_items, dev, block_h)
    o_part = _common.empty_output((num_splits, T, H, D), torch.float32, dev)
    lse_part = _common.empty_output((num_splits, T, H), torch.float32, dev)
    if T == 0:
        return _common.empty_output((T, H, D), out_dtype, dev), _common.empty_output((T, H), torch.float32, dev)
    if q.stride(2) != 1:
        q = q.contiguous()
    raw = plan.raw
    raw_rows, raw_table = _rows(raw.blocks, "raw.blocks"), _common.as_index(raw.block_table)
    if ck is None:
        mode, comp_rows, comp_table, idx, rate = COMP_NONE, raw_rows, raw_table, raw_table, 1
        comp_page, comp_pages = raw.page_size, raw.blocks.shape[0]
    else:
        comp = plan.compressed
        comp_rows, comp_table = _rows(comp.blocks, "compressed.blocks"), _common.as_index(comp.block_table)
        comp_page, comp_pages = comp.page_size, comp.blocks.shape[0]
        mode, idx, rate = (COMP_RULE, comp_table, ck.rate) if ck.indices is None else \
            (COMP_INDICES, _common.as_index(ck.indices), ck.rate)
    grid = (triton.cdiv(H, block_h) * T, num_splits)
    _shared_kv_split_kernel[grid](
        q, raw_rows, raw_table, comp_rows, comp_table, idx, plan.token_seq, plan.token_pos,
        o_part, lse_part,
        H, num_splits, spec.window, rate, win_items, comp_items, float(spec.scale) / math.log(2.0),
        raw.page_size, raw_table.shape[1], raw.blocks.shape[0], comp_page, comp_table.shape[1], comp_pages,
        q.stride(0), q.stride(1), raw_rows.stride(0), raw_table.stride(0), comp_rows.stride(0), comp_table.stride(0),
        idx.stride(0),
        o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0), lse_part.stride(1),
        D=D, BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_D=next_pow2(D), COMP=mode, DOT_T=dot_t,
        PRECISION=_common.dot_precision(dot_t), **cfg,
    )
    return merge_parts(o_part, lse_part, plan.q_offsets, attn_sink=spec.attn_sink, out_dtype=out_dtype)


def _rows(blocks: torch.Tensor, name: str) -> torch.Tensor:
    """``blocks [pages, page_size, D]`` as rows ``[pages * page_size, D]`` (a view: pages must be row-major)."""
    if blocks.stride(2) != 1 or blocks.stride(0) != blocks.shape[1] * blocks.stride(1):
        raise ValueError(f"{name}: pages must be stored row-major with contiguous entries")
    return blocks.view(-1, blocks.shape[2]) if blocks.is_contiguous() else blocks.as_strided(
        (blocks.shape[0] * blocks.shape[1], blocks.shape[2]), (blocks.stride(1), 1))
