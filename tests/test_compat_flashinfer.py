"""openmla.compat.flashinfer against float64 references written from FlashInfer's documented semantics.

FlashInfer's ``BatchMLAPagedAttentionWrapper`` (flashinfer/mla, its docstrings and tests): sequence
``b`` owns query rows ``qo_indptr[b]:qo_indptr[b+1]`` and ``kv_len_arr[b]`` keys stored in pages
``kv_indices[kv_indptr[b]:kv_indptr[b+1]]`` of separate caches ``ckv [pages, page_size, L]`` and
``kpe [pages, page_size, R]``; a key is ``[ckv, kpe]``, its value ``ckv``; causal aligns the queries
with the last keys (query ``i`` of ``q_len`` sees keys ``j <= kv_len - q_len + i``); the LSE is base 2
(natural with ``return_lse_base_on_e``), -inf for a query without keys, whose output is 0; FP8
caches are dequantised as ``stored * ckv_scale`` (or per token and 128 channels, ``ckv_scale_arr``)
and ``stored * kpe_scale``.

Caches are poisoned with NaN wherever the attention must not read.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from openmla.compat.flashinfer import BatchMLAPagedAttentionWrapper

from cases import TOL, assert_close

CUDA = torch.cuda.is_available()
INF = math.inf
LN2 = math.log(2.0)


def _device(backend: str) -> str:
    return "cuda" if backend == "triton" and CUDA else "cpu"


def make_step(q_lens, kv_lens, page_size, L, R, dtype, joined, g, layers=2):
    """Per-layer caches (``joined``: two halves of one ``[pages, ps, L+R]`` tensor) in shuffled pages,
    NaN where no key lives, plus FlashInfer's index arrays. Returns (caches, float64 keys per layer
    and sequence, qo_indptr, kv_indptr, kv_indices, kv_len_arr)."""
    need = [-(-n // page_size) for n in kv_lens]
    num_pages = sum(need) + 3
    perm = torch.randperm(num_pages, generator=g)
    kv_indices = perm[: sum(need)].to(torch.int32)
    kv_indptr = torch.tensor([0] + need, dtype=torch.int32).cumsum(0).to(torch.int32)
    qo_indptr = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    live = torch.zeros(num_pages, page_size, dtype=torch.bool)
    for b, n in enumerate(kv_lens):
        pages = kv_indices[kv_indptr[b]: kv_indptr[b + 1]].long()
        live.view(-1)[(pages[:, None] * page_size + torch.arange(page_size)).view(-1)[:n]] = True
    caches, keys = [], []
    for _ in range(layers):
        kv = torch.randn(num_pages, page_size, L + R, generator=g).to(dtype)
        kv[~live] = math.nan
        ckv, kpe = (kv[..., :L], kv[..., L:]) if joined else (kv[..., :L].contiguous(), kv[..., L:].contiguous())
        caches.append((ckv, kpe))
        keys.append([kv[kv_indices[kv_indptr[b]: kv_indptr[b + 1]].long()].reshape(-1, L + R)[:n].double()
                     for b, n in enumerate(kv_lens)])
    return caches, keys, qo_indptr, kv_indptr, kv_indices, torch.tensor(kv_lens, dtype=torch.int32)


def reference(q, keys, q_lens, kv_lens, L, scale, causal):
    """``q [T, H, L+R]`` float64 -> ``out [T, H, L]``, base-2 ``lse [T, H]`` (-inf without keys)."""
    T, H, _ = q.shape
    out = torch.zeros(T, H, L, dtype=torch.float64)
    lse = torch.full((T, H), -INF, dtype=torch.float64)
    row = 0
    for k, n_q, n in zip(keys, q_lens, kv_lens):
        for i in range(n_q):
            m = max(0, min(n, n - n_q + i + 1)) if causal else n
            if m:
                s = (q[row].double() @ k[:m].T) * scale
                lse_e = torch.logsumexp(s, -1)
                out[row] = torch.exp(s - lse_e[:, None]) @ k[:m, :L]
                lse[row] = lse_e / LN2
            row += 1
    return out, lse


def check(out, lse, want_out, want_lse, tol, seed, base_e=False):
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), f"NaN in the result (seed {seed})"
    assert_close(out.cpu(), want_out, tol, "out", seed)
    got = lse.double().cpu()
    want = want_lse * LN2 if base_e else want_lse
    assert torch.equal(got == -INF, want == -INF), f"lse: -inf (no key) rows differ (seed {seed})"
    assert not (got == INF).any()
    fin = torch.isfinite(want)
    if fin.any():
        err = float((got[fin] - want[fin]).abs().max() / want[fin].abs().max().clamp_min(1.0))
        assert err <= tol, f"lse: err {err:.3g} > {tol} (seed {seed})"


CASES = [  # (q_lens, kv_lens, page_size, causal)
    ([1, 1, 1], [37, 1, 200], 16, False),  # decode
    ([3, 1, 5], [37, 0, 200], 1, True),  # varlen multi-token causal, an empty cache
    ([3, 1, 5], [37, 0, 200], 64, False),
    ([4, 2, 6], [2, 9, 3], 16, True),  # fewer keys than queries: the first queries see nothing
    ([4, 2], [3, 9], 2, False),  # non-causal, fewer keys than queries
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("joined", [False, True], ids=["separate", "joined"])
@pytest.mark.parametrize("q_lens,kv_lens,page_size,causal", CASES)
def test_paged_mla(q_lens, kv_lens, page_size, causal, joined, dtype):
    """Separate caches (staged touched pages) and halves of one cache (read in place); one plan,
    two layers' caches."""
    seed = random.randrange(1 << 30)
    g = torch.Generator().manual_seed(seed)
    L, R, H = 512, 64, 8
    caches, keys, qo, kvp, kvi, kvl = make_step(q_lens, kv_lens, page_size, L, R, dtype, joined, g)
    w = BatchMLAPagedAttentionWrapper(torch.empty(8, dtype=torch.int8), openmla_backend="torch")
    scale = 1.0 / math.sqrt(128 + 64)
    w.plan(qo, kvp, kvi, kvl, H, L, R, page_size, causal, scale, dtype, dtype)
    T = sum(q_lens)
    for (ckv, kpe), k in zip(caches, keys):
        q_nope, q_pe = torch.randn(T, H, L, generator=g).to(dtype), torch.randn(T, H, R, generator=g).to(dtype)
        out, lse = w.run(q_nope, q_pe, ckv, kpe, return_lse=True)
        assert out.shape == (T, H, L) and out.dtype == dtype and lse.shape == (T, H) and lse.dtype == torch.float32
        want = reference(torch.cat([q_nope, q_pe], -1), k, q_lens, kv_lens, L, scale, causal)
        check(out, lse, *want, TOL[dtype], seed)
    assert (w._staging is None) == joined  # halves of one cache are read in place


