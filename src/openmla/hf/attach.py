"""``attach`` / ``detach``: route every attention layer of a transformers DeepSeek model through openmla.

After ``attach(model, num_pages=...)`` each decoder layer's ``self_attn`` is an
``AttachedAttention`` sharing the model's own projection modules, and one ``PagedLatentCache``
serves all layers. Embeddings, norms, MLP / MoE and ``lm_head`` stay transformers' code. The
model's attention implementation is switched to ``"openmla"`` (registered with transformers'
``AttentionInterface``); transformers has no mask function under that name, so it builds no
attention mask (no ``[T, T]`` tensor for a packed step). ``detach(model)`` puts the original
modules and attention implementation back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..cache import PagedLatentCache
from ..config import MLAConfig
from .attention import AttachedAttention, check_hf_attention, layer_config

ATTN_IMPLEMENTATION = "openmla"
_ATTR = "_openmla_attachment"


@dataclass
class Attachment:
    """What ``attach`` changed on a model, and the cache its layers share."""

    cache: PagedLatentCache
    config: MLAConfig
    layers: list[AttachedAttention]
    originals: list[nn.Module]
    previous_attn_implementation: str | None
    backend: str | None = None  # the openmla backend asked for (None: automatic per device)
    index_keys: torch.Tensor | None = None  # V3.2: [layers, pages * page_size, index_head_dim], rows as the cache's
    index_topk: int = 0


def _not_attached(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """transformers calls this only for an attention module attach did not replace."""
    raise RuntimeError(f"{type(module).__name__}: this model runs with attn_implementation='openmla', but this "
                       "attention module is not attached; call openmla.hf.detach(model) and attach again")


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, _not_attached)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a transformers ``...ForCausalLM`` (``model.model.layers``)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not hasattr(model, "lm_head") or not hasattr(model, "config"):
        raise ValueError(f"model: expected a transformers DeepseekV3ForCausalLM / DeepseekV2ForCausalLM, got {type(model).__name__}")
    return layers


def attachment(model: nn.Module) -> Attachment:
    """The ``Attachment`` of an attached model; ``ValueError`` when it is not attached."""
    found = getattr(model, _ATTR, None)
    if found is None:
        raise ValueError("model: not attached to openmla; call openmla.hf.attach(model, num_pages=...) first")
    return found


def is_attached(model: nn.Module) -> bool:
    return getattr(model, _ATTR, None) is not None


def attach(
    model: nn.Module,
    num_pages: int,
    page_size: int = 64,
    cache_dtype: torch.dtype | str | None = None,
    *,
    backend: str | None = None,
) -> PagedLatentCache:
    """Route every attention layer of ``model`` through openmla; returns the shared cache.

    ``num_pages`` x ``page_size`` tokens of latent cache per layer are allocated on the model's
    device. ``cache_dtype``: ``None`` stores entries in the attention weights' dtype, else a float
    dtype, ``"fp8_e4m3"`` or ``"fp8_ds_mla"`` (see ``PagedLatentCache``). ``backend`` picks the
    openmla backend (default: automatic per device). Everything is checked before the model is
    changed: a model that is not a DeepSeek MLA model raises ``ValueError`` and stays as it was.
    """
    if is_attached(model):
        raise ValueError("model: already attached; call openmla.hf.detach(model) first")
    layers = decoder_layers(model)
    if len(layers) == 0:
        raise ValueError("model: has no decoder layers")
    originals = [layer.self_attn for layer in layers]
    config = layer_config(model.config, originals[0])
    for i, module in enumerate(originals):
        check_hf_attention(module, config, f"model.layers.{i}.self_attn")
    weight = originals[0].kv_b_proj.weight
    cache = PagedLatentCache(len(layers), num_pages, page_size, config.cache_head_dim, cache_dtype or weight.dtype,
                             device=weight.device, rope_dim=config.qk_rope_head_dim)
    attached = [AttachedAttention.adopt(m, config, i, backend=backend) for i, m in enumerate(originals)]
    indexers = [m.indexer for m in attached if m.indexer is not None]
    index_keys, index_topk = None, 0
    if indexers:
        if len(indexers) != len(attached):
            raise ValueError("model: only some attention layers have a top-k indexer")
        first = indexers[0]
        index_topk = int(first.index_topk)
        index_keys = torch.zeros(len(layers), num_pages * page_size, first.head_dim, dtype=first.wk.weight.dtype,
                                 device=weight.device)
        for i, module in enumerate(attached):
            module.index_keys = index_keys[i]
    _register()
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:
        raise ValueError(f"model: {type(model).__name__} does not accept a custom attention implementation")
    for layer, module in zip(layers, attached):
        layer.self_attn = module
    setattr(model, _ATTR, Attachment(cache, config, attached, originals, previous, backend, index_keys, index_topk))
    return cache


def detach(model: nn.Module) -> None:
    """Undo ``attach``: the original attention modules and attention implementation come back."""
    state = attachment(model)
    for layer, module in zip(decoder_layers(model), state.originals):
        layer.self_attn = module
    if state.previous_attn_implementation is not None:
        model.set_attn_implementation(state.previous_attn_implementation)
    delattr(model, _ATTR)
