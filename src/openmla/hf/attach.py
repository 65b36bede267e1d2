"""``attach`` / ``detach``: route every attention layer of a transformers MLA model through openmla.

``attach`` accepts only the model classes of a known family (``openmla.hf.families``) and checks
every layer's attention module and the config against what that family's flags reproduce; any
difference is a ``ValueError`` naming the class and the feature, raised before the model is
changed. After ``attach(model, num_pages=...)`` each decoder layer's ``self_attn`` (each entry of
it, for a family with several MLA blocks per layer) is an ``AttachedAttention`` sharing the module's
own submodules, and one ``PagedLatentCache`` serves all of them, one cache layer each (a model
whose layers differ in latent width, dots3, has one storage per width over the same pages, and a
plan per distinct width, softmax scale and sliding window each step; a layer that reads an earlier
layer's latent, Mistral Large 4's, has no cache layer of its own and reads its source's). Embeddings, norms, MLP / MoE
and ``lm_head`` stay transformers' code. The text model's attention implementation is switched to ``"openmla"`` (registered with transformers'
``AttentionInterface``); transformers has no mask function under that name, so it builds no
attention mask (no ``[T, T]`` tensor for a packed step). ``detach(model)`` puts the original
modules and attention implementation back.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..cache import PagedLatentCache
from ..config import MLAConfig
from ..formats import RECORDS
from .attention import AttachedAttention
from .implementation import ATTN_IMPLEMENTATION, register
from .checks import check_attention, layer_config
from .families import Family, family_of
from .hybrid import HybridLayers, check_linear, is_linear
from .indexer import pooled_width
from .rope import RopeTable, rope_limit
from .state import ATTR, Attachment, attachment, is_attached
from .stats import AttentionClock
from .step import forward_step
from .text_only import TextOnlyGuard, media_token_ids
from .v4 import _ATTR as V4_ATTR, attach_v4, detach_v4, is_v4
from .verify import check_inputs, check_steps, openmla_outputs, transformers_outputs, unverified_warning, worst_difference


def decoder_layers(model: nn.Module, family: Family | None = None) -> nn.ModuleList:
    """The decoder layers of a transformers model of ``family`` (``model.model.layers`` for a ``...ForCausalLM``)."""
    family = family or family_of(model)
    layers = getattr(family.decoder_of(model), "layers", None)
    if not isinstance(layers, nn.ModuleList) or not hasattr(model, "lm_head"):
        raise ValueError(f"has no decoder layers at {family.decoder}.layers or no lm_head")
    return layers


def attention_slots(layers: nn.ModuleList, family: Family) -> list[tuple[nn.Module, str, str]]:
    """``(parent, attribute, where)`` of every MLA attention module, in cache-layer order: each decoder
    layer's ``self_attn``, or its ``family.sublayers`` entries where ``self_attn`` is a ``ModuleList``; a hybrid
    model's linear-attention layers are not among them (``openmla.hf.hybrid``)."""
    slots = []
    for i, layer in enumerate(layers):
        where = f"{family.decoder}.layers.{i}.self_attn"
        if is_linear(getattr(layer, "self_attn", None), family):
            continue
        if family.sublayers == 1:
            slots.append((layer, "self_attn", where))
            continue
        blocks = getattr(layer, "self_attn", None)
        if not isinstance(blocks, nn.ModuleList) or len(blocks) != family.sublayers:
            raise ValueError(f"{where} is a {type(blocks).__name__}, not a ModuleList of {family.sublayers} MLA modules")
        slots += [(blocks, str(j), f"{where}.{j}") for j in range(family.sublayers)]
    return slots


def _text_config(model: nn.Module, family: Family) -> Any:
    return model.config if family.text_config is None else getattr(model.config, family.text_config)


def _set_attn_implementation(model: nn.Module, family: Family, implementation: str) -> None:
    model.set_attn_implementation(implementation if family.text_config is None else {family.text_config: implementation})


