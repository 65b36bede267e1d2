"""Random-weight MLA checkpoints for the vLLM tests: 2 layers, each family's real MLA dims
(DeepSeek-V2/V3 and Kimi K2: kv_lora_rank 512, rope 64, nope 128, v 128; GLM-4.7-Flash: nope 192,
v 256; MiniCPM3: kv_lora_rank 256, rope 32, nope 64, v 64), small everything else (hidden 256, a
4-expert MoE); made with ``save_pretrained``, nothing downloaded."""

from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB = 512
# The engines' dtype: bfloat16 where this CPU has bf16 dot products; float32 elsewhere (an AVX2 CPU
# emulates bf16 matmuls ~100x slower than float32, which a user there would not serve in either).
ENGINE_DTYPE = "bfloat16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "float32"
MLA_DIMS = dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)


# A model type transformers does not know, saved as the one it loads as (vLLM maps it back).
SAVE_AS = {"kimi_k2": "deepseek_v3"}
SMALL_MOE = dict(n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=128)


def _common(num_heads: int, **mla_dims) -> dict:
    return dict(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=num_heads, num_key_value_heads=num_heads, max_position_embeddings=4096,
        rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
        **(mla_dims or MLA_DIMS),
    )


def deepseek_v2(num_heads: int = 16) -> dict:
    """DeepSeek-V2-Lite shaped: no q LoRA, layer 0 dense, layer 1 MoE with softmax gating."""
    return dict(
        architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", q_lora_rank=None,
        n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=128,
        first_k_dense_replace=1, moe_layer_freq=1, topk_method="greedy", n_group=1, topk_group=1,
        routed_scaling_factor=1.0, norm_topk_prob=False, scoring_func="softmax", **_common(num_heads),
    )


def deepseek_v3(num_heads: int = 128) -> dict:
    """DeepSeek-V3 shaped: q LoRA, 128 heads, layer 0 dense, layer 1 MoE with sigmoid gating and
    the noaux_tc router."""
    return dict(
        architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", q_lora_rank=256,
        n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=128,
        first_k_dense_replace=1, moe_layer_freq=1, topk_method="noaux_tc", n_group=1, topk_group=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, scoring_func="sigmoid", **_common(num_heads),
    )


def kimi_k2(num_heads: int = 64) -> dict:
    """Kimi K2 shaped (``model_type`` kimi_k2, DeepSeek-V3's architecture): q LoRA 1536, 64 heads,
    rope theta 50000 with YaRN x32 (mscale_all_dim 1: the softmax scale grows by mscale^2), sigmoid
    noaux_tc routing; layer 0 dense, layer 1 MoE."""
    common = _common(num_heads)
    common.update(rope_theta=50000.0, max_position_embeddings=131072)
    return dict(
        architectures=["DeepseekV3ForCausalLM"], model_type="kimi_k2", q_lora_rank=1536,
        first_k_dense_replace=1, moe_layer_freq=1, topk_method="noaux_tc", n_group=1, topk_group=1,
        routed_scaling_factor=2.827, norm_topk_prob=True, scoring_func="sigmoid",
        rope_scaling=dict(type="yarn", factor=32.0, original_max_position_embeddings=4096, beta_fast=1.0, beta_slow=1.0,
                          mscale=1.0, mscale_all_dim=1.0),
        **SMALL_MOE, **common,
    )


def glm4_7_flash(num_heads: int = 20) -> dict:
    """GLM-4.7-Flash shaped (``Glm4MoeLiteForCausalLM``): q LoRA 768, 20 heads, nope 192, v 256,
    interleaved rope; layer 0 dense, layer 1 MoE (sigmoid noaux_tc)."""
    dims = dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=192, v_head_dim=256)
    return dict(
        architectures=["Glm4MoeLiteForCausalLM"], model_type="glm4_moe_lite", q_lora_rank=768, rope_interleave=True,
        first_k_dense_replace=1, mlp_layer_types=["dense", "sparse"], topk_method="noaux_tc", n_group=1, topk_group=1,
        routed_scaling_factor=1.8, norm_topk_prob=True, **SMALL_MOE, **_common(num_heads, **dims),
    )


def minicpm3(num_heads: int = 40) -> dict:
    """MiniCPM3-4B shaped (``MiniCPM3ForCausalLM``): q LoRA 768, 40 heads, kv_lora_rank 256, rope 32
    (half-split), nope 64, v 64, MiniCPM's embedding and residual scales; dense MLPs. Hidden 320:
    MiniCPM3's config wants a multiple of the head count."""
    dims = dict(kv_lora_rank=256, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64)
    return {**_common(num_heads, **dims), **dict(
        architectures=["MiniCPM3ForCausalLM"], model_type="minicpm3", q_lora_rank=768, scale_emb=12, scale_depth=1.4,
        dim_model_base=256, hidden_size=8 * num_heads,
    )}


def save_model(config: dict, path: Path, seed: int = 0) -> Path:
    """Random weights for ``config`` saved as a bf16 safetensors checkpoint in ``path``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    model_type = config["model_type"]
    (path / "config.json").write_text(json.dumps({**config, "model_type": SAVE_AS.get(model_type, model_type)}))
    cfg = AutoConfig.from_pretrained(path)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.05)  # logits spread well apart: greedy ties are rare
    model.save_pretrained(path)
    if model_type in SAVE_AS:  # the checkpoint's own model type, as the real one ships it
        saved = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**saved, "model_type": model_type}, indent=2))
    return path
