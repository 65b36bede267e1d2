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
import threading
from dataclasses import dataclass

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
VIEW_MIN_KEYS = 512  # a physical run shorter than this is gathered with its neighbours
VIEW_MIN_ROWS = 64  # fewer query rows than this: copy even contiguous keys (see _dense_chunk)


WORKSPACE_CAP_BYTES = 64 << 20  # larger scratch buffers are not kept between calls


def _alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Output buffers; every row is written before return (tests swap this for a NaN fill)."""
    return torch.empty(shape, dtype=dtype, device=device)


_scratch = threading.local()


def _workspace(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A reused per-thread scratch tensor of ``shape`` (contents undefined).

    Fresh multi-MB allocations cost page faults on every block (measured: a page gather into a
    new tensor runs at a third of the speed of one into a reused buffer). A view of it must
    never outlive the block step that asked for it.
    """
    numel = math.prod(shape)
    bufs = getattr(_scratch, "bufs", None)
    if bufs is None:
        bufs = _scratch.bufs = {}
    key = (name, dtype, device)
    buf = bufs.get(key)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=dtype, device=device)
        if numel * buf.element_size() <= WORKSPACE_CAP_BYTES:
            bufs[key] = buf
    return buf[:numel].view(shape)


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
LOG2E = 1.4426950408889634
ESTIMATE_ROWS = 64  # keys sampled for a block's softmax offset
SAFE_SUM = 2.0**64  # a block sum above this means the sampled offset was too low: redo exactly


@dataclass
class _State:
    """Running softmax of one group of query rows, in base-2 units: ``m`` is the offset the
    exponentials are taken against (-inf while no key was seen), ``l`` their sum, ``acc`` the
    unnormalised output (the matmul dtype until a second block arrives, then float32)."""

    m: torch.Tensor  # [G, M]
    l: torch.Tensor  # [G, M]
    acc: torch.Tensor  # [G, M, L]


