"""The float64 oracle: slow, per sequence and per query token, written from the math (docs/api.md).

Nothing here calls a fast path. Every function returns float64 tensors; the
``reference`` backend (bottom of this file) casts them to the caller's dtype.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .cache import CacheBatch
from .masks import MaskVariant
from .spec import AttentionSpec

F64 = torch.float64


# Cache addressing ------------------------------------------------------------------
def physical_rows(batch: CacheBatch, b: int, positions: torch.Tensor) -> torch.Tensor:
    """Physical row (``page * page_size + offset``) of logical positions of sequence ``b``."""
    positions = positions.long().cpu()
    pages = batch.block_table[b].long().cpu()[positions // batch.page_size]
    return pages * batch.page_size + positions % batch.page_size


def cache_rows(batch: CacheBatch, layer_idx: int, rows: torch.Tensor) -> torch.Tensor:
    """Cache entries ``[n, L+R]`` (float64) at physical rows."""
    return batch.read_rows(layer_idx, rows, F64).cpu()


def _query_keys(batch: CacheBatch, b: int, q_pos: int, row: int, spec: AttentionSpec) -> torch.Tensor:
    """Physical cache rows of the keys one query attends to (a repeated sparse entry counts twice)."""
    seq_len = batch.seq_lens_list[b]
    sparse = spec.sparse
    if sparse is None:
        pos = torch.arange(seq_len)
    else:
        entries = sparse.indices[row].long().cpu()
        if sparse.topk_lengths is not None:
            entries = entries[: int(sparse.topk_lengths[b])]
        entries = entries[entries >= 0]
        if sparse.physical:
            return entries  # physical rows: no positions, so the mask does not apply
        pos = entries
    pos = pos[spec.mask.visible(torch.tensor(q_pos), pos)]
    return physical_rows(batch, b, pos)


def _sink_of(attn_sink: torch.Tensor | None, b: int) -> torch.Tensor | None:
    if attn_sink is None:
        return None
    s = attn_sink.cpu().to(F64)
    return s if s.dim() == 1 else s[b]


def softmax_combine(scores: torch.Tensor, values: torch.Tensor, sink: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One query token: ``scores [H, n]``, ``values [H, n, D]`` (or ``[n, D]``), ``sink [H]``.

    Returns ``out [H, D]`` = sum_s e^{score} v / (e^{sink} + sum_s e^{score}) and
    ``lse [H]`` = log sum_s e^{score} (without the sink); no key gives zeros and -inf.
    """
    H = scores.shape[0]
    D = values.shape[-1]
    if scores.shape[1] == 0:
        return torch.zeros(H, D, dtype=F64), torch.full((H,), -math.inf, dtype=F64)
    m = scores.max(dim=1, keepdim=True).values
    p = torch.exp(scores - m)
    denom = p.sum(dim=1)
    lse = m.squeeze(1) + torch.log(denom)
    if sink is not None:
        denom = denom + torch.exp(sink - m.squeeze(1))
    if values.dim() == 2:
        out = p @ values
    else:
        out = torch.einsum("hn,hnd->hd", p, values)
    return out / denom[:, None], lse


def _query_positions(batch: CacheBatch) -> list[tuple[int, int, int]]:
    """(row, sequence, position) of every query token of the ragged batch."""
    out = []
    offs = batch.offsets_list
    for b, c in enumerate(batch.cache_lengths_list):
        for i in range(offs[b + 1] - offs[b]):
            out.append((offs[b] + i, b, c + i))
    return out


