"""FP8 KV caches in vLLM: ``kv_cache_dtype="fp8"`` (= ``"fp8_e4m3"``, per-tensor ``k_scale``) and
``"fp8_ds_mla"`` (DeepSeek's 656-byte record), stored and read in place by openmla's formats.

vLLM's CPU build has no fp8 MLA backend of its own (its CPU_MLA kernel fails on a float8 cache,
its AMX_MLA asserts an unquantized one), so the tokens are checked against vLLM's own backend on
its native cache with every new latent and rope key rounded through the same fp8 format first
(``fake_quant`` in generate.py, written from the formats' definitions): both engines then attend
over the same values, and their tokens may part only at a bf16 near-tie (openmla's fp8 path
multiplies in bfloat16). Every attention call is also checked against the float64 reference on
the same fp8 cache. The random-weight DeepSeek-V2 checkpoint (16 heads) with per-layer scales
that are not powers of two, chunked prefill (a 150-token prompt in two chunks beside decodes) and
prefix caching (the second round reads 128 cached fp8 tokens) on the plugin's side.
"""

from __future__ import annotations

import random

from conftest import generate_cases
from models import VOCAB
from test_engine import OURS, TOL_BF16, assert_tokens_equal

K_SCALES = [0.3, 1.7]  # layer 0, layer 1: stored = x / k_scale


def test_fp8_caches_give_vllms_tokens_on_the_same_values(checkpoints, tmp_path):
    rng = random.Random(5)
    tokens = lambda n: [rng.randrange(2, VOCAB) for _ in range(n)]  # noqa: E731  (0, 1: bos, eos)
    first = [tokens(1), tokens(7), tokens(40), tokens(150)]
    spec = dict(model=checkpoints["v2"], rounds=[first, [first[3][:140] + tokens(5), tokens(3)]], max_tokens=4)
    fp8, ds_mla = dict(spec, k_scales=K_SCALES), dict(spec)
    want = generate_cases([dict(fp8, fake_quant="fp8_e4m3"), dict(ds_mla, fake_quant="fp8_ds_mla")], tmp_path, openmla=False)
    got = generate_cases([dict(fp8, engine=dict(kv_cache_dtype="fp8")), dict(ds_mla, engine=dict(kv_cache_dtype="fp8_ds_mla")),
                          dict(spec, engine=dict(kv_cache_dtype="fp8_e5m2"), expect_error=True)],
                         tmp_path, openmla=True, compare_with="reference")
    L, R = 512, 64
    for g, w, width in zip(got, want, (L + R, 656)):
        assert g["impl"] == OURS and w["impl"] != OURS
        assert g["cache"] == ["torch.uint8", [g["cache"][1][0], g["block_size"], width]]  # vLLM's own tensor, read in place
        assert g["chunked_prefill"] and g["prefix_caching"] and g["cached_tokens"][1][0] >= 128  # a cached fp8 prefix was read
        assert g["calls_compared"] >= 10 and g["max_rel_err"] < TOL_BF16  # every call against float64 on the same fp8 cache
        assert_tokens_equal(g, w)
    assert "openmla's fp8_e4m3 format (kv_cache_dtype=fp8)" in got[0]["announce"][0]
    assert "kv_cache_dtype='fp8_e5m2' is not served" in got[2]["error"]  # refused before anything runs
