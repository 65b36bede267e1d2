"""A.X K1 (``axk1``): DeepSeek-V3's attention, always with q LoRA."""

from __future__ import annotations

from .family import Family, needs

AXK1 = Family(
    name="axk1", model_types=("axk1",), model_classes=("AXK1ForCausalLM",),
    attention_class="AXK1Attention", config_checks=(needs("rope_interleave", (True, False)),),
    example="skt/A.X-K1",
)
