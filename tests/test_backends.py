"""The dispatch seam: a backend is one class plus one registry line; the plan picks it (or its
fallback) once and records what runs; every route (fused op, pieces, MAX's named ops) reaches it.

The class is ``tests/einsum_backend.py``, the walkthrough of docs/backends.md.
"""

from __future__ import annotations

import math

import pytest
import torch

import openmla
from openmla import backends

from cases import (
    EDGE_SCENARIOS, MASK_CASES, NO_ROPE_SCENARIOS, TOL, assert_close, assert_close_nan, assert_lse, make_case, scenario_case, small_config,
)

REGISTRY_LINE = "einsum_backend:EinsumBackend"  # tests/ is on sys.path (conftest.py)


@pytest.fixture
def einsum(monkeypatch):
    monkeypatch.setitem(backends.REGISTRY, "einsum", REGISTRY_LINE)
    return "einsum"


def run_both(case, backend, **opts):
    a, b = case.clone_cache(), case.clone_cache()
    plan = openmla.plan(a.batch, scale=case.scale, backend=backend, **opts)
    got = plan.run(*a.run_args(), return_lse=True)
    want = openmla.plan(b.batch, scale=case.scale, backend="reference", **opts).run(*b.run_args(), return_lse=True)
    return plan, got, want, (a, b)


@pytest.mark.parametrize("mask,extra", MASK_CASES, ids=[m for m, _ in MASK_CASES])
@pytest.mark.parametrize("new", [[1, 2, 0, 1], [9, 1, 0, 12]], ids=["decode", "prefill"])
def test_a_new_backend_is_one_class_and_one_line(einsum, mask, extra, new):
    case = make_case([5, 0, 3, 17], new, config=small_config(num_heads=3), page_size=4)
    sink = torch.linspace(-1, 1, 3)
    plan, (out, lse), (w_out, w_lse), (a, b) = run_both(case, einsum, mask=mask, attn_sink=sink, **extra)
    assert plan.backend_name == "einsum" and plan.fallback_reason is None
    assert_close(out, w_out, TOL[torch.float32], "einsum vs reference", case.seed)
    assert_lse(lse, w_lse, TOL[torch.float32], case.seed)
    torch.testing.assert_close(a.batch.blocks, b.batch.blocks, rtol=1e-5, atol=1e-5)  # the cache write


def test_a_declined_step_runs_the_fallback_and_says_why(einsum):
    case = make_case([20, 3], [1, 2], page_size=8, cache_dtype="fp8_e4m3")
    plan = openmla.plan(case.batch, scale=case.scale, backend=einsum)
    assert plan.backend_name == "torch" and "fp8_e4m3" in plan.fallback_reason and plan.fallback_reason.startswith("einsum")
    sparse = make_case([20, 3], [1, 2], page_size=8)
    idx = torch.zeros(3, 4, dtype=torch.int32)
    plan = openmla.plan(sparse.batch, scale=sparse.scale, backend=einsum, sparse_indices=idx, physical_indices=False)
    assert plan.backend_name == "torch" and "sparse" in plan.fallback_reason


def test_no_fallback_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(backends.REGISTRY, "strict", "einsum_backend:EinsumBackend")
    from einsum_backend import EinsumBackend

    monkeypatch.setattr(EinsumBackend, "fallback", None)
    case = make_case([4], [1], page_size=4, cache_dtype="fp8_e4m3")
    with pytest.raises(ValueError, match="^backend: the strict backend cannot run this step: it cannot read a fp8_e4m3 cache"):
        openmla.plan(case.batch, scale=case.scale, backend="strict")


def test_seed_ops_and_pieces_reach_the_same_backend(einsum):
    case = make_case([6, 2], [1, 1], page_size=4)
    want = openmla.mla_prefill_decode_graph(*case.clone_cache().fused_args(), scale=case.scale, backend="reference")
    got = openmla.mla_prefill_decode_graph(*case.fused_args(), scale=case.scale, backend=einsum)
    assert_close(got, want, TOL[torch.float32], "MAX's op on einsum", case.seed)
    step = openmla.plan(case.batch, scale=case.scale, backend=einsum)
    calls = []
    be = step.backend
    real = type(be).decode
    be.decode = lambda *a: calls.append("decode") or real(be, *a)
    try:
        step.decode(torch.randn(2, 4, case.batch.head_dim), 0, kv_lora_rank=case.config.kv_lora_rank)
    finally:
        del be.decode
    assert calls == ["decode"]


def test_unknown_and_unavailable_backends_are_value_errors(monkeypatch):
    with pytest.raises(ValueError, match="^backend: unknown backend 'nope'"):
        backends.resolve_backend_name("nope", torch.device("cpu"))
    monkeypatch.setitem(backends.REGISTRY, "missing", "no_such_module_here:X")
    with pytest.raises(ValueError, match="^backend: the missing backend is unavailable here"):
        backends.load_backend("missing")


