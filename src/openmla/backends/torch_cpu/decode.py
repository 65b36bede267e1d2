"""torch backend: the decode (absorbed, MQA) form over the paged latent cache.

Keys are the cache rows ``[L+R]``, shared by all H query heads; values are their first ``L``
columns, so one gathered key block serves both ``Q K^T`` and ``P V``.

- dense: per sequence, its query tokens with the heads folded into the rows (``[tokens*H, L+R]``)
  walk the keys they can see (``MaskVariant.key_range``) in blocks, with an online softmax
  (``OnlineSoftmax``); split-KV cuts those keys into ``plan.num_partitions`` ranges whose results
  merge by LSE (``combine.merge_states``);
- sparse: groups of query tokens, each against its own listed keys (``spec.sparse``), batched
  with ``matmul``, through the same online softmax.

Scores, softmax sums and the running output are float32 (float64 for float64 inputs): a bf16 or
fp8 query and a bf16 / quantised cache are multiplied as float32 (``score_dtype``), since a
torch GEMM on bf16 operands returns bf16 and rounding scores there costs ~2^-9 |score| before
the exponential. P x V reads a 16-bit cache's stored rows (a bf16 GEMM added into the float32
accumulator: its rounding is not amplified). Memory stays one block of scores
and one gathered key block whatever the context (fp8 caches are dequantised block by block by
``CacheBatch.read_pages`` / ``read_rows``).

Nothing here reads a tensor value on the host: the loops run over the plan's host lists
(``plan.batch.cache_lengths_list``, ``offsets_list``) and over key ranges computed from them,
and every mask, top-k length and empty row is handled by tensor ops, so a call never waits
for its device.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from ... import workspace
from ...combine import apply_sink, merge_states
from ...masks import MaskVariant

if TYPE_CHECKING:
    from ...spec import AttentionSpec
    from ..base import PlanView

__all__ = ["decode", "OnlineSoftmax", "fully_visible"]

# Block sizes (bench/RESULTS.md, "torch backend, plain"; times flat within noise around them):
SCORE_BUDGET = 1 << 19  # score elements per key block (2 MiB of float32); 2^17..2^20 within 6% at H=128
MAX_BLOCK_KEYS = 4096  # keys per block at few query rows; 1K..8K keys within noise at H=16
MAX_QUERY_ROWS = 1024  # query rows (tokens x heads) per dense chunk, so a block keeps >= 512 keys
SPARSE_GATHER_ROWS = 8192  # keys gathered at once by the sparse path (tokens x slots): one block's worth
SEEN_KEYS = 255  # keys per seen_product: its counts of infinities fit 8 bits each, exact in float32


# The online softmax, shared with prefill ------------------------------------------------------
class OnlineSoftmax:
    """Softmax attention of some query rows, accumulated over key blocks (flash-attention style).

    Per row: ``m`` the largest score so far (-inf while no key was seen), ``den`` the sum of
    ``exp(score - m)`` and ``acc`` the sum of ``exp(score - m) * value``, all in ``dtype``
    (float32, or float64). ``rows`` is the shape of the query rows, ``depth`` the value width.
    """

    def __init__(self, rows: tuple[int, ...], depth: int, dtype: torch.dtype, device: torch.device) -> None:
        self.m = torch.full(rows, -math.inf, dtype=dtype, device=device)
        self.den = torch.zeros(rows, dtype=dtype, device=device)
        self.acc = torch.zeros(*rows, depth, dtype=dtype, device=device)

    def add(self, s: torch.Tensor, v: torch.Tensor, at=..., seen: tuple[torch.Tensor, int, int] | None = None) -> None:
        """Fold in one key block: scores ``s [..., n]`` in the state's dtype, already scaled, -inf
        where masked (overwritten); values ``v [..., n, depth]``; ``at`` indexes the state's rows.

        ``seen = (visible [..., n], a, b)`` when some row does not see some key: every row sees
        the keys ``[a, b)``; the others go through ``seen_product``, so that a NaN or inf value
        reaches only the rows that see its key."""
        m, den, acc = self.m[at], self.den[at], self.acc[at]  # views: ``at`` is basic (slice) indexing
        m_new = torch.maximum(m, s.amax(-1))
        m_ref = m_new.masked_fill(m_new == -math.inf, 0.0)  # no key yet: any finite reference (exp(-inf) = 0)
        p = s.sub_(m_ref.unsqueeze(-1)).exp_()
        alpha = torch.exp(m - m_ref)  # rescales what came before (0 when nothing did)
        den.mul_(alpha).add_(p.sum(-1))
        acc.mul_(alpha.unsqueeze(-1))
        if seen is None:
            acc.add_(torch.matmul(p.to(v.dtype), v))
        else:
            visible, a, b = seen
            acc.add_(torch.matmul(p[..., a:b].to(v.dtype), v[..., a:b, :]))
            for lo, hi in ((0, a), (b, p.shape[-1])):
                for k0 in range(lo, hi, SEEN_KEYS):
                    k1 = min(k0 + SEEN_KEYS, hi)
                    acc.add_(seen_product(p[..., k0:k1], v[..., k0:k1, :], visible[..., k0:k1]))
        m.copy_(m_new)

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``out = acc / den`` and the natural-log ``lse = m + log(den)``; rows without keys give 0
        and -inf. A NaN or +inf score made ``m`` or ``den`` NaN for good: that row's out and LSE
        are NaN (docs/api.md's NaN rule)."""
        empty = self.den == 0
        out = self.acc / torch.where(empty, 1.0, self.den).unsqueeze(-1)
        lse = torch.where(empty, -math.inf, self.m + torch.log(self.den))
        return out, lse


