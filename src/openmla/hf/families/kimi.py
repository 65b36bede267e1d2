"""Kimi Linear (``kimi_linear``, ``KimiLinearForCausalLM``): MLA layers (q_proj or q LoRA) whose R values
per key are shared across heads but never rotated (no rotary module: openmla's identity rope table),
between KDA linear-attention layers, transformers' code run per sequence with its own state
(``openmla.hf.hybrid``)."""

from __future__ import annotations

from .bailing import hybrid_layer_types
from .family import Family

KIMI_LINEAR = Family(
    name="kimi_linear", model_types=("kimi_linear",), model_classes=("KimiLinearForCausalLM",),
    attention_class="KimiLinearAttention", rope_layout="interleave", rope_reader="none",
    linear_attention="KimiLinearDeltaAttention", config_checks=(hybrid_layer_types,),
    example="moonshotai/Kimi-Linear-48B-A3B-Instruct",
)
