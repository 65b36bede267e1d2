"""openmla.hf on Mistral Large 4 (``MistralLarge4ForConditionalGeneration``), text only, against transformers.

Its attention (q_proj, no q LoRA) has every layer kind in the tiny model: rope layers (R = 64, interleaved)
and NoPE layers (R = 0: Dn = 128), each kind with a layer that writes its latent and a layer that reads
it (no ``kv_a_proj_with_mqa``: ``kv_source_layers`` [0, 0, 2, 2]), indexer layers and layers reusing
the previous layer's picks (``indexer_types`` full, shared, shared, full: a reader with its own indexer,
a writer with reused picks). MLA dims are Mistral Large 4's (L=512, R=64, Dn=64, Dv=128); top 8 keys
from 4 index heads of 128. The learned rope frequencies (``alpha``) and the per-head log-position
query scales (``softmax_scaling`` of the attention and of the indexer) are drawn at random, so each of
them changes the tokens. A tiny random float32 model: greedy tokens equal ``model.generate(do_sample=False)``
for 4 prompts (16 new tokens) in one continuous batch and one at a time, logits within 1e-4 relative,
parameters shared; a reader's attention over its source's cache layer equals the fused op in every form
(dense prefill, decode, sparse); the picks equal transformers' indexer's, as sets (a rope and a NoPE
layer); configs whose reading transformers does not do as the config says are refused.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import openmla  # noqa: E402
from cases import rel_err  # noqa: E402
from openmla.hf import attach, attachment, detach, generate, is_attached  # noqa: E402
from openmla.hf import presets  # noqa: E402
from openmla.hf.families import REFUSED, family_of  # noqa: E402
from openmla.hf.indexer import IndexStep, select_keys  # noqa: E402
from test_hf_generate import attached_text_model, assert_serves_like_transformers, prompts_for, transformers_greedy  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

CLASS = "MistralLarge4ForConditionalGeneration"


@pytest.fixture(scope="module")
def model():
    m = presets.build("mistral_large4", "test")
    text = m.config.text_config
    assert (text.kv_lora_rank, text.qk_rope_head_dim, text.qk_nope_head_dim, text.v_head_dim) == (512, 64, 64, 128)
    assert text.kv_sharing_modes == ["store", "reuse", "store", "reuse_but_indexer"] and text.no_rope_layers == [1, 1, 0, 0]
    assert text.index_topk == 8 and text.indexer_types == ["full", "shared", "shared", "full"]
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # transformers initialises them to no effect (alpha 0, scale 0, bias 1)
        rotary = m.model.language_model.rotary_emb
        rotary.alpha.copy_(torch.randn(rotary.alpha.shape, generator=g) * 0.3)
        for module in m.modules():
            if type(module).__name__ == "MistralLarge4TextSoftmaxScaling":
                module.scale.copy_(torch.randn(module.scale.shape, generator=g) * 0.3)
                module.bias.copy_(1 + torch.randn(module.bias.shape, generator=g) * 0.2)
    return m


def _attention_modules(model):
    return [layer.self_attn for layer in model.model.language_model.layers]


def test_text_tokens_equal_transformers(model):
    prompts = prompts_for()
    want_tokens, want_logits = transformers_greedy(model, prompts)
    with attached_text_model(model, num_pages=40, page_size=8) as cache:
        state = attachment(model)
        # a storage per rope width (R = 64, R = 0), one cache layer each: the reading layers have none
        assert [(tuple(c.blocks.shape), c.rope_dim) for c in state.caches] == [((1, 40, 8, 576), 64), ((1, 40, 8, 512), 0)]
        assert [(m.reads_latent, m.layer_idx, m.plan_index) for m in state.layers] == [
            (False, 0, 0), (True, 0, 0), (False, 0, 1), (True, 0, 1)]
        assert_serves_like_transformers(model, cache, prompts, want_tokens, want_logits)


def test_reader_equals_the_fused_op_over_the_same_latent(model):
    """Layer 1 reads layer 0's cache layer and writes nothing; it must equal ``MLAPlan.run`` writing the same
    latent (layer 0's projection and norm) with layer 1's own weights, in the dense prefill form (the model's
    layers are all sparse), the decode form and a sparse step."""
    attach(model, num_pages=8, page_size=8)
    try:
        writer, reader = attachment(model).layers[:2]
        c = reader.config
        g = torch.Generator().manual_seed(7)
        caches = [openmla.PagedLatentCache(1, 8, 8, 576, torch.float32, rope_dim=64) for _ in range(2)]
        weights = openmla.LayerWeights(writer.latent_gamma(), reader.w_k, reader.w_uk, reader.w_uv, writer.config.rms_norm_eps,
                                       c.rope_interleave)
        for lens, sparse in (([9, 13], False), ([1, 1], False), ([7, 2], True)):
            batches = [cache.prepare(["a", "b"], lens) for cache in caches]
            plans = [openmla.plan(b, scale=c.softmax_scale) for b in batches]
            assert plans[0].form == ("prefill" if max(lens) > 6 else "decode")
            if sparse:  # each token: position 0 and itself
                pos = plans[0].token_pos.to(torch.int32)
                picks = torch.stack([torch.zeros_like(pos), pos, torch.full_like(pos, -1)], dim=1)
                plans = [p.with_sparse(picks, physical_indices=False) for p in plans]
            hidden = torch.randn(sum(lens), c.hidden_size, generator=g)
            q = reader.project_q(hidden)
            with torch.no_grad():
                writer._attend(hidden, plans[0], writer.project_q(hidden), None)  # writes cache layer 0
                got = reader._attend(hidden, plans[0], q, None)
                table = writer.rope.table(plans[1].max_position, hidden.device)
                out = plans[1].run(q, writer.kv_a_proj_with_mqa(hidden), 0, weights, table)
                want = reader.o_proj(out.reshape(sum(lens), -1))
            assert rel_err(got, want) < 1e-5, (lens, sparse)
            assert torch.equal(caches[0].blocks, caches[1].blocks)  # the reader wrote nothing
            for cache, batch in zip(caches, batches):
                cache.commit(batch)
    finally:
        detach(model)


def _as_sets(picks: torch.Tensor, upto: list[int] | None = None) -> list[set[int]]:
    return [{int(x) for x in row if x >= 0 and (upto is None or x <= upto[i])} for i, row in enumerate(picks)]


@pytest.mark.parametrize("layer", [0, 3])
def test_picks_equal_transformers_indexer(model, layer):
    """Two sequences (30 and 13 tokens) packed into one prefill step, then one decode token each: every token's
    picks equal transformers' indexer (queries from the hidden states, scaled per head by position; roped in
    layer 0, not in NoPE layer 3) run on its sequence alone, as sets; long prefixes leave keys out."""
    lm = model.model.language_model
    indexer = lm.layers[layer].self_attn.indexer
    assert bool(indexer.use_rope) == (layer == 0)
    text = model.config.text_config
    g = torch.Generator().manual_seed(3)
    lens, more = [30, 13], [1, 1]
    hidden = [torch.randn(n + m, text.hidden_size, generator=g) for n, m in zip(lens, more)]
    want = []
    with torch.no_grad():
        for h in hidden:
            n = h.shape[0]
            pos = torch.arange(n)[None]
            mask = torch.ones(n, n, dtype=torch.bool).tril()[None]
            picks = indexer(h[None], lm.rotary_emb(h[None], pos), mask, pos)[0]
            want.append(_as_sets(picks, list(range(n))))  # rows with fewer visible keys than index_topk pick masked ones too
    cache = openmla.PagedLatentCache(1, 12, 8, head_dim=576, dtype=torch.float32, rope_dim=64)
    store = torch.zeros(12 * 8, indexer.head_dim)
    spec = family_of(model).indexer
    for step_lens, start in ((lens, [0, 0]), (more, lens)):
        batch = cache.prepare(["a", "b"], step_lens)
        plan = openmla.plan(batch, scale=1.0)
        step = IndexStep.build(plan, int(indexer.index_topk))
        rows = [(s, s + n) for s, n in zip(start, step_lens)]
        h = torch.cat([x[a:b] for x, (a, b) in zip(hidden, rows)])
        cos, sin = lm.rotary_emb(h[None], plan.token_pos[None])
        got = _as_sets(select_keys(indexer, store, step, h, None, cos[0], sin[0], spec, plan.token_pos))
        assert got == [want[i][t] for i, (a, b) in enumerate(rows) for t in range(a, b)]
        cache.commit(batch)
    assert all(len(s) == 8 for s in want[0][8:])  # past 8 keys, only 8 are read


def _refused(model, match: str) -> None:
    text = model.config.text_config
    impl, originals = text._attn_implementation, _attention_modules(model)
    with pytest.raises(ValueError, match=rf"model: {CLASS}: .*{match}"):
        attach(model, num_pages=8, page_size=8)
    assert _attention_modules(model) == originals and text._attn_implementation == impl and not is_attached(model)


def test_refuses_a_reading_it_cannot_place(model):
    """A reading layer whose kind (NoPE) no earlier layer stores (transformers fails on it), and a config whose
    ``kv_source_layers`` names another layer than the one transformers' attention reads: refused before the
    model changes."""
    source = _attention_modules(model)[2]
    source.store_full_length_kv = False
    try:
        _refused(model, "layer 3 reads an earlier layer's NoPE latent and no earlier layer of that kind stores one")
    finally:
        source.store_full_length_kv = True
    sources = model.config.text_config.kv_source_layers
    sources[3] = 0
    try:
        _refused(model, "layer 3: kv_source_layers names layer 0, but transformers' attention reads layer 2's latent")
    finally:
        sources[3] = 2


def test_not_text_is_refused(model):
    attach(model, num_pages=8, page_size=8)
    try:
        with pytest.raises(ValueError, match=f"pixel_values: {CLASS} is attached to openmla for text only"):
            model(input_ids=torch.tensor([[1, 2, 3]]), pixel_values=torch.zeros(1, 3, 16, 16), image_sizes=torch.tensor([[16, 16]]))
        with pytest.raises(ValueError, match="image_token_id"):
            generate(model, [[1, model.config.image_token_id, 3]], 2)
        assert attachment(model).cache.num_free_pages == 8
    finally:
        detach(model)


def test_listed_and_no_longer_refused(model):
    assert CLASS not in REFUSED and family_of(model).name == "mistral_large4"
