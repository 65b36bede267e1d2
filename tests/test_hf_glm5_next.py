"""openmla.hf on GLM-5-Next (``Glm5NextForConditionalGeneration``), text only, against transformers.

Its MLA layers have no rope (R = 0: openmla's cache entries are the latent alone) and attend to the
keys a top-k indexer picks over pooled key groups: every complete group of ``index_kpool`` tokens
is pooled into one candidate by a softmax gate, the best ``index_topk / index_kpool`` pools are
expanded to their tokens, and the query's open tail pool is added; "shared" layers reuse the
previous layer's picks; KDA linear-attention layers run per sequence (openmla.hf.hybrid). A tiny
random float32 model (GLM-5-Next's MLA dims; KDA, indexed, shared layers; pools of 4 tokens, top 8
keys, so most pools of the longer prompts are left out; a MoE; hyper-connections; a tiny vision
tower): greedy tokens equal ``model.generate(do_sample=False)`` for 4 prompts (16 new tokens) in one
continuous batch and one at a time, logits within 1e-4, parameters shared; the picks equal
transformers' indexer's, as sets, over a packed ragged step and a decode step.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import openmla  # noqa: E402
from openmla.hf import attach, attachment, detach  # noqa: E402
from openmla.hf import presets  # noqa: E402
from openmla.hf.families import REFUSED, family_of  # noqa: E402
from openmla.hf.indexer import IndexStep, pooled_width, select_pooled  # noqa: E402
from test_hf_generate import attached_text_model, assert_serves_like_transformers, prompts_for, transformers_greedy  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    m = presets.build("glm5_next", "test")
    text = m.config.text_config
    assert text.qk_rope_head_dim == 0 and text.index_kpool == 4 and text.index_topk == 8
    assert text.layer_types == ["linear_attention", "indexed_attention", "indexed_attention"]
    return m


def test_text_tokens_equal_transformers(model):
    prompts = prompts_for()
    want_tokens, want_logits = transformers_greedy(model, prompts)
    with attached_text_model(model, num_pages=40, page_size=8) as cache:
        assert cache.blocks.shape[-1] == model.config.text_config.kv_lora_rank and cache.rope_dim == 0  # the latent alone
        assert_serves_like_transformers(model, cache, prompts, want_tokens, want_logits)


def _as_sets(picks: torch.Tensor) -> list[set[int]]:
    return [{int(x) for x in row if x >= 0} for row in picks]


def test_pooled_picks_equal_transformers_indexer(model):
    """Two sequences (30 and 13 tokens) packed into one prefill step, then one decode token each: every
    token's picks equal transformers' indexer run on its sequence alone (as sets: order is not part of
    the attention), and the picks leave pools out (the selection matters)."""
    indexer = model.model.language_model.layers[1].self_attn.indexer
    text = model.config.text_config
    g = torch.Generator().manual_seed(3)
    lens, more = [30, 13], [1, 1]
    hidden = [torch.randn(n + m, text.hidden_size, generator=g) for n, m in zip(lens, more)]
    resid = [torch.randn(n + m, text.q_lora_rank, generator=g) for n, m in zip(lens, more)]
    with torch.no_grad():
        want = [_as_sets(indexer(h[None], r[None], torch.ones(1, h.shape[0], dtype=torch.bool), None)[0])
                for h, r in zip(hidden, resid)]
    cache = openmla.PagedLatentCache(1, 12, 8, head_dim=16, dtype=torch.float32, rope_dim=0)
    store = torch.zeros(12 * 8, 2 * indexer.head_dim)
    for step_lens, start in ((lens, [0, 0]), (more, lens)):
        batch = cache.prepare(["a", "b"], step_lens)
        step = IndexStep.build(openmla.plan(batch, scale=1.0), pooled_width(indexer))
        rows = [(s, s + n) for s, n in zip(start, step_lens)]
        h = torch.cat([x[a:b] for x, (a, b) in zip(hidden, rows)])
        r = torch.cat([x[a:b] for x, (a, b) in zip(resid, rows)])
        got = _as_sets(select_pooled(indexer, store, step, h, r))
        assert got == [want[i][t] for i, (a, b) in enumerate(rows) for t in range(a, b)]
        cache.commit(batch)
    assert all(len(s) < t + 1 for t, s in enumerate(want[0]) if t >= 16)  # long prefixes: not every key is read


def test_not_text_is_refused(model):
    attach(model, num_pages=8, page_size=8)
    try:
        ids = torch.tensor([[1, 2, 3]])
        with pytest.raises(ValueError, match="pixel_values: Glm5NextForConditionalGeneration is attached to openmla for text only"):
            model(input_ids=ids, pixel_values=torch.zeros(4, 96), image_grid_thw=torch.tensor([[1, 2, 2]]))
        assert attachment(model).cache.num_free_pages == 8
    finally:
        detach(model)


def test_listed_and_no_longer_refused(model):
    assert "Glm5NextForConditionalGeneration" not in REFUSED and family_of(model).name == "glm5_next"