# Shared scenarios on every backend -----------------------------------------------------------
def _ready(name: str, monkeypatch) -> str:
    """``name`` prepared for one test; skipped where it cannot run here."""
    if name == "cpu":
        from cpu_backends import use_backend

        return use_backend("cpu", monkeypatch)  # NaN-poisoned outputs and scratch; skips without the kernels
    if name == "triton":
        try:
            from openmla.backends.triton import _common
        except ImportError:
            pytest.skip("triton unavailable")
        if not (torch.cuda.is_available() or _common.INTERPRET):
            pytest.skip("triton needs CUDA or its interpreter")
    return name


# Triton's interpreter is slow on the CPU: it runs the decode-form scenarios and one prefill.
ON_TRITON = {s.name for s in NO_ROPE_SCENARIOS if s.new_lens and max(s.new_lens) <= 6 or s.name == "prefill-p1-h2-swn-sink"}
NO_ROPE_PARAMS = [pytest.param(b, s, id=f"{b}-{s.name}") for b in ("torch", "cpu", "triton") for s in NO_ROPE_SCENARIOS
                  if b != "triton" or s.name in ON_TRITON]


@pytest.mark.parametrize("backend,scenario", NO_ROPE_PARAMS)
def test_mla_without_rope(backend, scenario, monkeypatch):
    """R = 0: entries are the latent alone, q is Dn nope dims, nothing rotates; the fused op (cache
    write, then the plan's form) and the absorbed piece against the float64 reference."""
    name = _ready(backend, monkeypatch)
    case, opts = scenario_case(scenario)
    assert case.batch.head_dim == scenario.L and case.freqs_cis.shape[1] == 0
    plan, (out, lse), (w_out, w_lse), (a, b) = run_both(case, name, **opts)
    assert plan.backend_name == name, plan.fallback_reason
    assert_close(out, w_out, scenario.tol, f"{name} vs reference", case.seed)
    assert_lse(lse, w_lse, scenario.tol, case.seed)
    assert_close(a.batch.blocks.float(), b.batch.blocks.float(), scenario.tol, "cache write", case.seed)
    if max(scenario.new_lens) > 6:
        return
    # The unfused absorbed piece: q [T, H, L] against the entries just written.
    q_abs = torch.randn(case.q.shape[0], scenario.heads, scenario.L, generator=torch.Generator().manual_seed(case.seed))
    got = plan.decode(q_abs.to(scenario.dtype), case.layer_idx, kv_lora_rank=scenario.L)
    want = openmla.plan(b.batch, scale=case.scale, backend="reference", **opts).decode(
        q_abs.to(scenario.dtype), case.layer_idx, kv_lora_rank=scenario.L)
    assert_close(got, want, scenario.tol, f"{name} decode piece", case.seed)


@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "nvfp4_ds_mla", "nvfp4_fp8rope"])
def test_record_formats_refuse_mla_without_rope(fmt):
    with pytest.raises(ValueError, match="^rope_dim: .*(rope width >= 2|64 rope values)"):
        openmla.PagedLatentCache(1, 2, 4, 512, dtype=fmt, rope_dim=0)


# Edges (issue 34): NaN through every cache format's write, and the NaN rule of docs/api.md ---------
# Under Triton's interpreter (which declines NVFP4 caches): the decode-form ones.
EDGE_ON_TRITON = {s.name for s in EDGE_SCENARIOS if max(s.new_lens) <= 2 and not (s.cache_dtype or "").startswith("nvfp4")}
EDGE_PARAMS = [pytest.param(b, s, id=f"{b}-{s.name}") for b in ("reference", "torch", "cpu", "triton") for s in EDGE_SCENARIOS
               if b != "triton" or s.name in EDGE_ON_TRITON]


def _entries(batch, layer_idx: int) -> torch.Tensor:
    """Every stored entry of one layer, decoded to float32 (a format's NaN byte reads as NaN)."""
    return batch.read_rows(layer_idx, torch.arange(batch.blocks.shape[1] * batch.page_size), torch.float32)


@pytest.mark.parametrize("backend,scenario", EDGE_PARAMS)
def test_nan_edges(backend, scenario, monkeypatch):
    """A NaN latent (or an all-zero one with epsilon = 0) is stored as NaN in every cache format, and
    a query that sees a NaN entry gets NaN out and NaN LSE on every backend (docs/api.md), split-KV,
    prefill chunks and sinks included; every other row and stored entry matches the reference."""
    name = _ready(backend, monkeypatch)
    case, opts = scenario_case(scenario)
    plan, (out, lse), (w_out, w_lse), (a, b) = run_both(case, name, **opts)
    assert plan.backend_name == name, plan.fallback_reason
    nan_rows = torch.isnan(w_lse)
    assert nan_rows.any() and not nan_rows.all(), f"the scenario must give some NaN rows and some finite ones (seed {case.seed})"
    assert_close_nan(_entries(a.batch, case.layer_idx), _entries(b.batch, case.layer_idx), scenario.tol, "stored entries", case.seed)
    if name == "triton" and not torch.cuda.is_available() and scenario.cache_dtype and scenario.poison != "nan-cached":
        return  # Triton's interpreter widens the e4m3 NaN byte to 480 (a GPU's cvt gives NaN): only the write is checked here
    assert_close_nan(out, w_out, scenario.tol, f"{name} out vs reference", case.seed)
    assert_close_nan(lse, w_lse, scenario.tol, f"{name} lse vs reference", case.seed)