@dataclass(frozen=True)
class Checked:
    """What ``attach`` read from a model, checked: per MLA attention module (cache-layer order) its
    ``MLAConfig``, rope table, sliding window (None: causal) and the earlier module whose latent it reads
    (None: its own; ``Family.latent_sources``)."""

    family: Family
    hf_config: Any
    layers: nn.ModuleList
    configs: list[MLAConfig]
    ropes: list[RopeTable]
    windows: list[int | None]
    sources: list[int | None]


def _checked(model: nn.Module) -> Checked:
    """Everything ``attach`` needs, checked; nothing on the model changes here. Every refusal is a
    ``ValueError`` naming the model class and what openmla.hf does not reproduce."""
    family = family_of(model)
    try:
        return Checked(family, *_check_family_model(model, family))
    except ValueError as exc:
        raise ValueError(f"model: {type(model).__name__}: {exc}") from None


def _layer_type(hf_config: Any, index: int) -> str:
    types = getattr(hf_config, "layer_types", None)
    if not isinstance(types, (list, tuple)) or index >= len(types) or not isinstance(types[index], str):
        raise ValueError(f"its config has no layer_types entry for layer {index} (the rope is chosen by layer type)")
    return types[index]


def _window(family: Family, hf_config: Any, module: nn.Module, where: str) -> int | None:
    """The sliding window of one attention module (None: causal), checked against what transformers' mask uses."""
    window = getattr(module, "sliding_window", None)
    if window is None:
        return None
    if not family.sliding_window:
        raise ValueError(f"{where} has a sliding window ({window!r}); {family.name} attaches without one")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1 or window != getattr(hf_config, "sliding_window", None):
        raise ValueError(f"{where}.sliding_window is {window!r}, the config's (its mask's) {getattr(hf_config, 'sliding_window', None)!r}")
    return window


def _check_lora_scales(family: Family, module: nn.Module, where: str) -> None:
    names = {"query": ("mla_scale_q_lora", "mla_scale_kv_lora"), "latents": ("q_lora_scale", "kv_lora_scale")}.get(
        family.lora_scales, ())
    for name in names:
        value = getattr(module, name, None)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise ValueError(f"{where}.{name} is {value!r}, not a positive float")


def _check_family_model(model: nn.Module, family: Family) -> tuple:
    layers = decoder_layers(model, family)
    if len(layers) == 0:
        raise ValueError("has no decoder layers")
    hf_config = _text_config(model, family)
    for check in family.config_checks:
        problem = check(hf_config)
        if problem is not None:
            raise ValueError(f"{problem}; openmla.hf does not reproduce it")
    check_linear(family, hf_config, layers)
    slots = attention_slots(layers, family)
    originals = [getattr(parent, name, None) for parent, name, _ in slots]
    where = [at for _, _, at in slots]
    for module, at in zip(originals, where):
        if not isinstance(module, nn.Module) or not isinstance(getattr(module, "kv_b_proj", None), nn.Module):
            raise ValueError(f"{at} is a {type(module).__name__}, not one MLA attention module")
    sources = _latent_sources(family, originals, where)
    configs = [layer_config(family, hf_config, module, at, None if src is None else originals[src])
               for module, at, src in zip(originals, where, sources)]
    for module, at, mine, src in zip(originals, where, configs, sources):
        check_attention(family, mine, module, at, reads_source=src is not None)
        if src is not None and (mine.kv_lora_rank, mine.qk_rope_head_dim) != (configs[src].kv_lora_rank,
                                                                             configs[src].qk_rope_head_dim):
            raise ValueError(f"{at} reads the latent of {where[src]}, whose entries are L+R = {configs[src].kv_lora_rank}+"
                             f"{configs[src].qk_rope_head_dim} wide, but its own dims are {mine.kv_lora_rank}+{mine.qk_rope_head_dim}")
        _check_lora_scales(family, module, at)
        if mine != configs[0] and not family.per_layer:
            raise ValueError(f"{at} has other MLA dims or another softmax scale than layer 0 ({mine} vs {configs[0]}): one cache "
                             "width and one plan serve all layers")
    windows = [_window(family, hf_config, module, at) for module, at in zip(originals, where)]
    if family.shared_topk and getattr(originals[0], "indexer", None) is None:
        raise ValueError("layer 0 has no top-k indexer, so no layer before it has picks to share")
    if family.rope_reader == "none":  # no rotary module; the rope part of q and k is never rotated (Kimi Linear)
        return hf_config, layers, configs, [RopeTable(None, c.qk_rope_head_dim, "none", None) for c in configs], windows, sources
    rotary = getattr(family.decoder_of(model), "rotary_emb", None)
    if not isinstance(rotary, nn.Module):
        raise ValueError(f"has no rotary embedding module at {family.decoder}.rotary_emb")
    index_of = {id(layer): i for i, layer in enumerate(layers)}
    ropes, by_key = [], {}
    try:
        for (parent, _, _), c in zip(slots, configs):
            if c.qk_rope_head_dim == 0:  # a layer without rope (Mistral Large 4's NoPE layers): an empty table
                ropes.append(RopeTable(None, 0, "none", None))
                continue
            kind = _layer_type(hf_config, index_of[id(parent)]) if family.rope_by_layer_type else None
            key = (kind, c.qk_rope_head_dim)
            if key not in by_key:  # one table per layer type (and rope width), shared by its layers
                rope = RopeTable(rotary, c.qk_rope_head_dim, family.rope_reader, rope_limit(rotary, hf_config, kind), kind)
                rope.check(originals[0].kv_b_proj.weight.device)
                by_key[key] = rope
            ropes.append(by_key[key])
    except ValueError as exc:
        raise ValueError(f"{exc}; openmla.hf does not reproduce it") from None
    return hf_config, layers, configs, ropes, windows, sources


