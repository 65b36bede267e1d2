"""Speculative decoding through the plugin: the verification step runs each request's last
token and its drafts (q_len > 1) through openmla's decode form, bottom-right causal over the
request's cache.

The backend's metadata builder declares ``QueryLenSupport.VARLEN``, so vLLM raises the
builder's ``reorder_batch_threshold`` to 1 + ``num_speculative_tokens`` and the plugin's decode
plans are made with that ``decode_max_q_len``. Greedy verification accepts exactly the tokens
the model would have picked: the speculative runs' tokens must equal the non-speculative
openmla run's and vLLM's own backend's non-speculative run's, up to near-ties (a different batch
composition rounds the GEMMs differently), and every openmla call (the draft model's MLA layer
too) must match the float64 reference on the same plan and cache.

The checkpoint: a random-weight DeepSeek-V3 (q LoRA, 16 heads, 2 layers) with one MTP layer
(``num_nextn_predict_layers`` 1, its weights at ``model.layers.2.*``, ``with_mtp``). Two proposers:
- vLLM's n-gram proposer, 7 drafts per step (a threshold of 8, above openmla's default
  ``decode_max_q_len`` of 6): the prompts repeat n-grams and the model's greedy continuations fall
  into loops, so drafts are proposed and many accepted;
- the MTP layer (``method="mtp"``, 1 draft per step), an MLA layer of its own that openmla serves:
  its ``eh_proj`` passes the target's hidden state through (plus noise) and its head is the target's,
  so it drafts roughly "the last token again", which a looping random model often accepts.
With chunked prefill (a 200-token prompt prefilled in two chunks beside verification steps),
prefix caching (the n-gram run's second round re-reads 128 cached tokens), and a 3-token prompt that vLLM
counts as a decode request (3 <= the threshold, an empty cache).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from conftest import generate, generate_cases
from models import VOCAB, deepseek_v3, save_model
from test_engine import OURS, TOL_BF16, assert_tokens_equal

K = 7  # n-gram drafts per step: verification steps of up to 8 query tokens


def with_mtp(path: Path, seed: int = 1) -> Path:
    """Add one DeepSeek MTP layer (``num_nextn_predict_layers`` 1) to the checkpoint in ``path``: a
    copy of its last decoder layer (attention and MoE outputs scaled by 0.1), RMSNorms of ones,
    ``eh_proj`` = [0 | I] + noise (the target's hidden state through, the new token's embedding
    nearly ignored) and the target's lm_head as its head."""
    from safetensors.torch import load_file, save_file

    cfg = json.loads((path / "config.json").read_text())
    n, hidden = cfg["num_hidden_layers"], cfg["hidden_size"]
    weights = load_file(path / "model.safetensors")
    src, dst = f"model.layers.{n - 1}.", f"model.layers.{n}."
    mtp = {dst + k[len(src):]: v.float() for k, v in weights.items() if k.startswith(src)}
    for k in mtp:
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            mtp[k] = mtp[k] * 0.1
    gen = torch.Generator().manual_seed(seed)
    eh_proj = torch.cat([torch.zeros(hidden, hidden), torch.eye(hidden)], dim=1) + 0.01 * torch.randn(hidden, 2 * hidden, generator=gen)
    ones = torch.ones(hidden)
    mtp.update({dst + "enorm.weight": ones, dst + "hnorm.weight": ones, dst + "eh_proj.weight": eh_proj,
                dst + "shared_head.norm.weight": ones, dst + "shared_head.head.weight": weights["lm_head.weight"].float()})
    weights.update({k: v.to(torch.bfloat16).contiguous() for k, v in mtp.items()})
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 1}, indent=2))
    return path


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory) -> Path:
    return with_mtp(save_model(deepseek_v3(num_heads=16), tmp_path_factory.mktemp("v3-mtp")))


def prompts(seed: int = 7) -> list[list[list[int]]]:
    rng = random.Random(seed)
    tokens = lambda n: [rng.randrange(2, VOCAB) for _ in range(n)]  # noqa: E731  (0, 1: bos, eos)
    loop, phrase = tokens(6), tokens(20)
    first = [loop * 5, phrase * 2, tokens(3), tokens(60) + phrase + tokens(100) + phrase]
    second = [first[3][:140] + loop * 2, tokens(9) * 3]
    return [first, second]


NGRAM = dict(speculative_config=dict(method="ngram", num_speculative_tokens=K, prompt_lookup_max=3, prompt_lookup_min=2))
MTP = dict(speculative_config=dict(method="mtp", num_speculative_tokens=1))


def test_speculation_gives_the_non_speculative_tokens(mtp_checkpoint, tmp_path):
    spec = dict(model=mtp_checkpoint, rounds=prompts(), max_tokens=16)
    want = generate(spec, tmp_path, openmla=False)  # vLLM's own backend, no speculation
    # The n-gram engine last in its process: after vLLM's n-gram proposer imported numba, a new
    # engine in the same process fails in vLLM's kernel-override scan (vLLM 0.32; see docs/vllm.md).
    plain, mtp, ngram = generate_cases([spec, dict(spec, engine=MTP), dict(spec, engine=NGRAM)], tmp_path, openmla=True,
                                       compare_with="reference")
    assert want["impl"] != OURS and want["decode_plans"] == {}
    assert plain["impls"] == [OURS] and plain["spec_decode"] is None and plain["decode_max_q_len"] == [1]
    assert mtp["impls"] == [OURS] and mtp["attention_layers"] == 3  # the MTP layer's attention is openmla's too
    for got, k in ((mtp, 1), (ngram, K)):
        stats = got["spec_decode"]
        assert stats["drafts"] > 0 and stats["draft_tokens"] > 0 and stats["accepted_tokens"] > 0, stats  # it speculated
        assert got["decode_max_q_len"] == [k + 1]  # vLLM's threshold: the last token and k drafts
        assert max(int(q) for q in got["decode_plans"]) == k + 1, got["decode_plans"]  # verification in the decode form
        assert got["chunked_prefill"] and got["prefix_caching"]
    # A cached prefix read beside verification steps (with MTP, vLLM drops the last matching block
    # from a hit, since the draft layer needs that block's hidden states: none of 140 shared tokens).
    assert ngram["cached_tokens"][1][0] >= 128
    for got in (plain, mtp, ngram):
        assert got["calls_compared"] >= 20 and got["max_rel_err"] < TOL_BF16, got  # every call against float64
        assert_tokens_equal(got, want)
    assert_tokens_equal(mtp, plain)
    assert_tokens_equal(ngram, plain)
