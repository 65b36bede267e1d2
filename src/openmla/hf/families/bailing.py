"""Ling 3 (``bailing_hybrid``, ``BailingHybridForCausalLM``): DeepSeek-V3's attention (q_proj or q LoRA,
interleaved rope) with a head-wise output gate (``g_proj``: one sigmoid scalar per head), in every
``layer_group_size``-th decoder layer; the layers between are KDA linear attention, transformers'
code run per sequence with its own state (``openmla.hf.hybrid``)."""

from __future__ import annotations

from typing import Any

from .family import Family


def hybrid_layer_types(hf_config: Any) -> str | None:
    kinds = set(getattr(hf_config, "layer_types", None) or ())
    if not kinds or not kinds <= {"full_attention", "linear_attention"}:
        return f"layer_types {sorted(kinds)} (supported: full_attention and linear_attention layers)"
    return None


BAILING_HYBRID = Family(
    name="bailing_hybrid", model_types=("bailing_hybrid",), model_classes=("BailingHybridForCausalLM",),
    attention_class="BailingHybridAttention", rope_layout="interleave", output_gate="g_proj",
    linear_attention="BailingHybridDeltaAttention", extra_modules=("g_proj",), config_checks=(hybrid_layer_types,),
    example="inclusionAI/Ling-3.0-Flash",
)
