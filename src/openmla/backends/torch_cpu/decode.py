"""torch backend: the decode (absorbed, MQA) form over the paged latent cache.

Keys are the raw ``L+R``-wide cache rows, shared by all H query heads; values are their first
``L`` columns, so one gathered key block serves both ``Q K^T`` and ``P V``. Work is organised as

- dense: per sequence, its query tokens with all heads folded into the GEMMs' M dimension
  (``[tok*H, L+R]``) against the visible key range, cut into partitions (split-KV) and each
  partition into key blocks run with an online softmax;
- sparse: per group of query tokens, each token's own listed keys, batched with ``bmm``.

The loops run over sequences and key blocks; each iteration is two GEMMs of real size plus a
handful of elementwise passes, so the per-op cost of eager PyTorch stays small (~20 ops a block).
Scores and probabilities are in the matmul dtype (bf16: the CPU GEMM accumulates in float32
and rounds once; exponent arguments are formed in float32); the softmax sums, the running
output and the merges are float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from ... import workspace
from ...cache import CacheBatch
from ...masks import MaskVariant

if TYPE_CHECKING:
    from ..base import PlanView
    from ...spec import AttentionSpec
from ...combine import apply_sink, merge_states

__all__ = ["decode", "pick_num_partitions"]

# Tuning, measured in place on a 2-core Zen 4 in bf16 (bench/RESULTS.md). One block of scores
# holds at most SCORE_BUDGET elements (M = 128 query rows: 4096 keys; 2048 measured the same,
# 8192 ~5% slower) and spans at most MAX_BLOCK_KEYS keys (M = 16: one block for a 4K context;
# 4096-key blocks measured ~20% slower).
SCORE_BUDGET = 1 << 19
MAX_BLOCK_KEYS = 8192
MAX_QUERY_ROWS = 1024  # query rows (tokens x heads) folded into one GEMM
SPARSE_GATHER_ROWS = 8192  # keys gathered at once by the sparse path
ESTIMATE_ROWS = 64  # keys sampled for a block's softmax offset
WIDE_P_ROWS = 64  # from this many query rows on, probabilities are exponentiated in float32
QUERY_MAJOR_ROWS = 64  # from this many query rows on, unmasked dense scores are query-major
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


def _alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, scratch: str | None = None) -> torch.Tensor:
    """Buffers whose every row a call writes (tests swap this for a NaN fill): a fresh tensor,
    or (``scratch``) a per-thread scratch one for state that never leaves the call."""
    if scratch is not None:
        return workspace.scratch(f"torch.{scratch}", shape, dtype, device)
    return torch.empty(shape, dtype=dtype, device=device)


# Online softmax over key blocks -----------------------------------------------------------
@dataclass
class _State:
    """Softmax of one group of query rows, base 2: exponentials are taken against the offset
    ``-nm`` (``nm`` = +inf while no key was seen), ``den`` is their sum and ``acc`` the unnormalised
    output. Leading dims ``...`` are ``()`` (dense: one sequence) or ``(G,)`` (sparse: G tokens).
    The same triple, in the call's batched buffers, is what every chunk finally leaves behind."""

    nm: torch.Tensor  # [..., M]
    den: torch.Tensor  # [..., M]
    acc: torch.Tensor  # [..., M, L]


