"""The native ``cpu`` backend's query absorption and output projection (``absorb``/``unabsorb``):
against the float64 definition, on strided inputs, with the packed-weight cache kept honest
(in-place edits, freed weights, inference tensors), the fallbacks to ``openmla.combine``, and the
fused op through a plan.

Outputs and kernel scratch start as NaN (``use_backend``), so an element the kernel leaves
unwritten fails the comparison.
"""

from __future__ import annotations

import gc

import pytest
import torch

import openmla
from openmla import combine

from cases import TOL, assert_close, assert_lse, make_case, small_config
from cpu_backends import use_backend

# Two column blocks of the kernel (256 + 64) for absorb; widths off every vector size.
DIMS = dict(L=320, R=16, Dn=48, Dv=40)


def packed_dtype() -> torch.dtype:
    """The dtype the per-head kernel runs natively here: bfloat16 where the CPU has bf16 brgemm
    (AVX512-BF16, AMX), float32 elsewhere (bfloat16 inputs then take combine's matmuls)."""
    from openmla.backends.cpu import kernels

    return torch.bfloat16 if kernels.bf16_gemm() else torch.float32
DEEPSEEK = dict(L=512, R=64, Dn=128, Dv=128)


@pytest.fixture(autouse=True)
def native(monkeypatch):
    use_backend("cpu", monkeypatch)


@pytest.fixture
def api():
    from openmla.backends import load_backend

    return load_backend("cpu")


def weights(H, L, Dn, Dv, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    w_uk = (torch.randn(H, L, Dn, generator=g) * Dn**-0.5).to(dtype)
    w_uv = (torch.randn(H, Dv, L, generator=g) * L**-0.5).to(dtype)
    return w_uk, w_uv


def absorb_def(q_rot, w_uk):
    Dn = w_uk.shape[2]
    lat = torch.einsum("thd,hld->thl", q_rot[..., :Dn].double(), w_uk.double())
    return torch.cat([lat, q_rot[..., Dn:].double()], -1)


def unabsorb_def(out_lat, w_uv):
    return torch.einsum("thl,hvl->thv", out_lat.double(), w_uv.double())


def check(api, q_rot, out_lat, w_uk, w_uv, seed, what=""):
    dtype = q_rot.dtype
    q_abs = api.absorb(q_rot, w_uk)
    out = api.unabsorb(out_lat, w_uv)
    T, H = q_rot.shape[:2]
    assert q_abs.shape == (T, H, w_uk.shape[1] + q_rot.shape[2] - w_uk.shape[2]) and q_abs.dtype == dtype
    assert out.shape == (T, H, w_uv.shape[1]) and out.dtype == dtype
    assert_close(q_abs, absorb_def(q_rot, w_uk), TOL[dtype], f"absorb{what}", seed)
    assert torch.equal(q_abs[..., w_uk.shape[1]:], q_rot[..., w_uk.shape[2]:]), "the rope part is copied exactly"
    assert_close(out, unabsorb_def(out_lat, w_uv), TOL[dtype], f"unabsorb{what}", seed)
    return q_abs, out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [0, 1, 7, 64, 130])
