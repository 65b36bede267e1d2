"""The CPU backends (torch and cpu) on fp8 caches against the float64 oracle reading the same fp8 cache."""

import sys

import pytest
import torch

import openmla
from openmla import reference as ref
from openmla.fp8 import FP8

from cases import make_case, rel_err, small_config
from cpu_backends import CPU_BACKENDS, use_backend

FORMATS = ["fp8_e4m3", "fp8_ds_mla"]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}

BACKEND = "torch"  # the backend under test; the autouse fixture below sets it per test


@pytest.fixture(autouse=True, params=CPU_BACKENDS)
def backend(request, monkeypatch):
    """Every test runs on the torch backend and on the native cpu backend."""
    monkeypatch.setattr(sys.modules[__name__], "BACKEND", use_backend(request.param, monkeypatch))


def run_both(case, **kwargs):
    a, b = case.clone_cache(), case.clone_cache()
    b.batch.blocks.view(torch.uint8)[...] = a.batch.blocks.view(torch.uint8)
    mask = openmla.MaskVariant.parse(kwargs.pop("mask", "causal"), kwargs.pop("window_size", None))
    schedule = {k: kwargs.pop(k) for k in ("buffer_size", "num_partitions") if k in kwargs}  # no effect on the math
    want, _ = ref.mla_prefill_decode_graph(a.q, a.kv, a.freqs_cis, a.gamma, a.batch, a.layer_idx, a.w_k, a.w_uk, a.w_uv,
                                           scale=a.scale, mask=mask, **kwargs)
    got = openmla.mla_prefill_decode_graph(*b.fused_args(), scale=b.scale, backend=BACKEND, mask=mask, **kwargs, **schedule)
    assert not torch.isnan(got).any()
    return got, want, a, b


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("new_lens", [[3, 1, 0, 2], [12, 20, 0, 1]], ids=["decode", "prefill"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_fused_op_on_fp8_cache(fmt, dtype, new_lens, page_size):
    case = make_case([9, 0, 5, 40], new_lens, config=small_config(4, 128, 16, 32, 32), dtype=dtype, cache_dtype=fmt,
                     kv_scale=0.5, page_size=page_size)
    got, want, a, b = run_both(case)
    assert rel_err(got, want) < TOL[dtype], f"seed {case.seed}"
    # The cache write stores exactly what the oracle's write stores.
    diff = (a.batch.blocks.view(torch.uint8) != b.batch.blocks.view(torch.uint8)).sum()
    assert int(diff) <= (0 if fmt == "fp8_e4m3" else 4 * sum(new_lens)), f"{int(diff)} bytes differ, seed {case.seed}"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("physical", [True, False])
def test_sparse_on_fp8_cache(fmt, physical):
    case = make_case([20, 7], [2, 1], config=small_config(2, 128, 16, 32, 32), dtype=torch.float32, cache_dtype=fmt, page_size=4)
    g = torch.Generator().manual_seed(case.seed)
    seq_of_row = [0, 0, 1]
    idx = torch.stack([torch.randint(0, case.batch.seq_lens_list[b], (5,), generator=g) for b in seq_of_row])
    if physical:
        idx = torch.stack([ref.physical_rows(case.batch, b, idx[t]) for t, b in enumerate(seq_of_row)])
    idx = idx.int()
    idx[:, -1] = -1
    got, want, _, _ = run_both(case, sparse_indices=idx, physical_indices=physical, attn_sink=torch.tensor([0.3, -0.2]))
    assert rel_err(got, want) < 1e-5, f"seed {case.seed}"


@pytest.mark.parametrize("fmt", FORMATS)
def test_chunked_prefill_and_window_on_fp8_cache(fmt):
    case = make_case([30, 0], [25, 9], config=small_config(3, 256, 16, 32, 32), dtype=torch.bfloat16, cache_dtype=fmt)
    got, want, _, _ = run_both(case, buffer_size=11, mask="sliding_window_causal", window_size=13)
    assert rel_err(got, want) < 2e-2, f"seed {case.seed}"


def test_fp8_query_on_fp8_cache_gives_bf16():
    case = make_case([5, 0], [1, 2], config=small_config(2, 128, 16, 32, 32), dtype=torch.bfloat16, cache_dtype="fp8_ds_mla")
    scale = torch.tensor([0.01, 0.02, 0.03])
    q8 = (case.q.float() / scale[:, None, None]).to(FP8)
    a, b = case.clone_cache(), case.clone_cache()
    got = openmla.mla_prefill_decode_graph(q8, *b.fused_args()[1:], scale=case.scale, q_scale=scale, backend=BACKEND)
    want = openmla.mla_prefill_decode_graph(q8, *a.fused_args()[1:], scale=case.scale, q_scale=scale, backend="reference")
    assert got.dtype == torch.bfloat16 and rel_err(got, want) < 2e-2


@pytest.mark.parametrize("fmt", FORMATS)
def test_long_context_repeated_decode_stays_finite(fmt):
    """4k cached tokens at DeepSeek dims, several decode steps in a row: finite, and each step within
    bf16 tolerance of the oracle reading the same fp8 cache."""
    case = make_case([4096], [1], config=small_config(4, 512, 64, 128, 128), dtype=torch.bfloat16, cache_dtype=fmt,
                     page_size=64, spare_pages=1, kv_scale=0.05)
    for step in range(3):
        got, want, a, b = run_both(case)
        assert torch.isfinite(got).all() and rel_err(got, want) < 2e-2, f"step {step}, seed {case.seed}"
        case.cache.commit(case.batch)
        case.batch = case.cache.prepare(["s0"], [1])
        case.batch.blocks.copy_(b.batch.blocks)
