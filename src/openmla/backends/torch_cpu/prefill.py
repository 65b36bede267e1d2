"""torch backend: prefill (up-projected, MHA) attention, flash-attention style in plain PyTorch.

Heads are the batch dim of every ``bmm``, and every operand is a packed tensor (torch's oneDNN
``bmm`` copies any other layout first): queries in blocks ``[H, block_m, Dq]`` (pre-scaled by
the softmax scale), keys transposed in blocks ``[H, Dq, n]`` (the Dn nope rows, then the R rope
rows all heads share), values in blocks ``[H, n, Dv]``.

Per sequence, each block of ``block_m`` queries walks the key blocks its mask can show
(``MaskVariant.key_range``); ``MaskVariant.visible`` is evaluated only on the key columns not
visible to every query of the block. One key block costs two ``bmm`` (scores, then P @ V, in the
input dtype; bf16 GEMMs accumulate in float32 and round once) and one fused ``torch.softmax``
(float32 inside). The block's log-sum-exp needs no extra exp pass: a row's largest probability
is ``exp(max - lse)``, so ``lse = max(S) - log(max(P))`` (both maxima read as integers, which is
~10x faster than a bf16 reduction). Blocks fold into a float32 running state by LSE (float64
for float64 inputs).

``prefill`` cuts the keys of the batch into chunks (the plan's ``chunks``), gathers each
chunk's latent rows through the page table, up-projects them block by block straight into the
packed layout, and continues the same running state chunk after chunk, so memory is bounded by
``buffer_size`` whatever the context length.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ... import workspace
from ...cache import CacheBatch
from ...chunks import default_buffer_size
from ...combine import apply_sink
from ...masks import MaskVariant

if TYPE_CHECKING:
    from ...chunks import ChunkRows
    from ...spec import AttentionSpec
    from ..base import PlanView

NEG_INF = float("-inf")
F32 = torch.float32


def stat_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax statistics and accumulation: float32, or float64 for float64 inputs."""
    return torch.float64 if dtype == torch.float64 else F32

# Tiles measured on a 2-core Zen 4 (bench/bench_prefill.py, bench/RESULTS.md): 256 x 512 for up
# to 32 heads; with more heads the score block (heads x block_m x block_n) is capped, query rows
# first, so it stays cache resident (H=128: 128 x 256).
DEFAULT_BLOCK_M = 256
DEFAULT_BLOCK_N = 512
MIN_BLOCK_M = 128
SCORE_BLOCK_ELEMS = 4 * 2**20
# A key block of which a query block sees less than 1/SLICE_BELOW is sliced (copied) instead
# of computed whole and masked.
SLICE_BELOW = 4 / 3
# A masked key block is run as two row halves (each over the keys it sees) when that needs at
# most SPLIT_GAIN of the work, and the query block has at least 2 * SPLIT_MIN_ROWS rows.
SPLIT_GAIN = 0.8
SPLIT_MIN_ROWS = 64


def _alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every buffer this module fills completely comes from here (tests poison it with NaN)."""
    return torch.empty(shape, dtype=dtype, device=device)


# Planning ----------------------------------------------------------------------------
@dataclass(frozen=True)
class SeqWork:
    """One sequence's share of a chunk: query rows, key rows, and their positions.

    Queries are rows ``q0:q1`` of the batch at positions ``q_pos + i``; keys are rows ``k0:k1``
    of the chunk's K/V buffer at positions ``k_pos + j``; ``kv_len`` = the sequence's keys.
    """

    q0: int
    q1: int
    q_pos: int
    k0: int
    k1: int
    k_pos: int
    kv_len: int


def pick_tiles(tile, num_heads: int) -> tuple[int, int]:
    """``(block_m, block_n)``: the tile's when given, else defaults that cap the score block."""
    if tile is not None:
        return int(tile.block_m), int(tile.block_n)
    bm, bn = DEFAULT_BLOCK_M, DEFAULT_BLOCK_N
    while num_heads * bm * bn > SCORE_BLOCK_ELEMS and bn > 64:
        if bm > MIN_BLOCK_M:
            bm //= 2
        else:
            bn //= 2
    return bm, bn


