"""DeepSeek-V4's compressors and indexer with their running state kept per sequence by openmla.

transformers keeps a compressor's state (the open window's projected tokens and gates, CSA's
overlap slice, the count of entries emitted) in its per-batch cache layer; under continuous
batching every sequence has its own, so ``compress`` takes one sequence's new tokens and its
state dict and returns the entries its closed windows emit. The parameters are the adopted
modules' own (``kv_proj``, ``gate_proj``, ``position_bias``, ``kv_norm``, ``rotary_emb``); the
arithmetic is transformers' (``DeepseekV4HCACompressor`` / ``DeepseekV4CSACompressor`` /
``DeepseekV4Indexer``), op for op, so the entries are the same numbers.

``top_k`` is the lightning indexer's pick for one sequence's queries: scores from the adopted
``scorer`` over that sequence's indexer keys, entries the causal rule hides masked, the top
``min(index_topk, entries)``, picks past the rule set to -1 (as transformers). Among exactly
tied scores (ReLU zeroes every head's product of an entry) ``torch.topk``'s choice depends on
the row's length, so transformers' pick can change with how a prompt is split; openmla takes
the lowest entries, the same for any split. Query rows go in
chunks, so the score tensor is ``chunk x heads x entries``, not ``T x heads x T / rate``.
"""

from __future__ import annotations

import torch
from torch import nn

SCORE_ROWS = 256  # query rows per indexer scoring chunk


def _rope():
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb

    return apply_rotary_pos_emb


def compress(module: nn.Module, hidden: torch.Tensor, state: dict, rate: int, head_dim: int, overlap: bool) -> torch.Tensor:
    """One sequence's new tokens ``hidden [n, hidden]`` -> the entries their closed windows emit
    ``[n_windows, head_dim]`` (normed, rotated at ``w * rate``); ``state`` is updated in place."""
    kv = module.kv_proj(hidden)
    gate = module.gate_proj(hidden)
    if "buffer_kv" in state:
        kv = torch.cat([state["buffer_kv"], kv], dim=0)
        gate = torch.cat([state["buffer_gate"], gate], dim=0)
    usable = (kv.shape[0] // rate) * rate
    state["buffer_kv"], state["buffer_gate"] = kv[usable:].clone(), gate[usable:].clone()  # not views of the step's projections
    first = state.get("count", 0) * rate
    n_windows = usable // rate
    if n_windows == 0:
        return kv.new_zeros((0, head_dim))
    chunk_kv = kv[:usable].view(n_windows, rate, -1)
    chunk_gate = gate[:usable].view(n_windows, rate, -1) + module.position_bias
    if overlap:  # CSA: entry w pools window w-1's first half (Ca) with window w's second half (Cb)
        new_kv = chunk_kv.new_zeros((n_windows, 2 * rate, head_dim))
        new_gate = chunk_gate.new_full((n_windows, 2 * rate, head_dim), float("-inf"))
        new_kv[:, rate:] = chunk_kv[..., head_dim:]
        new_gate[:, rate:] = chunk_gate[..., head_dim:]
        if n_windows > 1:
            new_kv[1:, :rate] = chunk_kv[:-1, :, :head_dim]
            new_gate[1:, :rate] = chunk_gate[:-1, :, :head_dim]
        prior = state.get("overlap_kv"), state.get("overlap_gate")
        state["overlap_kv"] = chunk_kv[-1, :, :head_dim].clone()
        state["overlap_gate"] = chunk_gate[-1, :, :head_dim].clone()
        if prior[0] is not None:
            new_kv[0, :rate] = prior[0].to(new_kv.dtype)
            new_gate[0, :rate] = prior[1].to(new_gate.dtype)
        chunk_kv, chunk_gate = new_kv, new_gate
    pooled = module.kv_norm((chunk_kv * chunk_gate.softmax(dim=1, dtype=torch.float32).to(chunk_kv.dtype)).sum(dim=1))
    positions = (torch.arange(n_windows, device=pooled.device) * rate + first)[None]
    cos, sin = module.rotary_emb(pooled, position_ids=positions, layer_type="compress")
    state["count"] = state.get("count", 0) + n_windows
    return _rope()(pooled[None, None], cos, sin)[0, 0]


def top_k(indexer: nn.Module, hidden: torch.Tensor, q_residual: torch.Tensor, positions: torch.Tensor,
          keys: torch.Tensor, rate: int) -> torch.Tensor:
    """int64 ``[n, min(index_topk, entries)]`` picks of one sequence's queries (-1: none) over
    its indexer keys ``keys [entries, index_head_dim]``."""
    n = hidden.shape[0]
    entries = keys.shape[0]
    k = min(int(indexer.index_topk), entries)
    out = torch.full((n, k), -1, dtype=torch.int64, device=hidden.device)
    if k == 0 or n == 0:
        return out
    rope = _rope()
    ids = torch.arange(entries, device=hidden.device)
    for r0 in range(0, n, SCORE_ROWS):
        r1 = min(n, r0 + SCORE_ROWS)
        pos = positions[r0:r1][None]
        cos, sin = indexer.rotary_emb(hidden[None, r0:r1], position_ids=pos, layer_type="compress")
        q = indexer.q_b_proj(q_residual[r0:r1]).view(1, r1 - r0, -1, indexer.head_dim).transpose(1, 2)
        q = rope(q, cos, sin).transpose(1, 2)
        scores = indexer.scorer(q, keys[None], hidden[None, r0:r1])[0]  # [rows, entries]
        limit = torch.div(pos[0] + 1, rate, rounding_mode="floor")[:, None]
        scores = scores.masked_fill(ids[None, :] >= limit, float("-inf"))
        picks = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]  # exact ties: the lowest entry
        out[r0:r1] = torch.where(picks >= limit, torch.full_like(picks, -1), picks)
    return out
