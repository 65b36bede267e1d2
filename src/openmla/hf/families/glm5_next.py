"""GLM-5-Next (``glm5_next``, ``Glm5NextForConditionalGeneration``, text only): MLA layers without rope
(R = 0: the key is the latent alone, q its Dn nope dims; transformers passes no position embeddings)
whose attention reads only the keys a top-k indexer picks over pooled key groups (``IndexerSpec(pooled)``:
``index_kpool`` tokens pooled by a softmax gate, the best pools expanded to their tokens plus the
query's open tail pool), layers that reuse the previous layer's picks (``indexer_types`` "shared"),
KDA linear-attention layers between them (transformers' code, per sequence: ``openmla.hf.hybrid``),
and hyper-connections around each block (the decoder layer's, transformers' code). The vision tower
never runs: pixel values, media embeddings and placeholder tokens are refused (``openmla.hf.text_only``).
"""

from __future__ import annotations

from typing import Any

from .family import Family, IndexerSpec, TextOnly


def glm5_layer_types(hf_config: Any) -> str | None:
    kinds = set(getattr(hf_config, "layer_types", None) or ())
    if not kinds or not kinds <= {"indexed_attention", "linear_attention"}:
        return f"layer_types {sorted(kinds)} (supported: indexed_attention and linear_attention layers)"
    if getattr(hf_config, "qk_rope_head_dim", None) != 0:
        return f"qk_rope_head_dim={getattr(hf_config, 'qk_rope_head_dim', None)!r} (GLM-5-Next's attention has no rope: 0)"
    return None


GLM5_NEXT = Family(
    name="glm5_next", model_types=("glm5_next",), model_classes=("Glm5NextForConditionalGeneration",),
    attention_class="Glm5NextTextAttention", decoder="model.language_model", text_config="text_config",
    rope_layout="interleave", rope_reader="none", indexer=IndexerSpec(pooled=True), shared_topk=True,
    linear_attention="Glm5NextTextLinearAttention",
    text_only=TextOnly(media_inputs=("pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw",
                                     "mm_token_type_ids", "mm_encoder_outputs", "inputs_embeds"),
                       media_tokens=("image_token_id", "video_token_id")),
    extra_modules=("indexer",), config_checks=(glm5_layer_types,), example="zai-org/GLM-5.3-Flash (text only)",
)
