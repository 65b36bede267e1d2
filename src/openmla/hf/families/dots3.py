"""dots3 (``dots3_note``, rednote's dots.llm3 note): MLA whose dims change per layer.

``config.per_layer_config[i]`` gives each layer type its own heads and latent width (the released
model: 128 heads, L=512, Dn=128 in the indexed layers; 64 heads, L=1024, Dn=192 in the sliding
ones; R=64, Dv=128 in both), so each latent width gets its own cache storage over one page table
and each (width, softmax scale, window) its own plan (``Family.per_layer``). Besides DeepSeek-V3.2's
attention: the normed query latent is scaled by ``sqrt(hidden / q_lora_rank)`` before ``q_b_proj``
and the indexer, the normed latent by ``sqrt(hidden / kv_lora_rank)``; an RMSNorm over the key's rope
part before the (interleaved) rotation (``k_rope_only_layernorm``); a sigmoid output gate of one
scalar per head (``g_proj``); sliding-window layers (``config.sliding_window``, dense) beside indexed
layers (a top-k indexer with interleaved rope at the head of each index head, each layer its own);
a rope per layer type (its own theta and width).

``Dots3NoteForCausalLM`` is the text model; ``Dots3NoteForConditionalGeneration`` runs its text model
(``model.language_model``, 1-D positions) on token ids alone: images, videos and audio are refused.
"""

from __future__ import annotations

from typing import Any

from .family import Family, IndexerSpec, TextOnly


def _layer_types(hf_config: Any) -> str | None:
    kinds = set(getattr(hf_config, "layer_types", None) or ())
    if not kinds or not kinds <= {"indexed_attention", "sliding_attention"}:
        return f"layer_types {sorted(kinds)} (supported: indexed_attention and sliding_attention layers)"
    return None


_COMMON = dict(
    name="dots3_note", model_types=("dots3_note", "dots3_note_text"), attention_class="Dots3NoteTextAttention",
    rope_layout="interleave", output_gate="g_proj", indexer=IndexerSpec(rope_layout="interleave"), indexer_optional=True,
    lora_scales="latents", rope_key_norm="k_rope_only_layernorm", per_layer=True, sliding_window=True,
    rope_by_layer_type=True, extra_modules=("indexer", "g_proj", "k_rope_only_layernorm"), config_checks=(_layer_types,),
)

DOTS3_NOTE = Family(model_classes=("Dots3NoteForCausalLM",), example="rednote-hilab/dots3-note (text model)", **_COMMON)

DOTS3_NOTE_MM = Family(
    model_classes=("Dots3NoteForConditionalGeneration",), decoder="model.language_model", text_config="text_config",
    text_only=TextOnly(media_inputs=("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw",
                                     "input_features", "chunk_sample_lengths", "mm_encoder_outputs", "inputs_embeds"),
                       media_tokens=("image_token_id", "video_token_id", "audio_token_id")),
    example="rednote-hilab/dots3-note (text only)", **_COMMON,
)