def test_paged_mla_float16():
    test_paged_mla(*CASES[1], joined=False, dtype=torch.float16)


def test_out_and_lse_buffers_and_natural_log():
    seed = random.randrange(1 << 30)
    g = torch.Generator().manual_seed(seed)
    L, R, H = 64, 16, 4
    q_lens, kv_lens = [2, 3], [5, 0]
    caches, keys, qo, kvp, kvi, kvl = make_step(q_lens, kv_lens, 4, L, R, torch.float32, False, g, layers=1)
    w = BatchMLAPagedAttentionWrapper(torch.empty(8), openmla_backend="torch")
    w.plan(qo, kvp, kvi, kvl, H, L, R, 4, True, 0.3, torch.float32, torch.float32)
    q_nope, q_pe = torch.randn(5, H, L, generator=g), torch.randn(5, H, R, generator=g)
    out_buf, lse_buf = torch.full((5, H, L), math.nan), torch.full((5, H), math.nan)
    got = w.run(q_nope, q_pe, *caches[0], out=out_buf, lse=lse_buf, return_lse=True, return_lse_base_on_e=True)
    assert got[0] is out_buf and got[1] is lse_buf
    want = reference(torch.cat([q_nope, q_pe], -1), keys[0], q_lens, kv_lens, L, 0.3, True)
    check(out_buf, lse_buf, *want, TOL[torch.float32], seed, base_e=True)
    only = w.run(q_nope, q_pe, *caches[0])
    assert isinstance(only, torch.Tensor)
    assert_close(only, want[0], TOL[torch.float32], "out", seed)