def _latent_sources(family: Family, modules: list[nn.Module], where: list[str]) -> list[int | None]:
    """Per MLA attention module, the earlier module whose latent it reads (``Family.latent_sources``), or None."""
    if family.latent_sources is None:
        return [None] * len(modules)
    sources = list(family.latent_sources(modules))
    if len(sources) != len(modules):  # a bug in the family's function, not the user's
        raise RuntimeError(f"{family.name}: latent_sources gave {len(sources)} entries for {len(modules)} attention modules")
    for i, src in enumerate(sources):
        if src is not None and not (isinstance(src, int) and 0 <= src < i and sources[src] is None):
            raise ValueError(f"{where[i]} reads the latent of module {src!r}, not an earlier module that writes its own")
    return sources


def _seat(model: nn.Module, checked: Checked, num_pages: int, page_size: int, cache_dtype: torch.dtype | str | None,
          backend: str | None) -> PagedLatentCache:
    """Seat every attention module of a checked model on openmla (what ``attach`` does once the model is checked)."""
    family, hf_config, layers, configs = checked.family, checked.hf_config, checked.layers, checked.configs
    config, rope = configs[0], checked.ropes[0]
    slots = attention_slots(layers, family)
    originals = [getattr(parent, name) for parent, name, _ in slots]
    weight = originals[0].kv_b_proj.weight
    # Cache storage per latent width (L, R) (one for every family but dots3), cache layers numbered within it;
    # a plan per distinct (storage, softmax scale, sliding window) each step.
    # A layer reading an earlier layer's latent (Family.latent_sources) has no cache layer: it runs on its source's.
    widths, group_of, index_in_group = [], [], []
    plan_keys, plan_of = [], []
    for c, window, src in zip(configs, checked.windows, checked.sources):
        width = (c.kv_lora_rank, c.qk_rope_head_dim)
        if width not in widths:
            widths.append(width)
        g = widths.index(width)
        writers = sum(1 for k, s in zip(group_of, checked.sources) if k == g and s is None)
        index_in_group.append(writers if src is None else index_in_group[src])
        group_of.append(g)
        key = (g, c.softmax_scale, window)
        if key not in plan_keys:
            plan_keys.append(key)
        plan_of.append(plan_keys.index(key))
    for L, R in widths:
        why = RECORDS[cache_dtype].shape_error(L, R) if cache_dtype in RECORDS else None
        if why is not None:  # a record format that cannot hold this model's entries (NVFP4: L=512, R=64 only)
            raise ValueError(f"cache_dtype: {why[1]}")
    caches = [PagedLatentCache(sum(1 for k, s in zip(group_of, checked.sources) if k == g and s is None), num_pages,
                               page_size, L + R, cache_dtype or weight.dtype, device=weight.device, rope_dim=R)
              for g, (L, R) in enumerate(widths)]
    cache = caches[0]  # its allocator, page tables and lengths serve every storage (the same rows in each)
    scale = family.query_scale(hf_config) if family.query_scale is not None else None
    clock = AttentionClock(weight.device)
    attached = [AttachedAttention.adopt(m, c, i, family, r, clock, query_scale=scale, backend=backend,
                                        reads_latent=src is not None)
                for m, c, i, r, src in zip(originals, configs, index_in_group, checked.ropes, checked.sources)]
    for module, k in zip(attached, plan_of):
        module.plan_index = k
    indexers = [m for m in attached if m.indexer is not None]
    index_keys, index_topk = None, 0
    if indexers:
        first = indexers[0].indexer
        index_topk = int(first.index_topk)
        if any(int(m.indexer.index_topk) != index_topk or m.indexer.head_dim != first.head_dim for m in indexers):
            raise ValueError(f"model: {type(model).__name__}: its indexers differ in index_topk or index_head_dim")
        width = first.head_dim
        if family.indexer.pooled:  # GLM-5-Next: each row holds the key and its pool gate scores; picks add the open tail pool
            if any(m.indexer.index_kpool != first.index_kpool or m.indexer.index_kpool_always_select_tail
                   != first.index_kpool_always_select_tail for m in indexers):
                raise ValueError(f"model: {type(model).__name__}: its indexers differ in index_kpool")
            width, index_topk = 2 * first.head_dim, pooled_width(first)
        index_keys = torch.zeros(len(indexers), num_pages * page_size, width, dtype=first.wk.weight.dtype,
                                 device=weight.device)
        for j, module in enumerate(indexers):
            module.index_keys = index_keys[j]
    register()
    text = _text_config(model, family)
    previous = text._attn_implementation
    _set_attn_implementation(model, family, ATTN_IMPLEMENTATION)
    if text._attn_implementation != ATTN_IMPLEMENTATION:
        raise ValueError(f"model: {type(model).__name__} does not accept a custom attention implementation")
    for (parent, name, _), module in zip(slots, attached):
        setattr(parent, name, module)
    hybrid = HybridLayers.attach(family, hf_config, layers)
    guard = TextOnlyGuard.install(family, model) if family.text_only is not None else None
    setattr(model, ATTR, Attachment(cache, config, attached, originals, previous, backend, index_keys, index_topk,
                                     family, int(hf_config.vocab_size), rope, clock, hybrid, guard,
                                     media_token_ids(family, model), caches, plan_keys))
    return cache


