"""DeepSeek-V3.2's top-k indexer (DeepSeek Sparse Attention) over the paged cache.

Every attention layer of a V3.2 model picks, for each new token, the ``index_topk`` keys its
attention reads: per-head queries ``q_h`` from the query latent, one key ``k_t`` per token
(LayerNorm, then half-split rope on the first ``qk_rope_head_dim`` values), and

    score_t = sum_h w_h * relu(scale * q_h . k_t),   w = weights_proj(hidden) / sqrt(heads)

over the keys the causal mask shows; the top ``index_topk`` scores win (all visible keys when
fewer). transformers' ``DeepseekV32Indexer`` holds the weights; here its keys live in a paged
store beside the latent cache (the same pages and rows), and the selection of one packed ragged
step comes back as logical positions (-1 = unused) for ``MLAPlan.with_sparse``.

Other families' indexers differ in where the rope sits and how it pairs values, and in where the
scale is applied (``IndexerSpec``): GLM-5 rotates even/odd pairs; Hunyuan V4 ropes the last
``qk_rope_head_dim`` values, keeps its key norm in float32 and scales the head weights instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..planning import MLAPlan
from .families.family import IndexerSpec

INDEXER_PARTS = ("wq_b", "wk", "k_norm", "weights_proj")
_SCORE_BUDGET = 1 << 22  # float32 scores held at once per chunk of query rows (16 MiB): no [T, T] tensor


POOL_PARTS = ("index_kpool", "index_kpool_always_select_tail", "index_kpool_compress_ape", "index_kpool_compress_gate")


def check_pooled(module: nn.Module, where: str) -> None:
    """``ValueError`` unless ``module`` is a k-pool indexer (GLM-5-Next's) of the form ``select_pooled`` runs."""
    missing = [n for n in POOL_PARTS if not hasattr(module, n)]
    if missing:
        raise ValueError(f"{where} ({type(module).__name__}) is not a k-pool indexer: no {missing}")
    P, D = module.index_kpool, module.head_dim
    if isinstance(P, bool) or not isinstance(P, int) or P < 1 or int(module.index_topk) % P:
        raise ValueError(f"{where}.index_kpool is {P!r} for index_topk {module.index_topk} (a divisor >= 1 needed)")
    if not isinstance(module.index_kpool_always_select_tail, bool):
        raise ValueError(f"{where}.index_kpool_always_select_tail is {module.index_kpool_always_select_tail!r}, not a bool")
    if module.qk_rope_head_dim != 0:
        raise ValueError(f"{where} ropes {module.qk_rope_head_dim} values; the k-pool indexer reproduced has no rope")
    if tuple(module.index_kpool_compress_ape.shape) != (P, D) or tuple(module.index_kpool_compress_gate.shape) != (D, module.hidden_size):
        raise ValueError(f"{where}: its pool gate parameters are not [index_kpool, head_dim] and [head_dim, hidden]")


def pooled_width(module: nn.Module) -> int:
    """Slots per token of a k-pool indexer's picks: ``index_topk`` (whole pools) plus the open tail pool's at most P-1."""
    return int(module.index_topk) + (module.index_kpool - 1 if module.index_kpool_always_select_tail else 0)


def check_indexer(module: nn.Module, where: str, spec: IndexerSpec = IndexerSpec()) -> None:
    """``ValueError`` unless ``module`` looks like transformers' ``DeepseekV32Indexer`` (with the parts
    ``spec`` reads: ``q_input_norm``, ``softmax_scaling``, ``use_rope``)."""
    parts = INDEXER_PARTS + (("q_input_norm",) if spec.query_from == "hidden" else ()) + (
        ("softmax_scaling",) if spec.query_scale else ())
    missing = [n for n in parts if not isinstance(getattr(module, n, None), nn.Module)]
    missing += [n for n in ("n_heads", "head_dim", "index_topk", "qk_rope_head_dim", "softmax_scale") if not hasattr(module, n)]
    if missing:
        raise ValueError(f"{where} ({type(module).__name__}) is not a DeepSeek-V3.2 indexer: no {missing}")
    if module.qk_rope_head_dim % 2 or module.qk_rope_head_dim > module.head_dim:
        raise ValueError(f"{where} has rope width {module.qk_rope_head_dim} for keys of {module.head_dim}")
    if spec.rope_by_layer and getattr(module, "use_rope", None) not in (0, 1):  # True/False compare equal to 1/0
        raise ValueError(f"{where}.use_rope is {getattr(module, 'use_rope', None)!r}, not 0 or 1")
    if spec.query_scale:
        got = {n: tuple(p.shape) for n, p in module.softmax_scaling.named_parameters()}
        if got != {"scale": (module.n_heads,), "bias": (module.n_heads,)}:
            raise ValueError(f"{where}.softmax_scaling holds {got}; a per-head query scale has scale and bias of "
                             f"({module.n_heads},)")


@dataclass
class IndexStep:
    """What every layer's selection shares in one step (made once per step by ``build``).

    - ``key_rows``: int64 ``[sum of sequence lengths]`` physical rows of every sequence's keys,
      sequence after sequence, positions in order;
    - ``spans``: per sequence with new tokens ``(t0, t1, k0, k1, p0)``: its rows ``[t0, t1)`` of
      the step, its keys ``key_rows[k0:k1]``, the position of row ``t0``;
    - ``write_rows``: int64 ``[T]`` physical row of every new token (the plan's);
    - ``stride``: slots per token, ``min(index_topk, longest sequence)``.
    """

    key_rows: torch.Tensor
    spans: list[tuple[int, int, int, int, int]]
    write_rows: torch.Tensor
    stride: int

    @classmethod
    def build(cls, plan: MLAPlan, index_topk: int) -> "IndexStep":
        b = plan.batch
        lens = torch.tensor(b.seq_lens_list, dtype=torch.long)
        total = int(lens.sum())
        seq = torch.repeat_interleave(torch.arange(b.batch_size), lens)
        starts = torch.cumsum(lens, 0) - lens
        pos = torch.arange(total) - starts.repeat_interleave(lens)
        key_rows = b.physical_rows(seq.to(b.block_table.device), pos.to(b.block_table.device))
        spans = []
        for s, (t0, t1, n, c) in enumerate(zip(b.offsets_list[:-1], b.offsets_list[1:], b.seq_lens_list, b.cache_lengths_list)):
            if t1 > t0:
                k0 = int(starts[s])
                spans.append((t0, t1, k0, k0 + n, c))
        return cls(key_rows, spans, plan.write_rows, max(1, min(index_topk, max(b.seq_lens_list, default=1))))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope: int, spec: IndexerSpec) -> torch.Tensor:
    """Rotate the ``rope`` values of ``x [..., D]`` (the first or last ones, per ``spec``) with
    transformers' arithmetic; ``cos``/``sin`` are its ``cat(freqs, freqs)`` tables, broadcast."""
    if spec.rope_at == "head":
        rot, rest = x[..., :rope], x[..., rope:]
    else:
        rest, rot = x[..., : x.shape[-1] - rope], x[..., x.shape[-1] - rope:]
    half = rope // 2
    if spec.rope_layout == "half":
        turned = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
        rot = rot * cos + turned * sin
    else:  # even/odd pairs, written back as [rotated evens, rotated odds] as transformers does (q and k alike)
        c, s = cos[..., :half], sin[..., :half]
        a, b = rot[..., 0::2], rot[..., 1::2]
        rot = torch.cat((a * c - b * s, b * c + a * s), dim=-1)
    return torch.cat((rot, rest) if spec.rope_at == "head" else (rest, rot), dim=-1)


