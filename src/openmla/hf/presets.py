"""Small random models of every supported family: the family's real MLA dims, few heads and layers.

``family_config(name, size)`` builds a transformers config from the family's config class, keeping
the class's defaults for the MLA dims (L, R, Dn, Dv, q LoRA: the flagship checkpoint's) and
shrinking the rest: ``"test"`` (hidden 64, 2 layers, 2 heads, vocab 256: the CI's equivalence
tests) or ``"demo"`` (hidden 1024, 4 layers, 8 heads, vocab 8192: ``openmla demo --model tiny-<family>``).
A family with a MoE gets a small one; a top-k family keeps 8 (test) or 64 (demo) keys per token.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class Preset:
    model_class: str  # transformers class to build
    config_class: str
    extra: dict = field(default_factory=dict)  # family-specific keywords (both sizes)
    moe: bool = True
    topk: bool = False


_YARN_MISTRAL4 = dict(rope_type="yarn", rope_theta=10000.0, factor=16.0, original_max_position_embeddings=16, beta_fast=32.0,
                      beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0, llama_4_scaling_beta=0.1, partial_rotary_factor=0.5)

PRESETS: dict[str, Preset] = {
    "deepseek_v2": Preset("DeepseekV2ForCausalLM", "DeepseekV2Config", dict(topk_method="group_limited_greedy")),
    "deepseek_v3": Preset("DeepseekV3ForCausalLM", "DeepseekV3Config"),
    "sarvam_mla": Preset("DeepseekV3ForCausalLM", "SarvamMLAConfig"),  # V3's class, q_proj (no q LoRA)
    "deepseek_v32": Preset("DeepseekV32ForCausalLM", "DeepseekV32Config", moe=False, topk=True),
    "kimi_k25": Preset("Kimi_K25ForConditionalGeneration", "Kimi_K25Config"),  # V3 text model, tiny vision tower
    "glm4_moe_lite": Preset("Glm4MoeLiteForCausalLM", "Glm4MoeLiteConfig"),
    "youtu": Preset("YoutuForCausalLM", "YoutuConfig", moe=False),
    "axk1": Preset("AXK1ForCausalLM", "AXK1Config", dict(rope_interleave=False)),
    "minicpm3": Preset("MiniCPM3ForCausalLM", "MiniCPM3Config", dict(v_head_dim=64), moe=False),  # Dv of MiniCPM3-4B
    # a short original length: the Llama-4 query scale steps within short prompts
    "mistral4": Preset("Mistral4ForCausalLM", "Mistral4Config", dict(max_position_embeddings=256, rope_parameters=_YARN_MISTRAL4)),
    "axk2": Preset("AXK2ForCausalLM", "AXK2Config", dict(gated_norm_rank=8), topk=True),
    "glm_moe_dsa": Preset("GlmMoeDsaForCausalLM", "GlmMoeDsaConfig", dict(first_k_dense_replace=1), topk=True),
    "hy_v4": Preset("HYV4ForCausalLM", "HYV4Config", dict(hc_mult=2, learnable_sink_init=0.5), topk=True),
    # text only; a tiny vision tower (never run: pixel values are refused); the placeholder ids stay transformers' (past the vocab)
    "hy_v4_vl": Preset("HYV4VLForConditionalGeneration", "HYV4VLConfig", dict(hc_mult=2, learnable_sink_init=0.5), topk=True),
    # a sliding layer (4 heads, L=1024, Dn=192: dots3's sliding dims) and an indexed one (the size's heads, L=512, Dn=128)
    "dots3_note": Preset("Dots3NoteForCausalLM", "Dots3NoteTextConfig",
                         dict(swa_num_attention_heads=4, swa_num_key_value_heads=4, shared_experts_intermediate_size=32),
                         topk=True),
    # num_hidden_layers counts MLA blocks (2 per decoder layer); its own MoE with zero experts
    "longcat_flash": Preset("LongcatFlashForCausalLM", "LongcatFlashConfig",
                            dict(num_hidden_layers=4, ffn_hidden_size=96, expert_ffn_hidden_size=32, n_routed_experts=4,
                                 zero_expert_num=2, moe_topk=2), moe=False),
    # KDA, MLA, KDA layers (every 2nd layer MLA); its experts count is num_local_experts
    "bailing_hybrid": Preset("BailingHybridForCausalLM", "BailingHybridConfig",
                             dict(num_hidden_layers=3, layer_group_size=2, num_local_experts=4, first_k_dense_replace=1)),
    # KDA, MLA, KDA layers; 2 KDA heads of Kimi Linear's 128 values (it has 32)
    "kimi_linear": Preset("KimiLinearForCausalLM", "KimiLinearConfig",
                          dict(num_hidden_layers=3, layer_types=["linear_attention", "full_attention", "linear_attention"],
                               linear_num_heads=2, num_local_experts=4, first_k_dense_replace=1)),
    # text only (a tiny vision tower, never run); KDA, MLA with its own pooled indexer, MLA reusing its picks; pools of 4
    # tokens, so the test's 8 picked keys are 2 pools (+ the open tail) and long prompts leave most pools out
    "glm5_next": Preset("Glm5NextForConditionalGeneration", "Glm5NextConfig",
                        dict(num_hidden_layers=3, layer_types=["linear_attention", "indexed_attention", "indexed_attention"],
                             indexer_types=["full", "full", "shared"], mlp_layer_types=["dense", "sparse", "sparse"],
                             index_kpool=4, hc_mult=2, linear_num_heads=2, linear_head_dim=32), topk=True),
    # text only (a tiny vision tower, never run); every layer kind: rope / NoPE (R = 64 / 0), writing its latent /
    # reading an earlier layer's, running its indexer / reusing the previous layer's picks
    "mistral_large4": Preset("MistralLarge4ForConditionalGeneration", "MistralLarge4Config",
                             dict(num_hidden_layers=4, no_rope_layers=[1, 1, 0, 0], kv_source_layers=[0, 0, 2, 2],
                                  indexer_types=["full", "shared", "shared", "full"]), topk=True),
}

_SIZES = {
    # initializer_range 0.1: varied tokens, and float32 logits of the 1536-wide q LoRA families within 1e-4 of transformers'
    "test": dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=2, initializer_range=0.1),
    "demo": dict(vocab_size=8192, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=8, initializer_range=0.02),
}
_IDS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)  # the real ids are outside the vocab
_MOE = {
    "test": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, n_group=1, topk_group=1),
    "demo": dict(n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=256, n_shared_experts=1, n_group=1, topk_group=1),
}
_TOPK = {"test": dict(index_topk=8, index_n_heads=4), "demo": dict(index_topk=64, index_n_heads=16)}
_VISION = dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2, patch_size=4,
               pos_emb_height=4, pos_emb_width=4, pos_emb_time=2)


def family_config(name: str, size: str = "test", **overrides: Any) -> Any:
    """A transformers config of family ``name`` (a key of ``PRESETS``) at ``size`` (``"test"`` or ``"demo"``);
    ``overrides``: further config keywords."""
    import transformers

    if name not in PRESETS or size not in _SIZES:
        raise ValueError(f"name/size: expected one of {sorted(PRESETS)} and {sorted(_SIZES)}, got {name!r}, {size!r}")
    p = PRESETS[name]
    extra = copy.deepcopy(p.extra)  # a config keeps the dicts it is given (rope_parameters): never the table's own
    kwargs = {**_SIZES[size], **_IDS, **(_MOE[size] if p.moe else {}), **(_TOPK[size] if p.topk else {}), **extra, **overrides}
    if name == "dots3_note":  # sliding, indexed, sliding, indexed, ...
        kwargs.setdefault("layer_types", ["sliding_attention", "indexed_attention"] * (kwargs["num_hidden_layers"] // 2))
    if p.topk and "indexer_types" in getattr(transformers, p.config_class).__dataclass_fields__:
        kwargs["indexer_types"] = ["full", "shared"] * (kwargs["num_hidden_layers"] // 2)  # every other layer reuses picks
    if name == "kimi_k25":
        text = dict(model_type="deepseek_v3", **kwargs, q_lora_rank=1536, rope_interleave=True)
        vision = dict(_VISION)
        return transformers.Kimi_K25Config(text_config=text, vision_config=vision, projection_hidden_size=32, **_IDS)
    if name == "hy_v4_vl":
        kwargs.setdefault("indexer_types", ["full", "shared"] * (kwargs["num_hidden_layers"] // 2))
        media = {k: kwargs.pop(k) for k in ("image_token_id", "video_token_id") if k in kwargs}
        vision = dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2, patch_size=4,
                      max_image_size=64, out_hidden_size=kwargs["hidden_size"])
        return transformers.HYV4VLConfig(text_config=kwargs, vision_config=vision, **media, **_IDS)
    if name == "glm5_next":
        media = {k: kwargs.pop(k) for k in ("image_token_id", "video_token_id") if k in kwargs}
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, image_size=16,
                      out_hidden_size=kwargs["hidden_size"], projection_intermediate_size=64)
        return transformers.Glm5NextConfig(text_config=kwargs, vision_config=vision, **media, **_IDS)
    if name == "mistral_large4":
        vision = dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2, patch_size=4,
                      image_size=16, head_dim=16)
        return transformers.MistralLarge4Config(text_config=kwargs, vision_config=vision, **_IDS)
    return getattr(transformers, p.config_class)(**kwargs)


def build(name: str, size: str = "test", *, dtype: torch.dtype = torch.float32, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A random model of family ``name`` in eval mode; ``generation_config.eos_token_id`` is None (a random
    model may emit any id: every run generates all its tokens). ``overrides``: further config keywords."""
    import transformers

    torch.manual_seed(seed)
    config = family_config(name, size, **overrides)
    model = getattr(transformers, PRESETS[name].model_class)._from_config(config, dtype=dtype).eval()
    model.generation_config.eos_token_id = None
    return model


# ``openmla demo --model NAME`` -> the preset family (None: tiny-v3 / tiny-v32, openmla_tools.hf.demo's own DeepSeek configs)
DEMO_MODELS: dict[str, str | None] = {"tiny-v3": None, "tiny-v32": None} | {
    "tiny-" + name.replace("_", "-"): name for name in PRESETS if name not in ("deepseek_v3", "deepseek_v32")
}