def seen_product(p: torch.Tensor, v: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """``p [..., m, n] x v [..., n, d]`` over the keys each row sees (``visible [..., m, n]``; ``p``
    is 0 where a row does not), with the reference's arithmetic for a NaN or inf value where seen
    (``0 x inf`` = NaN for a -inf score, +-inf for a positive probability) and nothing where not
    (a plain product would give ``0 x NaN``). No host read: one 0/1-coded product finds, per row
    and column, the seen infinities of each sign (NaN counts as both), and whether a seen one
    has probability 0. ``n <= SEEN_KEYS``, so the counts stay exact in float32."""
    nan, plus, minus = torch.isnan(v), v == math.inf, v == -math.inf
    plain = torch.matmul(p.to(v.dtype), v.masked_fill(nan | plus | minus, 0))
    signs = (plus | nan).to(p.dtype) + 256 * (minus | nan).to(p.dtype)  # [..., n, d]: +inf count, -inf count
    weight = visible.to(p.dtype) * torch.where(p > 0, 1.0, 65536.0)  # seen at probability 0: far above any count
    code = torch.matmul(weight, signs)  # < 65536 unless some seen probability-0 key has an infinity
    up, down = torch.remainder(code, 256) > 0, code >= 256
    odd = torch.where(up, math.inf, 0.0) + torch.where(down, -math.inf, 0.0)  # both: inf - inf = NaN
    return plain + odd.masked_fill(code >= 65536, math.nan).to(plain.dtype)


def _finite(values: torch.Tensor) -> torch.Tensor:
    """``values`` with NaN / inf replaced by 0, for a key block some query does not see: its zero
    probability times a NaN value would leak NaN into that query (a query that sees such a key has
    a NaN or +inf score there, so its row is NaN whatever the value: docs/api.md's NaN rule)."""
    return values.masked_fill(~torch.isfinite(values), 0)


def _seen_nonfinite(state: OnlineSoftmax, visible: torch.Tensor, values: torch.Tensor, H: int) -> None:
    """NaN into the accumulator columns where a query sees a key whose value there is NaN / inf
    (``visible [tokens, n]``, state rows token-major with ``H`` heads): what the reference's P x V
    gives, as such a key's score is NaN or +-inf (K = V in MLA): a NaN row already, or a -inf
    score's zero probability times an infinite value. Only blocks some query does not see come
    here (``_finite`` zeroed those values); one small product, no host read."""
    hit = torch.mm(visible.to(state.acc.dtype), (~torch.isfinite(values)).to(state.acc.dtype))  # [tokens, L]
    acc = state.acc.view(visible.shape[0], H, -1)
    acc.masked_fill_(hit[:, None, :] > 0, math.nan)


def fully_visible(mask: MaskVariant, p_lo: int, p_hi: int, kv_len: int) -> tuple[int, int]:
    """Key range ``[lo, hi)`` every query at positions ``p_lo..p_hi`` sees (may be empty).

    Every mask variant shows a query at ``p`` one interval of keys whose two ends never
    decrease with ``p``, and ``key_range(p, p)`` is exactly that interval; so the keys both
    the first and the last query see are seen by every query between them.
    """
    a0, a1 = mask.key_range(p_lo, p_lo, kv_len)
    b0, b1 = mask.key_range(p_hi, p_hi, kv_len)
    return max(a0, b0), min(a1, b1)


def _split(lo: int, hi: int, parts: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` cut into ``parts`` near-equal contiguous ranges (some empty when short)."""
    cuts = [lo + ((hi - lo) * i) // parts for i in range(parts + 1)]
    return list(zip(cuts[:-1], cuts[1:]))


def _merge(results: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The split-KV merge of partial results over disjoint key ranges."""
    out, lse = results[0]
    for o, part_lse in results[1:]:
        out, lse = merge_states(out, lse, o, part_lse)
    return out, lse


# Dense: every visible key of the sequence ---------------------------------------------------
def _page_keys(plan: "PlanView", layer_idx: int, b: int, k0: int, k1: int, dtype: torch.dtype,
               values_stored: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys ``[k1-k0, L+R]`` at positions ``k0..k1-1`` of sequence ``b``, gathered page by page, in
    ``dtype`` (the score product's), and the same rows as the P x V product reads them: with
    ``values_stored``, a 16-bit cache's stored rows (a bf16 GEMM into the float32 accumulator, for
    a bf16 query), else the same tensor."""
    batch, ps = plan.batch, plan.batch.page_size
    first, last = k0 // ps, (k1 - 1) // ps
    table = batch.block_table[b, first : last + 1]
    layer = batch.blocks[layer_idx]
    stored = None
    if batch.is_native:
        # Into reused buffers: a fresh multi-MB tensor costs a page fault per 4 KiB (2x the copy).
        shape = (last + 1 - first, *layer.shape[1:])
        pages = workspace.scratch("torch.keys", shape, dtype, layer.device)
        if layer.dtype == dtype:
            torch.index_select(layer, 0, table.long(), out=pages)
        else:  # a 16-bit cache widened to the score dtype
            stored = workspace.scratch("torch.keys_stored", shape, layer.dtype, layer.device)
            pages.copy_(torch.index_select(layer, 0, table.long(), out=stored))
    else:
        pages = batch.read_pages(layer_idx, table, dtype)  # fp8 formats dequantised here, a block at a time
    rows = slice(k0 - first * ps, k1 - first * ps)
    keys = pages.view(-1, pages.shape[-1])[rows]
    return keys, (stored.view(-1, pages.shape[-1])[rows] if values_stored and stored is not None else keys)


def _dense(plan: "PlanView", layer_idx: int, q: torch.Tensor, spec: "AttentionSpec", L: int, stat: torch.dtype,
           out: torch.Tensor, lse: torch.Tensor, values_stored: bool = False, widened: bool = False) -> None:
    T, H, D = q.shape
    mask, scale, device = spec.mask, spec.scale, q.device
    batch = plan.batch
    offsets = batch.offsets_list
    max_tokens = max(1, MAX_QUERY_ROWS // H)
    for b, c in enumerate(batch.cache_lengths_list):
        kv_len = c + offsets[b + 1] - offsets[b]
        for r0 in range(offsets[b], offsets[b + 1], max_tokens):  # a chunk of this sequence's query tokens
            r1 = min(r0 + max_tokens, offsets[b + 1])
            p_lo, p_hi = c + r0 - offsets[b], c + r1 - 1 - offsets[b]  # their positions
            q_rows = q[r0:r1].reshape(-1, D)  # [tokens*H, D], token-major
            # [D, tokens*H]; a query widened to float32 scores packs it (a float32 GEMM takes a packed B
            # ~2x faster than a transposed view; inputs already float32 keep the view they always had)
            q_t = q_rows.t().contiguous() if widened else q_rows.t()
            q_pos = torch.arange(p_lo, p_hi + 1, device=device)
            lo, hi = mask.key_range(p_lo, p_hi, kv_len)
            full_lo, full_hi = fully_visible(mask, p_lo, p_hi, kv_len)
            block = max(1, min(MAX_BLOCK_KEYS, SCORE_BUDGET // q_rows.shape[0]))
            results = []
            for k_lo, k_hi in _split(lo, hi, plan.num_partitions or 1):
                state = OnlineSoftmax((q_rows.shape[0],), L, stat, device)
                for k0 in range(k_lo, k_hi, block):
                    k1 = min(k0 + block, k_hi)
                    keys, vals = _page_keys(plan, layer_idx, b, k0, k1, q.dtype, values_stored)
                    # keys @ q^T, transposed back: ~1.3x faster than q @ keys^T at few query rows (M = 16)
                    s = torch.mm(keys, q_t).t().contiguous().to(stat).mul_(scale)
                    values = vals[:, :L]
                    if not (full_lo <= k0 and k1 <= full_hi):  # some query of the chunk cannot see some key
                        visible = mask.visible(q_pos[:, None], torch.arange(k0, k1, device=device)[None, :])
                        s.view(r1 - r0, H, k1 - k0).masked_fill_(~visible[:, None, :], -math.inf)
                        state.add(s, _finite(values))
                        _seen_nonfinite(state, visible, values, H)
                    else:
                        state.add(s, values)
                results.append(state.result())
            o, o_lse = _merge(results)
            out[r0:r1] = o.view(r1 - r0, H, L)
            lse[r0:r1] = o_lse.view(r1 - r0, H)


# Sparse: each query token's listed keys -------------------------------------------------------
def _sparse(plan: "PlanView", layer_idx: int, q: torch.Tensor, spec: "AttentionSpec", L: int, stat: torch.dtype,
            out: torch.Tensor, lse: torch.Tensor) -> None:
    T, H, D = q.shape
    sparse, mask, scale, device = spec.sparse, spec.mask, spec.scale, q.device
    batch = plan.batch
    stride = sparse.indices.shape[1]
    block = max(1, min(MAX_BLOCK_KEYS, stride, SCORE_BUDGET // H))
    group = max(1, min(SPARSE_GATHER_ROWS // block, SCORE_BUDGET // (H * block)))
    slot = torch.arange(stride, device=device)
    for t0 in range(0, T, group):
        t1 = min(T, t0 + group)
        seq, pos = plan.token_seq[t0:t1].to(device), plan.token_pos[t0:t1].to(device)
        entries = sparse.indices[t0:t1].to(device, torch.int64)  # [G, stride]
        keep = entries >= 0  # -1: an unused slot
        if sparse.topk_lengths is not None:  # slots at or past the sequence's top-k length are unused
            keep &= slot[None, :] < sparse.topk_lengths.to(device)[seq][:, None]
        if not sparse.physical:  # logical positions: the mask applies, the page table maps them
            keep &= mask.visible(pos[:, None], entries)
        entries = torch.where(keep, entries, 0)
        rows = entries if sparse.physical else batch.physical_rows(seq[:, None], entries)
        results = []
        for s_lo, s_hi in _split(0, stride, plan.num_partitions or 1):
            state = OnlineSoftmax((t1 - t0, H), L, stat, device)
            for k0 in range(s_lo, s_hi, block):
                k1 = min(k0 + block, s_hi)
                kept = keep[:, k0:k1]
                keys = batch.read_rows(layer_idx, rows[:, k0:k1].reshape(-1), q.dtype).view(t1 - t0, k1 - k0, D)
                # Unused slots read row 0: zero them, so a NaN or inf there cannot leak (0 * inf).
                keys = keys.masked_fill(~kept[..., None], 0)
                s = torch.matmul(q[t0:t1], keys.transpose(1, 2)).to(stat).mul_(scale)  # [G, H, n]
                s.masked_fill_(~kept[:, None, :], -math.inf)
                state.add(s, keys[..., :L])
            results.append(state.result())
        out[t0:t1], lse[t0:t1] = _merge(results)


# Entry point ------------------------------------------------------------------------------------
def score_dtype(q_dtype: torch.dtype, cache_dtype: torch.dtype) -> torch.dtype:
    """The products' dtype: float64 when either side is float64, else float32 (a bf16 or fp16 GEMM
    rounds its output, the scores, to 16 bits; torch has no bf16 x bf16 -> float32 GEMM on the CPU)."""
    return torch.float64 if torch.float64 in (q_dtype, cache_dtype) else torch.float32


@torch.no_grad()
def decode(
    plan: "PlanView", layer_idx: int, q_abs: torch.Tensor, spec: "AttentionSpec", kv_lora_rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed attention: ``q_abs [T, H, L+R]`` against the cache rows of ``layer_idx``.

    Returns ``out [T, H, L]`` (q_abs's dtype) and ``lse [T, H]`` (float32, natural log, without
    the sink). Query ``i`` of sequence ``b`` sits at ``cache_lengths[b] + i``; the cache already
    holds this call's tokens. Rows with no visible key give zeros and -inf. Inference only: the
    outputs carry no autograd graph.
    """
    T, H, _ = q_abs.shape
    device = q_abs.device
    mm_dtype = score_dtype(q_abs.dtype, plan.batch.compute_dtype)
    stat = torch.float64 if mm_dtype == torch.float64 else torch.float32
    q = q_abs.to(mm_dtype).contiguous()
    out = workspace.empty_output((T, H, kv_lora_rank), stat, device)
    lse = workspace.empty_output((T, H), stat, device)
    if spec.sparse is None:
        # bf16 query and cache: P x V on the stored rows (the bf16 GEMM the inputs' dtype promised),
        # only the scores widened; a wider query keeps float32 values.
        both_bf16 = q_abs.dtype == plan.batch.compute_dtype == torch.bfloat16 and plan.batch.is_native
        _dense(plan, layer_idx, q, spec, kv_lora_rank, stat, out, lse, both_bf16, q_abs.dtype != mm_dtype)
    else:
        _sparse(plan, layer_idx, q, spec, kv_lora_rank, stat, out, lse)
    if spec.attn_sink is not None:
        apply_sink(out, lse, spec.attn_sink, plan.token_seq.to(device))
    return out.to(q_abs.dtype), lse.float()
