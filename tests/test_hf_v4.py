"""DeepseekV4ForCausalLM on openmla (openmla.hf.attach -> openmla.hf.v4): tiny random float32
models built from transformers' DeepseekV4Config (every layer kind, hyper-connections, hash-MoE
with a random table, random sinks and compressor position biases). Greedy tokens equal
``model.generate(do_sample=False)`` and each step's logits are within 1e-4, one prompt at a time
and batched with chunked prefill, on prompts that cross several compression windows and the
sliding window; sliding pages go back to the pool; what is not reproduced is refused."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM  # noqa: E402

from openmla.hf import Limits, Sampling, attach, detach, generate, stream  # noqa: E402
from openmla.cache import CacheFullError  # noqa: E402
from openmla.hf.v4 import attach_v4, forward_step_v4, generate_v4, v4_attachment  # noqa: E402
from openmla_tools.testing import randomize_v4_untrained  # noqa: E402

KINDS = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
NEW = 6


def tiny(seed: int, head_dim: int = 32, rope: int = 8, layers=KINDS, topk: int = 3) -> DeepseekV4ForCausalLM:
    torch.manual_seed(seed)
    cfg = DeepseekV4Config(
        vocab_size=128, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=len(layers), num_attention_heads=4,
        head_dim=head_dim, partial_rotary_factor=rope / head_dim, q_lora_rank=32, n_routed_experts=4, num_experts_per_tok=2,
        hc_mult=2, sliding_window=8, o_groups=2, o_lora_rank=16, index_n_heads=16, index_head_dim=max(16, 2 * rope), index_topk=topk,
        layer_types=list(layers), compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        max_position_embeddings=512)
    return randomize_v4_untrained(DeepseekV4ForCausalLM(cfg).float().eval())


def hf_greedy(model, prompt: list[int], n: int):
    ids = torch.tensor([prompt])  # an explicit mask: generate would mask prompt tokens equal to pad_token_id
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    return out.sequences[0, len(prompt):].tolist(), [x[0] for x in out.logits]


def stream_all(model, prompts, n):
    return list(stream(model, prompts, n))


def check(got_tokens, got_logits, want_tokens, want_logits, what):
    assert got_tokens == want_tokens, f"{what}: tokens {got_tokens} != transformers' {want_tokens}"
    for i, (a, b) in enumerate(zip(got_logits, want_logits)):
        err = float((a - b).abs().max())
        assert err <= 1e-4, f"{what}: step {i} logits differ by {err}"


@pytest.fixture(scope="module")
def model_and_refs():
    model = tiny(0)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (37, 21, 50, 9)]
    refs = [hf_greedy(model, p, NEW) for p in prompts]
    return model, prompts, refs


def test_one_at_a_time_and_batched(model_and_refs):
    model, prompts, refs = model_and_refs
    attach(model, num_pages=64, page_size=4, backend="torch")
    try:
        for i, p in enumerate(prompts[:2]):
            toks, logits = generate_v4(model, [p], NEW, return_logits=True)
            check(toks[0], logits[0], *refs[i], f"prompt {i} alone")
        toks, logits = generate_v4(model, prompts, NEW, prefill_chunk=7, max_running=3, return_logits=True)
        for i in range(len(prompts)):
            check(toks[i], logits[i], *refs[i], f"prompt {i} batched")
        eos = refs[0][0][2]
        toks = generate_v4(model, prompts[:1], NEW, eos_token_id=[eos])
        assert toks[0] == refs[0][0][:refs[0][0].index(eos) + 1]  # stops on eos, which is kept
        limits = Limits(max_batch_tokens=7, max_running=3)  # openmla.hf.generate runs generate_v4 for a V4 model
        assert generate(model, prompts, NEW, limits=limits) == [r[0] for r in refs]
        cache = v4_attachment(model).cache
        assert all(s.allocator.num_free == s.allocator.num_pages for s in cache.stores()) and not cache.state
    finally:
        detach(model)
    assert hf_greedy(model, prompts[3], NEW)[0] == refs[3][0]  # detached: transformers' modules again


def test_preemption_on_a_full_pool(model_and_refs):
    """A compressed store too small for all prompts at once: the newest sequence is preempted and
    prefilled again later; tokens and logits still equal transformers'."""
    model, prompts, refs = model_and_refs
    attach_v4(model, num_pages=64, page_size=4, backend="torch", compressed_pages=6)
    try:
        toks, logits = generate_v4(model, prompts[:3], NEW, return_logits=True)
        assert v4_attachment(model).preemptions > 0
        for i in range(3):
            check(toks[i], logits[i], *refs[i], f"prompt {i} with preemption")
        with pytest.raises(CacheFullError):
            generate_v4(model, [prompts[2] * 2], 1)  # alone it does not fit
    finally:
        detach(model)


def test_sliding_pages_return_and_bytes(model_and_refs):
    model, prompts, _ = model_and_refs
    cache = attach(model, num_pages=64, page_size=4, backend="torch")
    try:
        forward_step_v4(model, ["s"], [prompts[2]], torch.tensor([49]))
        forward_step_v4(model, ["s"], [[5]], torch.tensor([0]))
        assert cache.raw.length("s") == 51 and cache.raw.pages_held("s") <= 3  # window 8 over pages of 4
        sizes = cache.bytes_per_sequence("s")
        assert sizes["raw"] == cache.raw.pages_held("s") * len(model.model.layers) * 4 * 32 * 4  # pages x layers x page x D x fp32
        assert sizes["compressed"] > 0 and sizes["index"] > 0 and sizes["state"] > 0
        cache.release("s")
    finally:
        detach(model)


def test_head_dim_512_rope_64():
    model = tiny(3, head_dim=512, rope=64, topk=2)
    prompt = torch.randint(0, 128, (26,), generator=torch.Generator().manual_seed(4)).tolist()
    want = hf_greedy(model, prompt, 3)
    attach(model, num_pages=32, page_size=16, backend="torch")
    try:
        toks, logits = generate_v4(model, [prompt], 3, prefill_chunk=10, return_logits=True)
    finally:
        detach(model)
    check(toks[0], logits[0], *want, "head_dim 512")


def test_refusals(model_and_refs):
    model = model_and_refs[0]
    with pytest.raises(ValueError, match="^cache_dtype:"):
        attach(model, num_pages=8, cache_dtype=torch.float16)
    window = model.config.sliding_window
    model.config.sliding_window = 0
    try:
        with pytest.raises(ValueError, match="^sliding_window:"):
            attach(model, num_pages=8)
    finally:
        model.config.sliding_window = window
    assert type(model.model.layers[0].self_attn).__name__ == "DeepseekV4Attention"  # refused before any change
    attach(model, num_pages=8, page_size=4)
    try:
        with pytest.raises(ValueError, match="^model: already attached"):
            attach(model, num_pages=8)
        with pytest.raises(ValueError, match="openmla_v4_step"):
            model(torch.tensor([[1, 2]]))
        with pytest.raises(ValueError, match="^sampling: a DeepSeek-V4 model generates greedily"):
            generate(model, [[1, 2]], 2, sampling=Sampling(temperature=0.7))
        with pytest.raises(ValueError, match="openmla.hf.v4"):
            stream_all(model, [[1, 2]], 2)
        with pytest.raises(ValueError, match="^eos_token_id:"):
            generate_v4(model, [[1]], 1, eos_token_id="2")
        with pytest.raises(ValueError, match="^max_new_tokens:"):
            generate_v4(model, [[1]], 0)
        with pytest.raises(ValueError, match=r"^prompts\[0\]:"):
            generate_v4(model, [[1000]], 1)
    finally:
        detach(model)