def attach(
    model: nn.Module,
    num_pages: int,
    page_size: int = 64,
    cache_dtype: torch.dtype | str | None = None,
    *,
    backend: str | None = None,
    verify: bool = True,
) -> PagedLatentCache:
    """Route every attention layer of ``model`` through openmla; returns the shared cache.

    ``num_pages`` x ``page_size`` tokens of latent cache per layer are allocated on the model's
    device (a model whose layers differ in latent width, dots3, gets one storage per width, every
    layer with the same pages). ``cache_dtype``: ``None`` stores entries in the attention weights' dtype, else a float
    dtype, ``"fp8_e4m3"``, ``"fp8_ds_mla"``, ``"nvfp4_ds_mla"`` or ``"nvfp4_fp8rope"`` (see
    ``PagedLatentCache``; the NVFP4 records hold L=512, R=64 models only). ``backend`` picks the
    openmla backend (default: automatic per device). Everything is checked before the model is
    changed: a model openmla.hf does not run exactly raises ``ValueError`` and stays as it was.

    ``verify`` (default): the self-check (``openmla.hf.verify``) runs every attention module as transformers
    runs it and as openmla does, on the same random inputs, and refuses the model with a ``ValueError`` naming
    the layer, the step, the error and the installed transformers version when they differ beyond the weights'
    dtype's tolerance; the model is then left exactly as it was. It also reads the rope layout the modules apply
    (half-split or interleaved pairs) from what they compute. ``verify=False`` skips it, with a warning.
    """
    if is_v4(model):  # DeepSeek-V4: shared-KV entries, sliding + compressed stores (openmla.hf.v4)
        return attach_v4(model, num_pages, page_size, cache_dtype, backend=backend, verify=verify)
    if is_attached(model):
        raise ValueError("model: already attached; call openmla.hf.detach(model) first")
    checked = _checked(model)
    if verify:
        checked = _verified(model, checked, page_size, backend)
    else:
        unverified_warning(type(model).__name__)
    return _seat(model, checked, num_pages, page_size, cache_dtype, backend)


