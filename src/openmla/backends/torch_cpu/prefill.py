"""torch backend: prefill (up-projected, MHA) attention, flash-attention style in plain PyTorch.

``prefill`` walks the plan's chunk plan (``plan.chunks(buffer_size)``): per chunk it gathers the
latent rows some query can see (``CacheBatch.read_rows``, which dequantises fp8 caches),
up-projects them with two matmuls into head-major keys ``[H, S, Dn+R]`` (the R rope columns are
shared by all heads) and values ``[H, S, Dv]``, and attends to them. ``flare_mla_prefill`` does
the same for one chunk whose keys and values come up-projected.

Attention runs per sequence, per block of ``block_m`` queries, over the key blocks of
``block_n`` keys its mask can show (``MaskVariant.key_range``), with heads as the batch dim of
every ``bmm``; ``MaskVariant.visible`` masks only blocks that some query of the block cannot
fully see. Scores are float32 (float64 for float64 inputs) whatever q's dtype: queries and keys
enter the score product in ``stat_dtype`` (a bf16 ``bmm`` would return bf16 scores); P x V runs in
the inputs' dtype into the float32 accumulator. One ``OnlineSoftmax`` (decode.py) holds the running max, sum and output of every
query row in float32 (float64 for float64 inputs) across blocks and chunks, so memory stays one
chunk's keys and one block of scores whatever the context length.

Nothing here reads a tensor value on the host: loops run over the plan's host lists.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ...chunks import default_buffer_size
from ...combine import apply_sink
from ...masks import MaskVariant
from ...workspace import empty_output
from .decode import OnlineSoftmax, fully_visible

if TYPE_CHECKING:
    from ...cache import CacheBatch
    from ...chunks import ChunkRows
    from ...spec import AttentionSpec
    from ..base import PlanView

__all__ = ["prefill", "flare_mla_prefill", "fully_visible", "pick_tiles"]

# Default tiles (bench/RESULTS.md): 64x256 to 256x1024 measured within 5% (H=16, fp32), 128x256
# best by a little (less masked work on the causal diagonal). With more heads the score block
# (heads x block_m x block_n, float32) stays under SCORE_BLOCK_ELEMS (16 MiB), query rows
# halved first, down to MIN_BLOCK_M, then key columns.
DEFAULT_BLOCK_M = 128
DEFAULT_BLOCK_N = 256
MIN_BLOCK_M = 64
SCORE_BLOCK_ELEMS = 4 * 2**20


def stat_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax statistics and accumulation: float32, or float64 for float64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


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


@dataclass(frozen=True)
class Span:
    """One sequence's share of a chunk: its query rows ``q0:q1`` (positions ``q_pos + i``) and the
    key positions ``k_lo..k_hi-1`` some of them see, which sit at rows ``row..`` of the chunk's
    compacted keys (and at ``buffer_row + j`` of a ``flare_mla_prefill`` buffer)."""

    b: int
    q0: int
    q1: int
    q_pos: int
    k_lo: int
    k_hi: int
    kv_len: int
    row: int
    buffer_row: int


def chunk_spans(batch: "CacheBatch", mask: MaskVariant, bro: list[int], co: list[int]) -> list[Span]:
    """Per sequence of one chunk (``bro``/``co`` as in ``ChunkPlan``): the keys some query of the
    sequence sees, compacted end to end. Sequences without new tokens or such keys are left out."""
    offs, cache_lens, seq_lens = batch.offsets_list, batch.cache_lengths_list, batch.seq_lens_list
    spans, row = [], 0
    for b in range(batch.batch_size):
        n_q, n_k = offs[b + 1] - offs[b], bro[b + 1] - bro[b]
        if not (n_q and n_k):
            continue
        lo, hi = mask.key_range(cache_lens[b], cache_lens[b] + n_q - 1, seq_lens[b])
        lo, hi = max(lo, co[b]), min(hi, co[b] + n_k)
        if lo < hi:
            spans.append(Span(b, offs[b], offs[b + 1], cache_lens[b], lo, hi, seq_lens[b], row, bro[b] + lo - co[b]))
            row += hi - lo
    return spans


def _cache_entries(batch: "CacheBatch", layer_idx: int, spans: list[Span], dtype: torch.dtype) -> torch.Tensor:
    """Cache entries ``[S, L+R]`` (dequantised, in ``dtype``) of every span's key positions, in order."""
    device = batch.blocks.device
    seq = torch.cat([torch.full((s.k_hi - s.k_lo,), s.b, device=device) for s in spans])
    pos = torch.cat([torch.arange(s.k_lo, s.k_hi, device=device) for s in spans])
    return batch.read_rows(layer_idx, batch.physical_rows(seq, pos), dtype)


