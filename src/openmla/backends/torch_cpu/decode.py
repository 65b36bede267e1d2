"""torch backend: the decode (absorbed, MQA) form over the paged latent cache.

Keys are the raw ``L+R``-wide cache rows, shared by all H query heads; values are their first
``L`` columns, so one gathered key block serves both ``Q K^T`` and ``P V``. Work is organised as

- dense: per sequence, its query tokens (all heads folded into the matmul's M dimension,
  ``[tok*H, L+R]``) against the visible key range, cut into partitions (split-KV) and each
  partition into key blocks run with an online softmax;
- sparse: per chunk of query tokens, each token's own listed keys, batched with ``bmm``.

The loops run over sequences and key blocks; each iteration is two matmuls of real size.
Scores stay in the matmul dtype (bf16: torch's CPU GEMM accumulates in float32 and rounds the
result once); the softmax statistics, the running output and the merges are float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

import torch

from ...cache import CacheBatch
from ...masks import MaskVariant
from .cache_write import token_positions

__all__ = ["absorb", "unabsorb", "decode", "pick_num_partitions"]

# Tuning (measured on a 2-core Zen 4, bf16; see bench/RESULTS.md). One block of scores holds at
# most SCORE_BUDGET elements; a block never spans more than MAX_BLOCK_KEYS keys (the gathered
# keys, 1152 B each, stay cache resident between the two matmuls).
SCORE_BUDGET = 1 << 20
MAX_BLOCK_KEYS = 4096
MAX_QUERY_ROWS = 1024  # query rows (tokens x heads) folded into one matmul
SPARSE_GATHER_ROWS = 8192  # keys gathered at once by the sparse path


def _alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Output buffers; every row is written before return (tests swap this for a NaN fill)."""
    return torch.empty(shape, dtype=dtype, device=device)


# Absorption ------------------------------------------------------------------------
def _heads_bmm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per-head product ``x [T, H, a] @ w [H, a, b] -> [T, H, b]`` (heads are the bmm batch)."""
    dtype = torch.promote_types(x.dtype, w.dtype)
    y = torch.bmm(x.transpose(0, 1).to(dtype), w.to(dtype))  # [H, T, b]
    return y.transpose(0, 1)


def absorb(q_rot: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """``q_abs [T, H, L+R]``: ``q_lat[t, h] = w_uk[h] @ q_nope[t, h]`` (``w_uk [H, L, Dn]``), then q_rope.

    Output in q_rot's dtype.
    """
    T, H, _ = q_rot.shape
    L, Dn = w_uk.shape[1], w_uk.shape[2]
    out = torch.empty(T, H, L + q_rot.shape[2] - Dn, dtype=q_rot.dtype, device=q_rot.device)
    out[..., :L] = _heads_bmm(q_rot[..., :Dn], w_uk.transpose(1, 2))
    out[..., L:] = q_rot[..., Dn:]
    return out


def unabsorb(out_lat: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """``out [T, H, Dv] = w_uv[h] @ out_lat[t, h]`` (``w_uv [H, Dv, L]``), in out_lat's dtype."""
    return _heads_bmm(out_lat, w_uv.transpose(1, 2)).to(out_lat.dtype)


# Online softmax over key blocks ---------------------------------------------------
@dataclass
class _State:
    """Running softmax of one group of query rows: ``m`` offset subtracted from the scaled
    scores (-inf while no key was seen), ``l`` sum of exponentials, ``acc`` unnormalised output."""

    m: torch.Tensor  # [G, M] float32
    l: torch.Tensor  # [G, M] float32
    acc: torch.Tensor  # [G, M, L] float32


