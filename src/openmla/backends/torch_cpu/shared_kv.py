"""Shared-KV (DeepSeek-V4) attention in plain PyTorch: exact, sync-free, memory bounded by a chunk.

Each chunk of query rows gathers, per query, the raw entries of its sliding window (at most
``plan.window_keys``) and its compressed entries (every entry the causal rule may allow, or its
top-k list), masks what it may not see, and runs one softmax over both sets with the sink in
the denominator. The value is the whole entry (K = V). Work per query is bounded by the window
plus the compressed stream, so memory is ``chunk x (window + compressed) x D``, never O(T^2).
Masked keys are zeroed before the products, so NaN in a free page never reaches an output.
Products and the softmax run in float32, or in float64 for float64 q and entries (as the MLA
path's float64 inputs); a NaN or +inf score makes its row's out and LSE NaN (docs/api.md).
"""

from __future__ import annotations

import torch

from ...shared_kv_spec import physical_rows
from ...workspace import empty_output

# Entries gathered per chunk (chunk rows x keys per row x D): ~16 MB of float32.
CHUNK_ELEMENTS = 1 << 22


def _gather(store, seq: torch.Tensor, entries: torch.Tensor, valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[C, n, D]`` entries ``entries [C, n]`` of sequences ``seq [C]`` in ``dtype``; invalid ones are 0."""
    table = store.block_table
    if table.shape[1] == 0:
        return torch.zeros(*entries.shape, store.blocks.shape[2], dtype=dtype, device=entries.device)
    e = torch.where(valid, entries, torch.zeros_like(entries))
    e = torch.minimum(e, torch.full_like(e, table.shape[1] * store.page_size - 1))
    rows = physical_rows(table, seq[:, None], e, store.page_size)
    rows = torch.where(valid, rows, torch.zeros_like(rows)).clamp_min(0)
    flat = store.blocks.reshape(-1, store.blocks.shape[2])
    keys = flat.index_select(0, rows.reshape(-1)).reshape(*rows.shape, -1).to(dtype)
    return torch.where(valid[..., None], keys, torch.zeros((), dtype=keys.dtype, device=keys.device))


def shared_kv_attention(plan, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [T, H, D]`` -> ``out [T, H, D]`` float32 (float64 for float64 q), ``lse [T, H]``
    float32 (sink left out of the LSE)."""
    spec = plan.spec
    T, H, D = q.shape
    dev = q.device
    cd = torch.float64 if q.dtype == torch.float64 else torch.float32  # the plan made the entries q's dtype
    out = empty_output((T, H, D), cd, dev)
    lse = empty_output((T, H), cd, dev)
    Wk, Nc = plan.window_keys, plan.compressed_keys
    ck = spec.compressed
    keys_per_row = Wk + Nc
    chunk = max(1, CHUNK_ELEMENTS // max(1, keys_per_row * max(D, H)))
    win = torch.arange(Wk, device=dev) - (Wk - 1)  # offsets t-Wk+1 .. t
    all_c = torch.arange(Nc, device=dev)
    sink = spec.attn_sink.to(dev, cd) if spec.attn_sink is not None else None
    for r0 in range(0, T, chunk):
        r1 = min(T, r0 + chunk)
        seq, pos = plan.token_seq[r0:r1], plan.token_pos[r0:r1]
        kpos = pos[:, None] + win[None, :]
        kvalid = (kpos >= 0) & (kpos > pos[:, None] - spec.window)
        keys = _gather(plan.raw, seq, kpos, kvalid, cd)
        valid = kvalid
        if ck is not None and Nc > 0:
            limit = torch.div(pos + 1, ck.rate, rounding_mode="floor")[:, None]  # entries w < (t+1)//rate
            if ck.indices is None:
                ents = all_c[None, :].expand(r1 - r0, Nc)
            else:
                ents = ck.indices[r0:r1].long()
            cvalid = (ents >= 0) & (ents < limit)
            keys = torch.cat([keys, _gather(plan.compressed, seq, ents, cvalid, cd)], dim=1)
            valid = torch.cat([valid, cvalid], dim=1)
        qc = q[r0:r1].to(cd)
        scores = torch.einsum("chd,cnd->chn", qc, keys) * spec.scale
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
        m = scores.amax(dim=2)
        m = m.masked_fill(m == float("-inf"), 0.0)  # no key: any finite reference; NaN / +inf stay (a NaN row)
        p = torch.exp(scores - m[..., None])
        den = p.sum(dim=2)
        lse[r0:r1] = m + torch.log(den)
        if sink is not None:
            den = den + torch.exp(sink[None, :] - m)
        o = torch.einsum("chn,cnd->chd", p, keys)
        out[r0:r1] = o / torch.where(den == 0, torch.ones_like(den), den)[..., None]
    return out, lse.float()