def test_merge_states_keeps_a_nan_row():
    """A NaN part (a NaN row) makes the merged row NaN; an empty part (-inf or +inf) is ignored."""
    o = torch.randn(3, 2, 8)
    lse = torch.tensor([[0.5, math.nan], [math.nan, math.nan], [1.0, 2.0]])
    o_b = torch.randn(3, 2, 8)
    lse_b = torch.tensor([[1.0, 0.0], [-math.inf, math.inf], [math.inf, -math.inf]])
    out, merged = openmla.merge_states(o, lse, o_b, lse_b)
    assert torch.equal(torch.isnan(merged), torch.isnan(lse))
    assert torch.isnan(out[0, 1]).all() and torch.isnan(out[1]).all() and not torch.isnan(out[0, 0]).any()
    torch.testing.assert_close(out[2], o[2])
    torch.testing.assert_close(merged[2], lse[2])


# Reduced-precision queries (issue 34 item 2): scores are float32 ----------------------------------
def _one_hot_weights(case) -> None:
    """W_UK and W_UV that pick latent coordinates: the up-projected keys and values are the stored
    bf16 values themselves (no rounding), so a prefill's products are exact in float32 too."""
    H, L, Dn, Dv = case.config.num_heads, case.config.kv_lora_rank, case.config.qk_nope_head_dim, case.config.v_head_dim
    g = torch.Generator().manual_seed(case.seed + 11)
    pick = lambda n: torch.nn.functional.one_hot(torch.randint(0, L, (H, n), generator=g), L).to(case.q.dtype)  # noqa: E731
    w_uk = pick(Dn)  # [H, Dn, L]
    case.w_k, case.w_uk, case.w_uv = w_uk.reshape(H * Dn, L), w_uk.transpose(1, 2).contiguous(), pick(Dv)


@pytest.mark.parametrize("form", ["decode-bf16", "decode-fp8q", "decode-fp8q-fp8cache", "prefill-bf16"])
@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_reduced_precision_queries_score_in_float32(backend, form, monkeypatch):
    """A bf16 query (or an fp8 one with q_scale, dequantised to bf16) against stored bf16 / fp8
    values: every product is exact in float32, so with float32 scores (docs/api.md) the LSE
    matches the float64 reference to float32 rounding, 1e-4 here with scores of ~30; a bf16 score
    is off by ~2^-9 |score|, 1e-3 of the LSE. The output within bf16's tolerance."""
    name = _ready(backend, monkeypatch)
    fp8_cache = form.endswith("fp8cache")
    if name == "triton" and form.startswith("prefill") and not torch.cuda.is_available():
        pytest.skip("the interpreter runs the triton prefill kernel slowly; the decode forms cover its scores")
    cfg = small_config(num_heads=4, L=128 if fp8_cache else 64, R=16)
    case = make_case([21, 3, 40], [1, 2, 1] if form.startswith("decode") else [9, 4, 7], config=cfg, dtype=torch.bfloat16,
                     cache_dtype="fp8_e4m3" if fp8_cache else None)
    _one_hot_weights(case)
    filled = case.clone_cache()
    openmla.plan(filled.batch, scale=case.scale, backend="reference").run(*filled.run_args())  # the step's entries
    g = torch.Generator().manual_seed(case.seed + 5)
    T, H, L = case.q.shape[0], cfg.num_heads, cfg.kv_lora_rank
    plans = {b: openmla.plan(filled.batch, scale=case.scale, backend=b) for b in (name, "reference")}
    assert plans[name].backend_name == name, plans[name].fallback_reason
    if form.startswith("decode"):
        q = torch.randn(T, H, L + cfg.qk_rope_head_dim, generator=g) * 24
        kw = {}
        if "fp8q" in form:
            q, kw = (q / 16).clamp(-448, 448).to(torch.float8_e4m3fn), {"q_scale": 16.0}
        else:
            q = q.bfloat16()
        res = {b: p.decode(q, case.layer_idx, kv_lora_rank=L, return_lse=True, **kw) for b, p in plans.items()}
    else:
        q = (torch.randn(T, H, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, generator=g) * 24).bfloat16()
        res = {b: p.prefill(q, case.layer_idx, case.w_k, case.w_uv, return_lse=True) for b, p in plans.items()}
    (out, lse), (w_out, w_lse) = res[name], res["reference"]
    assert w_lse.abs().max() > 10, f"the scores must be large for bf16 rounding to show (seed {case.seed})"
    assert_close(out, w_out, TOL[torch.bfloat16], f"{name} {form} out", case.seed)
    assert_lse(lse, w_lse, 1e-4, case.seed)
