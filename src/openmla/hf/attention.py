"""One transformers MLA attention module, re-seated on openmla's ``LatentAttention``: the shared core.

``AttachedAttention`` takes every submodule and parameter of a transformers attention module as
its own (the same ``nn.Linear`` / norm / indexer objects and the same ``sinks`` parameter, so the
same parameter tensors under the same names: nothing is copied), and answers transformers'
attention call: the decoder layer hands it ``hidden_states [1, T, hidden]`` of one packed ragged
step and the step's plan under the keyword ``openmla_step``; it returns ``([1, T, hidden], None)``
(and the step's top-k picks as a third value for families whose layers share them). The only
tensors it owns are ``LatentAttention``'s derived ``kv_b_proj`` layouts (``weights``: ``w_k``, ``w_uk``, ``w_uv``).

What differs between families is read from the layer's ``Family`` (``openmla.hf.families``):
how the query is projected, a query scale by position, an output gate, sinks, a top-k indexer.
The rope comes from the model's own rotary module through the attachment's ``RopeTable``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from ..config import MLAConfig
from ..layer import LatentAttention
from ..planning import MLAPlan
from ..rope import apply_rope
from .families import Family
from .implementation import packed_step
from .indexer import IndexStep, select_keys, select_pooled
from .rope import RopeTable
from .stats import AttentionClock

STEP_KWARG = "openmla_step"  # the keyword the attention context travels under through transformers' layers
INDEX_KWARG = "openmla_index_step"  # and the step's IndexStep, for models with a top-k indexer (V3.2)


@dataclass(frozen=True)
class StepPlans:
    """The plans of one step of a model whose layers differ in latent width, softmax scale or sliding
    window (``Family.per_layer``): one per ``Attachment.plan_keys`` entry, all over the same sequences,
    positions and cache rows; each layer runs ``plans[layer.plan_index]``."""

    plans: tuple[MLAPlan, ...]

    @property
    def first(self) -> MLAPlan:
        return self.plans[0]


class AttachedAttention(LatentAttention):
    """``LatentAttention`` over the submodules of a transformers MLA attention module of ``family``.

    A module with a top-k ``indexer`` (DeepSeek-V3.2 and others) has it adopted too: each call
    then picks every token's keys (``select_keys``, its keys kept in ``index_keys``, this layer's
    rows of the attachment's store), or reuses the previous layer's picks, and attends to those only."""

    index_keys: torch.Tensor | None = None
    q_factor: float | None = None  # a constant factor on the whole query (Family.lora_scales "query")
    q_latent_factor: float | None = None  # or on the normed query latent (Family.lora_scales "latents")
    latent_factor: float | None = None  # and on the normed latent: the cache write's gamma carries it
    plan_index: int = 0  # which of a StepPlans' plans this layer runs
    # Family.latent_sources: this layer reads cache layer ``layer_idx``, an earlier layer's, and writes nothing
    reads_latent: bool = False

    def latent_gamma(self) -> torch.Tensor:
        if self.reads_latent:  # no latent norm of its own (nothing is written): a placeholder LayerWeights carries
            w = self.kv_b_proj.weight
            return torch.ones(self.config.kv_lora_rank, dtype=w.dtype, device=w.device)
        gamma = self.kv_a_layernorm.weight
        if self.latent_factor is None:
            return gamma
        with torch.no_grad():
            return gamma.detach() * self.latent_factor

    @classmethod
    def adopt(cls, module: nn.Module, config: MLAConfig, layer_idx: int, family: Family, rope: RopeTable,
              clock: AttentionClock, *,
              query_scale: Callable[[torch.Tensor], torch.Tensor] | None = None,
              backend: str | None = None, reads_latent: bool = False) -> "AttachedAttention":
        """Build on the meta device (no throw-away weights), then take ``module``'s submodules and parameters.
        ``reads_latent``: ``layer_idx`` is an earlier layer's cache layer, which this one reads and never writes."""
        weight = module.kv_b_proj.weight
        layer = cls(config, layer_idx, dtype=weight.dtype, device="meta", backend=backend, max_position=1)
        theirs = dict(module.named_children())
        for name in [n for n, _ in layer.named_children() if n not in theirs]:
            delattr(layer, name)  # a projection of LatentAttention's this family does not have (AXK2: q_b_proj)
        for name, child in theirs.items():
            setattr(layer, name, child)
        for name, param in module.named_parameters(recurse=False):  # Hunyuan's sinks
            setattr(layer, name, param)
        layer.indexer = getattr(module, "indexer", None)
        layer.family, layer.rope, layer.clock, layer.query_scale = family, rope, clock, query_scale
        layer.reads_latent = reads_latent
        if family.lora_scales == "query":  # LongCat-Flash: constant factors on the query and on the normed latent
            layer.q_factor, layer.latent_factor = float(module.mla_scale_q_lora), float(module.mla_scale_kv_lora)
        elif family.lora_scales == "latents":  # dots3: on the normed query latent and the normed latent
            layer.q_latent_factor, layer.latent_factor = float(module.q_lora_scale), float(module.kv_lora_scale)
        layer.freqs_cis = None  # the rope comes from ``rope``, the model's own table
        layer.split_kv_b()  # weights (w_k, w_uk, w_uv) become real tensors, derived from the adopted kv_b_proj
        left = [n for n, t in list(layer.named_parameters()) + list(layer.named_buffers()) if t.is_meta]
        mine = {n for n, _ in layer.named_parameters()}
        if left or mine != {n for n, _ in module.named_parameters()}:  # a bug here, not the user's
            raise RuntimeError(f"AttachedAttention: adopting {type(module).__name__} left {left} on the meta device or "
                               f"changed its parameter names")
        return layer

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple:
        """``hidden_states [1, T, hidden]`` -> ``([1, T, hidden], None)``, transformers' attention contract
        (``([1, T, hidden], None, picks)`` for families whose layers share their top-k picks).

        ``kwargs[STEP_KWARG]`` is the step's plan; transformers' other arguments (mask, its cache)
        are not used: positions and causality come from the plan, the rope from the model's table.
        """
        step = packed_step(hidden_states, kwargs, STEP_KWARG)
        if not self.clock.on:
            return self._forward(hidden_states[0], step, kwargs)
        t0 = self.clock.now()
        out = self._forward(hidden_states[0], step, kwargs)
        self.clock.layers += self.clock.now() - t0
        return out

    def _forward(self, hidden: torch.Tensor, step: Any, kwargs: dict) -> tuple:
        if isinstance(step, StepPlans):
            step = step.plans[self.plan_index]
        step = self.check_step(hidden, step, {})
        q, q_resid, gate = self._query(hidden, step)
        picks = None
        if self.family.indexer is not None and (self.indexer is not None or self.family.shared_topk):
            picks = self._pick(hidden, q_resid, kwargs, step)
            step = step.with_sparse(picks, physical_indices=False)
        out = self._attend(hidden, step, q, gate)[None]
        return (out, None, picks) if self.family.shared_topk else (out, None)

    def _query(self, hidden: torch.Tensor, step: MLAPlan) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``(q [T, H, Dn+R] before rope, the query latent or None, the output gate's logits [T, H, Dv] ([T, H] for
        a per-head gate) or None)``."""
        c, f = self.config, self.family
        T, H = hidden.shape[0], c.num_heads
        gate = None
        if f.query == "q_gate":  # AXK2: one projection of [normed latent, latent] gives the query and the gate
            latent = self.q_a_proj(hidden)
            q_resid = self.q_a_layernorm(latent)
            both = self.q_gate_proj(torch.cat([q_resid, latent], dim=-1)).view(T, H, c.qk_head_dim + c.v_head_dim)
            q, gate = both.split([c.qk_head_dim, c.v_head_dim], dim=-1)
            q = q.contiguous()
        else:
            q_resid = None if c.q_lora_rank is None else self.query_latent(hidden)
            if self.q_latent_factor is not None:  # before q_b_proj and the indexer, as transformers scales it
                q_resid = q_resid * self.q_latent_factor
            q = self.project_q(hidden, q_resid)
            if f.output_gate == "gate_proj":
                gate = self.gate_proj(hidden).view(T, H, c.v_head_dim)
            elif f.output_gate == "g_proj":  # one logit per head
                gate = self.g_proj(hidden)
        if self.query_scale is not None:  # a factor per token on the whole query (rope is linear: before or after it)
            q = q * self.query_scale(step.token_pos)[:, None, None].to(q.dtype)
        if f.head_query_scale is not None:  # the module itself, per head and position, on transformers' [B, S, H, D]
            q = getattr(self, f.head_query_scale)(q[None], step.token_pos.to(q.device)[None], head_dim_first=False)[0]
        if self.q_factor is not None:
            q = q * self.q_factor
        return q, q_resid, gate

    def _pick(self, hidden: torch.Tensor, q_resid: torch.Tensor | None, kwargs: dict, step: MLAPlan) -> torch.Tensor:
        """int32 ``[T, stride]`` logical key positions each token attends to (-1: unused): this
        layer's indexer's, or the previous layer's for a layer without one."""
        if self.indexer is None:
            picks = kwargs.get("prev_topk_indices")
            if not isinstance(picks, torch.Tensor) or picks.shape[0] != hidden.shape[0]:
                raise ValueError("prev_topk_indices: this layer reuses the previous layer's top-k picks and got none")
            return picks
        index_step = kwargs.get(INDEX_KWARG)
        if not isinstance(index_step, IndexStep) or self.index_keys is None:
            raise ValueError(f"{INDEX_KWARG}: this layer has a top-k indexer; run the model through openmla.hf.generate "
                             "(or openmla.hf.forward_step) of an attached model")
        if self.family.indexer.pooled:  # GLM-5-Next: pooled key groups, no rope
            return select_pooled(self.indexer, self.index_keys, index_step, hidden, q_resid)
        tables = kwargs.get("position_embeddings")  # transformers' rotary tables at the step's positions, [1, T, rope]
        if not (isinstance(tables, tuple) and len(tables) == 2):
            raise ValueError("position_embeddings: a layer with a top-k indexer needs the model's (cos, sin) tables")
        cos, sin = tables
        spec = self.family.indexer
        positions = step.token_pos.to(hidden.device) if spec.query_scale else None
        return select_keys(self.indexer, self.index_keys, index_step, hidden, q_resid, cos[0], sin[0], spec, positions)

    def _attend(self, hidden: torch.Tensor, step: MLAPlan, q: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """Cache write, attention (``MLAPlan.run``), the output gate, ``o_proj``: ``[T, hidden]`` (a layer reading
        an earlier layer's latent writes nothing: ``_attend_cached``)."""
        c, f = self.config, self.family
        T = hidden.shape[0]
        sink = self.sinks.float() if f.sinks else None
        if self.reads_latent:
            out = self._attend_cached(hidden, step, q, sink)
        else:
            kv = self.kv_a_proj_with_mqa(hidden)
            if f.rope_key_norm is not None:  # dots3: the key's rope part normed (the module itself) before the write rotates it
                L = c.kv_lora_rank
                kv[:, L:] = getattr(self, f.rope_key_norm)(kv[:, L:])
            table = self.rope.table(step.max_position, hidden.device)
            t0 = self.clock.now() if self.clock.on else 0.0
            out = step.run(q, kv, self.layer_idx, self.weights, table, attn_sink=sink)
            if self.clock.on:
                self.clock.kernels += self.clock.now() - t0
        if f.output_gate == "g_proj":  # Ling 3: the sigmoid in float32, cast to the activations' dtype, then the product
            out = out.to(hidden.dtype) * torch.sigmoid(gate.float()).to(hidden.dtype)[..., None]
        elif gate is not None:
            if f.gate_in_float32:
                out = (out * torch.sigmoid(gate.float())).to(out.dtype)
            else:
                out = out * torch.sigmoid(gate)
        return self.o_proj(out.reshape(T, c.num_heads * c.v_head_dim).to(self.o_proj.weight.dtype))

    def _attend_cached(self, hidden: torch.Tensor, step: MLAPlan, q: torch.Tensor, sink: torch.Tensor | None) -> torch.Tensor:
        """Attention over cache layer ``layer_idx``, which an earlier layer wrote this step (its latent already
        normed and its keys' rope rotated there): q's rope part is rotated as the cache write rotates it, then
        ``MLAPlan.attend`` runs the plan's form as ``MLAPlan.run`` would after its write. Nothing is written.
        ``[T, H, Dv]``."""
        c, w = self.config, self.weights
        Dn, R = c.qk_nope_head_dim, c.qk_rope_head_dim
        if R:
            table = self.rope.table(step.max_position, hidden.device)
            q = torch.cat([q[..., :Dn], apply_rope(q[..., Dn:], table, step.token_pos.to(hidden.device), c.rope_interleave)],
                          dim=-1)
        t0 = self.clock.now() if self.clock.on else 0.0
        out = step.attend(q, self.layer_idx, w, attn_sink=sink)
        if self.clock.on:
            self.clock.kernels += self.clock.now() - t0
        return out

    def extra_repr(self) -> str:
        return f"family={self.family.name}, " + super().extra_repr() + (", reads an earlier layer's latent" if self.reads_latent else "")
