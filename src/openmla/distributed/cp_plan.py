"""One step of context-parallel attention: plan once per step, run per layer.

On each CP rank, for every layer (``ContextParallelPlan.run``):

1. the cache write stores only the tokens this rank holds (at their local positions, keys
   rotated at their global positions through ``ContextParallelCache.local_freqs``);
2. every rank has all T queries (q is replicated over the CP group) and rotates them at their
   global positions;
3. the queries attend, in the absorbed form, over this rank's keys only, with global-position
   semantics: for each query the plan lists the physical rows of the local keys it sees (the
   mask's visible interval ``[lo, hi)`` is the local interval ``[count(lo), count(hi))``; logical
   sparse indices keep the entries this rank holds), padded with -1, and runs
   ``MLAPlan.decode`` with physical sparse indices over them, which returns each part's LSE;
4. the partial outputs are merged over the CP group by LSE: an all-gather of the ``[T, H]``
   LSEs, then an all-reduce (sum) of each part's ``[T, H, Dv]`` output weighted by
   ``exp(lse_rank - lse_total)`` (cheaper than gathering every part: ``2 (cp-1)/cp`` of one part
   sent per rank, not ``cp - 1``); the attention sink is applied once, after the merge.

Prefill under CP runs this absorbed form with per-token key gathers: exact and bounded in memory
(the row lists are built in query chunks of at most ``ENTRY_BUDGET`` entries), but slower than
the dense prefill kernel. Making the kernels read a key-position map is the way to speed it up.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .. import combine
from ..cache import CacheBatch, HostLists
from ..planning import MLAPlan, Step, plan as make_plan
from ..rope import apply_rope
from ..weights import LayerWeights
from .cp import ContextParallelBatch, ContextParallelCache
from .groups import Grid, agree, fingerprint

# Row-list entries built at once (16 MiB of int32): bounds a long prefill's index memory.
ENTRY_BUDGET = 1 << 22
# Row lists of up to this many entries in all are kept for every layer of the step; longer
# ones (long prefills) are rebuilt per layer, chunk by chunk, so memory stays one chunk.
KEEP_BUDGET = 1 << 24


def plan(batch: ContextParallelBatch, *, scale: float, **options: Any) -> "ContextParallelPlan | MLAPlan":
    """Validate one step of a ``ContextParallelCache`` on every rank and precompute what every layer
    shares (once per step; every rank calls it together).

    Takes ``openmla.plan``'s keywords (``mask``, ``window_size``, ``chunk_size``,
    ``sparse_indices``, ``topk_lengths``, ``physical_indices``, ``attn_sink``,
    ``num_partitions``, ``backend``, ...), with global meaning: query positions, masks and
    logical sparse indices are positions in the whole sequence. With ``cp == 1`` it returns
    the plain ``MLAPlan`` of the local cache; otherwise a ``ContextParallelPlan``. Sparse
    indices under ``cp > 1`` must be logical positions (``physical_indices=False``): physical
    rows name storage of one rank. Ends with ``agree``: a bad input on any rank raises on all.
    """
    if not isinstance(batch, ContextParallelBatch):
        raise ValueError(f"batch: expected a ContextParallelBatch (ContextParallelCache.prepare), got {type(batch).__name__}")
    cache = batch.cache
    grid = cache.grid
    error, check = None, 0
    result: Any = None
    try:
        if grid.cp == 1:
            result = make_plan(batch.local, scale=scale, **options)
        else:
            if options.get("sparse_indices") is not None and options.get("physical_indices", True):
                raise ValueError("physical_indices: under context parallelism sparse indices must be logical positions "
                                 "(physical_indices=False); physical rows name one rank's storage")
            if options.get("max_pages") is not None:
                raise ValueError("max_pages: a context-parallel plan cannot be refilled (no CUDA-graph replay yet)")
            opts = dict(options, physical_indices=False)
            view = make_plan(_global_view(batch), scale=scale, **opts)  # validates every option, global positions
            write = make_plan(batch.local, scale=scale, backend=options.get("backend"))
            result = (view, write)
        check = fingerprint("plan", batch.seq_ids, batch.new_tokens, scale,
                            sorted((k, v if not isinstance(v, torch.Tensor) else tuple(v.shape)) for k, v in options.items()))
    except Exception as exc:  # every rank must hear of it: raised below by agree
        error = exc
    agree(grid, error, check)
    if grid.cp == 1:
        return result
    return ContextParallelPlan(cache, batch, *result)


def _global_view(batch: ContextParallelBatch) -> CacheBatch:
    """The step as if one cache held every token: global lengths and offsets over this rank's
    storage with an all-zero page table. Only for validation and global token positions; the
    plan made from it never touches the cache."""
    local = batch.local
    device = local.blocks.device
    width = max(1, -(-max(batch.seq_lens, default=0) // local.page_size))
    offsets = [0]
    for n in batch.new_tokens:
        offsets.append(offsets[-1] + n)
    view = dataclasses.replace(
        local,
        block_table=torch.zeros(batch.batch_size, width, dtype=torch.int32, device=device),
        cache_lengths=torch.tensor(batch.cache_lengths, dtype=torch.int32, device=device),
        input_row_offsets=torch.tensor(offsets, dtype=torch.int32, device=device),
        _host=HostLists(),  # its own host state (replace would share the local batch's)
    )
    return view


class ContextParallelPlan(Step):
    """One validated step of context-parallel attention (see the module doc); make it with
    ``ContextParallelCache.plan``. Per layer: ``run`` (the fused op, with the merge over the CP
    group). Attributes: ``spec`` (the step's ``AttentionSpec``, global meaning), ``num_tokens``,
    ``max_position`` (rope rows the step needs), ``token_seq`` / ``token_pos`` (int64 ``[T]``,
    global positions), ``own_rows`` (int64 ``[T_own]``: the query rows whose tokens this rank
    stores), ``grid``.
    """

    def __init__(self, cache: ContextParallelCache, batch: ContextParallelBatch, view: MLAPlan, write: MLAPlan) -> None:
        self.cache = cache
        self.batch = batch
        self.grid: Grid = cache.grid
        self.layout = cache.layout
        self.view = view
        self.write = write
        self.spec = view.spec
        self.backend_name = view.backend_name
        self.num_partitions = view.num_partitions
        self.num_tokens = view.num_tokens
        self.max_position = view.max_position
        self.token_seq, self.token_pos = view.token_seq, view.token_pos
        device = batch.local.blocks.device
        self.own_rows = torch.nonzero(self.layout.owner(self.token_pos) == self.layout.rank).flatten().to(device)
        self.kv_rows = self.own_rows  # Step: a layer projects only these rows' kv
        self._table = batch.local.block_table.to(device, torch.int64)
        self._offsets = view.batch.input_row_offsets.to(torch.int64)
        self._setup_lists()

    def __repr__(self) -> str:
        return (f"ContextParallelPlan(cp={self.grid.cp}, cp_rank={self.grid.cp_rank}, tokens={self.num_tokens}, "
                f"own={self.own_rows.numel()}, chunks={len(self._chunks)}, mask={self.spec.mask.kind.value}, "
                f"sparse={self.spec.sparse is not None})")

    # Row lists: the physical rows of the local keys each query sees ------------------------------------
    def _setup_lists(self) -> None:
        """Per-query local key intervals (dense) or the sparse width, and the query chunks."""
        T, spec = self.num_tokens, self.spec
        seq, pos = self.token_seq, self.token_pos
        if spec.sparse is None:
            lens = torch.tensor(self.batch.seq_lens, dtype=torch.int64, device=pos.device)[seq]
            lo, hi = spec.mask.key_range(pos, pos, lens)
            lo = torch.as_tensor(lo, dtype=torch.int64, device=pos.device).expand_as(pos)
            self._lo, self._hi = self.layout.count(lo), self.layout.count(hi)
            width = int((self._hi - self._lo).max()) if T else 0
        else:
            width = spec.sparse.stride
            if spec.sparse.topk_lengths is not None and spec.sparse.topk_lengths.numel():
                width = min(width, int(spec.sparse.topk_lengths.max()))
        self._width = width
        rows = max(1, ENTRY_BUDGET // max(width, 1))
        self._chunks = [(t0, min(T, t0 + rows)) for t0 in range(0, T, rows)]
        self._keep = T * width <= KEEP_BUDGET
        self._plans: dict[int, MLAPlan] = {}

    def _rows(self, t0: int, t1: int) -> torch.Tensor:
        """int32 ``[t1-t0, n]``: physical rows of the local keys queries ``t0:t1`` see, -1 padded."""
        seq, ps = self.token_seq[t0:t1], self.cache.page_size
        sparse = self.spec.sparse
        if sparse is None:
            lo, hi = self._lo[t0:t1], self._hi[t0:t1]
            n = max(1, int((hi - lo).max()))
            j = lo[:, None] + torch.arange(n, device=lo.device)[None, :]
            valid = j < hi[:, None]
        else:
            idx = sparse.indices[t0:t1, : self._width].to(torch.int64)
            valid = idx >= 0
            if sparse.topk_lengths is not None:
                slot = torch.arange(idx.shape[1], device=idx.device)
                valid &= slot[None, :] < sparse.topk_lengths.to(torch.int64)[seq][:, None]
            valid &= self.layout.owner(idx) == self.layout.rank
            valid &= self.spec.mask.visible(self.token_pos[t0:t1, None], idx)
            # This rank's entries first, then cut the width to the most any query keeps.
            order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)
            idx, valid = idx.gather(1, order), valid.gather(1, order)
            n = max(1, int(valid.sum(1).max()) if valid.numel() else 0)
            idx, valid = idx[:, :n], valid[:, :n]
            j = self.layout.count(torch.where(valid, idx, 0))
        j = torch.where(valid, j, 0)
        rows = self._table[seq[:, None], j // ps] * ps + j % ps
        return torch.where(valid, rows, -1).to(torch.int32)

    def _chunk_plan(self, i: int) -> MLAPlan:
        """The attention plan of query chunk ``i``: physical row lists over this rank's storage."""
        plan = self._plans.get(i)
        if plan is not None:
            return plan
        t0, t1 = self._chunks[i]
        local = self.batch.local
        B, ps = self.batch.batch_size, local.page_size
        offsets = (self._offsets - t0).clamp(0, t1 - t0).to(torch.int32)
        view = dataclasses.replace(
            local,
            block_table=torch.zeros(B, max(1, -(-(t1 - t0) // ps)), dtype=torch.int32, device=local.blocks.device),
            cache_lengths=torch.zeros(B, dtype=torch.int32, device=local.blocks.device),
            input_row_offsets=offsets.to(local.blocks.device),
            _host=HostLists(),
        )
        plan = make_plan(view, scale=self.spec.scale, sparse_indices=self._rows(t0, t1), physical_indices=True,
                         num_partitions=self.num_partitions, backend=self.backend_name)
        if self._keep:
            self._plans[i] = plan
        return plan

    # The fused op, per layer --------------------------------------------------------------------------
    def run(self, q: torch.Tensor, kv: torch.Tensor, layer_idx: int, weights: LayerWeights, freqs_cis: torch.Tensor, *,
            q_scale: torch.Tensor | float | None = None, attn_sink: torch.Tensor | None = None, return_lse: bool = False):
        """``MLAPlan.run`` over the CP group: ``q [T, H, Dn+R]`` (all T query rows, the same on
        every CP rank), ``kv [T, L+R]`` or only the rows this rank stores (``[len(kv_rows), L+R]``,
        which saves projecting the others), ``weights`` as ``MLAPlan.run``. Returns the merged
        ``out [T, H, Dv]`` in q's dtype (and float32 ``lse [T, H]``), the same on every CP rank.
        ``weights.w_k`` is unused (the absorbed form runs). Every CP rank must call it, in the same order."""
        if q_scale is not None:
            raise ValueError("q_scale: float8 queries are not supported under context parallelism")
        T = self.num_tokens
        if not isinstance(q, torch.Tensor) or q.dim() != 3 or q.shape[0] != T or not q.dtype.is_floating_point:
            raise ValueError(f"q: expected a float tensor [{T}, H, Dn+R], got {tuple(q.shape) if isinstance(q, torch.Tensor) else q!r}")
        for name, t, rank in (("kv", kv, 2), ("freqs_cis", freqs_cis, 2)):
            if not isinstance(t, torch.Tensor) or t.dim() != rank:
                raise ValueError(f"{name}: expected a rank-{rank} tensor, got {tuple(t.shape) if isinstance(t, torch.Tensor) else t!r}")
        if not isinstance(weights, LayerWeights):
            raise ValueError(f"weights: expected a LayerWeights, got {type(weights).__name__}")
        H, L, Dn = q.shape[1], weights.kv_lora_rank, weights.qk_nope_head_dim
        if weights.num_heads != H:
            raise ValueError(f"weights: {weights.num_heads} heads, q has {H}")
        kv_norm_gamma, w_uk, w_uv = weights.kv_norm_gamma, weights.w_uk, weights.w_uv
        n_own = self.own_rows.numel()
        if kv.shape[0] == T:
            kv = kv.index_select(0, self.own_rows.to(kv.device))
        elif kv.shape[0] != n_own:
            raise ValueError(f"kv: expected {T} rows (every query) or {n_own} (this rank's), got {kv.shape[0]}")
        if self.max_position > freqs_cis.shape[0]:
            raise ValueError(f"freqs_cis: has {freqs_cis.shape[0]} positions, the batch reaches position {self.max_position - 1}")
        sink = self.spec.attn_sink if attn_sink is None else attn_sink
        if sink is not None and (not isinstance(sink, torch.Tensor) or sink.shape[-1] != H):
            raise ValueError(f"attn_sink: expected {H} heads, got {tuple(sink.shape) if isinstance(sink, torch.Tensor) else sink!r}")
        # 1. cache write of this rank's tokens (q here is a one-head stand-in: its rotation is not used)
        self.write.write_cache(q[:, :1].index_select(0, self.own_rows.to(q.device)), kv, self.cache.local_freqs(freqs_cis),
                               kv_norm_gamma, layer_idx, epsilon=weights.epsilon, rope_interleaved=weights.rope_interleaved)
        # 2. every query rotated at its global position, absorbed
        q_rot = q.clone()
        q_rot[..., Dn:] = apply_rope(q[..., Dn:], freqs_cis, self.token_pos.to(q.device), weights.rope_interleaved)
        q_abs = combine.absorb(q_rot, w_uk)
        # 3. attention over this rank's keys, by query chunk
        wide = torch.float64 if q.dtype == torch.float64 else torch.float32
        out = torch.empty(T, H, w_uv.shape[1], dtype=wide, device=q.device)
        lse = torch.empty(T, H, dtype=torch.float32, device=q.device)
        for i, (t0, t1) in enumerate(self._chunks):
            o_lat, lse[t0:t1] = self._chunk_plan(i).decode(q_abs[t0:t1], layer_idx, kv_lora_rank=L, return_lse=True)
            out[t0:t1] = combine.unabsorb(o_lat, w_uv)
        # 4. LSE merge over the CP group, then the sink once
        out, lse = merge_over_cp(self.grid, out, lse)
        if sink is not None:
            combine.apply_sink(out, lse, sink, self.token_seq.to(out.device))
        out = out.to(q.dtype)
        return (out, lse) if return_lse else out


def merge_over_cp(grid: Grid, out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge each CP rank's partial attention ``out [T, H, D]`` (over its keys) with natural-log
    ``lse [T, H]`` (-inf: no key) into the attention over every rank's keys, on every rank.

    All-gather the LSEs, then all-reduce ``out * exp(lse - lse_total)``: the same sum as merging
    the parts pairwise (``combine.merge_states``), at the traffic of one all-reduce. Returns the
    merged ``out`` (float32, float64 for float64 input) and ``lse`` (float32); rows without any key
    give 0 and -inf.
    """
    wide = torch.float64 if out.dtype == torch.float64 else torch.float32
    lses = grid.cp_all_gather(lse.float())  # [cp, T, H]
    total = torch.logsumexp(lses, dim=0)
    seen = torch.isfinite(lse)
    weight = torch.where(seen, torch.exp(lse.to(wide) - total.to(wide).masked_fill(~seen, 0.0)), 0.0)
    part = torch.where(seen[..., None], out.to(wide) * weight[..., None], 0.0)
    return grid.cp_all_reduce(part), total