# The two forms ---------------------------------------------------------------------
def decode(q_abs: torch.Tensor, batch: CacheBatch, layer_idx: int, spec: AttentionSpec | None = None, *, kv_lora_rank: int,
           **spec_kw: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode (absorbed, MQA) form: ``q_abs [T, H, L+R]`` against raw cache rows.

    ``spec``, or its fields as keywords (``scale``, ``mask``, ``sparse_indices``, ...; see
    ``AttentionSpec.build``). Returns ``out_lat [T, H, L]`` and ``lse [T, H]`` (float64).
    """
    spec = spec or AttentionSpec.build(**spec_kw)
    T, H, _ = q_abs.shape
    q = q_abs.cpu().to(F64)
    out = torch.zeros(T, H, kv_lora_rank, dtype=F64)
    lse = torch.full((T, H), -math.inf, dtype=F64)
    for row, b, pos in _query_positions(batch):
        rows = _query_keys(batch, b, pos, row, spec)
        keys = cache_rows(batch, layer_idx, rows)  # [n, L+R]
        scores = spec.scale * (q[row] @ keys.T)  # [H, n]
        out[row], lse[row] = softmax_combine(scores, keys[:, :kv_lora_rank], _sink_of(spec.attn_sink, b))
    return out, lse


def prefill(q: torch.Tensor, batch: CacheBatch, layer_idx: int, w_k: torch.Tensor, w_uv: torch.Tensor,
            spec: AttentionSpec | None = None, **spec_kw: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill (up-projected, MHA) form: ``q [T, H, Dn+R]`` (rope part already rotated).

    ``K_nope[s,h] = W_UK[h] latent[s]``, ``V[s,h] = W_UV[h] latent[s]``. ``spec`` or its fields as
    keywords. Returns ``out [T, H, Dv]`` and ``lse [T, H]`` (float64).
    """
    spec = spec or AttentionSpec.build(**spec_kw)
    T, H, _ = q.shape
    Dv, L = w_uv.shape[1], w_uv.shape[2]
    Dn = w_k.shape[0] // H
    W_UK = w_k.cpu().to(F64).reshape(H, Dn, L)
    W_UV = w_uv.cpu().to(F64)
    qf = q.cpu().to(F64)
    out = torch.zeros(T, H, Dv, dtype=F64)
    lse = torch.full((T, H), -math.inf, dtype=F64)
    by_sequence: dict[int, list[tuple[int, int]]] = {}
    for row, b, pos in _query_positions(batch):
        by_sequence.setdefault(b, []).append((row, pos))
    for b, tokens in by_sequence.items():
        # Every key a token of sequence b reads, up-projected once (the same product for every token).
        rows_of = [_query_keys(batch, b, pos, row, spec) for row, pos in tokens]
        keys = torch.unique(torch.cat(rows_of))
        entries = cache_rows(batch, layer_idx, keys)
        latent, k_rope = entries[:, :L], entries[:, L:]
        k_nope = torch.einsum("hdl,nl->hnd", W_UK, latent)  # [H, keys, Dn]
        v = torch.einsum("hdl,nl->hnd", W_UV, latent)  # [H, keys, Dv]
        for (row, _), rows in zip(tokens, rows_of):
            i = torch.searchsorted(keys, rows)  # this token's keys (a repeated one counts twice)
            scores = spec.scale * (torch.einsum("hd,hnd->hn", qf[row, :, :Dn], k_nope[:, i]) + qf[row, :, Dn:] @ k_rope[i].T)
            out[row], lse[row] = softmax_combine(scores, v[:, i], _sink_of(spec.attn_sink, b))
    return out, lse


def flare_mla_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, buffer_row_offsets: torch.Tensor,
                      cache_offsets: torch.Tensor, batch: CacheBatch, layer_idx: int, *, scale: float,
                      mask: MaskVariant = MaskVariant()) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of prefill with given up-projected keys: ``k [S, H, Dn]``, ``v [S, H, Dv]``.

    Rows ``buffer_row_offsets[b]:[b+1]`` of k/v are the keys of sequence ``b`` at positions
    ``cache_offsets[b] + j``; their rope part comes from the cache. Returns float64
    ``out [T, H, Dv]`` and ``lse [T, H]`` over this chunk's keys only.
    """
    T, H, _ = q.shape
    Dn, Dv = k.shape[2], v.shape[2]
    qf, kf, vf = q.cpu().to(F64), k.cpu().to(F64), v.cpu().to(F64)
    L = batch.head_dim - (q.shape[2] - Dn)
    bro = [int(x) for x in buffer_row_offsets.tolist()]
    co = [int(x) for x in cache_offsets.tolist()]
    out = torch.zeros(T, H, Dv, dtype=F64)
    lse = torch.full((T, H), -math.inf, dtype=F64)
    for row, b, pos in _query_positions(batch):
        key_pos = co[b] + torch.arange(bro[b + 1] - bro[b])
        sel = mask.visible(torch.tensor(pos), key_pos)
        buf = (bro[b] + torch.arange(bro[b + 1] - bro[b]))[sel]
        k_rope = cache_rows(batch, layer_idx, physical_rows(batch, b, key_pos[sel]))[:, L:]
        scores = scale * (torch.einsum("hd,nhd->hn", qf[row, :, :Dn], kf[buf]) + qf[row, :, Dn:] @ k_rope.T)
        out[row], lse[row] = softmax_combine(scores, vf[buf].transpose(0, 1), None)
    return out, lse


# Cache write and the fused op ------------------------------------------------------
def rms_norm(x: torch.Tensor, gamma: torch.Tensor, epsilon: float) -> torch.Tensor:
    x = x.to(F64)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + epsilon) * gamma.to(F64)


def rope(x: torch.Tensor, freqs_cis: torch.Tensor, positions: torch.Tensor, interleaved: bool = True) -> torch.Tensor:
    """RoPE in float64, straight from the pair formula (``x [T, ..., R]``)."""
    fc = freqs_cis.cpu().to(F64)[positions.long()]
    c, s = fc[:, 0::2], fc[:, 1::2]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (c.shape[1],)
    c, s = c.reshape(shape), s.reshape(shape)
    x = x.cpu().to(F64)
    R = x.shape[-1]
    idx_a = torch.arange(0, R, 2) if interleaved else torch.arange(R // 2)
    idx_b = idx_a + 1 if interleaved else idx_a + R // 2
    out = x.clone()
    out[..., idx_a] = x[..., idx_a] * c - x[..., idx_b] * s
    out[..., idx_b] = x[..., idx_a] * s + x[..., idx_b] * c
    return out


def token_positions(batch: CacheBatch) -> torch.Tensor:
    """Position of every new token of the batch, ``[T]`` int64."""
    return torch.tensor([pos for _, _, pos in _query_positions(batch)], dtype=torch.int64)


def write_cache(kv: torch.Tensor, freqs_cis: torch.Tensor, kv_norm_gamma: torch.Tensor, batch: CacheBatch, layer_idx: int,
                epsilon: float, interleaved: bool = True) -> None:
    """RMSNorm the latent, rotate the key rope part, store both at each token's position."""
    L = kv_norm_gamma.shape[0]
    pos = token_positions(batch)
    entry = torch.cat([rms_norm(kv[:, :L].cpu(), kv_norm_gamma.cpu(), epsilon), rope(kv[:, L:], freqs_cis, pos, interleaved)], dim=-1)
    spans = zip(batch.cache_lengths_list, batch.new_tokens_list)
    rows = torch.cat([physical_rows(batch, b, torch.arange(c, c + n)) for b, (c, n) in enumerate(spans)] or [torch.zeros(0, dtype=torch.long)])
    batch.write_rows(layer_idx, rows, entry)


