"""openmla.hf over every MLA family it supports, against transformers' own model.

One test, parametrized over the families: a tiny random float32 model built from the family's
config class with the family's real MLA dims (transformers' defaults for L, R, Dn, Dv and q LoRA)
and 2 layers (a small MoE where the family has one; top 8 keys for top-k families), from
``openmla.hf.presets`` (size "test"). Greedy tokens must equal the unpatched
model's ``generate(do_sample=False)`` for 4 prompts of different lengths (16 new tokens each),
run in one continuous batch and one at a time, every step's logits within 1e-4 relative, and
``attach`` must share the model's parameters (same names, same data pointers).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from openmla.hf import attach, detach, generate, is_attached  # noqa: E402
from openmla.hf import presets  # noqa: E402
from openmla.hf.families import FAMILIES, REFUSED  # noqa: E402
from openmla.hf.presets import PRESETS  # noqa: E402
from test_hf_generate import NEW, assert_serves_like_transformers, prompts_for, transformers_greedy  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

# DeepSeek-V2, V3 and V3.2 have their own, wider tests (test_hf_generate.py); Hunyuan V4 VL, dots3, GLM-5-Next and
# Mistral Large 4 theirs (test_hf_hy_v4_vl.py, test_hf_dots3.py, test_hf_glm5_next.py, test_hf_mistral_large4.py)
CASES = [name for name in PRESETS
         if name not in ("deepseek_v2", "deepseek_v3", "deepseek_v32", "hy_v4_vl", "dots3_note", "glm5_next", "mistral_large4")]


def build(case: str):
    return presets.build(case, "test")


def test_every_supported_family_has_a_preset():
    assert {f.name for f in FAMILIES} <= set(PRESETS)


@pytest.mark.parametrize("case", CASES)
def test_family_tokens_equal_transformers(case):
    model = build(case)
    prompts = prompts_for()
    want_tokens, want_logits = transformers_greedy(model, prompts)
    before = {n: p.data_ptr() for n, p in model.named_parameters()}
    text = model.config.get_text_config()
    impl, originals = text._attn_implementation, [m for m in model.modules() if type(m).__name__.endswith("Attention")]
    cache = attach(model, num_pages=40, page_size=8)
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == before  # shared: same names, same tensors
    assert_serves_like_transformers(model, cache, prompts, want_tokens, want_logits)
    detach(model)  # transformers' modules and attention implementation are back (a composite's text model's only)
    assert [m for m in model.modules() if type(m).__name__.endswith("Attention")] == originals
    assert text._attn_implementation == impl


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
    with pytest.raises(ValueError, match=f"{PRESETS[case].model_class}: .*{message}"):
        attach(model, num_pages=4)
    _unchanged(model, originals, impl)


def test_longrope_runs_below_its_original_length_and_is_refused_past_it():
    """MiniCPM3-4B's rope is longrope: short factors up to original_max_position_embeddings, past which
    transformers switches every position to the long factors. The table holds the short ones; a
    request that would pass the original length is a ValueError before it runs."""
    rope = dict(rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=80, factor=4.0,
                short_factor=[1.0 + 0.1 * i for i in range(16)], long_factor=[2.0 + 0.3 * i for i in range(16)])
    model = presets.build("minicpm3", "test", rope_parameters=rope, max_position_embeddings=320)
    prompts = prompts_for()[1:3]
    want, _ = transformers_greedy(model, prompts)
    attach(model, num_pages=40, page_size=8)
    assert model.model.rotary_emb.attention_scaling != 1.0  # factor 4: cos and sin carry a magnitude
    assert generate(model, prompts, NEW) == want
    with pytest.raises(ValueError, match="position 80.*longrope"):
        generate(model, [list(range(70))], 12)
    assert generate(model, [list(range(70))], 11)  # feeds positions up to 79 (the last token is not fed back)
