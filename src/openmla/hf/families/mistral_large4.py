"""Mistral Large 4 (``mistral_large4``, ``MistralLarge4ForConditionalGeneration``, text only).

Its text model's attention is GLM-5's DSA attention without q LoRA (``q_proj``), and besides:

- layers without rope (``no_rope_layers`` 0: R = 0, the query's Dn + R values all nope, the cache entry the
  latent alone), beside layers with interleaved rope (R = 64): two cache storages over one page table
  (``Family.per_layer``: the dims differ per layer, the softmax scale does not);
- layers that read an earlier layer's latent instead of writing their own (``kv_source_layers``: no
  ``kv_a_proj_with_mqa`` / ``kv_a_layernorm``; ``Family.latent_sources``): transformers hands them the last
  latent a "store" layer of the same kind (rope or NoPE) put in ``shared_kv_states``, keys already rotated,
  and they apply their own ``kv_b_proj``; here they attend over that layer's cache layer, writing nothing;
- a per-head query scale by position, ``scale_h * log(pos + 1) + bias_h`` (``softmax_scaling``, the module
  itself, on the whole query; ``Family.head_query_scale``);
- learned rope frequencies (``inv_freq * exp(alpha)``): the rope table is read from the rotary module
  itself, so the learned ``alpha`` is in it;
- a top-k indexer whose queries come from the layer's input (``q_input_norm`` -> ``wq_b``), scaled per head
  by position (its own ``softmax_scaling``), with interleaved rope at the head of each index head, and none
  in NoPE layers (its ``use_rope``); "shared" layers (``indexer_types``) reuse the previous layer's picks;
- the final logit soft-capping stays transformers' code (the top-level forward).

The vision tower never runs: pixel values, image sizes, media embeddings and image placeholder tokens
are refused (``openmla.hf.text_only``).
"""

from __future__ import annotations

from typing import Any

from .family import Family, IndexerSpec, TextOnly


def latent_sources(modules: list) -> list[int | None]:
    """The cache layer each attention module reads, as transformers' forward picks it: a module with
    ``is_kv_shared_layer`` reads ``shared_kv_states["rope" or "nope"]``, which the last earlier module of the
    same kind with ``store_full_length_kv`` wrote. ``ValueError`` when none did (transformers fails there) or
    when that is not the layer ``config.kv_source_layers`` names."""
    stored: dict[bool, int] = {}
    out: list[int | None] = []
    for i, m in enumerate(modules):
        flags = {n: getattr(m, n, None) for n in ("use_rope", "is_kv_shared_layer", "store_full_length_kv")}
        if flags["use_rope"] not in (0, 1) or not all(isinstance(flags[n], bool) for n in flags if n != "use_rope"):
            raise ValueError(f"layer {i}'s attention has use_rope, is_kv_shared_layer, store_full_length_kv = "
                             f"{tuple(flags.values())!r} (expected 0/1 and bools)")
        rope = bool(flags["use_rope"])
        declared = (getattr(getattr(m, "config", None), "kv_source_layers", None) or [None] * (i + 1))[i]
        if flags["is_kv_shared_layer"]:
            if (getattr(m, "kv_a_proj_with_mqa", None) is not None) or (getattr(m, "kv_a_layernorm", None) is not None):
                raise ValueError(f"layer {i} reads an earlier layer's latent but has a kv_a_proj_with_mqa or kv_a_layernorm")
            src = stored.get(rope)
            if src is None:
                raise ValueError(f"layer {i} reads an earlier layer's {'rope' if rope else 'NoPE'} latent and no earlier "
                                 "layer of that kind stores one")
            if declared != src:
                raise ValueError(f"layer {i}: kv_source_layers names layer {declared!r}, but transformers' attention reads "
                                 f"layer {src}'s latent (the last stored {'rope' if rope else 'NoPE'} latent)")
            out.append(src)
            continue
        if declared not in (None, i):
            raise ValueError(f"layer {i}: kv_source_layers names layer {declared!r}, but the layer writes its own latent")
        if flags["store_full_length_kv"]:
            stored[rope] = i
        out.append(None)
    return out


def _checks(hf_config: Any) -> str | None:
    kinds = set(getattr(hf_config, "layer_types", None) or ())
    if kinds != {"indexed_attention"}:
        return f"layer_types {sorted(kinds)} (supported: indexed_attention layers)"
    return None


MISTRAL_LARGE4 = Family(
    name="mistral_large4", model_types=("mistral_large4", "mistral_large4_text"),
    model_classes=("MistralLarge4ForConditionalGeneration",), attention_class="MistralLarge4TextAttention",
    decoder="model.language_model", text_config="text_config", rope_layout="interleave",
    head_query_scale="softmax_scaling",
    indexer=IndexerSpec(rope_layout="interleave", query_from="hidden", query_scale=True, rope_by_layer=True),
    shared_topk=True, per_layer=True, latent_sources=latent_sources,
    text_only=TextOnly(media_inputs=("pixel_values", "image_sizes", "mm_encoder_outputs", "inputs_embeds"),
                       media_tokens=("image_token_id",)),
    extra_modules=("indexer", "softmax_scaling"), config_checks=(_checks,),
    example="mistralai/Mistral-Large-4-1T-A52B (text only)",
)
