"""``Family``: what one transformers MLA model family's attention is, as a table of names and flags.

The one attention core (``AttachedAttention``) reads these flags; a family adds no code of its
own beyond small functions named here (a config check, a query scale rule). Everything a flag
does not describe is refused by ``attach``: the model class must be listed, every layer's
attention module must be exactly ``attention_class`` and hold only the submodules the flags
account for, and each ``config_checks`` function must pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

# The MLA projections every family holds (DeepSeek's names), with q LoRA or a plain q_proj.
KV_MODULES = ("kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")
Q_LORA_MODULES = ("q_a_proj", "q_a_layernorm", "q_b_proj")


@dataclass(frozen=True)
class IndexerSpec:
    """A top-k indexer (DeepSeek Sparse Attention) in the form of transformers' ``DeepseekV32Indexer``.

    - ``rope_layout``: ``"half"`` (``rotate_half`` pairs) or ``"interleave"`` (even/odd pairs);
    - ``rope_at``: ``"head"`` (the first R values of each index head carry the rope) or ``"tail"``;
    - ``scale_in_weights``: ``softmax_scale`` multiplies the head weights (after the relu), not the scores;
    - ``query_from``: ``"q_latent"`` (``wq_b`` reads the attention's normed query latent) or ``"hidden"``
      (``wq_b(q_input_norm(hidden))``: the indexer's own norm over the layer's input, for attention without
      q LoRA: Mistral Large 4);
    - ``query_scale``: the indexer's ``softmax_scaling`` module scales each index query by its position
      (called as transformers calls it, on ``[1, T, heads, head_dim]`` before the rope);
    - ``rope_by_layer``: the indexer's ``use_rope`` says whether it ropes at all (Mistral Large 4's NoPE
      layers' indexers rotate nothing);
    - ``pooled``: GLM-5-Next's k-pool form (``index_kpool`` P, no rope): the keys of every complete group
      of P positions are pooled by a softmax over ``gate + ape`` into one candidate, the top
      ``index_topk // P`` visible pools win and expand to their P positions, plus (with
      ``index_kpool_always_select_tail``) the query's open tail pool; the key store's rows hold each
      token's key and its gate scores.
    """

    rope_layout: str = "half"
    rope_at: str = "head"
    scale_in_weights: bool = False
    query_from: str = "q_latent"
    query_scale: bool = False
    rope_by_layer: bool = False
    pooled: bool = False

    def __post_init__(self) -> None:
        if self.query_from not in ("q_latent", "hidden"):
            raise ValueError(f"IndexerSpec: query_from must be 'q_latent' or 'hidden', got {self.query_from!r}")


@dataclass(frozen=True)
class TextOnly:
    """A multimodal model run on its text alone (``openmla.hf.text_only``).

    - ``media_inputs``: forward keywords of the top-level model that carry images or videos (or
      embeddings that may hold them); any of them not None is refused;
    - ``media_tokens``: attributes of the top-level config naming the placeholder token ids that
      stand for an image or video; a prompt holding one is refused;
    - ``position_streams``: the model's rope reads that many position streams per token (M-RoPE: 3);
      position ids ``[streams, B, T]`` (``[1 + streams, B, T]`` with a leading text axis) are refused
      unless every stream equals the first, the only case the rope table (one position per token) holds.
    """

    media_inputs: tuple[str, ...]
    media_tokens: tuple[str, ...] = ()
    position_streams: int = 1


# A config check: (transformers text config) -> a problem in words, or None.
ConfigCheck = Callable[[Any], "str | None"]
# A query scale rule: (transformers text config) -> (positions int64 [T]) -> float factor [T] on q.
QueryScale = Callable[[Any], Callable[[torch.Tensor], torch.Tensor]]
# Which cache layer each MLA attention module reads: (the modules, in cache-layer order) -> per module the
# index of the earlier module whose latent it reads instead of writing its own (None: its own), or a
# ValueError naming what is not reproduced.
LatentSources = Callable[[list], list]


@dataclass(frozen=True)
class Family:
    """One MLA family's attention, as the shared core runs it.

    - ``name``: transformers' folder (``models/<name>``); ``model_types``: config ``model_type`` values
      that load this way; ``model_classes``: the top-level classes ``attach`` accepts;
    - ``attention_class``: the class every layer's ``self_attn`` must be;
    - ``decoder``: attribute path from the top-level model to its decoder stack (``layers``,
      ``rotary_emb``, ``config``); ``text_config``: the sub-config of a composite model whose
      attention implementation is switched (None: the model's own config);
    - ``query``: ``"auto"`` (``q_proj``, or q LoRA when ``config.q_lora_rank`` is set) or ``"q_gate"``
      (``q_gate_proj([q_resid, q_latent])`` gives the query and a per-channel output gate);
    - ``rope_layout``: ``"config"`` (``config.rope_interleave``), ``"interleave"`` or ``"half"``;
      ``rope_reader``: ``"cos_sin"`` or ``"complex"`` (what the rotary module returns), or ``"none"``: the model
      has no rotary module and never rotates the rope part of queries and keys (Kimi Linear's MLA);
    - ``query_scale``: a per-position factor on the query (Llama-4's), None for none;
      ``head_query_scale``: the name of a submodule of the attention module that scales the query per head
      and position, called as transformers calls it (``module(q [1, T, H, Dn+R], positions [1, T],
      head_dim_first=False)``, before the rope: rope is linear); Mistral Large 4's ``softmax_scaling``
      (``scale_h * log(pos + 1) + bias_h``);
    - ``output_gate``: None, ``"q_gate"`` or ``"gate_proj"`` (``sigmoid(gate)`` times each head's output
      before ``o_proj``), or ``"g_proj"`` (one scalar per head from ``g_proj``, its sigmoid in float32 and
      cast to the activations' dtype before the product: Ling 3's); ``gate_in_float32``: the sigmoid and
      product in float32, then cast back;
    - ``sinks``: a per-head ``sinks`` parameter (one extra logit in each softmax);
    - ``indexer``: the top-k indexer's form (None: dense attention); ``shared_topk``: layers without
      an indexer reuse the previous layer's picks (the attention returns them as a third value);
    - ``sublayers``: MLA attention modules per decoder layer; above 1, ``self_attn`` is a ``ModuleList``
      of that many (LongCat-Flash: 2), each its own cache layer, in order;
    - ``lora_scales``: constant factors on the query and the normed latent: ``"query"`` (the module's
      ``mla_scale_q_lora`` multiplies the whole query and ``mla_scale_kv_lora`` the normed latent:
      LongCat-Flash) or ``"latents"`` (``q_lora_scale`` multiplies the normed query latent before
      ``q_b_proj`` and the indexer, ``kv_lora_scale`` the normed latent: dots3); None: none;
    - ``rope_key_norm``: the name of an RMSNorm module over the R rope values of each key, applied before
      the rotation (dots3's ``k_rope_only_layernorm``); the adapter runs the module on the key's rope part
      before the cache write rotates it (rotation and norm commute with nothing else in between);
    - ``per_layer``: layers may differ in MLA dims (H, L, Dn, Dv, q LoRA), softmax scale and sliding window
      (dots3's ``per_layer_config``): the layers of each latent width get their own cache storage (one page
      table for all), and each distinct (width, scale, window) its own plan per step;
    - ``sliding_window``: a layer whose module has ``sliding_window`` set attends to the last that many
      positions (its own included), which must equal the text config's ``sliding_window`` (the window
      transformers' mask uses); ``rope_by_layer_type``: the rotary module takes the layer's type
      (``config.layer_types[i]``) and gives each type its own table;
    - ``indexer_optional``: layers without an indexer attend densely (they neither pick nor reuse picks);
    - ``linear_attention``: the class of a hybrid model's linear-attention layers (decoder layers whose
      ``self_attn`` is that class instead of ``attention_class``); they stay transformers' code, run on each
      sequence of a step with that sequence's own state (``openmla.hf.hybrid``); None: every layer is MLA;
    - ``text_only``: a multimodal model whose text model is attached and run on token ids alone; what is
      not text (pixel values, media placeholder tokens, position streams that differ) is refused;
    - ``latent_sources``: layers may read an earlier layer's latent instead of writing their own (Mistral Large
      4's ``kv_source_layers``): a function naming each module's source (``LatentSources``); such a layer has no
      ``kv_a_proj_with_mqa`` / ``kv_a_layernorm`` and no cache layer of its own: it runs the step's attention
      over its source's cache layer (already written this step) with its own ``kv_b_proj``, writing nothing;
    - ``extra_modules``: submodules beyond the MLA projections that the flags account for;
    - ``config_checks``: further checks of the config (allow-list of what the flags reproduce);
    - ``example``: a checkpoint of the family, for ``openmla models``.
    """

    name: str
    model_types: tuple[str, ...]
    model_classes: tuple[str, ...]
    attention_class: str
    decoder: str = "model"
    text_config: str | None = None
    query: str = "auto"
    rope_layout: str = "config"
    rope_reader: str = "cos_sin"
    query_scale: QueryScale | None = None
    head_query_scale: str | None = None
    output_gate: str | None = None
    gate_in_float32: bool = False
    sinks: bool = False
    indexer: IndexerSpec | None = None
    shared_topk: bool = False
    sublayers: int = 1
    lora_scales: str | None = None
    rope_key_norm: str | None = None
    per_layer: bool = False
    sliding_window: bool = False
    rope_by_layer_type: bool = False
    indexer_optional: bool = False
    linear_attention: str | None = None
    text_only: TextOnly | None = None
    latent_sources: LatentSources | None = None
    extra_modules: tuple[str, ...] = ()
    config_checks: tuple[ConfigCheck, ...] = ()
    example: str = ""

    def __post_init__(self) -> None:
        choices = {"query": ("auto", "q_gate"), "rope_layout": ("config", "interleave", "half"),
                   "rope_reader": ("cos_sin", "complex", "none"), "output_gate": (None, "q_gate", "gate_proj", "g_proj"),
                   "lora_scales": (None, "query", "latents")}
        for attr, allowed in choices.items():
            if getattr(self, attr) not in allowed:
                raise ValueError(f"Family {self.name}: {attr} must be one of {allowed}, got {getattr(self, attr)!r}")
        if (self.query == "q_gate") != (self.output_gate == "q_gate"):
            raise ValueError(f"Family {self.name}: query 'q_gate' and output_gate 'q_gate' go together")
        if self.output_gate == "g_proj" and self.gate_in_float32:
            raise ValueError(f"Family {self.name}: output_gate 'g_proj' casts its sigmoid back before the product")

    def decoder_of(self, model: Any) -> Any:
        """The decoder stack of ``model`` (``model.model`` for a plain ``...ForCausalLM``)."""
        inner = model
        for part in self.decoder.split("."):
            inner = getattr(inner, part, None)
        return inner

    def rope_interleaved(self, hf_config: Any) -> bool:
        if self.rope_layout == "config":
            return bool(hf_config.rope_interleave)
        return self.rope_layout == "interleave"

    def module_names(self, q_lora: bool) -> tuple[str, ...]:
        """The submodules an attention module of this family has (``q_lora``: the config sets q_lora_rank)."""
        if self.query == "q_gate":
            q = ("q_a_proj", "q_a_layernorm", "q_gate_proj")
        else:
            q = Q_LORA_MODULES if q_lora else ("q_proj",)
        return q + KV_MODULES + self.extra_modules

    def features(self) -> str:
        """The flags in words (``openmla models``)."""
        out = [{"config": "rope layout from rope_interleave", "interleave": "interleaved rope",
                "half": "half-split rope"}[self.rope_layout] if self.rope_reader != "none" else "no rope (R values not rotated)"]
        if self.query == "q_gate":
            out.append("query gate (q_gate_proj)")
        if self.query_scale is not None:
            out.append("position-dependent query scale")
        if self.head_query_scale is not None:
            out.append(f"per-head query scale by log-position ({self.head_query_scale})")
        if self.output_gate == "gate_proj":
            out.append("output gate (gate_proj)")
        if self.output_gate == "g_proj":
            out.append("per-head output gate (g_proj)")
        if self.sinks:
            out.append("per-head sinks")
        if self.indexer is not None:
            out.append("top-k indexer" + (" over pooled key groups" if self.indexer.pooled else "")
                       + (" with queries from the hidden states" if self.indexer.query_from == "hidden" else "")
                       + (", shared top-k layers" if self.shared_topk else ""))
        if self.sublayers > 1:
            out.append(f"{self.sublayers} MLA blocks per decoder layer")
        if self.lora_scales == "query":
            out.append("scaled query and latent (mla_scale_q_lora, mla_scale_kv_lora)")
        if self.lora_scales == "latents":
            out.append("scaled query latent and latent (q_lora_scale, kv_lora_scale)")
        if self.rope_key_norm is not None:
            out.append(f"RMSNorm on the key's rope part ({self.rope_key_norm})")
        if self.per_layer:
            out.append("MLA dims per layer (a cache storage per latent width)")
        if self.latent_sources is not None:
            out.append("layers reading an earlier layer's latent (no cache layer of their own)")
        if self.sliding_window:
            out.append("sliding-window layers")
        if self.indexer_optional:
            out.append("dense layers without an indexer")
        if self.text_only is not None:
            out.append("text only" + (f" (M-RoPE, {self.text_only.position_streams} equal position streams)"
                                      if self.text_only.position_streams > 1 else ""))
        if self.linear_attention is not None:
            out.append(f"linear-attention layers ({self.linear_attention}) with per-sequence state")
        return ", ".join(out)


def needs(attr: str, allowed: tuple | None = None) -> ConfigCheck:
    """A config check: ``attr`` must exist (and be one of ``allowed``)."""

    def check(hf_config: Any) -> str | None:
        if not hasattr(hf_config, attr):
            return f"its config has no {attr}"
        value = getattr(hf_config, attr)
        if allowed is not None and value not in allowed:
            return f"{attr}={value!r} (supported: {allowed})"
        return None

    check.__name__ = f"needs_{attr}"
    return check