def _rope_readings(checked: Checked) -> list[Checked]:
    """``checked`` as the family's table reads it, then with the other rope layout (half-split <-> interleaved
    pairs, in the attention and its indexer alike): the self-check keeps the first that the modules compute."""
    if checked.family.rope_reader == "none" or all(c.qk_rope_head_dim == 0 for c in checked.configs):
        return [checked]
    other = "half" if checked.configs[0].rope_interleave else "interleave"
    family = dataclasses.replace(checked.family, rope_layout=other)
    if family.indexer is not None:
        family = dataclasses.replace(family, indexer=dataclasses.replace(family.indexer, rope_layout=(
            "half" if family.indexer.rope_layout == "interleave" else "interleave")))
    configs = [dataclasses.replace(c, rope_interleave=other == "interleave") for c in checked.configs]
    return [checked, dataclasses.replace(checked, family=family, configs=configs)]


def _verified(model: nn.Module, checked: Checked, page_size: int, backend: str | None) -> Checked:
    """The reading of ``checked`` whose openmla run equals transformers' own on the self-check, or ``ValueError``
    (the first reading's difference) with the model left as it was."""
    family = checked.family
    slots = attention_slots(checked.layers, family)
    modules = [getattr(parent, name) for parent, name, _ in slots]
    weight = modules[0].kv_b_proj.weight
    indexer = next((m.indexer for m in modules if getattr(m, "indexer", None) is not None), None)
    topk = int(getattr(indexer, "index_topk", 0) or 0)
    steps = check_steps(int(checked.hf_config.vocab_size), topk, sorted(media_token_ids(family, model) or ()))
    inputs = check_inputs(steps, modules, checked.configs[0].hidden_size)
    want = transformers_outputs(model, modules, steps, inputs)
    first = None
    for reading in _rope_readings(checked):
        cache = _seat(model, reading, -(-steps.total // page_size) + 1, page_size, None, backend)
        key = ("openmla.hf.verify", id(model))

        def run_step(i: int, ids: torch.Tensor) -> None:
            batch = cache.prepare([key], [int(ids.numel())])
            forward_step(model, batch, ids, torch.tensor([int(ids.numel()) - 1]))
            cache.commit(batch)

        try:
            got = openmla_outputs(attachment(model).layers, steps, inputs, run_step)
        finally:
            detach(model)
        difference = worst_difference(want, got, [at for _, _, at in slots], steps, weight.dtype)
        if difference is None:
            return reading
        first = first or difference
    raise ValueError(first.message(type(model).__name__))


def detach(model: nn.Module) -> None:
    """Undo ``attach``: the original attention modules and attention implementation come back. A model that is not
    attached (never, or after a refused ``attach``) is left as it is."""
    if getattr(model, V4_ATTR, None) is not None:
        return detach_v4(model)
    if not is_attached(model):
        return None
    state = attachment(model)
    for (parent, name, _), module in zip(attention_slots(decoder_layers(model, state.family), state.family), state.originals):
        setattr(parent, name, module)
    if state.hybrid is not None:
        state.hybrid.detach()
    if state.text_only is not None:
        state.text_only.remove()
    if state.previous_attn_implementation is not None:
        _set_attn_implementation(model, state.family, state.previous_attn_implementation)
    delattr(model, ATTR)
