"""openmla.hf on hybrid models: linear-attention layers with a state per sequence (openmla.hf.hybrid).

The shared scenario (test_hf_families.py) covers Ling 3 (bailing_hybrid) and Kimi Linear in one
batch and one at a time. Here: the same tiny models through a small token budget (prefills chunked, the state carried
between chunks) and through a cache too small for all prompts (preempted sequences restart from
a fresh state) gives transformers' greedy tokens; each linear-attention class transformers ships
(Ling 3's, Kimi Linear's, GLM5-Next's), wrapped by the adapter and run on packed ragged steps,
equals the module run on each sequence alone with transformers' own cache; misuse is a ValueError.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from cases import rel_err  # noqa: E402
from openmla.hf import GenerationStats, Limits, attach, attachment, detach, generate, is_attached, presets  # noqa: E402
from openmla.hf.hybrid import LINEAR_KWARG, AttachedLinearAttention, LinearStates  # noqa: E402
from test_hf_generate import NEW, prompts_for, transformers_greedy  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=["bailing_hybrid", "kimi_linear"])
def ling(request):
    """(model, prompts, transformers' greedy tokens): KDA, MLA, KDA layers (Ling 3, Kimi Linear)."""
    model = presets.build(request.param, "test")
    prompts = prompts_for()
    return model, prompts, transformers_greedy(model, prompts)[0]


def test_chunked_prefill_carries_the_linear_state(ling):
    model, prompts, want = ling
    cache = attach(model, num_pages=40, page_size=8)
    try:
        stats = GenerationStats()
        assert generate(model, prompts, NEW, limits=Limits(max_batch_tokens=9, max_running=3), stats=stats) == want
        assert sum(1 for s in stats.steps if s.prefill_tokens) > 6  # the 50-token prompt alone takes 6 chunks
        assert any(s.prefill_tokens and s.decode_tokens for s in stats.steps)
        assert len(attachment(model).hybrid.states) == 0 and cache.num_free_pages == cache.num_pages
    finally:
        detach(model)


def test_preempted_sequences_restart_from_a_fresh_state(ling):
    model, prompts, want = ling
    longest = max(len(p) for p in prompts) + NEW - 1
    cache = attach(model, num_pages=-(-longest // 4) + 1, page_size=4)
    try:
        stats = GenerationStats()
        assert generate(model, prompts, NEW, stats=stats) == want
        assert stats.preemptions > 0
        assert len(attachment(model).hybrid.states) == 0 and cache.num_free_pages == cache.num_pages
    finally:
        detach(model)


def test_linear_layers_are_shared_and_come_back(ling):
    model = ling[0]
    layers = model.model.layers
    originals = [layer.self_attn for layer in layers]
    before = {n: p.data_ptr() for n, p in model.named_parameters()}
    attach(model, num_pages=4, page_size=8)
    assert [type(layer.self_attn).__name__ for layer in layers] == ["AttachedLinearAttention", "AttachedAttention",
                                                                    "AttachedLinearAttention"]
    assert layers[0].self_attn.wrapped is originals[0]
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == before
    with pytest.raises(ValueError, match=LINEAR_KWARG):
        layers[0].self_attn(torch.zeros(1, 3, model.config.hidden_size))
    detach(model)
    assert [layer.self_attn for layer in layers] == originals and not is_attached(model)


def test_attach_refuses_a_linear_layer_it_cannot_key_and_leaves_the_model_alone(ling):
    model = ling[0]
    layers = model.model.layers
    originals = [layer.self_attn for layer in layers]
    layers[2].self_attn.layer_idx = 1  # its state would be looked up at another layer's slot
    try:
        with pytest.raises(ValueError, match=rf"{type(model).__name__}: model.layers.2.self_attn.layer_idx is 1"):
            attach(model, num_pages=4)
    finally:
        layers[2].self_attn.layer_idx = 2
    assert [layer.self_attn for layer in layers] == originals and not is_attached(model)


# The adapter alone, on every linear-attention class transformers ships -------------------------------
def _linear_module(kind: str):
    if kind == "bailing_hybrid":
        from transformers.models.bailing_hybrid.modeling_bailing_hybrid import BailingHybridDeltaAttention as cls
        config = transformers.BailingHybridConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, head_dim=32,
                                                  layer_group_size=2)
    elif kind == "kimi_linear":
        from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention as cls
        config = transformers.KimiLinearConfig(hidden_size=64, num_hidden_layers=2, linear_num_heads=2, linear_head_dim=32)
    else:
        from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextLinearAttention as cls
        config = transformers.Glm5NextTextConfig(hidden_size=64, num_hidden_layers=2, linear_num_heads=2, linear_head_dim=32)
    assert config.layer_types[0] == "linear_attention"
    module = cls(config, 0).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return config, module


def _alone(config, module, h: torch.Tensor, prompt: int) -> torch.Tensor:
    """transformers' own order: the prompt in one call, then one token per call, on a cache of its own."""
    from transformers.cache_utils import DynamicCache

    cache = DynamicCache(config=config)
    outs = [module(h[None, :prompt], cache=cache)[0]]
    outs += [module(h[None, t:t + 1], cache=cache)[0] for t in range(prompt, h.shape[0])]
    return torch.cat(outs)


@pytest.mark.parametrize("kind", ["bailing_hybrid", "kimi_linear", "glm5_next"])
def test_adapter_runs_each_sequence_on_its_own_state(kind):
    """Three sequences (prompts of 1, 9 and 23 tokens, then 4 decode tokens each) packed into shared
    steps with chunked prefills; the middle one is dropped half way and runs again from the start
    (a preemption). Every row equals the module run on that sequence alone, prompt then decodes."""
    config, module = _linear_module(kind)
    adapter = AttachedLinearAttention(module)
    assert {n for n, _ in adapter.named_parameters()} == {n for n, _ in module.named_parameters()}
    g = torch.Generator().manual_seed(1)
    prompts, decode = (1, 9, 23), 4
    hs = [torch.randn(n + decode, config.hidden_size, generator=g) for n in prompts]
    with torch.no_grad():
        want = [_alone(config, module, h, n) for h, n in zip(hs, prompts)]
        states = LinearStates(config)
        done, got = [0, 0, 0], [[], [], []]
        chunk = {0: 1, 1: 4, 2: 5}  # prefill tokens per step; then one token per step
        step = 0
        while any(d < h.shape[0] for d, h in zip(done, hs)):
            if step == 3:  # preempt sequence 1: its state and its rows so far are gone
                states.drop(1)
                done[1], got[1] = 0, []
            ids = [i for i in range(3) if done[i] < hs[i].shape[0]]
            counts = [min(chunk[i], prompts[i] - done[i]) if done[i] < prompts[i] else 1 for i in ids]
            x = torch.cat([hs[i][done[i]:done[i] + n] for i, n in zip(ids, counts)])[None]
            out = adapter(x, **{LINEAR_KWARG: states.begin(ids, [done[i] for i in ids], counts)})[0]
            for i, n, part in zip(ids, counts, out.split(counts)):
                got[i].append(part)
                done[i] += n
            step += 1
    for i in range(3):
        assert rel_err(torch.cat(got[i]), want[i]) < 1e-5, i


def test_a_state_out_of_step_with_the_cache_is_a_value_error():
    config, _ = _linear_module("bailing_hybrid")
    states = LinearStates(config)
    states.begin(["a"], [0], [5])
    with pytest.raises(ValueError, match=r"sequence 'a' holds 4 cached tokens but a linear-attention state of 5 tokens"):
        states.begin(["a"], [4], [1])
    with pytest.raises(ValueError, match=r"sequence 'b' holds 3 cached tokens but no linear-attention state"):
        states.begin(["b"], [3], [1])
    states.begin(["a"], [5], [1], live={"a"})
    states.begin(["c"], [0], [2], live={"c"})  # "a" left the cache: its state goes
    assert len(states) == 1
