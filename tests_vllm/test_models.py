"""Other MLA families vLLM serves, as random-weight checkpoints with their real MLA dims
(tests_vllm/models.py): Kimi K2 (``kimi_k2``: DeepSeek-V3's architecture, 64 heads, YaRN x32
whose mscale^2 enters the softmax scale), GLM-4.7-Flash (``Glm4MoeLiteForCausalLM``: nope 192,
v 256) and MiniCPM3 (kv_lora_rank 256, rope 32, half-split rope).

Each model's greedy tokens with openmla serving its MLA layers, on the schedule vLLM's own run had
(page size, chunked prefill, prefix caching: batch composition changes GEMM rounding), must be
those vLLM gives with its own backend, up to bf16 near-ties, and every openmla call must
match the float64 reference on the same plan and cache. GLM-4.7-Flash's rope is vLLM's plain
``RotaryEmbedding``, whose CPU op rotates MLA queries at the wrong positions (cpu_platform.py):
the plugin turns it off, vLLM's own run here too (conftest), and the test checks both did.

MiniCPM3: vLLM's own MiniCPM3 model is not MLA (it up-projects K and V and runs ordinary
multi-head attention on its CPU_ATTN backend, 2 x 40 x 96 cached values per token and layer), so
no MLA backend is ever asked; under vLLM's Transformers modeling backend (``model_impl=
"transformers"``) its layers are MLA layers (288 cached values per token and layer) and openmla
serves them. Its tokens are compared with vLLM's own MiniCPM3 model. vLLM's own MLA backend
cannot run it (its MLA metadata refuses the head size), and fp8_ds_mla is refused for it (vLLM
allocates DeepSeek's 656-byte record, MiniCPM3's would be 328 bytes).
"""

from __future__ import annotations

import random

from conftest import generate_cases
from models import VOCAB
from test_engine import OURS, TOL_BF16, assert_tokens_equal, same_schedule

FAMILIES = ("kimi_k2", "glm4_7_flash", "minicpm3")
OWN = {"minicpm3": "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackendImpl"}  # vLLM's MiniCPM3: not MLA
OWN_ENGINE = {"minicpm3": dict(kv_cache_memory_bytes=128 << 20)}  # its per-head K/V: 61 KB per token in float32
OPENMLA_ENGINE = {"minicpm3": dict(model_impl="transformers")}  # where its layers are MLA layers


def test_other_mla_families_give_vllms_tokens(family_checkpoints, tmp_path):
    rng = random.Random(6)
    tokens = lambda n: [rng.randrange(2, VOCAB) for _ in range(n)]  # noqa: E731  (0, 1: bos, eos)
    first = [tokens(1), tokens(9), tokens(150)]
    rounds = [first, [first[2][:140] + tokens(4), tokens(3)]]
    specs = [dict(model=family_checkpoints[name], rounds=rounds, max_tokens=4) for name in FAMILIES]
    want = generate_cases([dict(s, engine=OWN_ENGINE.get(n, {})) for n, s in zip(FAMILIES, specs)], tmp_path, openmla=False)
    refused = dict(specs[2], engine=dict(OPENMLA_ENGINE["minicpm3"], kv_cache_dtype="fp8_ds_mla"), expect_error=True)
    got = generate_cases([dict(s, engine={**OPENMLA_ENGINE.get(n, {}), **same_schedule(w)}) for n, s, w in zip(FAMILIES, specs, want)]
                         + [refused], tmp_path, openmla=True, compare_with="reference")
    for name, g, w in zip(FAMILIES, got, want):
        assert g["impl"] == OURS and w["impl"] == OWN.get(name, w["impl"]) != OURS, name
        assert g["native_rope"] and w["native_rope"], name  # vLLM's CPU rotary op off in both runs
        assert (g["block_size"], g["chunked_prefill"], g["prefix_caching"]) == (w["block_size"], w["chunked_prefill"], w["prefix_caching"]), name
        if g["prefix_caching"]:  # vLLM's AMX_MLA or CPU_ATTN schedule: the second round reads the cached prefix
            assert g["cached_tokens"][1][0] >= 128, name
        assert g["calls_compared"] >= 10 and g["max_rel_err"] < TOL_BF16, (name, g["max_rel_err"])
        assert_tokens_equal(g, w)
    assert got[2]["cache"][1][2] == 256 + 32  # MiniCPM3's latent cache: L + R values per token
    assert "kv_lora_rank 256 and rope 32 (328-byte records)" in got[3]["error"]
