"""Plan once per step, run per layer.

``openmla.plan(batch, scale=..., ...)`` does the host work a batch step needs once: it takes
private copies of the batch's metadata (so editing the batch afterwards changes nothing the
kernels read), validates every argument that is the same for every layer, picks the decode or
prefill form and the backend (recorded on the plan: ``plan.backend_name`` is what runs), and
precomputes what every layer shares (token positions, the physical rows of the cache write, the
prefill chunk plan). ``plan.run(...)`` is then called once per layer with that layer's tensors;
it checks only shapes, dtypes and devices (O(1)), never reads a tensor's values on the host and
never syncs with a device.

    plan = openmla.plan(batch, scale=cfg.softmax_scale)          # once per step
    for i in range(num_layers):
        out = plan.run(q[i], kv[i], i, weights[i], freqs_cis)    # weights[i]: a LayerWeights
    cache.commit(batch)

``run`` is the fused op (cache write, q rope, then attention in the chosen form); ``attend`` is
``run`` after the write (roped q in, the same form rule: ``absorbed``); the unfused pieces are
``write_cache``, ``decode`` (absorbed q in, latent out) and ``prefill`` (roped q in). All of them
reach the kernels only through ``openmla.dispatch`` (under ``torch.compile``: one ``openmla::``
custom op each, absorption and output projection included), so a model compiles without graph
breaks.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, overload

import torch

from . import dispatch
from .backends import choose_backend, resolve_backend_name
from .cache import CacheBatch
from .chunks import ChunkPlan, chunk_plan
from .masks import MaskVariant
from .spec import AttentionSpec, SparseSpec
from .validate import (
    FLOAT_DTYPES,
    check_attn_sink,
    check_float,
    check_int,
    check_optional_positive,
    check_query,
    check_sparse,
    check_tensor,
    snapshot_batch,
)
from .weights import LayerWeights

DECODE_MAX_Q_LEN = 6  # MAX's threshold: up to this many new tokens per sequence runs the decode form


class Step:
    """One step's attention, run per layer: the base of ``MLAPlan`` and
    ``distributed.ContextParallelPlan`` (a layer takes any ``Step``).

    Attributes: ``spec`` (the step's ``AttentionSpec``), ``num_tokens`` (new tokens, T),
    ``max_position`` (rope rows the step needs), ``kv_rows`` (int64 ``[n]``: the query rows whose
    kv the step stores on this process, or None for all; a layer may project only those)."""

    spec: AttentionSpec
    num_tokens: int
    max_position: int
    kv_rows: torch.Tensor | None = None

    def run(self, q: torch.Tensor, kv: torch.Tensor, layer_idx: int, weights: LayerWeights, freqs_cis: torch.Tensor, *,
            q_scale: torch.Tensor | float | None = None, attn_sink: torch.Tensor | None = None, return_lse: bool = False):
        """One layer: ``q [T, H, Dn+R]``, ``kv [T or len(kv_rows), L+R]`` -> ``out [T, H, Dv]`` (and ``lse``)."""
        raise NotImplementedError


class MLAPlan(Step):
    """One batch step's validated metadata and precomputed shared state (see the module doc).

    Attributes (read-only; what backends read is ``backends.base.PlanView``):
    - ``batch``: the step's ``CacheBatch`` over private int32 copies of ``block_table``,
      ``cache_lengths`` and ``input_row_offsets`` (host lists filled from those copies);
    - ``spec``: the ``AttentionSpec`` (scale, mask, sparse top-k, sink);
    - ``token_seq``, ``token_pos``: int64 ``[T]`` sequence and position of every new token;
    - ``write_rows``: int64 ``[T]`` physical cache row of every new token (these three are made on
      first use on the CPU, with the plan elsewhere);
    - ``num_partitions`` (None: the backend picks), ``buffer_size`` (None: the backend picks);
    - ``form``: ``"decode"`` or ``"prefill"`` (``run``'s choice by the max-new-tokens rule);
    - ``backend``, ``backend_name``: what runs; ``fallback_reason``: why the backend asked for
      declined the step (None when it runs it).
    Make one with ``openmla.plan``.
    """

    def __init__(self, batch: CacheBatch, spec: AttentionSpec, *, num_partitions: int | None, buffer_size: int | None,
                 decode_max_q_len: int) -> None:
        self.batch = batch
        self.spec = spec
        self.num_partitions = num_partitions
        self.buffer_size = buffer_size
        self.decode_max_q_len = decode_max_q_len
        self.form: Literal["decode", "prefill"] = "decode" if batch.max_new_tokens <= decode_max_q_len else "prefill"
        self.device = batch.blocks.device
        self.head_dim = batch.head_dim  # L+R of the cache's entries
        self.num_tokens = batch.offsets_list[-1]
        self.num_layers = batch.num_layers
        self._rows = _TokenRows(batch)  # shared with this plan's views; made now off the CPU (a capture must not copy)
        if self.device.type != "cpu":
            self._rows.get()
        self._chunks: dict[int, ChunkPlan] = {}
        self.handle = dispatch.PlanHandle(self)  # how the custom ops carry this plan (made here: not inside a compiled graph)
        self.backend = None  # set by plan(), once: choose_backend
        self.fallback_reason: str | None = None

    # The step's tokens: made on first use on the CPU (an engine that writes the cache itself never needs them).
    @property
    def token_seq(self) -> torch.Tensor:
        return self._rows.get()[0]

    @property
    def token_pos(self) -> torch.Tensor:
        return self._rows.get()[1]

    @property
    def write_rows(self) -> torch.Tensor:
        return self._rows.get()[2]

    @property
    def backend_name(self) -> str:
        return self.backend.name

    def __repr__(self) -> str:
        return (f"MLAPlan(form={self.form}, backend={self.backend_name}, sequences={self.batch.batch_size}, "
                f"tokens={self.num_tokens}, mask={self.spec.mask.kind.value}, sparse={self.spec.sparse is not None})")

    @property
    def max_position(self) -> int:
        """Rows of ``freqs_cis`` the step needs: its longest sequence (cached + new)."""
        return self.batch.max_position

    def _view(self) -> "MLAPlan":
        """A shallow copy sharing everything, with its own handle (for ``with_blocks`` / ``with_sparse``)."""
        view = object.__new__(type(self))  # copy.copy's protocol costs more than the rest of a layer's checks
        view.__dict__.update(self.__dict__)
        view.handle = dispatch.PlanHandle(view)
        return view

    # Shared precomputation ----------------------------------------------------------------
    def chunks(self, buffer_size: int) -> ChunkPlan:
        """The prefill chunk plan for ``buffer_size`` key rows per chunk (made once per plan)."""
        plan = self._chunks.get(buffer_size)
        if plan is None:
            plan = self._chunks[buffer_size] = chunk_plan(self.batch.seq_lens_list, buffer_size)
        return plan

    def refill(self, batch: CacheBatch, *, sparse_indices: torch.Tensor | None = None,
               topk_lengths: torch.Tensor | None = None) -> "MLAPlan":
        """Load the next step's metadata into this plan's tensors, in place, and return the plan.

        For a captured CUDA graph: every tensor a kernel reads keeps its address. The new batch
        must view the same cache storage with the same number of sequences and new tokens, the
        same form (decode/prefill), and a page table no wider than the plan's (see ``max_pages``
        of ``openmla.plan``). A sparse plan takes the step's new ``sparse_indices`` (and
        ``topk_lengths``) of the same shapes. Validated like ``openmla.plan``; on a ValueError the
        plan is unchanged.
        """
        snap = snapshot_batch(batch)
        mine = self.batch
        if snap.blocks is not mine.blocks and (snap.blocks.data_ptr(), snap.blocks.shape) != (mine.blocks.data_ptr(), mine.blocks.shape):
            raise ValueError("batch: views other cache storage than the plan's")
        if snap.cache_format != mine.cache_format or snap.page_size != mine.page_size:
            raise ValueError("batch: another cache format or page size than the plan's")
        if snap.batch_size != mine.batch_size or snap.offsets_list[-1] != self.num_tokens:
            raise ValueError(f"batch: {snap.batch_size} sequences and {snap.offsets_list[-1]} new tokens, the plan was made for "
                             f"{mine.batch_size} and {self.num_tokens}")
        if snap.block_table.shape[1] > mine.block_table.shape[1]:
            raise ValueError(f"batch: its page table has {snap.block_table.shape[1]} columns, the plan {mine.block_table.shape[1]} "
                             "(make the plan with a larger max_pages)")
        form = "decode" if snap.max_new_tokens <= self.decode_max_q_len else "prefill"
        if form != self.form:
            raise ValueError(f"batch: needs the {form} form, the plan runs the {self.form} form")
        sparse = self.spec.sparse
        if (sparse_indices is not None or topk_lengths is not None) and sparse is None:
            raise ValueError("sparse_indices: the plan was made without sparse attention")
        if sparse is not None and sparse_indices is not None:
            idx, topk = check_sparse(sparse_indices, topk_lengths, sparse.physical, snap, self.device)
            if idx.shape != sparse.indices.shape or (topk is None) != (sparse.topk_lengths is None):
                raise ValueError(f"sparse_indices: shape {tuple(idx.shape)}, the plan holds {tuple(sparse.indices.shape)}")
            sparse.indices.copy_(idx)
            if topk is not None:
                sparse.topk_lengths.copy_(topk)
        mine.block_table.zero_()[:, : snap.block_table.shape[1]].copy_(snap.block_table)
        mine.cache_lengths.copy_(snap.cache_lengths)
        mine.input_row_offsets.copy_(snap.input_row_offsets)
        mine._host.refill(snap._host)
        self._rows.refill()
        self._chunks.clear()
        return self

    def with_blocks(self, blocks: torch.Tensor) -> "MLAPlan":
        """This plan over other cache storage of the same shape, dtype and device, in O(1).

        For an engine that keeps one cache tensor per layer (vLLM's ``[num_blocks, block_size,
        L+R]``, viewed as ``[1, ...]``): plan the step once over one layer's storage, then run
        every layer through ``plan.with_blocks(its_cache)`` with ``layer_idx`` 0. The view shares
        everything else with this plan (validated metadata, positions, write rows, chunk plans; a
        ``refill`` of either updates both); nothing is copied or recomputed.
        """
        mine = self.batch.blocks
        if blocks is mine:
            return self
        if not (type(blocks) is torch.Tensor and blocks.shape == mine.shape and blocks.dtype == mine.dtype
                and blocks.device == mine.device):
            check_tensor("blocks", blocks, shape=tuple(mine.shape), dtypes=(mine.dtype,), device=mine.device)
        view = self._view()
        view.batch = self.batch.checked_copy(blocks=blocks)
        return view

    def with_sparse(self, sparse_indices: torch.Tensor, topk_lengths: torch.Tensor | None = None, *,
                    physical_indices: bool = True) -> "MLAPlan":
        """This plan with other sparse top-k lists (validated like ``openmla.plan``'s), for a model
        whose layers each pick their own keys (DeepSeek-V3.2's indexer runs per layer). The view
        shares everything else with this plan; its layers run the sparse (absorbed) form."""
        if not isinstance(physical_indices, bool):
            raise ValueError(f"physical_indices: expected a bool, got {physical_indices!r}")
        indices, topk = check_sparse(sparse_indices, topk_lengths, physical_indices, self.batch, self.device)
        view = self._view()
        view.spec = dataclasses.replace(self.spec, sparse=SparseSpec(indices, topk, physical_indices))
        return view

    # Per-layer checks (O(1): shapes, dtypes, devices; no tensor values) -------------------
    def _layer(self, layer_idx: object) -> int:
        return check_int("layer_idx", layer_idx, 0, self.num_layers)

    def _sink(self, attn_sink: object, num_heads: int) -> AttentionSpec:
        """The spec with this call's sink: the plan's, or a per-layer one (shape checked only)."""
        if attn_sink is None:
            sink = self.spec.attn_sink
            if sink is not None and sink.shape[-1] != num_heads:
                raise ValueError(f"attn_sink: the plan's sink has {sink.shape[-1]} heads, q has {num_heads}")
            return self.spec
        check_attn_sink(attn_sink, num_heads, self.batch.batch_size, self.device, check_values=False)
        return self.spec.with_sink(attn_sink)

    def _check_layer(self, q: torch.Tensor, kv: object, weights: object, freqs_cis: object) -> LayerWeights:
        """``q`` (checked) against ``weights``, ``kv`` and ``freqs_cis`` against both and the cache."""
        w = self._check_weights(q, weights)
        L, R = w.kv_lora_rank, self.head_dim - w.kv_lora_rank
        if not (type(kv) is torch.Tensor and kv.shape == (self.num_tokens, L + R) and kv.dtype in FLOAT_DTYPES
                and kv.device == self.device):
            check_tensor("kv", kv, shape=(self.num_tokens, L + R), dtypes=FLOAT_DTYPES, device=self.device)
        if not (type(freqs_cis) is torch.Tensor and freqs_cis.dim() == 2 and freqs_cis.shape[1] == R
                and freqs_cis.dtype in (torch.float32, torch.float64) and freqs_cis.device == self.device):
            check_tensor("freqs_cis", freqs_cis, shape=(None, R), dtypes=(torch.float32, torch.float64), device=self.device)
        return w

    def _check_weights(self, q: torch.Tensor, weights: object) -> LayerWeights:
        """``weights`` against the cache, and ``q`` (checked) against both."""
        if not isinstance(weights, LayerWeights):
            raise ValueError(f"weights: expected a LayerWeights (openmla.LayerWeights.from_kv_b), got {type(weights).__name__}")
        if weights.device != self.device:
            raise ValueError(f"weights: on {weights.device}, the cache is on {self.device}")
        H, L, Dn = weights.num_heads, weights.kv_lora_rank, weights.qk_nope_head_dim
        R = self.head_dim - L
        if R < 0 or R % 2:
            raise ValueError(f"weights: latent width {L} leaves {R} rope dims of the cache's {self.head_dim}-wide entries "
                             "(need an even R >= 0)")
        if q.shape[1:] != (H, Dn + R):
            raise ValueError(f"q: expected shape ({self.num_tokens}, {H}, {Dn + R}) for these weights, got {tuple(q.shape)}")
        return weights

    # The fused op -----------------------------------------------------------------------
    @overload
    def run(self, q: torch.Tensor, kv: torch.Tensor, layer_idx: int, weights: LayerWeights, freqs_cis: torch.Tensor, *,
            q_scale: torch.Tensor | float | None = ..., attn_sink: torch.Tensor | None = ...,
            return_lse: Literal[False] = ...) -> torch.Tensor: ...

    @overload
    def run(self, q: torch.Tensor, kv: torch.Tensor, layer_idx: int, weights: LayerWeights, freqs_cis: torch.Tensor, *,
            q_scale: torch.Tensor | float | None = ..., attn_sink: torch.Tensor | None = ...,
            return_lse: Literal[True]) -> tuple[torch.Tensor, torch.Tensor]: ...

    def run(self, q, kv, layer_idx, weights, freqs_cis, *, q_scale=None, attn_sink=None, return_lse=False):
        """MLA for one layer: cache write, q rope, then attention in the plan's form.

        ``q [T, H, Dn+R]``, ``kv [T, L+R]`` (``kv_a_proj_with_mqa`` output, before norm and rope),
        ``weights`` the layer's ``LayerWeights``, ``freqs_cis [>= max_position, R]``. Returns
        ``out [T, H, Dv]`` in q's dtype (and float32 ``lse [T, H]``, natural log, without the sink).
        A float8_e4m3fn ``q`` (with ``q_scale``) gives bfloat16 output. ``attn_sink`` overrides the
        plan's sink for this layer. Nothing is written to the cache when an argument is rejected.
        """
        q, out_dtype = check_query(q, q_scale, self.num_tokens, self.device)
        layer_idx = self._layer(layer_idx)
        _check_return_lse(return_lse)
        w = self._check_layer(q, kv, weights, freqs_cis)
        spec = self._sink(attn_sink, w.num_heads)
        q_rot = dispatch.write(self, layer_idx, q, kv, freqs_cis, w.kv_norm_gamma, w.epsilon, w.rope_interleaved)
        out, lse = self._attend(q_rot, layer_idx, spec, w.w_k, w.w_uk, w.w_uv)
        return _finish(out, lse, out_dtype, self.device, return_lse)

    def absorbed(self, spec: AttentionSpec | None = None) -> bool:
        """The form rule: True when this step's attention runs absorbed (the decode form: every
        sequence has at most ``decode_max_q_len`` new tokens, or the step is sparse), False when
        it runs up-projected (the prefill form). Sparse prefill reads at most ``stride`` keys per
        token: the absorbed form is the same math without up-projecting every key."""
        return self.form == "decode" or (self.spec if spec is None else spec).sparse is not None

    def _attend(self, q_rot, layer_idx, spec, w_k, w_uk, w_uv):
        """Attention after the cache write, in the form ``absorbed`` picks (unchecked arguments)."""
        if self.absorbed(spec):
            return self._absorbed(q_rot, layer_idx, spec, w_uk, w_uv)
        return dispatch.attention(self, "prefill", layer_idx, q_rot, spec, w_k=w_k, w_uv=w_uv)

    def _absorbed(self, q_rot, layer_idx, spec, w_uk, w_uv):
        q_abs = dispatch.absorb(self, q_rot, w_uk)
        out_lat, lse = dispatch.attention(self, "decode", layer_idx, q_abs, spec, kv_lora_rank=w_uk.shape[1])
        return dispatch.unabsorb(self, out_lat, w_uv), lse

    @overload
    def attend(self, q: torch.Tensor, layer_idx: int, weights: LayerWeights, *, q_scale: torch.Tensor | float | None = ...,
               attn_sink: torch.Tensor | None = ..., return_lse: Literal[False] = ...) -> torch.Tensor: ...

    @overload
    def attend(self, q: torch.Tensor, layer_idx: int, weights: LayerWeights, *, q_scale: torch.Tensor | float | None = ...,
               attn_sink: torch.Tensor | None = ..., return_lse: Literal[True]) -> tuple[torch.Tensor, torch.Tensor]: ...

    def attend(self, q, layer_idx, weights, *, q_scale=None, attn_sink=None, return_lse=False):
        """``run`` without the cache write: roped ``q [T, H, Dn+R]`` over cache layer ``layer_idx``
        (which already holds this step's entries) -> ``out [T, H, Dv]``, in the plan's form
        (``absorbed``: absorbed for decode or sparse steps, else up-projected). For a layer that
        reads a cache another layer (or an engine) wrote. Output rules as ``run``'s."""
        q, out_dtype = check_query(q, q_scale, self.num_tokens, self.device)
        layer_idx = self._layer(layer_idx)
        _check_return_lse(return_lse)
        w = self._check_weights(q, weights)
        spec = self._sink(attn_sink, w.num_heads)
        out, lse = self._attend(q, layer_idx, spec, w.w_k, w.w_uk, w.w_uv)
        return _finish(out, lse, out_dtype, self.device, return_lse)

    # The unfused pieces --------------------------------------------------------------------
    def write_cache(self, q: torch.Tensor, kv: torch.Tensor, freqs_cis: torch.Tensor, kv_norm_gamma: torch.Tensor,
                    layer_idx: int, *, epsilon: float = 1e-6, rope_interleaved: bool = True) -> torch.Tensor:
        """Write ``kv [T, L+R]`` into layer ``layer_idx`` (RMSNorm latent, RoPE'd key rope) and return
        q ``[T, H, Dn+R]`` with its last R dims rotated (a new tensor of q's dtype)."""
        check_tensor("q", q, shape=(self.num_tokens, None, None), dtypes=FLOAT_DTYPES, device=self.device)
        layer_idx = self._layer(layer_idx)
        L = check_tensor("kv_norm_gamma", kv_norm_gamma, rank=1, dtypes=FLOAT_DTYPES, device=self.device).shape[0]
        check_tensor("kv", kv, shape=(self.num_tokens, None), dtypes=FLOAT_DTYPES, device=self.device)
        R = kv.shape[1] - L
        if R < 0 or R % 2:
            raise ValueError(f"kv: width {kv.shape[1]} minus kv_norm_gamma's {L} leaves {R} rope dims (need an even R >= 0)")
        if L + R != self.batch.head_dim:
            raise ValueError(f"kv: width {L + R} must equal the cache entry width {self.batch.head_dim} (L+R)")
        check_tensor("freqs_cis", freqs_cis, shape=(None, R), dtypes=(torch.float32, torch.float64), device=self.device)
        epsilon = check_float("epsilon", epsilon, lo=0.0)
        if not isinstance(rope_interleaved, bool):
            raise ValueError(f"rope_interleaved: expected a bool, got {rope_interleaved!r}")
        if q.shape[2] < R:
            raise ValueError(f"q: depth {q.shape[2]} is smaller than the rope width {R}")
        q_rot = dispatch.write(self, layer_idx, q, kv, freqs_cis, kv_norm_gamma, epsilon, rope_interleaved)
        return q_rot.to(device=self.device, dtype=q.dtype)

    @overload
    def decode(self, q: torch.Tensor, layer_idx: int, *, kv_lora_rank: int = ..., q_scale: torch.Tensor | float | None = ...,
               attn_sink: torch.Tensor | None = ..., return_lse: Literal[False] = ...) -> torch.Tensor: ...

    @overload
    def decode(self, q: torch.Tensor, layer_idx: int, *, kv_lora_rank: int = ..., q_scale: torch.Tensor | float | None = ...,
               attn_sink: torch.Tensor | None = ..., return_lse: Literal[True]) -> tuple[torch.Tensor, torch.Tensor]: ...

    def decode(self, q, layer_idx, *, kv_lora_rank=512, q_scale=None, attn_sink=None, return_lse=False):
        """Absorbed (MQA) attention: ``q [T, H, L+R]`` (absorbed and roped) against the cache rows
        of ``layer_idx`` (which already hold this step's tokens) -> ``out [T, H, L]``."""
        q, out_dtype = check_query(q, q_scale, self.num_tokens, self.device, self.batch.head_dim)
        layer_idx = self._layer(layer_idx)
        _check_return_lse(return_lse)
        # kv_lora_rank == L+R: entries without a rope part (a cache made with rope_dim 0, or one that does not say)
        check_int("kv_lora_rank", kv_lora_rank, 1, q.shape[2] + (0 if self.batch.rope_dim else 1))
        spec = self._sink(attn_sink, q.shape[1])
        out, lse = dispatch.attention(self, "decode", layer_idx, q, spec, kv_lora_rank=kv_lora_rank)
        return _finish(out, lse, out_dtype, self.device, return_lse)

    @overload
    def prefill(self, q: torch.Tensor, layer_idx: int, w_k: torch.Tensor, w_uv: torch.Tensor, *,
                q_scale: torch.Tensor | float | None = ..., attn_sink: torch.Tensor | None = ...,
                return_lse: Literal[False] = ...) -> torch.Tensor: ...

    @overload
    def prefill(self, q: torch.Tensor, layer_idx: int, w_k: torch.Tensor, w_uv: torch.Tensor, *,
                q_scale: torch.Tensor | float | None = ..., attn_sink: torch.Tensor | None = ...,
                return_lse: Literal[True]) -> tuple[torch.Tensor, torch.Tensor]: ...

    def prefill(self, q, layer_idx, w_k, w_uv, *, q_scale=None, attn_sink=None, return_lse=False):
        """Up-projected (MHA) attention: ``q [T, H, Dn+R]`` (roped) over every visible cached key,
        chunked by ``buffer_size``; ``w_k [H*Dn, L]``, ``w_uv [H, Dv, L]`` -> ``out [T, H, Dv]``."""
        q, out_dtype = check_query(q, q_scale, self.num_tokens, self.device)
        layer_idx = self._layer(layer_idx)
        _check_return_lse(return_lse)
        T, H, qd = q.shape
        check_tensor("w_uv", w_uv, shape=(H, None, None), dtypes=FLOAT_DTYPES, device=self.device)
        L = w_uv.shape[2]
        R = self.batch.head_dim - L
        Dn = qd - R
        if R < 0 or Dn < 1:
            raise ValueError(f"w_uv: latent width {L} leaves {R} rope dims of q's {qd} (cache entries are {self.batch.head_dim} wide)")
        check_tensor("w_k", w_k, shape=(H * Dn, L), dtypes=FLOAT_DTYPES, device=self.device)
        spec = self._sink(attn_sink, H)
        if spec.sparse is not None:  # sparse: absorbed whatever the form (see ``absorbed``)
            out, lse = self._absorbed(q, layer_idx, spec, w_k.view(H, Dn, L).transpose(1, 2), w_uv)
        else:
            out, lse = dispatch.attention(self, "prefill", layer_idx, q, spec, w_k=w_k, w_uv=w_uv)
        return _finish(out, lse, out_dtype, self.device, return_lse)


class _TokenRows:
    """``(token_seq, token_pos, write_rows)`` of a batch, made once on first use; a refill rewrites
    them in place (their addresses stay: a captured graph reads them)."""

    def __init__(self, batch: CacheBatch) -> None:
        self.batch = batch
        self.rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def get(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.rows is None:
            self.rows = self.batch.token_rows()
        return self.rows

    def refill(self) -> None:
        if self.rows is not None:
            for mine, new in zip(self.rows, self.batch.token_rows()):
                mine.copy_(new)


def _check_return_lse(return_lse: object) -> None:
    if not isinstance(return_lse, bool):
        raise ValueError(f"return_lse: expected a bool, got {return_lse!r}")


def _finish(out: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype, device: torch.device, return_lse: bool):
    """The one output rule of every public entry: out in the caller's dtype, LSE float32."""
    if out.dtype != dtype or out.device != device:
        out = out.to(device=device, dtype=dtype)
    if not return_lse:
        return out
    return out, (lse if lse.dtype == torch.float32 and lse.device == device else lse.to(device=device, dtype=torch.float32))


# Making a plan ---------------------------------------------------------------------------
def plan(
    batch: CacheBatch,
    *,
    scale: float,
    mask: str | MaskVariant = "causal",
    window_size: int | None = None,
    chunk_size: int | None = None,
    sparse_indices: torch.Tensor | None = None,
    topk_lengths: torch.Tensor | None = None,
    physical_indices: bool = True,
    attn_sink: torch.Tensor | None = None,
    num_partitions: int | None = None,
    buffer_size: int | None = None,
    decode_max_q_len: int = DECODE_MAX_Q_LEN,
    max_pages: int | None = None,
    backend: str | None = None,
) -> MLAPlan:
    """Validate one batch step and precompute what every layer shares; returns an ``MLAPlan``.

    ``batch`` is the step's ``CacheBatch`` (from ``PagedLatentCache.prepare``). Options, the same
    for every layer of the step: ``scale`` (softmax scale), ``mask`` (``causal``, ``null``,
    ``sliding_window_causal`` / ``sliding_window_noncausal`` with ``window_size``,
    ``chunked_causal`` with ``chunk_size``), ``sparse_indices [T, stride]`` (-1 = unused) with
    optional ``topk_lengths [B]`` and ``physical_indices``, ``attn_sink [H]`` or ``[B, H]``
    (float32), ``num_partitions`` (split-KV of the decode form), ``buffer_size`` (key rows per
    prefill chunk), ``decode_max_q_len`` (the decode form runs when no sequence has more new
    tokens than this), ``max_pages`` (pad the plan's page table to this many columns, so later
    steps can ``refill`` it in place), ``backend`` (``cpu``, ``torch``, ``triton``, ``reference``;
    None: by device and ``OPENMLA_BACKEND``; a backend that declines the step runs its fallback,
    recorded as ``plan.backend_name`` and ``plan.fallback_reason``). Raises ``ValueError`` naming
    the argument on bad input.

    For a CUDA graph, make the plan with ``num_partitions`` and ``max_pages`` fixed and call
    ``plan.refill(batch)`` before each replay.
    """
    snap = snapshot_batch(batch)
    if max_pages is not None:
        width = snap.block_table.shape[1]
        check_int("max_pages", max_pages, max(width, 1))
        table = snap.block_table.new_zeros(snap.batch_size, max_pages)
        table[:, :width] = snap.block_table
        snap.block_table = table
    device = snap.blocks.device
    scale = check_float("scale", scale)
    variant = MaskVariant.parse(mask, window_size, chunk_size)
    if not isinstance(physical_indices, bool):
        raise ValueError(f"physical_indices: expected a bool, got {physical_indices!r}")
    sparse = None
    if sparse_indices is not None or topk_lengths is not None:
        indices, topk = check_sparse(sparse_indices, topk_lengths, physical_indices, snap, device)
        sparse = SparseSpec(indices, topk, physical_indices)
    if attn_sink is not None:
        check_attn_sink(attn_sink, None, snap.batch_size, device)
        attn_sink = attn_sink.clone()
    check_optional_positive("num_partitions", num_partitions)
    check_optional_positive("buffer_size", buffer_size)
    check_int("decode_max_q_len", decode_max_q_len, 0)
    name = resolve_backend_name(backend, device)
    step = MLAPlan(snap, AttentionSpec(scale, variant, sparse, attn_sink), num_partitions=num_partitions,
                   buffer_size=buffer_size, decode_max_q_len=decode_max_q_len)
    step.backend, step.fallback_reason = choose_backend(name, step)
    return step