def _scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``q [G, M, D] @ k[G, n, D]^T -> [G, M, n]`` (a plain mm when G == 1)."""
    if q.shape[0] == 1:
        return torch.mm(q[0], k[0].t()).unsqueeze(0)
    return torch.bmm(q, k.transpose(1, 2))


def _pv(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    if p.shape[0] == 1:
        return torch.mm(p[0], v[0]).unsqueeze(0)
    return torch.bmm(p, v)


def _scaled_max(s: torch.Tensor, scale: float, stat: torch.dtype) -> torch.Tensor:
    """``scale * max_n s`` per row ``[G, M]``; an all-masked row stays -inf (also for scale 0)."""
    m = s.amax(-1).to(stat)
    if scale == 0.0:
        return torch.where(m == -math.inf, m, 0.0)
    return m * scale


def _block_step(
    state: _State | None, q: torch.Tensor, k: torch.Tensor, keep: torch.Tensor | None,
    heads: int, scale: float, L: int, stat: torch.dtype,
) -> _State:
    """Fold one key block into ``state``.

    ``q [G, M, D]`` (M = tok * heads, token-major), ``k [G, n, D]`` (values = ``k[..., :L]``),
    ``keep [G, tok, n]`` bool or None (all visible). ``scale >= 0``.
    """
    G, M, _ = q.shape
    n = k.shape[1]
    s = _scores(q, k)  # [G, M, n], matmul dtype
    if keep is not None:
        s.view(G, M // heads, heads, n).masked_fill_(~keep[:, :, None, :], -math.inf)
    m_blk = _scaled_max(s, scale, stat)
    m_new = m_blk if state is None else torch.maximum(state.m, m_blk)
    finite = torch.isfinite(m_new)
    # The offset is rounded to the scores' dtype so the value subtracted below is exactly `off`.
    off = torch.where(finite, m_new, 0.0).to(s.dtype)
    p = torch.add(off.neg().unsqueeze(-1), s, alpha=scale, out=s)  # scale*s - off, float32 inside
    if keep is not None and scale == 0.0:  # 0 * -inf: keep masked keys out explicitly
        p.view(G, M // heads, heads, n).masked_fill_(~keep[:, :, None, :], -math.inf)
    p.exp_()
    l_blk = p.sum(-1, dtype=stat)
    pv = _pv(p, k[..., :L])
    off_f = off.to(stat)
    m_state = torch.where(finite, off_f, -math.inf)
    if state is None:
        return _State(m_state, l_blk, pv.to(stat))
    alpha = torch.exp(state.m - off_f)  # 0 where nothing was seen yet
    acc = state.acc.mul_(alpha.unsqueeze(-1)).add_(pv)
    return _State(m_state, state.l.mul_(alpha).add_(l_blk), acc)


def _finish(state: _State | None, shape: tuple[int, int, int], stat: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalised ``(out [G, M, L], lse [G, M])``; rows without keys give 0 and -inf."""
    if state is None:
        return torch.zeros(shape, dtype=stat, device=device), torch.full(shape[:2], -math.inf, dtype=stat, device=device)
    l = state.l
    seen = l > 0
    out = state.acc.div_(torch.where(seen, l, 1.0).unsqueeze(-1))
    lse = torch.where(seen, state.m + torch.log(torch.where(seen, l, 1.0)), -math.inf)
    return out, lse


