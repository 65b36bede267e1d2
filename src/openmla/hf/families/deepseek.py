"""DeepSeek-V2, V3 (Kimi K2, Sarvam, and Kimi K2.5's text model load as V3's class) and V3.2."""

from __future__ import annotations

from .family import Family, IndexerSpec, needs

DEEPSEEK_V2 = Family(
    name="deepseek_v2", model_types=("deepseek_v2",), model_classes=("DeepseekV2ForCausalLM",),
    attention_class="DeepseekV2Attention", rope_layout="interleave", rope_reader="complex",  # complex rope: even/odd pairs
    example="deepseek-ai/DeepSeek-V2-Lite",
)

DEEPSEEK_V3 = Family(
    name="deepseek_v3", model_types=("deepseek_v3", "kimi_k2", "sarvam_mla"), model_classes=("DeepseekV3ForCausalLM",),
    attention_class="DeepseekV3Attention", config_checks=(needs("rope_interleave", (True, False)),),
    example="deepseek-ai/DeepSeek-V3, moonshotai/Kimi-K2-Instruct, sarvamai/sarvam-105b",
)

KIMI_K25 = Family(
    name="kimi_k25", model_types=("kimi_k25",), model_classes=("Kimi_K25ForConditionalGeneration",),
    attention_class="DeepseekV3Attention", decoder="model.language_model", text_config="text_config",
    config_checks=(needs("rope_interleave", (True, False)),),
    example="moonshotai/Kimi-K2.6 (text only)",
)

DEEPSEEK_V32 = Family(
    name="deepseek_v32", model_types=("deepseek_v32",), model_classes=("DeepseekV32ForCausalLM",),
    attention_class="DeepseekV32Attention", rope_layout="interleave", indexer=IndexerSpec(rope_layout="half"),
    extra_modules=("indexer",), example="deepseek-ai/DeepSeek-V3.2-Exp",
)
