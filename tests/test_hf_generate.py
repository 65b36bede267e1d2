"""openmla.hf: a whole transformers DeepSeek model on openmla against the same model in transformers.

Tiny random checkpoints (written with save_pretrained, loaded with from_pretrained; nothing is
downloaded) with 2-3 layers cover q_lora on/off, MoE on/off, rope_interleave both ways, YaRN
on/off, DeepSeek-V2 and V3. In float32, greedy tokens must equal transformers'
``model.generate(do_sample=False)`` of the unpatched model for 4 prompts of different lengths
(16 new tokens each), whether they run together, one at a time, chunked through a small token
budget, or squeezed through a cache too small for all of them (waiting and preemption), and
every step's logits must agree within 1e-4 relative.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

transformers = pytest.importorskip("transformers")

from cases import rel_err  # noqa: E402
from openmla.hf import (  # noqa: E402
    GenerationStats, Limits, Sampling, attach, attachment, detach, forward_step, generate, is_attached, stream,
)
from openmla.hf.sampling import filter_logits  # noqa: E402

VOCAB = 256
NEW = 16
PROMPT_LENS = (1, 7, 23, 50)
TOL = 1e-4
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4096,
            beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=0.707)  # mscale != mscale_all_dim: cos/sin carry a magnitude


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny matrices


def tiny_config(kind: str, *, q_lora: bool, moe: bool, yarn: bool, interleave: bool = True, layers: int = 2):
    rope = dict(YARN) if yarn else {"rope_type": "default", "rope_theta": 10000.0}
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48 if q_lora else None,
                  qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32, rope_parameters=rope,
                  max_position_embeddings=4096 * 40 if yarn else 4096, moe_intermediate_size=32, n_routed_experts=8,
                  num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1,
                  first_k_dense_replace=1 if moe else layers, initializer_range=0.2, tie_word_embeddings=False)
    if kind == "v3":
        return transformers.DeepseekV3Config(rope_interleave=interleave, **common)
    if kind == "v32":  # DeepSeek-V3.2: top-8 keys per token (prompts reach 65 keys), 16 indexer heads
        return transformers.DeepseekV32Config(index_topk=8, index_head_dim=32, index_n_heads=16, **common)
    return transformers.DeepseekV2Config(topk_method="group_limited_greedy", **common)


CASES = {
    "v3-qlora-moe-interleave-yarn": ("v3", dict(q_lora=True, moe=True, yarn=True, interleave=True)),
    "v3-plain-dense-halfsplit": ("v3", dict(q_lora=False, moe=False, yarn=False, interleave=False)),
    "v3-qlora-moe-halfsplit-yarn-3layers": ("v3", dict(q_lora=True, moe=True, yarn=True, interleave=False, layers=3)),
    "v2-plain-moe-yarn": ("v2", dict(q_lora=False, moe=True, yarn=True)),
    "v2-qlora-dense": ("v2", dict(q_lora=True, moe=False, yarn=False)),
    "v32-sparse-moe-yarn": ("v32", dict(q_lora=True, moe=True, yarn=True)),
}


def save_tiny(path, kind: str, seed: int = 0, **options) -> None:
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(kind, **options), dtype=torch.float32)
    model.generation_config.eos_token_id = None  # generate every token (a random model may emit any id)
    model.save_pretrained(path)


def load(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def prompts_for(seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]


def transformers_greedy(model, prompts):
    """Tokens and per-step logits of the unpatched model, one prompt at a time (no padding)."""
    tokens, logits = [], []
    with torch.no_grad():
        for p in prompts:
            out = model.generate(torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True)
            tokens.append(out.sequences[0, len(p):].tolist())
            logits.append(torch.stack([step[0] for step in out.logits]))  # [NEW, vocab]
    return tokens, logits


@pytest.fixture(scope="module", params=list(CASES))
def reference(request, tmp_path_factory):
    """(checkpoint folder, prompts, transformers' greedy tokens, transformers' per-step logits)."""
    kind, options = CASES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    save_tiny(path, kind, **options)
    prompts = prompts_for()
    tokens, logits = transformers_greedy(load(path), prompts)
    return path, prompts, tokens, logits


def run_stream(model, prompts, **kwargs):
    toks = [[] for _ in prompts]
    logits = [[] for _ in prompts]
    reasons = {}
    for ev in stream(model, prompts, NEW, return_logits=True, **kwargs):
        toks[ev.request].append(ev.token)
        logits[ev.request].append(ev.logits)
        if ev.finish_reason:
            reasons[ev.request] = ev.finish_reason
    return toks, [torch.stack(x) for x in logits], reasons


def _attention_modules(model):
    return [m for m in model.modules() if type(m).__name__.endswith("Attention")]


@contextlib.contextmanager
def attached_text_model(model, **cache_kwargs):
    """``attach(model, **cache_kwargs)`` (a composite model: its text model) yielding the cache, with
    the parameters shared; on leaving, ``detach`` puts transformers' attention modules and
    attention implementation back."""
    before = {n: p.data_ptr() for n, p in model.named_parameters()}
    text = model.config.text_config
    impl, originals = text._attn_implementation, _attention_modules(model)
    cache = attach(model, **cache_kwargs)
    try:
        assert {n: p.data_ptr() for n, p in model.named_parameters()} == before
        yield cache
    finally:
        detach(model)
    assert _attention_modules(model) == originals
    assert text._attn_implementation == impl and not is_attached(model)


def assert_serves_like_transformers(model, cache, prompts, want_tokens, want_logits):
    """An attached ``model``: one continuous batch gives transformers' greedy tokens and every step's
    logits within TOL, one request at a time the same tokens, and every page is back after."""
    got, logits, _ = run_stream(model, prompts)
    assert got == want_tokens
    for i in range(len(prompts)):
        errs = [rel_err(logits[i][t], want_logits[i][t]) for t in range(NEW)]
        assert max(errs) <= TOL, (i, errs)
    assert [generate(model, [p], NEW)[0] for p in prompts] == want_tokens
    assert cache.num_free_pages == cache.num_pages


# Equivalence with transformers ---------------------------------------------------------------
def test_greedy_equals_transformers(reference):
    path, prompts, want_tokens, want_logits = reference
    model = load(path)
    cache = attach(model, num_pages=64, page_size=8)
    # all four together in one continuous batch
    got, logits, reasons = run_stream(model, prompts)
    assert got == want_tokens
    assert reasons == {i: "length" for i in range(len(prompts))}
    for i in range(len(prompts)):
        errs = [rel_err(logits[i][t], want_logits[i][t]) for t in range(NEW)]
        assert max(errs) <= TOL, (i, errs)
    # one at a time
    assert [generate(model, [p], NEW)[0] for p in prompts] == want_tokens
    # a small token budget: chunked prefills run in the same steps as other sequences' decodes
    stats = GenerationStats()
    assert generate(model, prompts, NEW, limits=Limits(max_batch_tokens=9, max_running=3), stats=stats) == want_tokens
    assert any(s.prefill_tokens and s.decode_tokens for s in stats.steps)  # mixed steps happened
    assert cache.num_free_pages == cache.num_pages


def test_requests_wait_for_pages_and_are_preempted(reference):
    """A cache that holds the longest request alone but not all four: requests wait, the newest
    running one is preempted when decodes run out of pages, and nothing changes the tokens."""
    path, prompts, want_tokens, _ = reference
    model = load(path)
    longest = max(PROMPT_LENS) + NEW - 1
    cache = attach(model, num_pages=-(-longest // 4) + 1, page_size=4)
    stats = GenerationStats()
    assert generate(model, prompts, NEW, stats=stats) == want_tokens
    assert stats.preemptions > 0
    assert stats.generated_tokens == NEW * len(prompts)
    assert cache.num_free_pages == cache.num_pages and cache.sequences == []


def test_a_cache_that_holds_every_request_runs_them_together(tiny_path):
    """Admission counts the pages running sequences already hold: four 16-token prompts, 5 new
    tokens each, in exactly the 20 pages of 4 their whole lives take, admitted over two steps
    (a 32-token budget) all run together, with no preemption."""
    model = load(tiny_path)
    cache = attach(model, num_pages=20, page_size=4)
    prompts = [list(range(i, i + 16)) for i in range(4)]
    stats = GenerationStats()
    generate(model, prompts, 5, limits=Limits(max_batch_tokens=32), stats=stats)
    assert stats.preemptions == 0
    assert max(s.sequences for s in stats.steps) == 4
    assert stats.peak_pages == 20 and cache.num_free_pages == 20


# attach / detach --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-v3")
    save_tiny(path, "v3", q_lora=True, moe=True, yarn=True)
    return path


def test_attach_shares_parameters_and_builds_no_mask(tiny_path):
    model = load(tiny_path)
    originals = [layer.self_attn for layer in model.model.layers]
    before = {n: p.data_ptr() for n, p in model.named_parameters()}
    keys = set(model.state_dict())
    attach(model, num_pages=8, page_size=16)
    for i, layer in enumerate(model.model.layers):
        new, old = layer.self_attn, originals[i]
        assert new is not old
        for name in ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"):
            assert getattr(new, name) is getattr(old, name)
            assert getattr(new, name).weight.data_ptr() == getattr(old, name).weight.data_ptr()
    after = {n: p.data_ptr() for n, p in model.named_parameters()}
    assert after == before  # the same tensors under the same names: nothing copied, nothing added
    assert set(model.state_dict()) == keys
    seen = []
    model.model.layers[0].self_attn.register_forward_pre_hook(lambda m, a, kw: seen.append(kw), with_kwargs=True)
    generate(model, [[1, 2, 3, 4, 5], [6, 7]], 2)
    assert seen and all(kw["attention_mask"] is None for kw in seen)  # transformers built no [T, T] mask


def test_attach_detach_round_trip(tiny_path):
    model = load(tiny_path)
    ids = torch.tensor([[5, 9, 2, 7, 1, 3]])
    impl = model.config._attn_implementation
    with torch.no_grad():
        want = model(ids).logits
    originals = [layer.self_attn for layer in model.model.layers]
    attach(model, num_pages=8, page_size=16)
    assert is_attached(model)
    with pytest.raises(ValueError, match="openmla_step"):
        with torch.no_grad():
            model(ids)  # an attached model is driven by openmla.hf, not called directly
    with pytest.raises(ValueError, match="already attached"):
        attach(model, num_pages=8)
    generate(model, [ids[0].tolist()], 3)
    detach(model)
    assert not is_attached(model)
    assert [layer.self_attn for layer in model.model.layers] == originals
    assert model.config._attn_implementation == impl
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want)
    with pytest.raises(ValueError, match="not attached"):
        generate(model, [[1]], 1)


def test_attach_refuses_a_malformed_indexer_and_leaves_the_model_alone(tiny_path):
    model = load(tiny_path)
    model.model.layers[1].self_attn.indexer = torch.nn.Identity()  # not a DeepSeek-V3.2 indexer
    impl = model.config._attn_implementation
    originals = [layer.self_attn for layer in model.model.layers]
    with pytest.raises(ValueError, match="indexer"):
        attach(model, num_pages=8)
    assert [layer.self_attn for layer in model.model.layers] == originals
    assert model.config._attn_implementation == impl and not is_attached(model)
    with pytest.raises(ValueError, match="DeepseekV3ForCausalLM"):
        attach(model.model, num_pages=8)


def test_v32_indexer_is_shared_and_its_keys_follow_the_pages(tmp_path):
    """attach adopts each layer's indexer (the same parameters), keeps its keys in a store with the
    cache's rows; detach gives the modules back."""
    save_tiny(tmp_path, "v32", q_lora=True, moe=False, yarn=False)
    prompts = prompts_for(seed=3)[2:]
    want, _ = transformers_greedy(load(tmp_path), prompts)
    model = load(tmp_path)
    originals = [layer.self_attn for layer in model.model.layers]
    cache = attach(model, num_pages=24, page_size=4)
    state = attachment(model)
    assert state.index_keys.shape == (2, 24 * 4, 32) and state.index_topk == 8
    for layer, orig in zip(model.model.layers, originals):
        assert layer.self_attn.indexer is orig.indexer
        assert layer.self_attn.indexer.wk.weight.data_ptr() == orig.indexer.wk.weight.data_ptr()
    state.index_keys.fill_(float("nan"))  # rows no sequence wrote must never be read
    assert generate(model, prompts, NEW) == want
    assert cache.num_free_pages == cache.num_pages
    detach(model)
    assert [layer.self_attn for layer in model.model.layers] == originals


