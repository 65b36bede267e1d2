"""openmla.hf over every MLA family it supports, against transformers' own model.

One test, parametrized over the families: a tiny random float32 model built from the family's
config class with the family's real MLA dims (transformers' defaults for L, R, Dn, Dv and q LoRA)
and 2 layers (a small MoE where the family has one). Greedy tokens must equal the unpatched
model's ``generate(do_sample=False)`` for 4 prompts of different lengths (16 new tokens each),
run in one continuous batch and one at a time, every step's logits within 1e-4 relative, and
``attach`` must share the model's parameters (same names, same data pointers).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from cases import rel_err  # noqa: E402
from openmla.hf import attach, detach, generate, is_attached  # noqa: E402
from openmla.hf.families import FAMILIES, REFUSED  # noqa: E402
from test_hf_generate import NEW, TOL, VOCAB, one_thread, prompts_for, run_stream, transformers_greedy  # noqa: E402,F401

# initializer_range 0.1: wide enough for varied tokens, narrow enough that the 1536-wide q LoRA of some
# families keeps float32 logits within 1e-4 of transformers' (0.2 gave 1.8e-4 on Youtu)
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=2, initializer_range=0.1, tie_word_embeddings=False)
MOE = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, n_group=1, topk_group=1)
TOPK = dict(index_topk=8, index_n_heads=4)


def _text(**extra):
    return {**SMALL, **extra}


# family -> (model class, config class, keyword arguments): MLA dims are the config class's defaults unless given.
CASES = {
    "glm4_moe_lite": ("Glm4MoeLiteForCausalLM", "Glm4MoeLiteConfig", _text(**MOE)),  # L=512 R=64 Dn=192 Dv=256 q_lora=768
    "youtu": ("YoutuForCausalLM", "YoutuConfig", _text()),  # L=512 R=64 Dn=128 Dv=128 q_lora=1536, dense
    "axk1": ("AXK1ForCausalLM", "AXK1Config", _text(**MOE, rope_interleave=False)),  # V3 dims, half-split rope
    "minicpm3": ("MiniCPM3ForCausalLM", "MiniCPM3Config", _text(v_head_dim=64)),  # L=256 R=32 Dn=64 Dv=64, half-split rope
    # L=256 R=64 Dn=64 Dv=128 q_lora=1024; a short original length so the Llama-4 query scale steps within the prompts
    "mistral4": ("Mistral4ForCausalLM", "Mistral4Config", _text(**MOE, max_position_embeddings=256, rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=16.0, original_max_position_embeddings=16, beta_fast=32.0,
        beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0, llama_4_scaling_beta=0.1, partial_rotary_factor=0.5))),
    "sarvam_mla": ("DeepseekV3ForCausalLM", "SarvamMLAConfig", _text(**MOE)),  # L=512 R=64 Dn=128 Dv=128, q_proj
    # DeepSeek-V3's text model (L=512 R=64 Dn=128 Dv=128 q_lora=1536) under a tiny vision tower
    "kimi_k25": ("Kimi_K25ForConditionalGeneration", "Kimi_K25Config", None),
    # top-k families: top 8 keys per token (prompts reach 65 keys), 4 index heads of the real width
    # L=128 R=32 Dn=64 Dv=64 q_lora=384: query gate from q_gate_proj
    "axk2": ("AXK2ForCausalLM", "AXK2Config", _text(**MOE, **TOPK, gated_norm_rank=8)),
    # L=512 R=64 Dn=192 Dv=256 q_lora=2048; layer 1 reuses layer 0's picks
    "glm_moe_dsa": ("GlmMoeDsaForCausalLM", "GlmMoeDsaConfig", _text(**MOE, **TOPK, first_k_dense_replace=1,
                                                                      indexer_types=["full", "shared"])),
    # L=512 R=64 Dn=192 Dv=256 q_lora=1536; output gate, sinks, 2 hyper-connection streams, layer 1 reuses picks
    "hy_v4": ("HYV4ForCausalLM", "HYV4Config", _text(**MOE, **TOPK, indexer_types=["full", "shared"], hc_mult=2, pad_token_id=0,
                                                     learnable_sink_init=0.5)),
}


def family_config(case: str):
    _, cls, kwargs = CASES[case]
    if case == "kimi_k25":
        text = dict(model_type="deepseek_v3", **_text(**MOE), q_lora_rank=1536, rope_interleave=True)
        vision = dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2, patch_size=4,
                      pos_emb_height=4, pos_emb_width=4, pos_emb_time=2)
        return transformers.Kimi_K25Config(text_config=text, vision_config=vision, projection_hidden_size=32,
                                           tie_word_embeddings=False)
    return getattr(transformers, cls)(**kwargs)


def build(case: str, seed: int = 0):
    torch.manual_seed(seed)
    config = family_config(case)
    model = getattr(transformers, CASES[case][0])._from_config(config, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # every token (a random model may emit any id)
    return model


def test_every_supported_family_has_a_case():
    tested = {"deepseek_v2", "deepseek_v3", "deepseek_v32"}  # test_hf_generate.py
    tested |= {f.name for f in FAMILIES if f.name in CASES or set(f.model_types) & set(CASES)}
    assert tested >= {f.name for f in FAMILIES}


@pytest.mark.parametrize("case", list(CASES))
def test_family_tokens_equal_transformers(case):
    model = build(case)
    prompts = prompts_for()
    want_tokens, want_logits = transformers_greedy(model, prompts)
    before = {n: p.data_ptr() for n, p in model.named_parameters()}
    cache = attach(model, num_pages=40, page_size=8)
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == before  # shared: same names, same tensors
    got, logits, _ = run_stream(model, prompts)  # one continuous batch
    assert got == want_tokens
    for i in range(len(prompts)):
        errs = [rel_err(logits[i][t], want_logits[i][t]) for t in range(NEW)]
        assert max(errs) <= TOL, (i, errs)
    assert [generate(model, [p], NEW)[0] for p in prompts] == want_tokens  # one at a time
    assert cache.num_free_pages == cache.num_pages
    detach(model)


# Refusals: before the model is changed, naming the class and what is not reproduced ------------------
def _unchanged(model, originals, impl):
    assert [layer.self_attn for layer in model.model.layers] == originals
    assert model.config._attn_implementation == impl and not is_attached(model)


@pytest.mark.parametrize("name", sorted(REFUSED) + ["LlamaForCausalLM"])
def test_attach_refuses_classes_it_does_not_run(name):
    model = type(name, (torch.nn.Module,), {})()
    gap = REFUSED.get(name)
    with pytest.raises(ValueError, match=name + (rf" \({gap.family}\) is not supported" if gap else " is not a transformers MLA")):
        attach(model, num_pages=4)


def _swap_class(model):
    attn = model.model.layers[1].self_attn
    attn.__class__ = type("PatchedAttention", (type(attn),), {})


def _extra_module(model):
    model.model.layers[0].self_attn.extra_proj = torch.nn.Linear(4, 4)


def _layer_norm(model):
    attn = model.model.layers[1].self_attn
    attn.kv_a_layernorm = torch.nn.LayerNorm(attn.kv_lora_rank)


def _dynamic_rope(model):
    model.model.rotary_emb.rope_type = "dynamic"


def _no_llama4_beta(model):
    model.config.rope_parameters["llama_4_scaling_beta"] = None


REFUSALS = {
    "another attention class": ("minicpm3", _swap_class, "PatchedAttention; minicpm3 models attach with MiniCPM3Attention only"),
    "a submodule it does not use": ("minicpm3", _extra_module, r"not reproduced: \['extra_proj'\]"),
    "a latent norm that is not RMSNorm": ("minicpm3", _layer_norm, r"kv_a_layernorm \(LayerNorm\) does not compute"),
    "a rope that changes with the length": ("minicpm3", _dynamic_rope, "rope type 'dynamic'"),
    "Mistral 4 without its query scale": ("mistral4", _no_llama4_beta, "llama_4_scaling_beta=None"),
}


@pytest.mark.parametrize("what", list(REFUSALS))
def test_attach_refuses_what_it_does_not_reproduce(what):
    case, edit, message = REFUSALS[what]
    model = build(case)
    edit(model)
    originals, impl = [layer.self_attn for layer in model.model.layers], model.config._attn_implementation
    with pytest.raises(ValueError, match=f"{CASES[case][0]}: .*{message}"):
        attach(model, num_pages=4)
    _unchanged(model, originals, impl)