_INT_OF = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _max(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Exact ``x.amax(dim)`` through the integer view of the float bits (about 2x faster on bf16).

    Sign-magnitude floats order like their bit patterns read as signed integers when positive
    and in reverse when negative, so the integer max is the float max whenever that is >= +0,
    and for an all-negative row the integer min is.
    """
    if x.numel() < 1 << 15 or not (x.dtype.is_floating_point and x.element_size() in _INT_OF):
        return x.amax(dim)  # small: fewer ops beat faster ones
    xi = x.view(_INT_OF[x.element_size()])  # same-size reinterpretation: any strides
    hi, lo = xi.amax(dim), xi.amin(dim)
    return torch.where(hi >= 0, hi, lo).view(x.dtype)


def _neg_offset(
    s_t: torch.Tensor, a: float, prev: torch.Tensor | None, exact: bool, stat: torch.dtype, out: torch.Tensor | None
) -> torch.Tensor:
    """``-max(a * s)`` over this block's keys (and the previous offset), ``[..., M]``; +inf where no
    key is visible. ``exact=False`` takes the max over a strided sample of keys only.

    A sampled max is a lower bound; any offset within ~60 of the true max keeps every
    exponential finite and exact in relative terms, and a failure shows as inf in the results,
    which ``decode`` checks once (then reruns with exact maxima). The max over keys of a
    keys-major block is a strided reduction that costs more than the exp itself when M = 16,
    hence the sample. The offset may be rounded (bf16 product): it only has to be used
    consistently, and it is.
    """
    n = s_t.shape[-2]
    rows = s_t if exact or n <= 2 * ESTIMATE_ROWS else s_t[..., :: n // ESTIMATE_ROWS, :]
    m = _max(rows, -2)
    if a == 0.0:  # 0 * -inf would be NaN
        nm = torch.where(m == -math.inf, math.inf, 0.0).to(stat)
    elif out is not None and prev is None:
        return torch.mul(m, -a, out=out)
    else:
        nm = torch.mul(m, -a).to(stat)
    if prev is not None:
        nm = torch.minimum(prev, nm)
    return nm if out is None else out.copy_(nm)


def _exponentiate(
    s_t: torch.Tensor, nm: torch.Tensor, a: float, keep: torch.Tensor | None, heads: int, stat: torch.dtype,
    den_out: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Query-major ``p = 2^(a*s - offset)`` ``[..., M, n]`` (scratch, matmul dtype) and its row
    sums (``stat``). ``a*s - offset`` is always formed in float32.

    p is written query-major so the second GEMM reads it untransposed (faster at M = 16). With
    16-bit scores and few rows (M < WIDE_P_ROWS) p is exponentiated directly in 16 bits and summed
    with float32 accumulation, which saves a conversion pass (~3% at H = 16, for an LSE error of
    ~3e-3 instead of ~2e-3); with many rows float32 p plus a conversion measured ~2% faster.
    """
    if keep is not None:  # a row may have no visible key here (nm = +inf): use offset 0
        nm = torch.where(nm == math.inf, 0.0, nm)
    shape = (*s_t.shape[:-2], s_t.shape[-1], s_t.shape[-2])
    direct = s_t.dtype == stat or s_t.shape[-1] < WIDE_P_ROWS
    p = torch.add(nm.unsqueeze(-1), s_t.transpose(-1, -2), alpha=a,
                  out=workspace.scratch("torch.probs", shape, s_t.dtype if direct else stat, s_t.device))
    if keep is not None and a == 0.0:  # 0 * -inf: keep masked keys out explicitly
        p.view(*shape[:-2], -1, heads, shape[-1]).masked_fill_(~keep.unsqueeze(-2), -math.inf)
    p.exp2_()
    if direct:
        return p, torch.sum(p, -1, dtype=stat, out=den_out)
    den = torch.sum(p, -1, out=den_out)
    return workspace.scratch("torch.probs_mm", shape, s_t.dtype, s_t.device).copy_(p), den


def _block_step(
    state: _State | None, q_t: torch.Tensor, k: torch.Tensor, keep: torch.Tensor | None,
    heads: int, a: float, L: int, stat: torch.dtype, exact: bool, dest: _State | None = None,
) -> _State:
    """Fold one key block into ``state``.

    ``q_t [..., D, M]`` (queries transposed; M = tok * heads, token-major), ``k [..., n, D]``
    (values = ``k[..., :L]``), ``keep [..., tok, n]`` bool or None (all visible);
    ``a = scale * log2(e) >= 0``. ``dest``: with no ``state`` (a first block), write the result
    straight into these batched-buffer views (for a chunk that is a single block).
    """
    M = q_t.shape[-1]
    if keep is None and k.dim() == 2 and M >= QUERY_MAJOR_ROWS:
        # Many rows: query-major scores. The GEMM is ~5% slower than keys-major, but the
        # exponent pass then reads contiguously and the exact row max is cheap (net ~3%).
        s = torch.mm(q_t.t(), k.t(), out=workspace.scratch("torch.scores_qm", (M, k.shape[0]), q_t.dtype, q_t.device))
        s_t, exact = s.t(), True
    else:
        # Keys-major scores [..., n, M]: at M = 16 this GEMM runs ~1.6x faster than q @ k^T.
        out = workspace.scratch("torch.scores", (*k.shape[:-1], M), q_t.dtype, q_t.device)
        s_t = torch.mm(k, q_t, out=out) if k.dim() == 2 else torch.bmm(k, q_t, out=out)
    if keep is not None:
        s_t.view(*s_t.shape[:-1], -1, heads).masked_fill_(~keep.transpose(-1, -2).unsqueeze(-1), -math.inf)
    prev = None if state is None else state.nm
    direct = dest is not None and state is None
    nm = _neg_offset(s_t, a, prev, exact or keep is not None, stat, dest.nm if direct else None)
    p, den_blk = _exponentiate(s_t, nm, a, keep, heads, stat, dest.den if direct else None)
    v = k[..., :L]
    pv_out = dest.acc if direct else None
    pv = torch.mm(p, v, out=pv_out) if v.dim() == 2 else torch.bmm(p, v, out=pv_out)  # [..., M, L]
    if state is None:
        return _State(nm, den_blk, pv)
    used = nm if keep is None else torch.where(nm == math.inf, 0.0, nm)
    alpha = torch.exp2(used - state.nm)  # 0 where nothing was seen before
    acc = state.acc if state.acc.dtype == stat else state.acc.to(stat)
    acc.mul_(alpha.unsqueeze(-1)).add_(pv)
    return _State(nm, state.den.mul_(alpha).add_(den_blk), acc)


def _normalise(state: _State | None, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Write ``out [..., M, L] = acc / l`` and the natural-log ``lse [..., M]``; rows without keys
    get 0 and -inf."""
    if state is None:
        out.zero_()
        lse.fill_(-math.inf)
        return
    den = torch.where(state.den > 0, state.den, 1.0)  # unseen rows: acc = 0 and nm = +inf already
    torch.div(state.acc, den.unsqueeze(-1), out=out)
    torch.sub(torch.log(den), state.nm, alpha=LN2, out=lse)


def _store(state: _State | None, dest: _State) -> None:
    """Leave a chunk's final softmax state in the batched buffers ``dest``."""
    if state is None:
        dest.acc.zero_()
        dest.den.zero_()
        dest.nm.fill_(math.inf)
    elif state.acc is not dest.acc:
        dest.acc.copy_(state.acc)
        dest.den.copy_(state.den)
        dest.nm.copy_(state.nm)


def _run_parts(
    parts: list[tuple[int, int]], blocks_of: Callable[[int, int], list], step: Callable, dest: _State
) -> None:
    """Run each partition's key blocks alone (``step(state, block, dest)``); one partition is
    left in ``dest`` as is, several are normalised and LSE-merged first."""
    if len(parts) == 1:
        blocks = blocks_of(*parts[0])
        state = None
        for blk in blocks:
            state = step(state, blk, dest if len(blocks) == 1 else None)
        _store(state, dest)
        return
    results = []
    for part in parts:
        state = None
        for blk in blocks_of(*part):
            state = step(state, blk, None)
        o, lse = torch.empty(dest.acc.shape, dtype=dest.den.dtype, device=dest.den.device), torch.empty_like(dest.den)
        _normalise(state, o, lse)
        results.append((o, lse))
    o, lse = results[0]
    for part in results[1:]:
        o, lse = merge_states(o, lse, *part)
    # A merged result is its own unnormalised state with l = 1 and offset lse.
    _store(_State(torch.mul(lse, -LOG2E), torch.ones_like(lse), o), dest)


# Planning -----------------------------------------------------------------------------------
def pick_num_partitions(num_keys: int) -> int:
    """Split-KV heuristic for the CPU: one partition.

    Split-KV exists to occupy idle GPU SMs when few sequences are long; here the intra-op
    threads already share every GEMM, and each extra partition only adds merge work.
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


# Key access ---------------------------------------------------------------------------------
def _raw_dtype(t: torch.Tensor) -> torch.dtype:
    """index_select copies 32-bit elements about twice as fast as 16-bit ones (measured), so
    16-bit rows of even width are moved as int32."""
    return torch.int32 if t.element_size() == 2 and t.shape[-1] % 2 == 0 and t.is_contiguous() else t.dtype


class _PagedKeys:
    """Key rows of one layer, fetched by logical position range of one sequence (dense path) or
    by physical row (sparse path), always copied into a reused scratch block.

    Copying even physically consecutive pages pays. Reading long runs in place instead was
    measured in the full decode (bf16, 2 cores, B=8 x 4K keys in ordered pages): 0.68 against
    0.73 of the matmul rate at H = 128 (the copy also keeps blocks balanced), and 0.27 against
    0.39 at H = 16, where GEMMs with M = 16 rows stream DRAM poorly.
    """

    def __init__(self, batch: CacheBatch, layer_idx: int, dtype: torch.dtype) -> None:
        self.layer = batch.blocks[layer_idx]  # [pages, ps, D]
        self.ps = batch.page_size
        self.D = self.layer.shape[-1]
        raw = _raw_dtype(self.layer)
        self.raw_pages = self.layer.view(raw) if raw != self.layer.dtype else self.layer
        contiguous = self.layer.is_contiguous()
        self.raw_rows = self.raw_pages.view(-1, self.raw_pages.shape[-1]) if contiguous else None
        self.table = batch.block_table.to(self.layer.device, torch.int64)
        self.dtype = dtype

    def _as_compute(self, keys: torch.Tensor) -> torch.Tensor:
        return keys if keys.dtype == self.dtype else keys.to(self.dtype)

    def rows(self, pages: torch.Tensor, k0: int, k1: int) -> torch.Tensor:
        """Keys at positions ``[k0, k1)`` of the sequence owning ``pages`` (its page-table row),
        ``[k1-k0, D]``, gathered page by page."""
        ps = self.ps
        j0, j1 = k0 // ps, (k1 - 1) // ps
        start, n_pages = k0 - j0 * ps, j1 + 1 - j0
        raw = workspace.scratch("torch.keys", (n_pages, ps, self.raw_pages.shape[-1]), self.raw_pages.dtype, self.layer.device)
        torch.index_select(self.raw_pages, 0, pages[j0 : j1 + 1], out=raw)
        keys = workspace.scratch("torch.keys", (n_pages * ps, self.D), self.layer.dtype, self.layer.device)
        if start or k1 - k0 != n_pages * ps:
            keys = keys[start : start + (k1 - k0)]
        return self._as_compute(keys)

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows ``[..., D]`` at physical row indices ``rows`` (any shape)."""
        flat_idx = rows.reshape(-1)
        if self.raw_rows is None:
            return self._as_compute(self.layer[flat_idx // self.ps, flat_idx % self.ps].view(*rows.shape, self.D))
        n = flat_idx.shape[0]
        raw = workspace.scratch("torch.keys", (n, self.raw_rows.shape[-1]), self.raw_rows.dtype, self.layer.device)
        torch.index_select(self.raw_rows, 0, flat_idx, out=raw)
        return self._as_compute(workspace.scratch("torch.keys", (*rows.shape, self.D), self.layer.dtype, self.layer.device))


class _DequantKeys(_PagedKeys):
    """Key rows of an fp8 cache (``fp8_e4m3``, ``fp8_ds_mla``), dequantised block by block as they
    are gathered: extra memory stays one key block, whatever the context length."""

    def __init__(self, batch: CacheBatch, layer_idx: int, dtype: torch.dtype) -> None:  # noqa: D107
        self.batch, self.layer_idx = batch, layer_idx
        self.ps, self.D, self.dtype = batch.page_size, batch.head_dim, dtype
        self.table = batch.block_table.to(batch.blocks.device, torch.int64)

    def rows(self, pages: torch.Tensor, k0: int, k1: int) -> torch.Tensor:
        ps = self.ps
        j0, j1 = k0 // ps, (k1 - 1) // ps
        keys = self.batch.read_pages(self.layer_idx, pages[j0 : j1 + 1], self.dtype).view(-1, self.D)
        return keys[k0 - j0 * ps : k1 - j0 * ps]

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        return self.batch.read_rows(self.layer_idx, rows.reshape(-1), self.dtype).view(*rows.shape, self.D)


@dataclass
class _Ctx:
    """Everything a decode call shares. Every chunk leaves its unnormalised softmax state in
    the batched buffers ``acc``/``den``/``nm``; ``decode`` normalises all rows at once."""

    q: torch.Tensor  # [T, H, D] in the matmul dtype, sign folded so that the scale is >= 0
    keys: _PagedKeys
    plan: "PlanView"
    a: float  # scale * log2(e), >= 0
    L: int  # value columns (kv_lora_rank)
    mask: MaskVariant
    num_partitions: int | None
    stat: torch.dtype
    acc: torch.Tensor  # [T, H, L] matmul dtype
    den: torch.Tensor  # [T, H] stat
    nm: torch.Tensor  # [T, H] stat
    exact: bool = False  # exact block maxima (the rerun after a sampled offset failed)

    def __post_init__(self) -> None:
        T, H, D = self.q.shape
        self.H = H
        self.batch = self.plan.batch
        # Flat (token, head)-row views, made once: a chunk's rows are then one slice each.
        self.q_t = self.q.view(T * H, D).t()
        self.flat = _State(self.nm.view(-1), self.den.view(-1), self.acc.view(T * H, self.L))

    def rows(self, r0: int, r1: int, flat: bool) -> _State:
        """Batched-buffer views of query tokens ``r0:r1`` (``flat``: tokens and heads as one dim)."""
        if flat:
            f, H = self.flat, self.H
            return _State(f.nm[r0 * H : r1 * H], f.den[r0 * H : r1 * H], f.acc[r0 * H : r1 * H])
        return _State(self.nm[r0:r1], self.den[r0:r1], self.acc[r0:r1])


# Dense: every visible key of the sequence ---------------------------------------------------
def _dense_chunk(ctx: _Ctx, pages: torch.Tensor, row0: int, tok: int, p_lo: int, kv_len: int) -> None:
    """Query tokens ``row0 .. row0+tok-1`` (positions ``p_lo ..``) of one sequence."""
    H, mask = ctx.H, ctx.mask
    p_hi = p_lo + tok - 1
    lo, hi = mask.key_range(p_lo, p_hi, kv_len)
    # For one query, key_range is exactly its visible interval, so keys in [all_lo, all_hi)
    # are visible to every query of the chunk; only the edges need a mask.
    all_lo = mask.key_range(p_hi, p_hi, kv_len)[0]
    all_hi = max(all_lo, mask.key_range(p_lo, p_lo, kv_len)[1])
    M = tok * H
    q_t = ctx.q_t[:, row0 * H : (row0 + tok) * H]
    block = max(1, min(MAX_BLOCK_KEYS, SCORE_BUDGET // M))
    q_pos = torch.arange(p_lo, p_hi + 1, device=q_t.device) if all_lo > lo or all_hi < hi else None

    def blocks_of(a: int, e: int) -> list[tuple[int, int, bool]]:
        zones = ((a, min(e, all_lo), True), (max(a, all_lo), min(e, all_hi), False), (max(a, all_hi), e, True))
        return [(k0, k1, masked) for z0, z1, masked in zones for k0, k1 in _blocks(z0, z1, block, ctx.keys.ps)]

    def step(state: _State | None, blk: tuple[int, int, bool], dest: _State | None) -> _State:
        k0, k1, masked = blk
        keep = mask.visible(q_pos[:, None], torch.arange(k0, k1, device=q_t.device)[None, :]) if masked else None
        keys = ctx.keys.rows(pages, k0, k1)
        return _block_step(state, q_t, keys, keep, H, ctx.a, ctx.L, ctx.stat, ctx.exact, dest)

    nparts = ctx.num_partitions or pick_num_partitions(hi - lo)
    dest = ctx.rows(row0, row0 + tok, flat=True)
    if nparts == 1 and q_pos is None:  # the common decode step, without the general machinery
        blocks = _blocks(lo, hi, block, ctx.keys.ps)
        state = None
        for k0, k1 in blocks:
            keys = ctx.keys.rows(pages, k0, k1)
            state = _block_step(state, q_t, keys, None, H, ctx.a, ctx.L, ctx.stat, ctx.exact,
                                dest if len(blocks) == 1 else None)
        _store(state, dest)
        return
    _run_parts(_split(lo, hi, nparts), blocks_of, step, dest)


def _dense(ctx: _Ctx) -> None:
    """Every sequence with new tokens, in balanced query chunks of at most ``MAX_QUERY_ROWS`` rows."""
    b_offs = ctx.batch.offsets_list
    tok_cap = max(1, MAX_QUERY_ROWS // ctx.H)
    for b, (c, n) in enumerate(zip(ctx.batch.cache_lengths_list, ctx.batch.new_tokens_list)):
        if n == 0:
            continue
        pages = ctx.keys.table[b]
        for i0, i1 in _split(0, n, -(-n // tok_cap)):
            _dense_chunk(ctx, pages, b_offs[b] + i0, i1 - i0, c + i0, c + n)


# Sparse: each query token's listed keys -------------------------------------------------------
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
    """Groups of query tokens, each against its own listed keys (one bmm per key block)."""
    T, H, device = ctx.q.shape[0], ctx.H, ctx.q.device
    seq, pos = ctx.plan.token_seq.to(device), ctx.plan.token_pos.to(device)
    idx = sparse_indices.to(device)
    topk = None if topk_lengths is None else topk_lengths.to(device, torch.int64)
    stride = idx.shape[1]
    if topk is not None:  # slots at or past every topk length are never read
        stride = min(stride, int(topk.max()) if topk.numel() else 0)
    block = max(1, min(MAX_BLOCK_KEYS, stride, SCORE_BUDGET // H))
    group = max(1, min(SPARSE_GATHER_ROWS // block, SCORE_BUDGET // (H * block)))
    parts = _split(0, stride, ctx.num_partitions or pick_num_partitions(stride))
    for t0 in range(0, T, group):
        t1 = min(T, t0 + group)
        rows, keep = _sparse_rows(ctx, idx[t0:t1, :stride], seq[t0:t1], pos[t0:t1], topk, physical)
        q_t = ctx.q[t0:t1].transpose(1, 2)

        def step(state: _State | None, blk: tuple[int, int], dest: _State | None) -> _State:
            k0, k1 = blk
            blk_keep = keep[:, None, k0:k1]
            blk_keep = None if bool(blk_keep.all()) else blk_keep  # all visible: fast path
            keys = ctx.keys.gather(rows[:, k0:k1])
            if blk_keep is not None:  # dropped slots point at row 0: zero them so stale NaN/Inf there cannot leak (0*inf)
                keys = keys.masked_fill(~keep[:, k0:k1, None], 0)
            return _block_step(state, q_t, keys, blk_keep, H, ctx.a, ctx.L, ctx.stat, ctx.exact, dest)

        _run_parts(parts, lambda a, e: _blocks(a, e, block, 1), step, ctx.rows(t0, t1, flat=False))


# Entry point ------------------------------------------------------------------------------------
def _matmul_dtype(q_dtype: torch.dtype, cache_dtype: torch.dtype) -> torch.dtype:
    dtype = torch.promote_types(q_dtype, cache_dtype)
    return torch.float32 if dtype == torch.float16 else dtype  # no fast fp16 GEMM on this CPU path


def _run(ctx: _Ctx, sparse) -> None:
    if sparse is None:
        _dense(ctx)
    else:
        _sparse(ctx, sparse.indices, sparse.topk_lengths, sparse.physical)


@torch.no_grad()
def decode(
    plan: "PlanView", layer_idx: int, q_abs: torch.Tensor, spec: "AttentionSpec", kv_lora_rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed attention: ``q_abs [T, H, L+R]`` against the cache rows of ``layer_idx``.

    Returns ``out [T, H, L]`` (q_abs's dtype) and ``lse [T, H]`` (float32, natural log, without
    the sink). Query ``i`` of sequence ``b`` sits at ``cache_lengths[b] + i``; the cache already
    holds this call's tokens. Rows with no visible key give zeros and -inf. Inference only: the
    outputs carry no autograd graph (the kernel writes into reused scratch buffers).
    """
    batch = plan.batch
    T, H, _ = q_abs.shape
    device = q_abs.device
    mm_dtype = _matmul_dtype(q_abs.dtype, batch.compute_dtype)
    stat = torch.float64 if mm_dtype == torch.float64 else torch.float32
    q = q_abs.to(mm_dtype)
    scale = spec.scale
    if scale < 0:  # negating q is exact; the softmax then only sees a scale >= 0
        q, scale = -q, -scale
    ctx = _Ctx(
        q=q.contiguous(), keys=(_PagedKeys if batch.is_native else _DequantKeys)(batch, layer_idx, mm_dtype), plan=plan,
        a=float(scale) * LOG2E, L=kv_lora_rank, mask=spec.mask, num_partitions=plan.num_partitions, stat=stat,
        acc=_alloc((T, H, kv_lora_rank), mm_dtype, device, "acc"), den=_alloc((T, H), stat, device, "den"),
        nm=_alloc((T, H), stat, device, "nm"),
    )
    if T:
        _run(ctx, spec.sparse)
        # One sum each shows an inf or NaN anywhere (|acc| <= l * max|v|, far from overflow);
        # isfinite().all() costs 30x more on bf16.
        if not (math.isfinite(float(ctx.acc.sum())) and math.isfinite(float(ctx.den.sum()))):
            ctx.exact = True  # a sampled block offset was too low somewhere (or the inputs hold inf/NaN)
            _run(ctx, spec.sparse)
    sink = spec.attn_sink
    out = _alloc((T, H, kv_lora_rank), q_abs.dtype if sink is None else stat, device)
    lse = _alloc((T, H), stat, device)
    _normalise(_State(ctx.nm, ctx.den, ctx.acc), out, lse)
    if sink is not None and T:
        apply_sink(out, lse, sink, plan.token_seq.to(device))
    return out.to(q_abs.dtype), lse.float()
