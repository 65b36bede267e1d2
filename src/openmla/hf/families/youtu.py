"""Youtu-LLM (``youtu``): DeepSeek-V3's attention, a dense model."""

from __future__ import annotations

from .family import Family, needs

YOUTU = Family(
    name="youtu", model_types=("youtu",), model_classes=("YoutuForCausalLM",),
    attention_class="YoutuAttention", config_checks=(needs("rope_interleave", (True, False)),),
    example="tencent/Youtu-LLM-2B",
)
