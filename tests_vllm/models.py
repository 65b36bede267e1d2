"""Random-weight DeepSeek checkpoints for the vLLM tests: 2 layers, the real MLA dims
(kv_lora_rank 512, rope 64, nope 128, v 128), small everything else; made with
``save_pretrained``, nothing downloaded."""

from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB = 512
# The engines' dtype: bfloat16 where this CPU has bf16 dot products; float32 elsewhere (an AVX2 CPU
# emulates bf16 matmuls ~100x slower than float32, which a user there would not serve in either).
ENGINE_DTYPE = "bfloat16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "float32"
MLA_DIMS = dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)


def _common(num_heads: int) -> dict:
    return dict(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=num_heads, num_key_value_heads=num_heads, max_position_embeddings=4096,
        rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
        **MLA_DIMS,
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


def save_model(config: dict, path: Path, seed: int = 0) -> Path:
    """Random weights for ``config`` saved as a bf16 safetensors checkpoint in ``path``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
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
    return path