def test_forward_step_gives_prefill_logits_of_transformers(tiny_path):
    """One packed step of two prompts: the logits of each prompt's last token equal transformers'."""
    model = load(tiny_path)
    prompts = [[3, 1, 4, 1, 5, 9, 2], [2, 7, 1]]
    with torch.no_grad():
        want = [model(torch.tensor([p])).logits[0, -1] for p in prompts]
    cache = attach(model, num_pages=8, page_size=4)
    batch = cache.prepare(["a", "b"], [len(p) for p in prompts])
    logits = forward_step(model, batch, torch.tensor(prompts[0] + prompts[1]), torch.tensor([6, 9]))
    cache.commit(batch)
    for i in range(2):
        assert rel_err(logits[i], want[i]) <= TOL
    assert attachment(model).cache is cache


# Sampling, eos, the stream, bad input ----------------------------------------------------------
def test_sampling_is_reproducible_and_pages_return(tiny_path):
    model = load(tiny_path)
    cache = attach(model, num_pages=16, page_size=8)
    prompts = prompts_for(seed=3)
    hot = Sampling(temperature=1.5, top_k=50, top_p=0.95, seed=11)
    a = generate(model, prompts, NEW, sampling=hot)
    b = generate(model, prompts, NEW, sampling=hot)
    c = generate(model, prompts, NEW, sampling=Sampling(temperature=1.5, top_k=50, top_p=0.95, seed=12))
    assert a == b and a != c
    assert all(len(x) == NEW for x in a)
    greedy = generate(model, prompts, NEW)
    assert generate(model, prompts, NEW, sampling=Sampling(temperature=1.0, top_k=1, seed=0)) == greedy
    assert generate(model, prompts, NEW, sampling=Sampling(temperature=1.0, top_p=1e-6, seed=0)) == greedy
    assert cache.num_free_pages == cache.num_pages


