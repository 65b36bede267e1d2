"""Hunyuan V4 (``hy_v4``): DeepSeek-V3.2's attention with a per-channel output gate (``gate_proj``),
per-head sinks, half-split rope, an indexer that ropes the last values of each index head (its key
norm in float32, its scale on the head weights), and layers that reuse the previous layer's picks.
The hyper-connections around attention are the decoder layer's (transformers' code).

Hunyuan V4 VL (``hy_v4_vl``, ``HYV4VLForConditionalGeneration``): the same attention in its text
model (``model.language_model``), with interleaved rope (even/odd pairs, in the attention and the
indexer alike) and multimodal rope (M-RoPE): three position streams (time, height, width) whose
frequencies are interleaved by ``mrope_section``. For text, transformers gives every token the
same position in all three streams (``_prepare_position_ids_for_generation`` and the text model
expand the 1-D positions), and then each frequency's angle is ``position * inv_freq`` whichever
stream it comes from: the rotary module's output for equal streams is the plain 1-D rope table,
which ``RopeTable`` reads from the module itself. So the family runs text only: pixel values and
the other media inputs, prompts holding the image or video placeholder token, and position ids
whose streams differ are refused (``openmla.hf.text_only``).
"""

from __future__ import annotations

from .family import Family, IndexerSpec, TextOnly

HY_V4 = Family(
    name="hy_v4", model_types=("hy_v4",), model_classes=("HYV4ForCausalLM",), attention_class="HYV4Attention",
    rope_layout="half", output_gate="gate_proj", sinks=True,
    indexer=IndexerSpec(rope_layout="half", rope_at="tail", scale_in_weights=True), shared_topk=True,
    extra_modules=("indexer", "gate_proj"), example="tencent/Hy4-preview",
)

HY_V4_VL = Family(
    name="hy_v4_vl", model_types=("hy_v4_vl",), model_classes=("HYV4VLForConditionalGeneration",),
    attention_class="HYV4VLAttention", decoder="model.language_model", text_config="text_config",
    rope_layout="interleave", output_gate="gate_proj", sinks=True,
    indexer=IndexerSpec(rope_layout="interleave", rope_at="tail", scale_in_weights=True), shared_topk=True,
    text_only=TextOnly(media_inputs=("pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw",
                                     "mm_token_type_ids", "mm_encoder_outputs", "inputs_embeds"),
                       media_tokens=("image_token_id", "video_token_id"), position_streams=3),
    extra_modules=("indexer", "gate_proj"), example="tencent/Hy4 (text only)",
)
