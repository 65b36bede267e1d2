"""GLM-4.7-Flash (``glm4_moe_lite``, DeepSeek-V3's attention with Dn=192, Dv=256) and GLM-5 (``glm_moe_dsa``)."""

from __future__ import annotations

from .family import Family, IndexerSpec, needs

GLM4_MOE_LITE = Family(
    name="glm4_moe_lite", model_types=("glm4_moe_lite",), model_classes=("Glm4MoeLiteForCausalLM",),
    attention_class="Glm4MoeLiteAttention", config_checks=(needs("rope_interleave", (True, False)),),
    example="zai-org/GLM-4.7-Flash",
)

# GLM-5: DeepSeek-V3.2's attention with interleaved rope in the indexer too, and layers ("shared" in
# config.indexer_types) that reuse the previous layer's top-k picks instead of running an indexer.
GLM_MOE_DSA = Family(
    name="glm_moe_dsa", model_types=("glm_moe_dsa",), model_classes=("GlmMoeDsaForCausalLM",),
    attention_class="GlmMoeDsaAttention", rope_layout="interleave", indexer=IndexerSpec(rope_layout="interleave"),
    shared_topk=True, extra_modules=("indexer",), example="zai-org/GLM-5",
)
