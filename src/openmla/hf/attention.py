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

STEP_KWARG = "openmla_step"  # the keyword the attention context travels under through transformers' layers
_ROPE_ROWS = 4096  # first size of the shared rope table; it grows with the longest sequence seen


def projection_names(config: MLAConfig) -> tuple[str, ...]:
    """The attention submodules a layer of ``config`` has, under DeepSeek's names."""
    q = ("q_proj",) if config.q_lora_rank is None else ("q_a_proj", "q_a_layernorm", "q_b_proj")
    return q + ("kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")


def check_hf_attention(module: nn.Module, config: MLAConfig, where: str) -> None:
    """``ValueError`` unless ``module`` is an MLA attention module this package can take over."""
    if hasattr(module, "indexer"):
        raise ValueError(f"model: {where} has a top-k indexer (DeepSeek-V3.2 sparse attention), which attach does not route yet")
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
    """``LatentAttention`` over the projection modules of a transformers MLA attention module."""

    @classmethod
    def adopt(cls, module: nn.Module, config: MLAConfig, layer_idx: int, *, backend: str | None = None) -> "AttachedAttention":
        """Build on the meta device (no throw-away weights), then take ``module``'s projections."""
        weight = module.kv_b_proj.weight
        layer = cls(config, layer_idx, dtype=weight.dtype, device="meta", backend=backend, max_position=1)
        for name in projection_names(config):
            setattr(layer, name, getattr(module, name))
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
        out = super().forward(hidden_states[0], step)
        return out[None], None
