"""What ``attach`` checks before it changes a model: each layer's attention module against its family.

A module passes only when it is exactly the family's attention class and holds exactly the
submodules and parameters the family's flags account for, with the shapes the MLA dims imply;
its latent norm is probed to be an RMSNorm (``x / rms(x) * weight``). The ``MLAConfig`` every
layer runs with is read from the module itself (its dims, the norm's epsilon, its softmax scale).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ..config import MLAConfig
from .families import Family
from .indexer import check_indexer, check_pooled

_DIMS = ("num_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "hidden_size")


def layer_config(family: Family, hf_config: Any, module: nn.Module, where: str, source: nn.Module | None = None) -> MLAConfig:
    """The ``MLAConfig`` of one attention module (dims and softmax scale as the module holds them).

    ``source``: for a module that reads another's latent (``Family.latent_sources``), that module (its
    ``kv_a_layernorm`` normed the latent). A module with a plain ``q_proj`` and no ``q_lora_rank``
    attribute (Mistral Large 4's) has no q LoRA."""
    plain_q = isinstance(getattr(module, "q_proj", None), nn.Module) and getattr(module, "q_a_proj", None) is None
    needed = _DIMS + ("scaling",) + (() if plain_q else ("q_lora_rank",))
    missing = [d for d in needed if not hasattr(module, d)]
    if missing:
        raise ValueError(f"{where} ({type(module).__name__}) has no {missing}")
    bad = [d for d in _DIMS if not isinstance(getattr(module, d), int) or getattr(module, d) < (d != "qk_rope_head_dim")
           or (d == "qk_rope_head_dim" and getattr(module, d) % 2)]
    if bad:  # R = 0 (no rope part) is a shape openmla's kernels run; a negative or odd one is not
        raise ValueError(f"{where} has {', '.join(f'{d}={getattr(module, d)!r}' for d in bad)}: openmla's kernels need "
                         "positive MLA dims and an even rope width R >= 0")
    scale = module.scaling
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < math.inf:
        raise ValueError(f"{where}.scaling is {scale!r}, not a positive float")
    norm = source if source is not None else module
    eps = _norm_eps(getattr(norm, "kv_a_layernorm", None), f"{where}.kv_a_layernorm")
    q_lora_rank = getattr(module, "q_lora_rank", None)
    if plain_q and q_lora_rank is not None:
        raise ValueError(f"{where} has a q_proj and q_lora_rank={q_lora_rank!r}")
    return MLAConfig(
        num_heads=module.num_heads, kv_lora_rank=module.kv_lora_rank, qk_nope_head_dim=module.qk_nope_head_dim,
        qk_rope_head_dim=module.qk_rope_head_dim, v_head_dim=module.v_head_dim, q_lora_rank=q_lora_rank,
        hidden_size=module.hidden_size, rope_interleave=family.rope_interleaved(hf_config),
        max_position_embeddings=int(getattr(hf_config, "max_position_embeddings", None) or 163840),
        rms_norm_eps=eps, attention_scale=float(scale), name=str(getattr(hf_config, "model_type", family.name)),
    )


def _norm_eps(norm: Any, where: str) -> float:
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if not isinstance(getattr(norm, "weight", None), torch.Tensor) or not isinstance(eps, float):
        raise ValueError(f"{where} is not an RMSNorm with a weight and an epsilon")
    return eps


@torch.no_grad()
def _probe_rms_norm(norm: nn.Module, eps: float, where: str) -> None:
    """``ValueError`` unless ``norm(x)`` is ``x / rms(x) * weight`` (what the cache write computes)."""
    w = norm.weight
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, w.shape[0], generator=g).to(device=w.device, dtype=w.dtype)
    xf = x.float()
    want = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()
    got = norm(x).float()
    tol = 1e-5 if w.dtype in (torch.float32, torch.float64) else 3e-2
    if got.shape != want.shape or not torch.allclose(got, want, rtol=tol, atol=tol * float(w.abs().max())):
        raise ValueError(f"{where} ({type(norm).__name__}) does not compute x / rms(x) * weight")


def _rows(module: nn.Module, name: str) -> int:
    return module.get_submodule(name).weight.shape[0]