def mla_prefill_decode_graph(
    q: torch.Tensor, kv: torch.Tensor, freqs_cis: torch.Tensor, kv_norm_gamma: torch.Tensor, batch: CacheBatch, layer_idx: int,
    w_k: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor, spec: AttentionSpec | None = None, *, epsilon: float = 1e-6,
    interleaved: bool = True, use_decode_form: bool = False, **spec_kw: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused op in float64: write the cache, rotate q, then either form. ``out [T,H,Dv]``, ``lse``."""
    spec = spec or AttentionSpec.build(**spec_kw)
    write_cache(kv, freqs_cis, kv_norm_gamma, batch, layer_idx, epsilon, interleaved)
    H, L, Dn = w_uk.shape
    qf = q.cpu().to(F64)
    q_rot = torch.cat([qf[..., :Dn], rope(qf[..., Dn:], freqs_cis, token_positions(batch), interleaved)], dim=-1)
    if use_decode_form:
        q_lat = torch.einsum("thd,hld->thl", q_rot[..., :Dn], w_uk.cpu().to(F64))
        out_lat, lse = decode(torch.cat([q_lat, q_rot[..., Dn:]], dim=-1), batch, layer_idx, spec, kv_lora_rank=L)
        return torch.einsum("thl,hvl->thv", out_lat, w_uv.cpu().to(F64)), lse
    return prefill(q_rot, batch, layer_idx, w_k, w_uv, spec)


# Shared-KV (DeepSeek-V4) attention --------------------------------------------------
def _entries(store: Any, b: int, positions: torch.Tensor) -> torch.Tensor:
    """Entries ``positions`` of sequence ``b`` of a V4 ``PagedEntries`` store, float64 ``[n, D]``."""
    ps = store.blocks.shape[1]
    pages = store.block_table[b].long().cpu()[positions // ps]
    return store.blocks.reshape(-1, store.blocks.shape[2])[(pages * ps + positions % ps).to(store.blocks.device)].cpu().to(F64)


def shared_kv_attention(q: torch.Tensor, q_offsets: torch.Tensor, raw: Any, spec: Any,
                        compressed: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """V4 attention in float64 (``openmla.shared_kv_spec`` states the math): per sequence ``b`` and new
    token at position ``t``, keys = raw entries ``t - window < k <= t`` plus compressed entries
    ``w < (t + 1) // rate`` (all of them, or those listed in the query's row of indices), value =
    the whole entry, one softmax with the sink. Returns ``out [T, H, D]``, ``lse [T, H]``."""
    T, H, D = q.shape
    qf = q.cpu().to(F64)
    out = torch.zeros(T, H, D, dtype=F64)
    lse = torch.full((T, H), -math.inf, dtype=F64)
    offs = [int(x) for x in q_offsets.tolist()]
    kv_lens = [int(x) for x in raw.lengths.tolist()]
    ck = spec.compressed
    sink = None if spec.attn_sink is None else spec.attn_sink.cpu().to(F64)
    for b in range(len(offs) - 1):
        n = offs[b + 1] - offs[b]
        for i in range(n):
            row, t = offs[b] + i, kv_lens[b] - n + i
            window = torch.arange(max(0, t - spec.window + 1), t + 1)
            keys = [_entries(raw, b, window)]
            if ck is not None:
                seen = (t + 1) // ck.rate
                if ck.indices is None:
                    picked = torch.arange(seen)
                else:
                    picked = ck.indices[row].long().cpu()
                    picked = picked[(picked >= 0) & (picked < seen)]
                keys.append(_entries(compressed, b, picked))
            k = torch.cat(keys)
            out[row], lse[row] = softmax_combine(spec.scale * (qf[row] @ k.T), k, sink)
    return out, lse