@torch.no_grad()
def select_keys(indexer: nn.Module, keys: torch.Tensor, step: IndexStep, hidden: torch.Tensor, q_resid: torch.Tensor | None,
                cos: torch.Tensor, sin: torch.Tensor, spec: IndexerSpec = IndexerSpec(),
                positions: torch.Tensor | None = None) -> torch.Tensor:
    """Write this step's index keys into ``keys [rows, head_dim]`` (one layer's store) and return
    int32 ``[T, step.stride]``: the logical key positions each new token attends to, -1 in unused
    slots. ``hidden [T, hidden]`` and ``q_resid [T, q_lora_rank]`` are the layer's inputs (``q_resid``
    None when ``spec.query_from`` is ``"hidden"``); ``cos``/``sin [T, rope]`` the model's rotary tables at
    the tokens' positions; ``spec`` the indexer's form; ``positions`` int64 ``[T]`` the tokens' positions
    (read by ``spec.query_scale``)."""
    T = hidden.shape[0]
    H, D, R = indexer.n_heads, indexer.head_dim, indexer.qk_rope_head_dim
    if spec.rope_by_layer and not indexer.use_rope:  # a NoPE layer's indexer rotates nothing (Mistral Large 4)
        R = 0
    q_in = q_resid if spec.query_from == "q_latent" else indexer.q_input_norm(hidden)
    q = indexer.wq_b(q_in).view(T, H, D)
    if spec.query_scale:  # the module itself, on transformers' [B, S, H, D] layout, before the rope
        q = indexer.softmax_scaling(q[None], positions[None], head_dim_first=False)[0]
    k = indexer.k_norm(indexer.wk(hidden).to(indexer.k_norm.weight.dtype)).to(hidden.dtype)  # a float32 norm stays float32
    if R:
        q = _rope(q, cos[:, None], sin[:, None], R, spec)
        k = _rope(k, cos, sin, R, spec)
    keys[step.write_rows] = k.to(keys.dtype)
    weights = indexer.weights_proj(hidden.to(indexer.weights_proj.weight.dtype)).float() * H**-0.5  # [T, H]
    if spec.scale_in_weights:
        weights = weights * indexer.softmax_scale
    score_scale = 1.0 if spec.scale_in_weights else indexer.softmax_scale
    out = torch.full((T, step.stride), -1, dtype=torch.int32, device=hidden.device)
    for t0, t1, k0, k1, p0 in step.spans:
        n = k1 - k0
        seq_keys = keys[step.key_rows[k0:k1]].float().T  # [D, n]
        key_pos = torch.arange(n, device=hidden.device)
        rows = max(1, _SCORE_BUDGET // (H * n))
        for a in range(t0, t1, rows):
            b = min(t1, a + rows)
            seen = min(n, p0 + (b - t0))  # keys past the chunk's last position are masked for all its rows
            scores = torch.matmul(q[a:b].float(), seq_keys[:, :seen])  # [c, H, seen]
            if score_scale != 1.0:
                scores.mul_(score_scale)
            scores.relu_()
            total = torch.matmul(weights[a:b, None, :], scores)[:, 0]  # [c, seen]
            q_pos = p0 + (a - t0) + torch.arange(b - a, device=hidden.device)
            total.masked_fill_(key_pos[None, :seen] > q_pos[:, None], float("-inf"))
            kk = min(step.stride, seen)
            best, picked = total.topk(kk, dim=-1, sorted=False)  # a set: its order does not matter
            out[a:b, :kk] = picked.to(torch.int32).masked_fill_(best == float("-inf"), -1)
    return out


@torch.no_grad()
def select_pooled(indexer: nn.Module, store: torch.Tensor, step: IndexStep, hidden: torch.Tensor,
                  q_resid: torch.Tensor) -> torch.Tensor:
    """GLM-5-Next's k-pool selection (transformers' ``Glm5NextTextIndexer``) over one layer's store.

    Writes this step's rows ``[key, gate scores]`` into ``store [rows, 2 * head_dim]`` and returns int32
    ``[T, step.stride]`` logical positions (-1: unused). Per sequence with n keys: pool j is positions
    ``[jP, (j+1)P)`` for every complete group (``j < n // P``); its candidate key is
    ``sum_i softmax_i(gate_i + ape_i) * key_i`` (softmax over the pool's P tokens, per channel);
    a query at position p scores the pools that end at or before p as ``sum_h w_h relu(scale q_h . pool)``,
    takes the best ``index_topk // P`` of them (all when fewer), expands them to their positions, and
    adds its open tail ``[p + 1 - (p + 1) % P, p]`` when ``index_kpool_always_select_tail``."""
    T = hidden.shape[0]
    H, D, P = indexer.n_heads, indexer.head_dim, indexer.index_kpool
    q = indexer.wq_b(q_resid).view(T, H, D)
    k = indexer.k_norm(indexer.wk(hidden))
    gate = F.linear(hidden, indexer.index_kpool_compress_gate)
    store[step.write_rows] = torch.cat([k, gate], dim=-1).to(store.dtype)
    weights = indexer.weights_proj(hidden.to(indexer.weights_proj.weight.dtype)).float() * H**-0.5  # [T, H]
    ape = indexer.index_kpool_compress_ape.float()
    pick = int(indexer.index_topk) // P
    tail = indexer.index_kpool_always_select_tail
    out = torch.full((T, step.stride), -1, dtype=torch.int32, device=hidden.device)
    offsets = torch.arange(P, device=hidden.device)
    for t0, t1, k0, k1, p0 in step.spans:
        n = k1 - k0
        q_pos = p0 + torch.arange(t1 - t0, device=hidden.device)
        parts = []
        pools = n // P
        kk = min(pick, pools)
        if kk:
            rows = store[step.key_rows[k0:k0 + pools * P]].view(pools, P, 2 * D)
            keys, gates = rows[..., :D], rows[..., D:]
            probs = (gates.float() + ape).softmax(dim=1).to(keys.dtype)
            pooled = (probs * keys).sum(dim=1)  # [pools, D], as transformers pools (in the keys' dtype)
            scores = torch.matmul(q[t0:t1].float(), pooled.T.float()).mul_(indexer.softmax_scale).relu_()  # [c, H, pools]
            total = torch.matmul(weights[t0:t1, None, :], scores)[:, 0]  # [c, pools]
            ends = (torch.arange(pools, device=hidden.device) + 1) * P - 1
            total.masked_fill_(ends[None, :] > q_pos[:, None], float("-inf"))  # a pool is seen once its last token is
            best, chosen = total.topk(kk, dim=-1, sorted=False)  # a set: its order does not matter
            positions = chosen[..., None] * P + offsets  # [c, kk, P]
            parts.append(positions.masked_fill_((best == float("-inf"))[..., None], -1).flatten(1))
        if tail and P > 1:
            count = (q_pos + 1) % P
            start = q_pos + 1 - count
            spots = start[:, None] + offsets[None, : P - 1]
            parts.append(spots.masked_fill_(offsets[None, : P - 1] >= count[:, None], -1))
        if parts:
            picks = torch.cat(parts, dim=1)
            picks = picks.sort(dim=1, descending=True).values[:, : step.stride]  # the used slots first (at most stride)
            out[t0:t1, : picks.shape[1]] = picks.to(torch.int32)
    return out
