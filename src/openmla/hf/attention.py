"""One transformers DeepSeek attention module, re-seated on openmla's ``LatentAttention``.

``AttachedAttention`` takes the projection modules of a transformers ``DeepseekV3Attention`` /
``DeepseekV2Attention`` as its own (the same ``nn.Linear`` and RMSNorm objects, so the same
parameter tensors: nothing is copied), and answers transformers' attention call: the decoder
layer hands it ``hidden_states [1, T, hidden]`` of one packed ragged step and the step's
attention context under the keyword ``openmla_step``; it returns ``([1, T, hidden], None)``.
The only tensors it owns are ``LatentAttention``'s derived ``kv_b_proj`` layouts (``w_k``,
``w_uk``, ``w_uv``) and the shared rope table.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from ..config import MLAConfig
from ..layer import LatentAttention, shared_freqs_cis
from .indexer import IndexStep, check_indexer, select_keys

STEP_KWARG = "openmla_step"  # the keyword the attention context travels under through transformers' layers
INDEX_KWARG = "openmla_index_step"  # and the step's IndexStep, for models with a top-k indexer (V3.2)
_ROPE_ROWS = 4096  # first size of the shared rope table; it grows with the longest sequence seen


def projection_names(config: MLAConfig) -> tuple[str, ...]:
    """The attention submodules a layer of ``config`` has, under DeepSeek's names."""
    q = ("q_proj",) if config.q_lora_rank is None else ("q_a_proj", "q_a_layernorm", "q_b_proj")
    return q + ("kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")


def check_hf_attention(module: nn.Module, config: MLAConfig, where: str) -> None:
    """``ValueError`` unless ``module`` is an MLA attention module this package can take over."""
    if getattr(module, "indexer", None) is not None:
        check_indexer(module.indexer, f"{where}.indexer")
        if config.q_lora_rank is None:
            raise ValueError(f"model: {where} has a top-k indexer but no query latent (q_lora_rank)")
    missing = [n for n in projection_names(config) if not isinstance(getattr(module, n, None), nn.Module)]
    if missing:
        raise ValueError(f"model: {where} ({type(module).__name__}) is not a DeepSeek MLA attention module: no {missing}")
    if not isinstance(getattr(module.kv_a_layernorm, "weight", None), torch.Tensor):
        raise ValueError(f"model: {where}.kv_a_layernorm has no weight")
    H, Dn, Dv, L = config.num_heads, config.qk_nope_head_dim, config.v_head_dim, config.kv_lora_rank
    want = (H * (Dn + Dv), L)
    if tuple(module.kv_b_proj.weight.shape) != want:
        raise ValueError(f"model: {where}.kv_b_proj.weight has shape {tuple(module.kv_b_proj.weight.shape)}, the config says {want}")


def layer_config(hf_config: Any, module: nn.Module) -> MLAConfig:
    """The ``MLAConfig`` of a transformers model, with the latent norm's epsilon taken from ``module``.

    transformers builds ``kv_a_layernorm`` with its own default epsilon, not the config's
    ``rms_norm_eps``; the fused op must use the one the module holds.
    """
    config = MLAConfig.from_hf(hf_config)
    eps = getattr(module.kv_a_layernorm, "variance_epsilon", getattr(module.kv_a_layernorm, "eps", None))
    return config if eps is None else dataclasses.replace(config, rms_norm_eps=float(eps))


class AttachedAttention(LatentAttention):
    """``LatentAttention`` over the projection modules of a transformers MLA attention module.

    A DeepSeek-V3.2 module's ``indexer`` is adopted too: each call then picks every token's keys
    (``select_keys``, its keys kept in ``index_keys``, this layer's rows of the attachment's
    store) and attends to those only."""

    index_keys: torch.Tensor | None = None

    @classmethod
    def adopt(cls, module: nn.Module, config: MLAConfig, layer_idx: int, *, backend: str | None = None) -> "AttachedAttention":
        """Build on the meta device (no throw-away weights), then take ``module``'s projections."""
        weight = module.kv_b_proj.weight
        layer = cls(config, layer_idx, dtype=weight.dtype, device="meta", backend=backend, max_position=1)
        for name in projection_names(config):
            setattr(layer, name, getattr(module, name))
        layer.indexer = getattr(module, "indexer", None)  # a submodule when present (its parameters shared)
        layer.split_kv_b()  # w_k, w_uk, w_uv become real tensors, derived from the adopted kv_b_proj
        layer.freqs_cis = shared_freqs_cis(config, min(config.max_position_embeddings, _ROPE_ROWS), weight.device)
        left = [n for n, t in list(layer.named_parameters()) + list(layer.named_buffers()) if t.is_meta]
        if left:  # a projection the config did not name: a bug here, not the user's
            raise RuntimeError(f"AttachedAttention: {left} still on the meta device after adopting {type(module).__name__}")
        return layer

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
        """``hidden_states [1, T, hidden]`` -> ``([1, T, hidden], None)``, transformers' attention contract.

        ``kwargs[STEP_KWARG]`` is the step's attention context; transformers' other arguments
        (mask, position embeddings, its cache) are not used: positions and causality come from
        the context, the rope from openmla's table.
        """
        step = kwargs.get(STEP_KWARG)
        if step is None:
            raise ValueError("openmla_step: this model is attached to openmla; run it through openmla.hf.generate "
                             "(or openmla.hf.forward_step), or call openmla.hf.detach(model) first")
        if hidden_states.dim() != 3 or hidden_states.shape[0] != 1:
            raise ValueError(f"hidden_states: expected one packed step [1, T, hidden], got {tuple(hidden_states.shape)}")
        if self.indexer is None:
            return super().forward(hidden_states[0], step)[None], None
        return self._sparse_forward(hidden_states[0], step, kwargs)[None], None

    def _sparse_forward(self, hidden: torch.Tensor, step: Any, kwargs: dict) -> torch.Tensor:
        """V3.2: the indexer's selection, then attention over the selected keys only."""
        index_step = kwargs.get(INDEX_KWARG)
        if not isinstance(index_step, IndexStep) or self.index_keys is None:
            raise ValueError(f"{INDEX_KWARG}: this layer has a top-k indexer; run the model through openmla.hf.generate "
                             "(or openmla.hf.forward_step) of an attached model")
        tables = kwargs.get("position_embeddings")  # transformers' rotary tables at the step's positions, [1, T, rope]
        if not (isinstance(tables, tuple) and len(tables) == 2):
            raise ValueError("position_embeddings: a layer with a top-k indexer needs the model's (cos, sin) tables")
        cos, sin = tables
        step = self.check_step(hidden, step, {})
        q_resid = self.query_latent(hidden)
        q = self.project_q(hidden, q_resid)
        picked = select_keys(self.indexer, self.index_keys, index_step, hidden, q_resid, cos[0], sin[0])
        return self.attend(hidden, step.with_sparse(picked, physical_indices=False), q)