def test_filter_logits_top_k_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.1, 0.3, 0.05, 0.05]]))
    keep = lambda x: torch.isfinite(x[0]).nonzero()[:, 0].tolist()  # noqa: E731
    assert keep(filter_logits(logits, 2, 1.0)) == [0, 2]
    assert keep(filter_logits(logits, 0, 0.5)) == [0]  # 0.5 reached by the best alone
    assert keep(filter_logits(logits, 0, 0.85)) == [0, 1, 2]  # 0.5 + 0.3 < 0.85: the next one joins
    assert keep(filter_logits(logits, 2, 0.85)) == [0, 2]


def test_eos_ends_a_request_and_is_kept(tiny_path):
    model = load(tiny_path)
    cache = attach(model, num_pages=16, page_size=8)
    prompts = prompts_for(seed=3)
    greedy = generate(model, prompts, NEW)
    eos = greedy[0][4]
    got = generate(model, prompts, NEW, eos_token_id=[eos])
    for g, full in zip(got, greedy):
        want = full[: full.index(eos) + 1] if eos in full else full
        assert g == want
    assert len(got[0]) <= 5
    assert cache.num_free_pages == cache.num_pages


def test_stream_closed_early_releases_pages(tiny_path):
    model = load(tiny_path)
    cache = attach(model, num_pages=16, page_size=8)
    it = stream(model, prompts_for(), NEW)
    first = [next(it) for _ in range(5)]
    assert all(ev.finish_reason is None and ev.logits is None for ev in first)
    assert cache.num_free_pages < cache.num_pages
    it.close()
    assert cache.num_free_pages == cache.num_pages


def test_bad_input_is_a_value_error(tiny_path):
    model = load(tiny_path)
    cache = attach(model, num_pages=4, page_size=8)  # 32 tokens
    with pytest.raises(ValueError, match=r"prompts\[1\].*cache holds 32"):
        stream(model, [[1, 2], list(range(30))], 4)
    with pytest.raises(ValueError, match=r"prompts\[0\].*vocabulary"):
        generate(model, [[VOCAB]], 2)
    with pytest.raises(ValueError, match=r"prompts\[0\].*empty"):
        generate(model, [[]], 2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, [[1]], 0)
    with pytest.raises(ValueError, match="top_p"):
        Sampling(temperature=1.0, top_p=0.0)
    with pytest.raises(ValueError, match="max_batch_tokens"):
        Limits(max_batch_tokens=0)
    assert cache.num_free_pages == cache.num_pages and cache.sequences == []