@pytest.mark.parametrize("H", [1, 3, 16, 128])
def test_matches_the_definition(api, H, T, dtype):
    seed = 1000 * H + T
    L, R, Dn, Dv = DIMS.values()
    g = torch.Generator().manual_seed(seed)
    w_uk, w_uv = weights(H, L, Dn, Dv, dtype, seed)
    q_rot = torch.randn(T, H, Dn + R, generator=g).to(dtype)
    out_lat = torch.randn(T, H, L, generator=g).to(dtype)
    check(api, q_rot, out_lat, w_uk, w_uv, seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deepseek_dims(api, dtype):
    L, R, Dn, Dv = DEEPSEEK.values()
    w_uk, w_uv = weights(16, L, Dn, Dv, dtype, 5)
    g = torch.Generator().manual_seed(6)
    check(api, torch.randn(9, 16, Dn + R, generator=g).to(dtype), torch.randn(9, 16, L, generator=g).to(dtype), w_uk, w_uv, 5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_inputs_and_weights(api, dtype):
    """q_rot a slice of a wider tensor at an odd offset, out_lat a transposed view, weights as
    views (w_uk as the sparse-prefill path passes it: w_k viewed and transposed; w_uv at an odd
    offset), a single token whose row stride is meaningless."""
    H, (L, R, Dn, Dv) = 5, DIMS.values()
    g = torch.Generator().manual_seed(7)
    T = 11
    q_rot = torch.randn(T, H, Dn + R + 9, generator=g).to(dtype)[:, :, 1:1 + Dn + R]
    out_lat = torch.randn(H, T, L, generator=g).to(dtype).transpose(0, 1)
    w_k = (torch.randn(H * Dn, L, generator=g) * Dn**-0.5).to(dtype)
    w_uk = w_k.view(H, Dn, L).transpose(1, 2)
    w_uv = (torch.randn(H * Dv * L + 1, generator=g) * L**-0.5).to(dtype)[1:].view(H, Dv, L)
    assert not q_rot.is_contiguous() and not out_lat.is_contiguous() and w_uk.stride(-1) != 1
    check(api, q_rot, out_lat, w_uk, w_uv, 7)
    one = torch.randn(1, H, Dn + R, generator=g).to(dtype).expand(1, H, Dn + R)
    check(api, one.as_strided(one.shape, (3, Dn + R, 1)), out_lat[:1], w_uk, w_uv, 7, " (one token)")
    many = torch.randn(1, H, Dn + R, generator=g).to(dtype).expand(4, H, Dn + R)  # rows overlap (stride 0)
    check(api, many, out_lat[:4], w_uk, w_uv, 7, " (expanded)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_edited_in_place_repacks(api, dtype):
    """The packed copy of a weight must follow in-place edits of the weight and of its base."""
    H, (L, R, Dn, Dv) = 3, DIMS.values()
    g = torch.Generator().manual_seed(8)
    w_uk, w_uv = weights(H, L, Dn, Dv, dtype, 8)
    q_rot = torch.randn(4, H, Dn + R, generator=g).to(dtype)
    out_lat = torch.randn(4, H, L, generator=g).to(dtype)
    first = check(api, q_rot, out_lat, w_uk, w_uv, 8)
    with torch.no_grad():
        w_uk[1].mul_(-3.0)
        w_uv[2, :5].zero_()
    second = check(api, q_rot, out_lat, w_uk, w_uv, 8, " after an edit")
    assert not torch.equal(first[0], second[0]) and not torch.equal(first[1], second[1])
    # through a view's base: w_uk as a view of w_k (the version counter is shared)
    w_k = (torch.randn(H * Dn, L, generator=g) * Dn**-0.5).to(dtype)
    view = w_k.view(H, Dn, L).transpose(1, 2)
    check(api, q_rot, out_lat, view, w_uv, 8, " (view)")
    w_k.copy_(torch.randn(H * Dn, L, generator=g).to(dtype))
    check(api, q_rot, out_lat, w_k.view(H, Dn, L).transpose(1, 2), w_uv, 8, " (base edited)")


def test_new_weight_at_a_freed_address(api):
    """A weight freed and another allocated in its place (same address, shape and version) is a
    new weight."""
    from openmla.backends.cpu import packed

    H, (L, R, Dn, Dv) = 4, DIMS.values()
    g = torch.Generator().manual_seed(9)
    dtype = packed_dtype()
    q_rot = torch.randn(3, H, Dn + R, generator=g).to(dtype)
    out_lat = torch.randn(3, H, L, generator=g).to(dtype)
    w_uk, w_uv = weights(H, L, Dn, Dv, dtype, 9)
    check(api, q_rot, out_lat, w_uk, w_uv, 9)
    keys = [packed._key(w) for w in (w_uk, w_uv)]
    assert all(k in packed._entries for k in keys)
    del w_uk, w_uv
    gc.collect()
    assert not any(k in packed._entries for k in keys), "a freed weight drops its packed copy"
    for seed in (10, 11):  # the allocator hands the same blocks back, typically at the same addresses
        w_uk, w_uv = weights(H, L, Dn, Dv, dtype, seed)
        check(api, q_rot, out_lat, w_uk, w_uv, seed, f" (seed {seed})")
        del w_uk, w_uv


def test_inference_tensors_are_packed_per_call(api):
    """Inference tensors track no version: an in-place edit inside inference_mode must show."""
    H, (L, R, Dn, Dv) = 2, DIMS.values()
    with torch.inference_mode():
        w_uk, w_uv = weights(H, L, Dn, Dv, torch.bfloat16, 12)
        q_rot = torch.randn(5, H, Dn + R).bfloat16()
        out_lat = torch.randn(5, H, L).bfloat16()
        check(api, q_rot, out_lat, w_uk, w_uv, 12)
        w_uk.mul_(2.0)
        w_uv.neg_()
        check(api, q_rot, out_lat, w_uk, w_uv, 12, " after an edit")


def test_fallbacks_equal_combine(api):
    """What the kernel does not take runs combine's: float64, float16, mixed dtypes, autograd."""
    H, (L, R, Dn, Dv) = 3, DIMS.values()
    g = torch.Generator().manual_seed(13)
    q64 = torch.randn(4, H, Dn + R, generator=g, dtype=torch.float64)
    lat64 = torch.randn(4, H, L, generator=g, dtype=torch.float64)
    w_uk, w_uv = weights(H, L, Dn, Dv, torch.float64, 13)
    for qd, wd in ((torch.float64, torch.float64), (torch.float16, torch.float16), (torch.bfloat16, torch.float32)):
        q, lat, wk, wv = q64.to(qd), lat64.to(qd), w_uk.to(wd), w_uv.to(wd)
        assert torch.equal(api.absorb(q, wk), combine.absorb(q, wk))
        assert torch.equal(api.unabsorb(lat, wv), combine.unabsorb(lat, wv))
    q = q64.float().requires_grad_()
    api.absorb(q, w_uk.float()).sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


# The fused op through a plan -----------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H", [1, 16, 128])
def test_plan_run_decode_form(dtype, H):
    """plan.run with the cpu backend (absorb, decode, unabsorb all native) vs the reference."""
    case = make_case([0, 37, 300, 5], [1, 1, 1, 1], config=small_config(num_heads=H, **DIMS), page_size=16, dtype=dtype)
    mirror = case.clone_cache()
    got = openmla.plan(case.batch, scale=case.scale, backend="cpu").run(*case.run_args(), return_lse=True)
    want = openmla.plan(mirror.batch, scale=case.scale, backend="reference").run(*mirror.run_args(), return_lse=True)
    assert got[0].shape == (4, H, DIMS["Dv"]) and got[0].dtype == dtype
    assert_close(got[0], want[0], TOL[dtype], "fused out", case.seed)
    assert_lse(got[1], want[1], TOL[dtype], case.seed)


def test_plan_run_uses_the_native_kernels(monkeypatch):
    """The plan picks the cpu backend's own absorb/unabsorb (not combine's)."""
    from openmla.backends.cpu.backend import CpuBackend

    calls = []
    for name in ("absorb", "unabsorb"):
        real = getattr(CpuBackend, name)
        monkeypatch.setattr(CpuBackend, name, lambda self, *a, real=real, name=name: calls.append(name) or real(self, *a))
    monkeypatch.setattr(combine, "absorb", lambda *a: pytest.fail("combine.absorb ran"))
    case = make_case([20, 3], [1, 1], config=small_config(num_heads=4), dtype=packed_dtype())
    step = openmla.plan(case.batch, scale=case.scale, backend="cpu")
    step.run(*case.run_args())
    assert calls == ["absorb", "unabsorb"]
