"""GLM-4.7-Flash (``glm4_moe_lite``): DeepSeek-V3's attention with Dn=192, Dv=256."""

from __future__ import annotations

from .family import Family, needs

GLM4_MOE_LITE = Family(
    name="glm4_moe_lite", model_types=("glm4_moe_lite",), model_classes=("Glm4MoeLiteForCausalLM",),
    attention_class="Glm4MoeLiteAttention", config_checks=(needs("rope_interleave", (True, False)),),
    example="zai-org/GLM-4.7-Flash",
)