def _head_major_keys(k_nope: torch.Tensor, rope: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Keys ``[H, S, Dn+R]`` in ``dtype`` (the score product's): per-head ``k_nope [S, H, Dn]`` next
    to the shared ``rope [S, R]``."""
    S, H, Dn = k_nope.shape
    k = empty_output((H, S, Dn + rope.shape[1]), dtype, k_nope.device)
    k[:, :, :Dn] = k_nope.transpose(0, 1)
    k[:, :, Dn:] = rope
    return k


def host_reads_free(t: torch.Tensor) -> bool:
    """Whether reading ``t``'s values on the host makes no call wait for a device (CPU tensors)."""
    return t.device.type == "cpu"


def _attend(state: OnlineSoftmax, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: list[Span],
            mask: MaskVariant, scale: float, block_m: int, block_n: int) -> None:
    """Fold one chunk into ``state``: queries ``q [H, T, Dq]`` and the chunk's compacted keys
    ``k [H, S, Dq]`` in the state's dtype (float32 scores), values ``v [H, S, Dv]``."""
    device = q.device
    # Partly seen keys with a NaN / inf value need seen_product; on CPU tensors one look (a free host
    # read) finds the usual case, none anywhere, and keeps the plain product; on a device every
    # masked block takes seen_product, so the call never waits.
    exact = not host_reads_free(v) or not bool(torch.isfinite(v).all())
    for sp in spans:
        for r0 in range(sp.q0, sp.q1, block_m):
            r1 = min(r0 + block_m, sp.q1)
            p_lo, p_hi = sp.q_pos + r0 - sp.q0, sp.q_pos + r1 - 1 - sp.q0  # positions of this query block
            lo, hi = mask.key_range(p_lo, p_hi, sp.kv_len)
            lo, hi = max(lo, sp.k_lo), min(hi, sp.k_hi)
            full_lo, full_hi = fully_visible(mask, p_lo, p_hi, sp.kv_len)
            q_pos = torch.arange(p_lo, p_hi + 1, device=device)
            for k0 in range(lo, hi, block_n):
                k1 = min(k0 + block_n, hi)
                j0, j1 = sp.row + k0 - sp.k_lo, sp.row + k1 - sp.k_lo  # rows of the compacted keys
                s = torch.bmm(q[:, r0:r1], k[:, j0:j1].transpose(1, 2)).mul_(scale)  # [H, m, n] in the state's dtype
                values = v[:, j0:j1]
                seen = None
                if not (full_lo <= k0 and k1 <= full_hi):  # some query of the block cannot see some key
                    visible = mask.visible(q_pos[:, None], torch.arange(k0, k1, device=device)[None, :])
                    s.masked_fill_(~visible, -math.inf)
                    if exact:
                        a = min(max(full_lo, k0), k1) - k0  # [a, b): the block's keys every query sees
                        seen = (visible, a, max(a, min(full_hi, k1) - k0))
                state.add(s, values, at=(slice(None), slice(r0, r1)), seen=seen)


def _output(state: OnlineSoftmax, dtype: torch.dtype, attn_sink: torch.Tensor | None,
            token_seq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``out [T, H, Dv]`` in ``dtype`` (the sink applied, if any) and ``lse [T, H]`` (without it)."""
    acc, lse = state.result()  # [H, T, Dv], [H, T]
    H, T, Dv = acc.shape
    lse = lse.t().contiguous()
    if attn_sink is None:
        return empty_output((T, H, Dv), dtype, acc.device).copy_(acc.transpose(0, 1)), lse.float()
    out = acc.transpose(0, 1).contiguous()  # the sink scales in the state's dtype, then one cast
    apply_sink(out, lse, attn_sink, token_seq.to(acc.device))
    return out.to(dtype), lse.float()


# flare_mla_prefill -------------------------------------------------------------------
@torch.no_grad()
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
    batch, mask = plan.batch, spec.mask
    T, H, Dq = q.shape
    Dn, Dv = k.shape[2], v.shape[2]
    dtype = q.dtype
    state = OnlineSoftmax((H, T), Dv, stat_dtype(dtype), q.device)
    spans = chunk_spans(batch, mask, chunk.bro, chunk.co)
    if spans:
        rows = torch.cat([torch.arange(s.buffer_row, s.buffer_row + s.k_hi - s.k_lo, device=k.device) for s in spans])
        rope = _cache_entries(batch, layer_idx, spans, dtype)[:, batch.head_dim - (Dq - Dn):]  # the R rope columns (R may be 0)
        score = stat_dtype(dtype)
        keys = _head_major_keys(k.index_select(0, rows).to(dtype), rope, score)
        values = v.index_select(0, rows).to(dtype).transpose(0, 1).contiguous()
        block_m, block_n = pick_tiles(tile, H)
        _attend(state, q.transpose(0, 1).to(score).contiguous(), keys, values, spans, mask, spec.scale, block_m, block_n)
    return _output(state, dtype, None, plan.token_seq)


# prefill -----------------------------------------------------------------------------
@torch.no_grad()
def prefill(
    plan: "PlanView", layer_idx: int, q_rot: torch.Tensor, w_k: torch.Tensor, w_uv: torch.Tensor, spec: "AttentionSpec",
    tile=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense prefill form over the paged cache (this step's tokens already written).

    ``q_rot [T, H, Dn+R]``, ``w_k [H*Dn, L]``, ``w_uv [H, Dv, L]``. Keys are taken in chunks of at
    most ``plan.buffer_size`` rows (None: ``chunks.default_buffer_size``, about
    ``chunks.KV_BUFFER_BYTES`` of K/V). Returns ``out [T, H, Dv]`` (q's dtype) and float32
    ``lse [T, H]`` (sink excluded)."""
    batch, mask = plan.batch, spec.mask
    T, H, Dq = q_rot.shape
    Dv, L = w_uv.shape[1], w_uv.shape[2]
    Dn = w_k.shape[0] // H
    dtype = q_rot.dtype
    state = OnlineSoftmax((H, T), Dv, stat_dtype(dtype), q_rot.device)
    if T and plan.max_position:
        score = stat_dtype(dtype)
        q = q_rot.transpose(0, 1).to(score).contiguous()  # [H, T, Dq]: heads are the batch dim of every bmm
        w_k, w_v = w_k.to(dtype), w_uv.reshape(H * Dv, L).to(dtype)
        block_m, block_n = pick_tiles(tile, H)
        chunks = plan.chunks(plan.buffer_size or default_buffer_size(H, Dq, Dv, L, dtype))
        for bro, co in zip(chunks.buffer_row_offsets, chunks.cache_offsets):
            spans = chunk_spans(batch, mask, bro, co)
            if not spans:
                continue
            entries = _cache_entries(batch, layer_idx, spans, dtype)  # [S, L+R]
            latent = entries[:, :L]
            S = latent.shape[0]
            keys = _head_major_keys(torch.mm(latent, w_k.t()).view(S, H, Dn), entries[:, L:], score)
            values = torch.mm(latent, w_v.t()).view(S, H, Dv).transpose(0, 1).contiguous()
            _attend(state, q, keys, values, spans, mask, spec.scale, block_m, block_n)
            del entries, keys, values  # the next chunk's take their place
    return _output(state, dtype, spec.attn_sink, plan.token_seq)
