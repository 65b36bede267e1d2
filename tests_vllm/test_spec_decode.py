"""Speculative decoding through the plugin: vLLM's n-gram proposer drafts tokens from the
context, and the verification step runs each request's last token and its drafts (q_len > 1)
through openmla's decode form, bottom-right causal over the request's cache.

The backend's metadata builder declares ``QueryLenSupport.VARLEN``, so vLLM raises the
builder's ``reorder_batch_threshold`` to 1 + ``num_speculative_tokens`` and the plugin's decode
plan is made with that ``decode_max_q_len``. Random-weight DeepSeek-V2 (16 heads); the prompts
repeat n-grams, and the model's own greedy continuations fall into loops, so drafts are proposed
and many accepted. Greedy verification accepts exactly the tokens the model would have picked:
the speculative runs' tokens must equal the non-speculative openmla run's and vLLM's own
backend's non-speculative run's, up to near-ties (a different batch composition rounds the
GEMMs differently), and every openmla call must match the float64 reference on the same plan
and cache. ``num_speculative_tokens`` 7 (a threshold of 8, above openmla's default
``decode_max_q_len`` of 6); with chunked prefill (a 200-token prompt prefilled in two chunks
beside verification steps), prefix caching (the second round re-reads 128 cached tokens), and a
3-token prompt that vLLM counts as a decode request (3 <= the threshold, an empty cache).
"""

from __future__ import annotations

import random

from conftest import generate, generate_cases
from models import VOCAB
from test_engine import OURS, TOL_BF16, assert_tokens_equal


def prompts(seed: int = 7) -> list[list[list[int]]]:
    rng = random.Random(seed)
    tokens = lambda n: [rng.randrange(2, VOCAB) for _ in range(n)]  # noqa: E731  (0, 1: bos, eos)
    loop, phrase = tokens(6), tokens(20)
    first = [loop * 5, phrase * 2, tokens(3), tokens(60) + phrase + tokens(100) + phrase]
    second = [first[3][:140] + loop * 2, tokens(9) * 3]
    return [first, second]


def ngram(k: int, lookup_max: int) -> dict:
    return dict(speculative_config=dict(method="ngram", num_speculative_tokens=k, prompt_lookup_max=lookup_max,
                                        prompt_lookup_min=2))


K = 7  # drafts per step: verification steps of up to 8 query tokens, above openmla's default decode_max_q_len (6)


def test_ngram_speculation_gives_the_non_speculative_tokens(checkpoints, tmp_path):
    spec = dict(model=checkpoints["v2"], rounds=prompts(), max_tokens=24)
    want = generate(spec, tmp_path, openmla=False)  # vLLM's own backend, no speculation
    # The speculative engine last in its process: after vLLM's n-gram proposer imported numba, a new
    # engine in the same process fails in vLLM's kernel-override scan (vLLM 0.32; see docs/vllm.md).
    plain, got = generate_cases([spec, dict(spec, engine=ngram(K, 3))], tmp_path, openmla=True, compare_with="reference")
    assert want["impl"] != OURS and want["decode_plans"] == {}
    assert plain["impl"] == OURS and plain["spec_decode"] is None and plain["decode_max_q_len"] == [1]
    assert got["impl"] == OURS
    stats = got["spec_decode"]
    assert stats["drafts"] > 0 and stats["draft_tokens"] > 0 and stats["accepted_tokens"] > 0, stats  # it speculated
    assert got["decode_max_q_len"] == [K + 1]  # vLLM's threshold: the last token and K drafts
    assert max(int(q) for q in got["decode_plans"]) == K + 1, got["decode_plans"]  # verification steps ran the decode form
    assert got["chunked_prefill"] and got["prefix_caching"] and got["cached_tokens"][1][0] >= 128
    for run in (plain, got):
        assert run["calls_compared"] >= 20 and run["max_rel_err"] < TOL_BF16, run  # every call against float64
    assert_tokens_equal(got, plain)
    assert_tokens_equal(got, want)
    assert_tokens_equal(plain, want)