def check_attention(family: Family, config: MLAConfig, module: nn.Module, where: str, reads_source: bool = False) -> None:
    """``ValueError`` unless ``module`` is an attention module of ``family`` that ``config`` describes;
    ``reads_source``: it reads an earlier layer's latent (``Family.latent_sources``), so it has no latent
    projection or norm of its own."""
    kind = type(module).__name__
    if kind != family.attention_class:
        raise ValueError(f"{where} is a {kind}; {family.name} models attach with {family.attention_class} only")
    if module.training and float(getattr(module, "attention_dropout", 0.0) or 0.0) > 0:
        raise ValueError(f"{where} is in training mode with attention dropout; call model.eval() first")
    have = {n for n, _ in module.named_children()}
    want = set(family.module_names(config.q_lora_rank is not None))
    if reads_source:
        want -= {"kv_a_proj_with_mqa", "kv_a_layernorm"}
    # a layer reusing the previous layer's top-k has no indexer, nor a dense layer of a family with some
    optional = {"indexer"} if family.shared_topk or family.indexer_optional else set()
    unknown, missing = sorted(have - want), sorted(want - have - optional)
    if unknown or missing:
        raise ValueError(f"{where} ({kind}) has submodules {sorted(have)}; {family.name} attaches with "
                         f"{sorted(want)}" + (f" (not reproduced: {unknown})" if unknown else "") +
                         (f" (missing: {missing})" if missing else ""))
    params = {n for n, _ in module.named_parameters(recurse=False)}
    want_params = {"sinks"} if family.sinks else set()
    if params != want_params:
        raise ValueError(f"{where} holds parameters {sorted(params)} itself; {family.name} attaches with {sorted(want_params)}")
    H, L, R, Dn, Dv = config.num_heads, config.kv_lora_rank, config.qk_rope_head_dim, config.qk_nope_head_dim, config.v_head_dim
    if module.kv_b_proj.bias is not None:
        raise ValueError(f"{where}.kv_b_proj has a bias (the absorbed form has no place for it)")
    shapes = {"kv_b_proj": (H * (Dn + Dv), L), "o_proj": (config.hidden_size, H * Dv)}
    if not reads_source:
        shapes["kv_a_proj_with_mqa"] = (L + R, config.hidden_size)
    q_name = {"q_gate": "q_gate_proj"}.get(family.query, "q_b_proj" if config.q_lora_rank is not None else "q_proj")
    shapes[q_name] = (H * (Dn + R + (Dv if family.query == "q_gate" else 0)), None)
    if family.output_gate == "gate_proj":
        shapes["gate_proj"] = (H * Dv, config.hidden_size)
    if family.output_gate == "g_proj":
        shapes["g_proj"] = (H, config.hidden_size)
    for name, (rows, cols) in shapes.items():
        weight = module.get_submodule(name).weight
        if weight.shape[0] != rows or (cols is not None and weight.shape[1] != cols):
            raise ValueError(f"{where}.{name}.weight has shape {tuple(weight.shape)}, the MLA dims say ({rows}, {cols or '...'})")
    if not reads_source:
        _probe_rms_norm(module.kv_a_layernorm, config.rms_norm_eps, f"{where}.kv_a_layernorm")
    if family.head_query_scale is not None:  # run as the module itself: its per-head parameters are checked
        scaling = module.get_submodule(family.head_query_scale)
        got = {n: tuple(p.shape) for n, p in scaling.named_parameters()}
        if got != {"scale": (H,), "bias": (H,)}:
            raise ValueError(f"{where}.{family.head_query_scale} holds {got}; a per-head query scale has scale and bias of ({H},)")
    if family.rope_key_norm is not None:  # run as the module itself: only its width is checked
        norm = module.get_submodule(family.rope_key_norm)
        if tuple(getattr(norm, "weight", torch.empty(0)).shape) != (R,):
            raise ValueError(f"{where}.{family.rope_key_norm} is not a norm over the key's {R} rope values")
    if family.sinks and tuple(module.sinks.shape) != (H,):
        raise ValueError(f"{where}.sinks has shape {tuple(module.sinks.shape)}, expected ({H},)")
    indexer = getattr(module, "indexer", None)
    if family.indexer is not None and indexer is not None:
        check_indexer(indexer, f"{where}.indexer", family.indexer)
        if family.indexer.pooled:
            check_pooled(indexer, f"{where}.indexer")
    elif indexer is not None:
        raise ValueError(f"{where} has a top-k indexer; {family.name} attaches without one")
