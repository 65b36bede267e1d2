"""Mistral 4: DeepSeek-V3's attention times Llama 4's position-dependent query scale.

transformers multiplies the whole query (after rope) by ``1 + beta * log(1 + floor(pos / original_max))``
with ``beta = rope_parameters["llama_4_scaling_beta"]``; the same factor is applied here to the
query before the kernels rotate it (rope is linear, so the order does not matter).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .family import Family, needs


def _llama4_params(hf_config: Any) -> tuple[Any, Any]:
    rope = getattr(hf_config, "rope_parameters", None) or {}
    return rope.get("llama_4_scaling_beta"), rope.get("original_max_position_embeddings")


def check_llama4_scale(hf_config: Any) -> str | None:
    beta, original = _llama4_params(hf_config)
    if isinstance(beta, bool) or not isinstance(beta, (int, float)):
        return f"rope_parameters.llama_4_scaling_beta={beta!r} (expected a number)"
    if isinstance(original, bool) or not isinstance(original, int) or original < 1:
        return f"rope_parameters.original_max_position_embeddings={original!r} (expected a positive int)"
    return None


def llama4_query_scale(hf_config: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """positions int64 ``[T]`` -> the float32 factor of each token's query (transformers' arithmetic)."""
    beta, original = _llama4_params(hf_config)
    return lambda positions: 1 + beta * torch.log(1 + torch.floor(positions / original))


MISTRAL4 = Family(
    name="mistral4", model_types=("mistral4",), model_classes=("Mistral4ForCausalLM",),
    attention_class="Mistral4Attention", query_scale=llama4_query_scale,
    config_checks=(needs("rope_interleave", (True, False)), check_llama4_scale),
    example="mistralai/Mistral-Small-4-119B-2603",
)