def fully_visible(mask: MaskVariant, p_lo: int, p_hi: int, kv_len: int) -> tuple[int, int]:
    """Key range ``[lo, hi)`` every query at positions ``p_lo..p_hi`` sees (may be empty).

    Every mask variant shows a query at ``p`` one interval of keys whose two ends never
    decrease with ``p``, and ``key_range(p, p)`` is exactly that interval; so the keys both
    the first and the last query see are seen by every query between them.
    """
    a0, a1 = mask.key_range(p_lo, p_lo, kv_len)
    b0, b1 = mask.key_range(p_hi, p_hi, kv_len)
    return max(a0, b0), min(a1, b1)


# The block kernel --------------------------------------------------------------------
_BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32, torch.float64: torch.int64}


def row_max(s: torch.Tensor) -> torch.Tensor:
    """Max over the last dim of a NaN-free float tensor, read through its bit pattern.

    IEEE floats are sign-magnitude: as signed integers, non-negative values order like the
    floats and negative ones in reverse. So the float max is the integer max when that is
    >= 0, else the integer min. Integer reductions are ~10x faster than bf16 float ones here.
    """
    bits = s.view(_BITS[s.dtype])
    hi = bits.amax(dim=-1)
    negative = hi < 0  # rows of negative scores only (rare): their max is the integer min
    if bool(negative.any()):
        hi = torch.where(negative, bits.amin(dim=-1), hi)
    return hi.view(s.dtype)


def _mask_columns(s: torch.Tensor, mask: MaskVariant, q_pos: torch.Tensor, c0: int, c1: int, k_first: int) -> torch.Tensor:
    """Add -inf to the invisible scores of key positions ``c0..c1-1`` in place (``s [H, m, n]``
    holds keys from position ``k_first``). Returns the rows that see any of those keys."""
    vis = mask.visible(q_pos[:, None], torch.arange(c0, c1, device=q_pos.device)[None, :])  # [m, c1-c0]
    bias = torch.where(vis, 0.0, NEG_INF).to(s.dtype)
    s[:, :, c0 - k_first : c1 - k_first].add_(bias)  # an add broadcasts over heads faster than masked_fill_
    return vis.any(dim=1)


