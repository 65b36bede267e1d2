"""A.X K1 (``axk1``): DeepSeek-V3's attention, always with q LoRA; A.X K2 (``axk2``): query gate and top-k indexer."""

from __future__ import annotations

from .family import Family, IndexerSpec, needs

AXK1 = Family(
    name="axk1", model_types=("axk1",), model_classes=("AXK1ForCausalLM",),
    attention_class="AXK1Attention", config_checks=(needs("rope_interleave", (True, False)),),
    example="skt/A.X-K1",
)

# A.X K2: q_gate_proj([q_resid, q_latent]) gives the query and a per-channel output gate (sigmoid in
# float32); interleaved rope; DeepSeek-V3.2's top-k indexer (half-split rope at the head of each index head).
AXK2 = Family(
    name="axk2", model_types=("axk2",), model_classes=("AXK2ForCausalLM",), attention_class="AXK2Attention",
    query="q_gate", output_gate="q_gate", gate_in_float32=True, rope_layout="interleave",
    indexer=IndexerSpec(rope_layout="half"), extra_modules=("indexer",), example="skt/A.X-K2",
)