def _merge(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """LSE-merge independently computed partitions ``(o, lse)``."""
    o, lse = parts[0]
    for o_b, lse_b in parts[1:]:
        m = torch.maximum(lse, lse_b)
        m_safe = torch.where(torch.isfinite(m), m, 0.0)
        wa, wb = torch.exp(lse - m_safe), torch.exp(lse_b - m_safe)
        denom = wa + wb
        safe = torch.where(denom > 0, denom, 1.0)
        o = o * (wa / safe).unsqueeze(-1) + o_b * (wb / safe).unsqueeze(-1)
        lse = torch.where(denom > 0, m_safe + torch.log(safe), -math.inf)
    return o, lse


# Planning helpers -------------------------------------------------------------------
def pick_num_partitions(num_keys: int) -> int:
    """Split-KV heuristic for the CPU: one partition.

    Split-KV exists to occupy idle GPU SMs when few sequences are long; here the intra-op
    threads already share every matmul, and each extra partition only adds merge work.
    """
    return 1


def _split(lo: int, hi: int, parts: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` cut into ``parts`` near-equal contiguous ranges (some empty when short)."""
    n = hi - lo
    cuts = [lo + (n * i) // parts for i in range(parts + 1)]
    return list(zip(cuts[:-1], cuts[1:]))


def _blocks(lo: int, hi: int, size: int, align: int) -> Iterator[tuple[int, int]]:
    """``[lo, hi)`` in blocks of at most ``size`` keys whose inner edges fall on multiples of
    ``align`` (page boundaries), so a block gathers whole pages."""
    k0 = lo
    while k0 < hi:
        k1 = min(hi, k0 + size)
        if k1 < hi and align > 1 and (k1 // align) * align > k0:
            k1 = (k1 // align) * align
        yield k0, k1
        k0 = k1


class _PagedKeys:
    """Key rows of one layer, fetched by logical position range of one sequence."""

    def __init__(self, batch: CacheBatch, layer_idx: int, dtype: torch.dtype) -> None:
        self.layer = batch.blocks[layer_idx]  # [pages, ps, D]
        self.ps = batch.page_size
        self.D = self.layer.shape[-1]
        self.flat = self.layer.view(-1, self.D) if self.layer.is_contiguous() else None
        self.table = batch.block_table.to(self.layer.device, torch.int64)
        self.dtype = dtype

    def sequence(self, b: int, kv_len: int) -> tuple[torch.Tensor, list[int]]:
        """Page ids of sequence ``b`` and, per logical page, the id of its run of consecutive
        physical pages (two pages with equal run ids are physically adjacent in order)."""
        pages = self.table[b, : -(-kv_len // self.ps)]
        runs = torch.cumsum(torch.cat([pages.new_zeros(1), (pages[1:] - pages[:-1] != 1).long()]), 0)
        return pages, runs.tolist()

    def rows(self, pages: torch.Tensor, runs: list[int], k0: int, k1: int) -> torch.Tensor:
        """Keys at positions ``[k0, k1)`` as ``[k1-k0, D]``: a view when their pages are
        physically consecutive, else one page-level gather."""
        ps = self.ps
        j0, j1 = k0 // ps, (k1 - 1) // ps
        start = k0 - j0 * ps
        if self.flat is not None and runs[j0] == runs[j1]:
            base = int(pages[j0]) * ps + start
            keys = self.flat[base : base + (k1 - k0)]
        else:
            keys = self.layer.index_select(0, pages[j0 : j1 + 1]).view(-1, self.D)[start : start + (k1 - k0)]
        return keys if keys.dtype == self.dtype else keys.to(self.dtype)

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows ``[..., D]`` at physical row indices ``rows`` (any shape)."""
        flat_idx = rows.reshape(-1)
        if self.flat is not None:
            keys = self.flat.index_select(0, flat_idx)
        else:
            keys = self.layer[flat_idx // self.ps, flat_idx % self.ps]
        keys = keys.view(*rows.shape, self.D)
        return keys if keys.dtype == self.dtype else keys.to(self.dtype)


@dataclass
class _Ctx:
    """Everything a decode call shares."""

    q: torch.Tensor  # [T, H, D] in the matmul dtype, sign folded so that scale >= 0
    keys: _PagedKeys
    batch: CacheBatch
    scale: float
    L: int
    mask: MaskVariant
    num_partitions: int | None
    stat: torch.dtype
    out: torch.Tensor  # [T, H, L]
    lse: torch.Tensor  # [T, H]

    @property
    def H(self) -> int:
        return self.q.shape[1]


# Dense: every visible key of the sequence ---------------------------------------------
def _dense_chunk(ctx: _Ctx, pages: torch.Tensor, runs: list[int], row0: int, tok: int, p_lo: int, kv_len: int) -> None:
    """Query tokens ``row0 .. row0+tok-1`` (positions ``p_lo ..``) of one sequence."""
    H, L, mask = ctx.H, ctx.L, ctx.mask
    p_hi = p_lo + tok - 1
    lo, hi = mask.key_range(p_lo, p_hi, kv_len)
    # For one query, key_range is exactly its visible interval; keys inside every query's
    # interval need no mask.
    all_lo = mask.key_range(p_hi, p_hi, kv_len)[0]
    all_hi = mask.key_range(p_lo, p_lo, kv_len)[1]
    q = ctx.q[row0 : row0 + tok].reshape(1, tok * H, -1)
    M = tok * H
    block = max(1, min(MAX_BLOCK_KEYS, SCORE_BUDGET // M))
    nparts = ctx.num_partitions or pick_num_partitions(hi - lo)
    q_pos = None
    results = []
    for a, e in _split(lo, hi, nparts):
        state = None
        for k0, k1 in _blocks(a, e, block, ctx.keys.ps):
            keys = ctx.keys.rows(pages, runs, k0, k1).unsqueeze(0)
            keep = None
            if k0 < all_lo or k1 > all_hi:
                if q_pos is None:
                    q_pos = torch.arange(p_lo, p_hi + 1, device=q.device)
                k_pos = torch.arange(k0, k1, device=q.device)
                keep = mask.visible(q_pos[:, None], k_pos[None, :]).unsqueeze(0)
            state = _block_step(state, q, keys, keep, H, ctx.scale, L, ctx.stat)
        results.append(_finish(state, (1, M, L), ctx.stat, q.device))
    o, lse = _merge(results)
    ctx.out[row0 : row0 + tok].view(M, L).copy_(o[0])
    ctx.lse[row0 : row0 + tok].view(M).copy_(lse[0])


def _dense(ctx: _Ctx) -> None:
    b_offs = ctx.batch.offsets_list
    tok_cap = max(1, MAX_QUERY_ROWS // ctx.H)
    for b, (c, n) in enumerate(zip(ctx.batch.cache_lengths_list, ctx.batch.new_tokens_list)):
        if n == 0:
            continue
        kv_len = c + n
        pages, runs = ctx.keys.sequence(b, kv_len)
        chunks = -(-n // tok_cap)
        for i0, i1 in _split(0, n, chunks):  # balanced query chunks
            _dense_chunk(ctx, pages, runs, b_offs[b] + i0, i1 - i0, c + i0, kv_len)


# Sparse: each query token's listed keys -----------------------------------------------
def _sparse_rows(
    ctx: _Ctx, idx: torch.Tensor, seq: torch.Tensor, pos: torch.Tensor, topk: torch.Tensor | None, physical: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Physical rows ``[G, n]`` and validity ``[G, n]`` of the sparse entries ``idx`` of G tokens."""
    entries = idx.long()
    keep = entries >= 0
    if topk is not None:
        slot = torch.arange(entries.shape[1], device=entries.device)
        keep &= slot[None, :] < topk[seq][:, None]
    entries = torch.where(keep, entries, 0)
    if physical:
        return entries, keep  # physical rows: no positions, so no mask
    keep &= ctx.mask.visible(pos[:, None], entries)
    ps = ctx.keys.ps
    rows = ctx.keys.table[seq[:, None], entries // ps] * ps + entries % ps
    return rows, keep


def _sparse(ctx: _Ctx, sparse_indices: torch.Tensor, topk_lengths: torch.Tensor | None, physical: bool) -> None:
    T, H = ctx.q.shape[0], ctx.H
    L, device = ctx.L, ctx.q.device
    seq, pos = token_positions(ctx.batch, device)
    idx = sparse_indices.to(device)
    topk = None if topk_lengths is None else topk_lengths.to(device, torch.int64)
    stride = idx.shape[1]
    if topk is not None:  # slots at or past every topk length are never read
        stride = min(stride, int(topk.max()) if topk.numel() else 0)
    block = max(1, min(MAX_BLOCK_KEYS, stride, SCORE_BUDGET // H))
    group = max(1, min(SPARSE_GATHER_ROWS // block, SCORE_BUDGET // (H * block)))
    nparts = ctx.num_partitions or pick_num_partitions(stride)
    for t0 in range(0, T, group):
        t1 = min(T, t0 + group)
        rows, keep = _sparse_rows(ctx, idx[t0:t1, :stride], seq[t0:t1], pos[t0:t1], topk, physical)
        q = ctx.q[t0:t1]
        results = []
        for a, e in _split(0, stride, nparts):
            state = None
            for k0, k1 in _blocks(a, e, block, 1):
                keys = ctx.keys.gather(rows[:, k0:k1])
                state = _block_step(state, q, keys, keep[:, None, k0:k1], H, ctx.scale, L, ctx.stat)
            results.append(_finish(state, (t1 - t0, H, L), ctx.stat, device))
        o, lse = _merge(results)
        ctx.out[t0:t1].copy_(o)
        ctx.lse[t0:t1].copy_(lse)


# Entry point ----------------------------------------------------------------------------
def _matmul_dtype(q_dtype: torch.dtype, cache_dtype: torch.dtype) -> torch.dtype:
    dtype = torch.promote_types(q_dtype, cache_dtype)
    return torch.float32 if dtype == torch.float16 else dtype  # CPU fp16 GEMM has no fast path


def _apply_sink(out: torch.Tensor, lse: torch.Tensor, attn_sink: torch.Tensor, batch: CacheBatch) -> None:
    """``out *= e^lse / (e^lse + e^sink)`` in place; the sink joins the denominator only."""
    sink = attn_sink.to(lse.device, lse.dtype)
    if sink.dim() == 2:
        seq, _ = token_positions(batch, lse.device)
        sink = sink[seq]
    factor = torch.sigmoid(lse - sink).nan_to_num_(nan=0.0)  # -inf - (-inf): no key and no sink weight
    out.mul_(factor.unsqueeze(-1).to(out.dtype))


def decode(
    q_abs: torch.Tensor,
    batch: CacheBatch,
    layer_idx: int,
    *,
    scale: float,
    kv_lora_rank: int,
    mask: MaskVariant = MaskVariant(),
    sparse_indices: torch.Tensor | None = None,
    topk_lengths: torch.Tensor | None = None,
    physical_indices: bool = True,
    attn_sink: torch.Tensor | None = None,
    num_partitions: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed attention: ``q_abs [T, H, L+R]`` against the cache rows of ``layer_idx``.

    Returns ``out [T, H, L]`` (q_abs's dtype) and ``lse [T, H]`` (float32, natural log, without
    the sink). Query ``i`` of sequence ``b`` sits at ``cache_lengths[b] + i``; the cache already
    holds this call's tokens. Rows with no visible key give zeros and -inf.
    """
    T, H, _ = q_abs.shape
    device = q_abs.device
    mm_dtype = _matmul_dtype(q_abs.dtype, batch.blocks.dtype)
    stat = torch.float64 if mm_dtype == torch.float64 else torch.float32
    q = q_abs.to(mm_dtype)
    if scale < 0:  # negating q is exact; the block step then needs only scale >= 0
        q, scale = -q, -scale
    acc_dtype = torch.float64 if q_abs.dtype == torch.float64 else torch.float32
    ctx = _Ctx(
        q=q.contiguous(), keys=_PagedKeys(batch, layer_idx, mm_dtype), batch=batch, scale=float(scale),
        L=kv_lora_rank, mask=mask, num_partitions=num_partitions, stat=stat,
        out=_alloc((T, H, kv_lora_rank), acc_dtype, device), lse=_alloc((T, H), stat, device),
    )
    if T:
        if sparse_indices is None:
            _dense(ctx)
        else:
            _sparse(ctx, sparse_indices, topk_lengths, physical_indices)
    if attn_sink is not None and T:
        _apply_sink(ctx.out, ctx.lse, attn_sink, batch)
    return ctx.out.to(q_abs.dtype), ctx.lse.float()