def attend_block(
    q_blk: torch.Tensor,
    kT_blk: torch.Tensor,
    v_blk: torch.Tensor,
    mask: MaskVariant,
    q_pos: torch.Tensor,
    k_first: int,
    full: tuple[int, int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one query block over one key block.

    ``q_blk [H, m, Dq]`` (scaled), ``kT_blk [H, Dq, n]``, ``v_blk [H, n, Dv]`` (packed, so ``bmm``
    copies nothing); the keys sit at positions ``k_first + j``, queries at ``q_pos [m]``; keys in
    ``full`` are visible to all queries, the others go through the mask. Returns the block's
    normalised output ``o [H, m, Dv]`` (input dtype) and float32 ``lse [H, m]`` (-inf for rows
    that see nothing, whose ``o`` is 0).
    """
    n = kT_blk.shape[2]
    k_last = k_first + n
    s = torch.bmm(q_blk, kT_blk)  # [H, m, n]
    f0, f1 = max(full[0], k_first), min(full[1], k_last)
    dead = None
    if f0 >= f1:  # no column visible to all: mask everything, some rows may see nothing
        alive = _mask_columns(s, mask, q_pos, k_first, k_last, k_first)
        if not bool(alive.all()):
            dead = ~alive
    else:
        if f0 > k_first:
            _mask_columns(s, mask, q_pos, k_first, f0, k_first)
        if f1 < k_last:
            _mask_columns(s, mask, q_pos, f1, k_last, k_first)
    s_max = row_max(s)
    p = torch.softmax(s, dim=2)  # exp(s - lse), float32 inside, stored in the input dtype
    del s
    if dead is not None:
        p.masked_fill_(dead[:, None], 0.0)  # all -inf rows came out NaN
    o = torch.bmm(p, v_blk)
    # The largest probability of a row is exp(max - lse) = 1 / sum(exp(s - max)); p >= 0, so its
    # integer bits order like the floats.
    p_max = p.view(_BITS[p.dtype]).amax(dim=2).view(p.dtype)
    stat = stat_dtype(p.dtype)
    lse = s_max.to(stat).sub_(p_max.to(stat).log_())
    if dead is not None:
        lse.masked_fill_(dead, NEG_INF)
    return o, lse


# Running state -----------------------------------------------------------------------
RESCALE_MARGIN = 8.0  # let block weights reach e^8 before rescaling the accumulator


class State:
    """Running attention state of every query row, float32, head-major.

    ``acc [H, T, Dv]`` = sum over key blocks of ``exp(lse_b - ref) * o_b``, ``wsum [H, T]`` = sum of
    the same weights, ``ref [H, T]`` a reference LSE moved up only when a block's LSE exceeds it
    by ``RESCALE_MARGIN`` (so most blocks cost one fused multiply-add). Then
    ``out = acc / wsum`` and ``lse = ref + log(wsum)``. ``acc`` starts undefined (a reused scratch
    buffer): the first block a row receives is written, later ones merged; rows that never
    receive one are zeroed at the end.
    """

    def __init__(self, num_heads: int, num_rows: int, v_depth: int, device: torch.device, dtype: torch.dtype = F32) -> None:
        self.acc = workspace.scratch("torch.acc", (num_heads, num_rows, v_depth), dtype, device)
        self.ref = torch.full((num_heads, num_rows), NEG_INF, dtype=dtype, device=device)
        self.wsum = torch.zeros(num_heads, num_rows, dtype=dtype, device=device)
        self.started = bytearray(num_rows)  # 1 where acc holds a block's result

    def add(self, rows: slice, o: torch.Tensor, lse_b: torch.Tensor) -> None:
        """Fold one block result (``o [H, m, Dv]``, ``lse_b [H, m]``) into rows ``rows``."""
        acc, ref, wsum = self.acc[:, rows], self.ref[:, rows], self.wsum[:, rows]
        a, b = rows.start, rows.stop
        if self.started.find(1, a, b) < 0:  # nothing here yet: write
            acc.copy_(o)
            ref.copy_(lse_b)
            wsum.copy_(lse_b > NEG_INF)
            self.started[a:b] = b"\x01" * (b - a)
            return
        if self.started.find(0, a, b) >= 0:  # partly started: the fresh rows hold nothing
            fresh = torch.frombuffer(self.started[a:b], dtype=torch.uint8).to(acc.device) == 0
            acc.masked_fill_(fresh[None, :, None], 0.0)
            self.started[a:b] = b"\x01" * (b - a)
        grow = lse_b > ref + RESCALE_MARGIN  # also every first finite block of a row
        if bool(grow.any()):
            factor = torch.where(grow, (ref - lse_b).exp_(), 1.0)
            acc.mul_(factor.unsqueeze(2))
            wsum.mul_(factor)
            ref.copy_(torch.where(grow, lse_b, ref))
        w = (lse_b - ref).exp_().nan_to_num_(nan=0.0)  # -inf - -inf: a row that saw nothing yet
        acc.addcmul_(o, w.unsqueeze(2))
        wsum.add_(w)

    def finish(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalise in place: ``acc`` becomes ``out [H, T, Dv]``; returns it and ``lse [H, T]``."""
        if self.started.find(0) >= 0:
            never = torch.frombuffer(bytearray(self.started), dtype=torch.uint8).to(self.acc.device) == 0
            self.acc.masked_fill_(never[None, :, None], 0.0)
        seen = self.wsum > 0
        self.acc.div_(torch.where(seen, self.wsum, 1.0).unsqueeze(2))
        lse = torch.where(seen, self.ref + self.wsum.log(), NEG_INF)
        return self.acc, lse


# Keys in packed blocks ---------------------------------------------------------------
@dataclass
class KeyBlocks:
    """One sequence's keys in a chunk, cut into packed blocks: block ``i`` holds positions
    ``bounds[i]..bounds[i+1]-1`` as ``kT[i] [H, Dq, n_i]`` and ``v[i] [H, n_i, Dv]``."""

    bounds: list[int]
    kT: list[torch.Tensor]
    v: list[torch.Tensor]


def block_bounds(k_lo: int, k_hi: int, q_pos: int, block_n: int) -> list[int]:
    """Cut key positions ``[k_lo, k_hi)`` every ``block_n``, on a grid through ``q_pos`` so that
    query-block edges (``q_pos + i*block_m``) fall on block edges when block_m divides block_n."""
    first = k_lo + (q_pos - k_lo) % block_n
    inner = list(range(first if first > k_lo else k_lo + block_n, k_hi, block_n))
    return [k_lo] + inner + [k_hi]


def pack_keys(
    k_nope_T: torch.Tensor, k_rope_T: torch.Tensor, v: torch.Tensor, bounds: list[int], col0: int
) -> KeyBlocks:
    """Copy key columns into packed blocks.

    ``k_nope_T [H, Dn, *]``, ``k_rope_T [R, *]`` (shared by heads) and ``v [*, H, Dv]`` hold key
    position ``p`` at column/row ``p - col0``."""
    H, Dn = k_nope_T.shape[0], k_nope_T.shape[1]
    R = k_rope_T.shape[0]
    kTs, vs = [], []
    for a, b in zip(bounds, bounds[1:]):
        c0, c1 = a - col0, b - col0
        kT = _alloc((H, Dn + R, b - a), k_nope_T.dtype, k_nope_T.device)
        kT[:, :Dn].copy_(k_nope_T[:, :, c0:c1])
        kT[:, Dn:].copy_(k_rope_T[:, c0:c1].unsqueeze(0).expand(H, -1, -1))
        kTs.append(kT)
        vs.append(_alloc((H, b - a, v.shape[2]), v.dtype, v.device).copy_(v[c0:c1].transpose(0, 1)))
    return KeyBlocks(bounds, kTs, vs)


def _seen_span(mask: MaskVariant, p_lo: int, p_hi: int, kv_len: int, lo: int, hi: int) -> tuple[int, int]:
    """Keys in ``[lo, hi)`` that some query at positions ``p_lo..p_hi`` sees, as one range."""
    a, b = mask.key_range(p_lo, p_hi, kv_len)
    return max(a, lo), min(b, hi)


def _attend_rows(
    q_blk: torch.Tensor,
    row0: int,
    p_lo: int,
    keys: KeyBlocks,
    k_lo: int,
    k_hi: int,
    mask: MaskVariant,
    kv_len: int,
    state: State,
    split: bool,
) -> None:
    """Queries ``q_blk [H, m, Dq]`` (state rows ``row0..``, positions ``p_lo..``) over the keys of
    ``keys`` in positions ``[k_lo, k_hi)``.

    A key block that needs the mask (a causal diagonal, a window edge) may be run as two row
    halves, each over the keys it can see, when that saves enough work (``split``)."""
    m = q_blk.shape[1]
    p_hi = p_lo + m - 1
    lo, hi = _seen_span(mask, p_lo, p_hi, kv_len, k_lo, k_hi)
    if lo >= hi:
        return  # these queries see none of these keys
    full = fully_visible(mask, p_lo, p_hi, kv_len)
    q_pos = torch.arange(p_lo, p_hi + 1, device=q_blk.device)
    bounds = keys.bounds
    j = bisect.bisect_right(bounds, lo) - 1
    while j < len(bounds) - 1 and bounds[j] < hi:
        b0, b1 = bounds[j], bounds[j + 1]
        a, b = max(lo, b0), min(hi, b1)
        j += 1
        if split and m >= 2 * SPLIT_MIN_ROWS and not (full[0] <= a and b <= full[1]):
            h = m // 2
            top = _seen_span(mask, p_lo, p_lo + h - 1, kv_len, a, b)
            bottom = _seen_span(mask, p_lo + h, p_hi, kv_len, a, b)
            work = h * max(0, top[1] - top[0]) + (m - h) * max(0, bottom[1] - bottom[0])
            if work <= SPLIT_GAIN * m * (b - a):
                # q_blk[:, :h] is not packed: bmm copies it, which costs far less than the saved work
                _attend_rows(q_blk[:, :h], row0, p_lo, keys, a, b, mask, kv_len, state, True)
                _attend_rows(q_blk[:, h:], row0 + h, p_lo + h, keys, a, b, mask, kv_len, state, True)
                continue
        kT, v = keys.kT[j - 1], keys.v[j - 1]
        if (b - a) * SLICE_BELOW < b1 - b0:
            # Mostly unseen: slice (bmm packs a copy of the slice) rather than compute it all.
            kT, v = kT[:, :, a - b0 : b - b0], v[:, a - b0 : b - b0]
        else:  # the whole packed block; the mask hides the keys these queries cannot see
            a, b = b0, b1
        o, lse_b = attend_block(q_blk, kT, v, mask, q_pos, a, full)
        state.add(slice(row0, row0 + m), o, lse_b)


def attend_sequence(
    q_blocks: list[torch.Tensor],
    keys: KeyBlocks,
    work: SeqWork,
    mask: MaskVariant,
    block_m: int,
    state: State,
) -> None:
    """Continue the state of one sequence's queries over its keys in this chunk.

    ``q_blocks``: the sequence's queries as packed ``[H, block_m, Dq]`` blocks (scaled, see
    ``pack_queries``).
    """
    for i, q_blk in enumerate(q_blocks):
        i0 = i * block_m
        _attend_rows(q_blk, work.q0 + i0, work.q_pos + i0, keys, keys.bounds[0], keys.bounds[-1], mask, work.kv_len,
                     state, split=True)


# Layout helpers ----------------------------------------------------------------------
def pack_queries(q: torch.Tensor, q0: int, q1: int, block_m: int, scale: float, dtype: torch.dtype) -> list[torch.Tensor]:
    """Rows ``q0:q1`` of ``q [T, H, D]`` as packed head-major blocks ``scale * q[rows]`` of
    ``[H, block_m, D]`` (the last may be shorter), so ``bmm`` never copies them again."""
    out = []
    for a in range(q0, q1, block_m):
        b = min(a + block_m, q1)
        blk = _alloc((q.shape[1], b - a, q.shape[2]), dtype, q.device)
        out.append(blk.copy_(q[a:b].transpose(0, 1)).mul_(scale))  # two plain passes beat one transposing mul
    return out


def cache_rows_of(batch: CacheBatch, b: int, start: int, stop: int) -> torch.Tensor:
    """Physical cache rows (int64) of positions ``start..stop-1`` of sequence ``b``."""
    pos = torch.arange(start, stop, device=batch.block_table.device)
    pages = batch.block_table[b].to(torch.int64)[pos // batch.page_size]
    return pages * batch.page_size + pos % batch.page_size


def gather_entries(batch: CacheBatch, layer_idx: int, spans: list[tuple[int, int, int]]) -> torch.Tensor:
    """Cache entries ``[n, L+R]`` of ``(sequence, start, stop)`` position spans, in order (an fp8
    cache's entries dequantised to float32: only this chunk's rows, so memory stays bounded)."""
    rows = [cache_rows_of(batch, b, lo, hi) for b, lo, hi in spans]
    if not batch.is_native:
        index = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64)
        return batch.read_rows(layer_idx, index, torch.float32)
    flat = batch.blocks[layer_idx].reshape(-1, batch.head_dim)
    if not rows:
        return flat[:0]
    return flat.index_select(0, torch.cat(rows).to(flat.device))


def output_of(state: State, dtype: torch.dtype, attn_sink: torch.Tensor | None = None,
              token_seq: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalised ``out [T, H, Dv]`` in ``dtype`` (the sink applied, if any) and float32
    ``lse [T, H]`` (without the sink)."""
    acc, lse = state.finish()
    H, T, Dv = acc.shape
    lse = lse.t().contiguous()
    if attn_sink is None:
        return _alloc((T, H, Dv), dtype, acc.device).copy_(acc.transpose(0, 1)), lse
    out = acc.transpose(0, 1).contiguous()  # the sink scales in the state dtype, then one cast
    apply_sink(out, lse, attn_sink, token_seq)
    return out.to(dtype), lse


def visible_span(mask: MaskVariant, work_q: tuple[int, int], k_lo: int, k_hi: int, kv_len: int) -> tuple[int, int]:
    """Key positions in ``[k_lo, k_hi)`` that some query at positions ``work_q[0]..work_q[1]``
    (inclusive) sees, as one range (may be empty)."""
    lo, hi = mask.key_range(work_q[0], work_q[1], kv_len)
    return max(lo, k_lo), min(hi, k_hi)


# flare_mla_prefill -------------------------------------------------------------------
def flare_mla_prefill(
    plan: "PlanView",
    layer_idx: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    chunk: "ChunkRows",
    spec: "AttentionSpec",
    tile=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk with up-projected keys: ``q [T, H, Dn+R]`` (roped), ``k [S, H, Dn]``,
    ``v [S, H, Dv]``; rows ``bro[b]:bro[b+1]`` of the chunk are sequence ``b``'s keys at positions
    ``co[b] + j`` (rope part read from the cache). ``tile``: an ``MlaConfigV2`` or None.
    Returns ``out [T, H, Dv]`` (q's dtype) and float32 ``lse [T, H]`` over these keys."""
    batch, scale, mask = plan.batch, spec.scale, spec.mask
    T, H, Dq = q.shape
    Dn, Dv = k.shape[2], v.shape[2]
    dtype = q.dtype
    bro, co = chunk.bro, chunk.co
    offs, cache_lens, seq_lens = batch.offsets_list, batch.cache_lengths_list, batch.seq_lens_list
    block_m, block_n = pick_tiles(tile, H)
    state = State(H, T, Dv, q.device, stat_dtype(dtype))
    # Per sequence: the keys some query sees (others are never read).
    todo = []
    for b in range(batch.batch_size):
        n_q, n_k = offs[b + 1] - offs[b], bro[b + 1] - bro[b]
        if n_q and n_k:
            work = SeqWork(offs[b], offs[b + 1], cache_lens[b], bro[b], bro[b + 1], co[b], seq_lens[b])
            lo, hi = visible_span(mask, (cache_lens[b], cache_lens[b] + n_q - 1), co[b], co[b] + n_k, seq_lens[b])
            if lo < hi:
                todo.append((b, work, lo, hi))
    if todo:
        rope_T = gather_entries(batch, layer_idx, [(b, lo, hi) for b, _, lo, hi in todo])[:, Dn - Dq :].t().to(dtype)
        k_nope_T = k.permute(1, 2, 0)  # [H, Dn, S] view; packing copies it block by block
        col = 0
        for b, work, lo, hi in todo:
            rope_cols = rope_T[:, col : col + hi - lo]
            col += hi - lo
            row0 = work.k0 - work.k_pos  # buffer row of a key position
            nope = k_nope_T[:, :, lo + row0 : hi + row0].to(dtype)
            keys = pack_keys(nope, rope_cols, v[lo + row0 : hi + row0].to(dtype), block_bounds(lo, hi, work.q_pos, block_n), lo)
            q_blocks = pack_queries(q, work.q0, work.q1, block_m, scale, dtype)
            attend_sequence(q_blocks, keys, work, mask, block_m, state)
    return output_of(state, dtype)


# prefill -----------------------------------------------------------------------------
def chunk_spans(batch: CacheBatch, mask: MaskVariant, bro: list[int], co: list[int]) -> list[tuple[int, SeqWork]]:
    """Per sequence of one chunk: the key positions some query of the sequence sees, compacted
    into consecutive buffer rows. Sequences without new tokens or such keys are left out."""
    offs, cache_lens, seq_lens = batch.offsets_list, batch.cache_lengths_list, batch.seq_lens_list
    out, row = [], 0
    for b in range(batch.batch_size):
        n_q, n_k = offs[b + 1] - offs[b], bro[b + 1] - bro[b]
        if not (n_q and n_k):
            continue
        lo, hi = visible_span(mask, (cache_lens[b], cache_lens[b] + n_q - 1), co[b], co[b] + n_k, seq_lens[b])
        if lo < hi:
            out.append((b, SeqWork(offs[b], offs[b + 1], cache_lens[b], row, row + hi - lo, lo, seq_lens[b])))
            row += hi - lo
    return out


def up_project(
    batch: CacheBatch,
    layer_idx: int,
    works: list[tuple[int, SeqWork]],
    w_k: torch.Tensor,
    w_v: torch.Tensor,
    num_heads: int,
    block_n: int,
) -> list[KeyBlocks]:
    """Gather one chunk's cache rows and up-project them straight into packed key blocks.

    Per block of ``n`` keys, two matmuls: ``K_nope^T = W_UK @ latent^T`` (``[H*Dn, n]``, copied
    next to the shared rope rows) and ``V^T = W_UV @ latent^T`` (``[H*Dv, n]``, used as is: its
    transpose is a layout ``bmm`` takes without copying). ``w_k [H*Dn, L]`` and ``w_v [H*Dv, L]``
    in the compute dtype."""
    H, L = num_heads, w_k.shape[1]
    Dn, Dv = w_k.shape[0] // H, w_v.shape[0] // H
    entries = gather_entries(batch, layer_idx, [(b, w.k_pos, w.k_pos + w.k1 - w.k0) for b, w in works]).to(w_k.dtype)
    latent = entries[:, :L].contiguous()  # row slices of it are packed matmul operands
    rope_T = entries[:, L:].t()
    R = rope_T.shape[0]
    out = []
    for _, w in works:
        bounds = block_bounds(w.k_pos, w.k_pos + w.k1 - w.k0, w.q_pos, block_n)
        kTs, vs = [], []
        for a, b in zip(bounds, bounds[1:]):
            r0, r1 = a - w.k_pos + w.k0, b - w.k_pos + w.k0
            lat_T = latent[r0:r1].t()
            kT = _alloc((H, Dn + R, b - a), w_k.dtype, w_k.device)
            kT[:, :Dn].copy_(torch.mm(w_k, lat_T).view(H, Dn, b - a))
            kT[:, Dn:].copy_(rope_T[:, r0:r1].unsqueeze(0).expand(H, -1, -1))
            kTs.append(kT)
            vs.append(torch.mm(w_v, lat_T).view(H, Dv, b - a).transpose(1, 2))
        out.append(KeyBlocks(bounds, kTs, vs))
    return out


def prefill(
    plan: "PlanView", layer_idx: int, q_rot: torch.Tensor, w_k: torch.Tensor, w_uv: torch.Tensor, spec: "AttentionSpec",
    tile=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense prefill form over the paged cache (this step's tokens already written).

    ``q_rot [T, H, Dn+R]``, ``w_k [H*Dn, L]``, ``w_uv [H, Dv, L]``. Keys are taken in chunks of at
    most ``plan.buffer_size`` rows (None: about ``chunks.KV_BUFFER_BYTES`` of K/V). Returns
    ``out [T, H, Dv]`` (q's dtype) and float32 ``lse [T, H]`` (sink excluded)."""
    batch, scale, mask = plan.batch, spec.scale, spec.mask
    T, H, Dq = q_rot.shape
    Dv, L = w_uv.shape[1], w_uv.shape[2]
    dtype = q_rot.dtype
    state = State(H, T, Dv, q_rot.device, stat_dtype(dtype))
    if T and plan.max_position:
        chunks = plan.chunks(plan.buffer_size or default_buffer_size(H, Dq, Dv, L, dtype))
        w_k_c, w_v_c = w_k.to(dtype), w_uv.reshape(H * Dv, L).to(dtype)
        block_m, block_n = pick_tiles(tile, H)
        q_blocks: dict[int, list[torch.Tensor]] = {}  # per sequence, packed on first use
        for bro, co in zip(chunks.buffer_row_offsets, chunks.cache_offsets):
            works = chunk_spans(batch, mask, bro, co)
            if not works:
                continue
            keys = up_project(batch, layer_idx, works, w_k_c, w_v_c, H, block_n)
            for (b, work), kb in zip(works, keys):
                if b not in q_blocks:
                    q_blocks[b] = pack_queries(q_rot, work.q0, work.q1, block_m, scale, dtype)
                attend_sequence(q_blocks[b], kb, work, mask, block_m, state)
            del keys
    return output_of(state, dtype, spec.attn_sink, plan.token_seq)