@pytest.mark.parametrize("per_channel", [False, True], ids=["ckv_scale", "ckv_scale_arr"])
def test_fp8_cache(per_channel):
    """kv_data_type float8_e4m3fn with FlashInfer's dequantisation scales, bfloat16 q."""
    seed = random.randrange(1 << 30)
    g = torch.Generator().manual_seed(seed)
    L, R, H, ps = 512, 64, 8, 16
    q_lens, kv_lens = [1, 4], [40, 20]
    caches, keys, qo, kvp, kvi, kvl = make_step(q_lens, kv_lens, ps, L, R, torch.float32, False, g, layers=1)
    ckv32, kpe32 = caches[0]
    num_pages = ckv32.shape[0]
    ckv8, kpe8 = (ckv32 * 8).to(torch.float8_e4m3fn), (kpe32 * 4).to(torch.float8_e4m3fn)
    kpe_scale = 0.25
    if per_channel:
        scale_arr = torch.rand(num_pages, ps, L // 128, generator=g) * 0.2 + 0.05
        ckv_real = ckv8.double().view(num_pages, ps, L // 128, 128) * scale_arr.double()[..., None]
        kw = dict(ckv_scale_arr=scale_arr)
    else:
        ckv_real = ckv8.double() * 0.125
        kw = dict(ckv_scale=0.125)
    real = torch.cat([ckv_real.view(num_pages, ps, L), kpe8.double() * kpe_scale], -1)
    keys = [real[kvi[kvp[b]: kvp[b + 1]].long()].reshape(-1, L + R)[:n] for b, n in enumerate(kv_lens)]
    w = BatchMLAPagedAttentionWrapper(torch.empty(8), openmla_backend="torch")
    w.plan(qo, kvp, kvi, kvl, H, L, R, ps, True, 0.07, torch.bfloat16, torch.float8_e4m3fn)
    q_nope, q_pe = torch.randn(5, H, L, generator=g).bfloat16(), torch.randn(5, H, R, generator=g).bfloat16()
    out, lse = w.run(q_nope, q_pe, ckv8, kpe8, return_lse=True, kpe_scale=kpe_scale, **kw)
    want = reference(torch.cat([q_nope, q_pe], -1), keys, q_lens, kv_lens, L, 0.07, True)
    check(out, lse, *want, TOL[torch.bfloat16], seed)


@pytest.mark.parametrize("joined", [False, True], ids=["separate", "joined"])
def test_triton_backend(joined):
    seed = random.randrange(1 << 30)
    g = torch.Generator().manual_seed(seed)
    dev = _device("triton")
    L, R, H = 64, 16, 2
    q_lens, kv_lens = [3, 1, 2], [20, 0, 1]
    caches, keys, qo, kvp, kvi, kvl = make_step(q_lens, kv_lens, 8, L, R, torch.float32, joined, g)
    w = BatchMLAPagedAttentionWrapper(torch.empty(8, device=dev), openmla_backend="triton")
    w.plan(qo, kvp, kvi, kvl, H, L, R, 8, True, 0.2, torch.float32, torch.float32)
    for (ckv, kpe), k in zip(caches, keys):
        q_nope, q_pe = torch.randn(6, H, L, generator=g), torch.randn(6, H, R, generator=g)
        ckv, kpe = _joined_on(dev, ckv, kpe) if joined else (ckv.to(dev), kpe.to(dev))
        out, lse = w.run(q_nope.to(dev), q_pe.to(dev), ckv, kpe, return_lse=True)
        want = reference(torch.cat([q_nope, q_pe], -1), k, q_lens, kv_lens, L, 0.2, True)
        check(out, lse, *want, TOL[torch.float32], seed)


def _joined_on(dev, ckv, kpe):
    whole = torch.cat([ckv, kpe], -1).to(dev)
    return whole[..., : ckv.shape[-1]], whole[..., ckv.shape[-1]:]


# Bad input ---------------------------------------------------------------------------------------
def _planned():
    g = torch.Generator().manual_seed(0)
    caches, _, qo, kvp, kvi, kvl = make_step([1, 2], [5, 9], 4, 64, 16, torch.float32, False, g, layers=1)
    plan_args = dict(qo_indptr=qo, kv_indptr=kvp, kv_indices=kvi, kv_len_arr=kvl, num_heads=2, head_dim_ckv=64,
                     head_dim_kpe=16, page_size=4, causal=True, sm_scale=0.1, q_data_type=torch.float32,
                     kv_data_type=torch.float32)
    run_args = dict(q_nope=torch.randn(3, 2, 64), q_pe=torch.randn(3, 2, 16), ckv_cache=caches[0][0], kpe_cache=caches[0][1])
    return plan_args, run_args


BAD_PLAN = [
    ("qo_indptr", dict(qo_indptr=torch.tensor([0, 2, 1], dtype=torch.int32))),
    ("kv_indptr", dict(kv_indptr=torch.tensor([0, 2], dtype=torch.int32))),
    ("kv_indptr", dict(kv_indptr=torch.tensor([0, 1, 4], dtype=torch.int32))),
    ("kv_indices", dict(kv_indices=torch.zeros(3, dtype=torch.int32))),
    ("kv_indices", dict(kv_indices=torch.full((8,), -2, dtype=torch.int32))),
    ("kv_len_arr", dict(kv_len_arr=torch.tensor([5, -1], dtype=torch.int32))),
    ("num_heads", dict(num_heads=0)),
    ("head_dim_kpe", dict(head_dim_kpe=0)),
    ("page_size", dict(page_size=2.0)),
    ("causal", dict(causal="yes")),
    ("sm_scale", dict(sm_scale=math.inf)),
    ("q_data_type", dict(q_data_type=torch.int32)),
    ("kv_data_type", dict(kv_data_type=torch.float8_e5m2)),
    ("use_profiler", dict(use_profiler=True)),
]


@pytest.mark.parametrize("name,change", BAD_PLAN, ids=[f"{n}-{i}" for i, (n, _) in enumerate(BAD_PLAN)])
def test_bad_plan_input_names_the_argument(name, change):
    plan_args, _ = _planned()
    plan_args.update(change)
    w = BatchMLAPagedAttentionWrapper(torch.empty(8))
    with pytest.raises(ValueError, match=f"^{name}:"):
        w.plan(**plan_args)


BAD_RUN = [
    ("q_nope", dict(q_nope=torch.randn(3, 2, 32))),
    ("q_nope", dict(q_nope=torch.randn(3, 2, 64).bfloat16())),
    ("q_pe", dict(q_pe=torch.randn(4, 2, 16))),
    ("ckv_cache", dict(ckv_cache=torch.randn(8, 2, 64))),
    ("kpe_cache", dict(kpe_cache=torch.randn(7, 4, 16))),
    ("kv_indices", dict(ckv_cache=torch.randn(2, 4, 64), kpe_cache=torch.randn(2, 4, 16))),
    ("out", dict(out=torch.empty(3, 2, 63))),
    ("lse", dict(lse=torch.empty(3, 2, dtype=torch.float64), return_lse=True)),
    ("return_lse", dict(return_lse=1)),
    ("ckv_scale", dict(ckv_scale=1.0)),
    ("page_table", dict(page_table=torch.zeros(2, 3, dtype=torch.int32))),
]


@pytest.mark.parametrize("name,change", BAD_RUN, ids=[f"{n}-{i}" for i, (n, _) in enumerate(BAD_RUN)])
def test_bad_run_input_names_the_argument(name, change):
    plan_args, run_args = _planned()
    w = BatchMLAPagedAttentionWrapper(torch.empty(8), openmla_backend="torch")
    w.plan(**plan_args)
    run_args.update(change)
    with pytest.raises(ValueError, match=f"^{name}:"):
        w.run(**run_args)


def test_unsupported_options_are_rejected():
    with pytest.raises(ValueError, match="^backend:"):
        BatchMLAPagedAttentionWrapper(torch.empty(8), backend="cutlass")
    with pytest.raises(ValueError, match="^use_cuda_graph:"):
        BatchMLAPagedAttentionWrapper(torch.empty(8), use_cuda_graph=True)
    with pytest.raises(ValueError, match="^plan:"):
        BatchMLAPagedAttentionWrapper(torch.empty(8)).run(*_planned()[1].values())
    plan_args, run_args = _planned()
    plan_args.update(kv_data_type=torch.float8_e4m3fn)
    w = BatchMLAPagedAttentionWrapper(torch.empty(8), openmla_backend="torch")
    w.plan(**plan_args)
    run_args.update(ckv_cache=run_args["ckv_cache"].to(torch.float8_e4m3fn), kpe_cache=run_args["kpe_cache"].to(torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="^kpe_scale:"):
        w.run(**run_args, ckv_scale=1.0)
    with pytest.raises(ValueError, match="^ckv_scale:"):
        w.run(**run_args, kpe_scale=1.0)
