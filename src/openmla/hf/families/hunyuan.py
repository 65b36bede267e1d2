"""Hunyuan V4 (``hy_v4``): DeepSeek-V3.2's attention with a per-channel output gate (``gate_proj``),
per-head sinks, half-split rope, an indexer that ropes the last values of each index head (its key
norm in float32, its scale on the head weights), and layers that reuse the previous layer's picks.
The hyper-connections around attention are the decoder layer's (transformers' code)."""

from __future__ import annotations

from .family import Family, IndexerSpec

HY_V4 = Family(
    name="hy_v4", model_types=("hy_v4",), model_classes=("HYV4ForCausalLM",), attention_class="HYV4Attention",
    rope_layout="half", output_gate="gate_proj", sinks=True,
    indexer=IndexerSpec(rope_layout="half", rope_at="tail", scale_in_weights=True), shared_topk=True,
    extra_modules=("indexer", "gate_proj"), example="tencent/Hy4-preview",
)