def _scores_t(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Transposed scores ``k [G, n, D] @ q [G, M, D]^T -> [G, n, M]`` in scratch memory.

    Keys-major: with few query rows (M = 16) this orientation runs the GEMM ~1.6x faster than
    ``q @ k^T``, and it is never slower at M = 128 (measured, bf16).
    """
    G, n, _ = k.shape
    out = _workspace("scores", (G, n, q.shape[1]), q.dtype, q.device)
    if G == 1:
        torch.mm(k[0], q[0].t(), out=out[0])
    else:
        torch.bmm(k, q.transpose(1, 2), out=out)
    return out


def _pv_t(p_t: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``p_t [G, n, M]^T @ v [G, n, L] -> [G, M, L]``."""
    if p_t.shape[0] == 1:
        return torch.mm(p_t[0].t(), v[0]).unsqueeze(0)
    return torch.bmm(p_t.transpose(1, 2), v)


def _offset(s_t: torch.Tensor, a: float, prev: torch.Tensor | None, exact: bool, stat: torch.dtype) -> torch.Tensor:
    """Softmax offset ``[G, M]`` (base-2 units, -inf where no key is visible): the running max
    of ``a * s`` over this block's keys, or over a strided sample of them (``exact=False``).

    A sampled max is only a lower bound; any offset within ~60 of the true max keeps every
    exponential finite and exact in relative terms, so the caller just checks the block sum.
    A max over rows of a keys-major block is a strided reduction, several times slower than
    the exp itself for M = 16, hence the sample.
    """
    n = s_t.shape[1]
    rows = s_t if exact or n <= 2 * ESTIMATE_ROWS else s_t[:, :: n // ESTIMATE_ROWS]
    m = rows.amax(1).to(stat)
    if a == 0.0:  # 0 * -inf would be NaN
        m = torch.where(m == -math.inf, m, 0.0)
    else:
        m.mul_(a)
    return m if prev is None else torch.maximum(prev, m)


def _exponentiate(
    s_t: torch.Tensor, m: torch.Tensor, a: float, hidden: torch.Tensor | None, heads: int, stat: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``p = 2^(a*s - m)`` in ``stat`` dtype (scratch) and its per-row sum ``[G, M]``."""
    neg_off = torch.where(torch.isfinite(m), m, 0.0).neg_().unsqueeze(1)
    p = torch.add(neg_off, s_t, alpha=a, out=_workspace("probs", s_t.shape, stat, s_t.device))
    if hidden is not None and a == 0.0:  # 0 * -inf: keep masked keys out explicitly
        G, n, M = p.shape
        p.view(G, n, M // heads, heads).masked_fill_(hidden.unsqueeze(-1), -math.inf)
    p.exp2_()
    return p, p.sum(1)


def _block_step(
    state: _State | None, q: torch.Tensor, k: torch.Tensor, keep: torch.Tensor | None,
    heads: int, a: float, L: int, stat: torch.dtype,
) -> _State:
    """Fold one key block into ``state``.

    ``q [G, M, D]`` (M = tok * heads, token-major), ``k [G, n, D]`` (values = ``k[..., :L]``),
    ``keep [G, tok, n]`` bool or None (all visible); ``a = scale * log2(e) >= 0``.
    """
    G, n, _ = k.shape
    M = q.shape[1]
    s_t = _scores_t(q, k)  # [G, n, M], matmul dtype
    hidden = None
    if keep is not None:
        hidden = ~keep.transpose(1, 2)  # [G, n, tok]
        s_t.view(G, n, M // heads, heads).masked_fill_(hidden.unsqueeze(-1), -math.inf)
    prev = None if state is None else state.m
    m = _offset(s_t, a, prev, hidden is not None, stat)
    p, l_blk = _exponentiate(s_t, m, a, hidden, heads, stat)
    if hidden is None and float(l_blk.max()) > SAFE_SUM:  # sampled offset too low: exact max
        m = _offset(s_t, a, prev, True, stat)
        p, l_blk = _exponentiate(s_t, m, a, hidden, heads, stat)
    if p.dtype != s_t.dtype:  # bf16 probabilities for the second GEMM
        p = _workspace("probs_mm", p.shape, s_t.dtype, p.device).copy_(p)
    pv = _pv_t(p, k[..., :L])  # [G, M, L]
    if state is None:
        return _State(m, l_blk, pv)
    used = torch.where(torch.isfinite(m), m, 0.0)
    alpha = torch.exp2(state.m - used)  # 0 where nothing was seen yet
    acc = state.acc if state.acc.dtype == stat else state.acc.to(stat)
    acc.mul_(alpha.unsqueeze(-1)).add_(pv)
    return _State(m, state.l.mul_(alpha).add_(l_blk), acc)


def _finish(state: _State | None, shape: tuple[int, int, int], stat: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalised ``(out [G, M, L], lse [G, M])`` (lse in natural log); rows without keys give
    0 and -inf."""
    if state is None:
        return torch.zeros(shape, dtype=stat, device=device), torch.full(shape[:2], -math.inf, dtype=stat, device=device)
    l = state.l
    seen = l > 0
    safe = torch.where(seen, l, 1.0)
    out = torch.div(state.acc, safe.unsqueeze(-1)).to(stat)
    lse = torch.where(seen, (state.m + torch.log2(safe)) * math.log(2.0), -math.inf)
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


def _blocks(lo: int, hi: int, size: int, align: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` in the fewest near-equal blocks of at most about ``size`` keys; inner edges
    fall on multiples of ``align`` (page boundaries) so a block gathers whole pages."""
    n = hi - lo
    if n <= 0:
        return []
    count = -(-n // size)
    edges = [lo]
    for i in range(1, count):
        e = lo + (n * i) // count
        e = max(edges[-1] + 1, (e // align) * align if align > 1 else e)
        if e < hi:
            edges.append(e)
    edges.append(hi)
    return list(zip(edges[:-1], edges[1:]))


def _raw_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` reinterpreted with 4-byte elements where possible: index_select copies 32-bit
    elements about twice as fast as 16-bit ones (measured on this CPU)."""
    if t.element_size() == 2 and t.shape[-1] % 2 == 0 and t.is_contiguous():
        return t.view(torch.int32)
    return t


@dataclass
class _SeqPages:
    """One sequence's page ids and its long runs of physically consecutive pages."""

    pages: torch.Tensor  # [num_pages] int64, logical page -> physical page
    runs: list[tuple[int, int]]  # long logical page ranges [p0, p1) on consecutive physical pages


class _PagedKeys:
    """Key rows of one layer, fetched by logical position range of one sequence."""

    def __init__(self, batch: CacheBatch, layer_idx: int, dtype: torch.dtype) -> None:
        self.layer = batch.blocks[layer_idx]  # [pages, ps, D]
        self.ps = batch.page_size
        self.D = self.layer.shape[-1]
        contiguous = self.layer.is_contiguous()
        self.flat = self.layer.view(-1, self.D) if contiguous else None
        self.raw_pages = _raw_view(self.layer)
        self.raw_rows = _raw_view(self.flat) if contiguous else None
        self.table = batch.block_table.to(self.layer.device, torch.int64)
        self.dtype = dtype

    def sequence(self, b: int, kv_len: int) -> _SeqPages:
        """Pages of sequence ``b`` and its runs of at least ``VIEW_MIN_KEYS`` keys on
        consecutive physical pages (the only ones worth a block of their own)."""
        pages = self.table[b, : -(-kv_len // self.ps)]
        if self.flat is None or pages.shape[0] < 2:
            return _SeqPages(pages, [(0, pages.shape[0])] if self.flat is not None else [])
        breaks = torch.nonzero(pages[1:] - pages[:-1] != 1).flatten() + 1
        edges = torch.cat([breaks.new_zeros(1), breaks, breaks.new_full((1,), pages.shape[0])])
        min_pages = max(1, -(-VIEW_MIN_KEYS // self.ps))
        long = torch.nonzero(edges[1:] - edges[:-1] >= min_pages).flatten()
        runs = [(int(a), int(b)) for a, b in zip(edges[long].tolist(), edges[long + 1].tolist())]
        return _SeqPages(pages, runs)

    def plan(self, seq: _SeqPages, lo: int, hi: int, size: int, views: bool) -> list[tuple[int, int, bool]]:
        """Key blocks ``(k0, k1, is_view)`` covering ``[lo, hi)``: long physical runs become view
        blocks (no copy), everything between them page-gathered blocks of about ``size`` keys."""
        out: list[tuple[int, int, bool]] = []
        cursor = lo
        for p0, p1 in seq.runs if views else ():
            a, b = max(cursor, p0 * self.ps), min(hi, p1 * self.ps)
            if b - a < max(VIEW_MIN_KEYS, size // 2):
                continue
            out += [(x, y, False) for x, y in _blocks(cursor, a, size, self.ps)]
            out += [(x, y, True) for x, y in _blocks(a, b, size, self.ps)]
            cursor = b
        out += [(x, y, False) for x, y in _blocks(cursor, hi, size, self.ps)]
        return out

    def _select(self, src: torch.Tensor, idx: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """``src.index_select(0, idx)`` into scratch memory, returned in the cache dtype."""
        buf = _workspace("keys", shape, self.layer.dtype, self.layer.device)
        out = buf.view(src.dtype) if src.dtype != buf.dtype else buf
        torch.index_select(src, 0, idx, out=out.view(idx.shape[0], *src.shape[1:]))
        return buf

    def _as_compute(self, keys: torch.Tensor) -> torch.Tensor:
        return keys if keys.dtype == self.dtype else keys.to(self.dtype)

    def rows(self, seq: _SeqPages, k0: int, k1: int, view: bool) -> torch.Tensor:
        """Keys at positions ``[k0, k1)`` as ``[k1-k0, D]``: a view of the cache (``view``, the
        pages must be physically consecutive) or one page-level gather into scratch memory."""
        ps = self.ps
        j0, j1 = k0 // ps, (k1 - 1) // ps
        start = k0 - j0 * ps
        if view:
            base = int(seq.pages[j0]) * ps + start
            return self._as_compute(self.flat[base : base + (k1 - k0)])
        ids = seq.pages[j0 : j1 + 1]
        keys = self._select(self.raw_pages, ids, (ids.shape[0], ps, self.D)).view(-1, self.D)
        return self._as_compute(keys[start : start + (k1 - k0)])

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows ``[..., D]`` at physical row indices ``rows`` (any shape)."""
        flat_idx = rows.reshape(-1)
        if self.raw_rows is not None:
            keys = self._select(self.raw_rows, flat_idx, (flat_idx.shape[0], self.D))
        else:
            keys = self.layer[flat_idx // self.ps, flat_idx % self.ps]
        return self._as_compute(keys.view(*rows.shape, self.D))


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
def _dense_chunk(ctx: _Ctx, seq: _SeqPages, row0: int, tok: int, p_lo: int, kv_len: int) -> None:
    """Query tokens ``row0 .. row0+tok-1`` (positions ``p_lo ..``) of one sequence.

    With few query rows the GEMMs stream keys too slowly from DRAM (bf16, M = 16: ~130
    GFLOP/s on a view of the cache against ~250 on a freshly copied block), so keys are then
    always copied; with many rows, long physical runs are used in place.
    """
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
        for k0, k1, view in ctx.keys.plan(seq, a, e, block, views=M >= VIEW_MIN_ROWS):
            keys = ctx.keys.rows(seq, k0, k1, view).unsqueeze(0)
            keep = None
            if k0 < all_lo or k1 > all_hi:
                if q_pos is None:
                    q_pos = torch.arange(p_lo, p_hi + 1, device=q.device)
                k_pos = torch.arange(k0, k1, device=q.device)
                keep = mask.visible(q_pos[:, None], k_pos[None, :]).unsqueeze(0)
            state = _block_step(state, q, keys, keep, H, ctx.scale * LOG2E, L, ctx.stat)
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
        seq = ctx.keys.sequence(b, kv_len)
        chunks = -(-n // tok_cap)
        for i0, i1 in _split(0, n, chunks):  # balanced query chunks
            _dense_chunk(ctx, seq, b_offs[b] + i0, i1 - i0, c + i0, kv_len)


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
                state = _block_step(state, q, keys, keep[:, None, k0:k1], H, ctx.scale * LOG2E, L, ctx.stat)
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
