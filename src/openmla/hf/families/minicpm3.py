"""MiniCPM3: DeepSeek-V2's projections with half-split (``rotate_half``) rope and no ``rope_interleave`` field."""

from __future__ import annotations

from .family import Family

MINICPM3 = Family(
    name="minicpm3", model_types=("minicpm3",), model_classes=("MiniCPM3ForCausalLM",),
    attention_class="MiniCPM3Attention", rope_layout="half", example="openbmb/MiniCPM3-4B",
)
