"""The CPU backends' cache write and decode form against the float64 reference (torch and cpu).

Every case draws a fresh seed (printed in the failure message); pages are handed out in a
shuffled order by ``make_case``, so a wrong page-table lookup shows.
"""

from __future__ import annotations

import importlib
import math
import random
import sys

import pytest
import torch

import openmla
from openmla import CacheBatch, MaskVariant
from openmla import reference as ref

from cases import MASK_CASES, TOL, Case, assert_close, assert_lse, make_case, small_config
from cpu_backends import CPU_BACKENDS, use_backend

# The package re-exports the function ``decode``; the module itself holds the tunables.
tdec = importlib.import_module("openmla.backends.torch_cpu.decode")

MASKS = MASK_CASES
DEEPSEEK = dict(L=512, R=64, Dn=128, Dv=128)

BACKEND = "torch"  # the backend under test; the autouse fixture below sets it per test


@pytest.fixture(autouse=True, params=CPU_BACKENDS)
def backend(request, monkeypatch):
    """Every test runs on the torch backend and on the native cpu backend."""
    monkeypatch.setattr(sys.modules[__name__], "BACKEND", use_backend(request.param, monkeypatch))


@pytest.fixture(autouse=True)
def poison_outputs(nan_buffers):
    """Output and scratch buffers start as NaN, so a row the backend forgets to write shows."""


# Helpers ------------------------------------------------------------------------------
def random_q_abs(case: Case, dtype: torch.dtype | None = None) -> torch.Tensor:
    cfg = case.config
    g = torch.Generator().manual_seed(case.seed + 1)
    T = case.q.shape[0]
    q = torch.randn(T, cfg.num_heads, cfg.kv_lora_rank + cfg.qk_rope_head_dim, generator=g) * 0.5
    return q.to(dtype or case.q.dtype)


def decode_both(case: Case, q_abs: torch.Tensor, **kw):
    """flare_mla_decode with the torch backend and the reference, both with LSE."""
    L = case.config.kv_lora_rank
    args = (q_abs, case.batch, case.layer_idx)
    got = openmla.flare_mla_decode(*args, scale=case.scale, kv_lora_rank=L, return_lse=True, backend=BACKEND, **kw)
    want = openmla.flare_mla_decode(*args, scale=case.scale, kv_lora_rank=L, return_lse=True, backend="reference", **kw)
    return got, want


def check_decode(case: Case, q_abs: torch.Tensor, **kw):
    (out, lse), (w_out, w_lse) = decode_both(case, q_abs, **kw)
    tol = TOL[q_abs.dtype]
    assert out.dtype == q_abs.dtype and lse.dtype == torch.float32
    assert_close(out, w_out, tol, "out", case.seed)
    assert_lse(lse, w_lse, tol, case.seed)
    return out, lse


def contiguous_pages(case: Case) -> Case:
    """The same case with every sequence's pages renumbered to one physically ordered run."""
    b = case.batch
    used = [(s, j, int(b.block_table[s, j])) for s, n in enumerate(b.seq_lens_list) for j in range(-(-n // b.page_size))]
    old = torch.tensor([p for _, _, p in used], dtype=torch.long)
    blocks = b.blocks.clone()
    blocks[:, : len(used)] = b.blocks[:, old]
    table = torch.zeros_like(b.block_table)
    for new, (s, j, _) in enumerate(used):
        table[s, j] = new
    batch = CacheBatch(blocks, table, b.cache_lengths.clone(), b.input_row_offsets.clone(), b.page_size, b.seq_ids)
    return Case(case.config, case.cache, batch, case.q, case.kv, case.freqs_cis, case.gamma, case.w_k, case.w_uk,
                case.w_uv, case.layer_idx, case.seed)


# Cache write --------------------------------------------------------------------------
def written_rows(batch: CacheBatch) -> torch.Tensor:
    parts = [ref.physical_rows(batch, s, torch.arange(c, c + n)) for s, (c, n) in
             enumerate(zip(batch.cache_lengths_list, batch.new_tokens_list))]
    return torch.cat(parts)


def ulp(x: torch.Tensor) -> torch.Tensor:
    a = x.abs()
    return torch.nextafter(a, torch.full_like(a, math.inf)) - a


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("interleaved", [True, False])
def test_write_cache_matches_reference(dtype, page_size, interleaved):
    case = make_case([0, 63, 5, 130], [1, 3, 0, 70], page_size=page_size, dtype=dtype)
    rows = written_rows(case.batch)
    flat = case.batch.blocks[case.layer_idx].view(-1, case.batch.head_dim)
    flat[rows] = math.nan  # poison: every written row must be overwritten
    before = case.batch.blocks.clone()
    mirror = case.clone_cache()
    q_rot = openmla.mla_write_cache(case.q, case.kv, case.freqs_cis, case.gamma, case.batch, case.layer_idx,
                                    rope_interleaved=interleaved, backend=BACKEND)
    ref.write_cache(mirror.kv, mirror.freqs_cis, mirror.gamma, mirror.batch, mirror.layer_idx, 1e-6, interleaved)
    got, want = case.batch.blocks, mirror.batch.blocks
    assert not torch.isnan(got).any(), f"unwritten rows (seed {case.seed})"
    diff = (got.double() - want.double()).abs()
    assert bool((diff <= ulp(want).double()).all()), f"cache differs by more than one ulp (seed {case.seed})"
    untouched = torch.ones(flat.shape[0], dtype=torch.bool)
    untouched[rows] = False
    other_layer = 1 - case.layer_idx
    assert torch.equal(got[other_layer], before[other_layer])
    assert torch.equal(got[case.layer_idx].view(-1, flat.shape[1])[untouched], before[case.layer_idx].view(-1, flat.shape[1])[untouched])
    R = case.config.qk_rope_head_dim
    pos = ref.token_positions(case.batch)
    want_q = torch.cat([case.q.double()[..., :-R], ref.rope(case.q[..., -R:], case.freqs_cis, pos, interleaved)], -1)
    assert q_rot.dtype == dtype and q_rot.shape == case.q.shape
    assert_close(q_rot, want_q, TOL[dtype], "q_rot", case.seed)


def test_write_cache_empty_batch():
    case = make_case([4, 0], [0, 0])
    before = case.batch.blocks.clone()
    q_rot = openmla.mla_write_cache(case.q, case.kv, case.freqs_cis, case.gamma, case.batch, case.layer_idx, backend=BACKEND)
    assert q_rot.shape == case.q.shape
    assert torch.equal(case.batch.blocks, before)


def test_empty_batch_decode_and_fused():
    case = make_case([5, 0], [0, 0])
    q_abs = torch.randn(0, case.config.num_heads, 80)
    out, lse = openmla.flare_mla_decode(q_abs, case.batch, case.layer_idx, scale=case.scale, kv_lora_rank=64,
                                        return_lse=True, backend=BACKEND)
    assert out.shape == (0, case.config.num_heads, 64) and lse.shape == (0, case.config.num_heads)
    assert openmla.mla_prefill_decode_graph(*case.fused_args(), scale=case.scale, backend=BACKEND).shape[0] == 0


# Dense decode -------------------------------------------------------------------------
@pytest.mark.parametrize("mask,extra", MASKS, ids=[m for m, _ in MASKS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_masks_multi_token(mask, extra, dtype):
    case = make_case([0, 1, 17, 40, 95], [1, 6, 3, 0, 4], config=small_config(num_heads=3), page_size=16, dtype=dtype)
    check_decode(case, random_q_abs(case), mask=mask, **extra)


@pytest.mark.parametrize("H", [1, 3, 16, 128])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_decode_heads_and_pages(H, page_size):
    case = make_case([0, 64, 129, 200], [2, 1, 5, 1], config=small_config(num_heads=H), page_size=page_size,
                     dtype=torch.float32)
    check_decode(case, random_q_abs(case))


@pytest.mark.parametrize("mask,extra", MASKS, ids=[m for m, _ in MASKS])
def test_decode_many_query_tokens(mask, extra):
    """flare_mla_decode is public: any number of query tokens per sequence works."""
    case = make_case([0, 21, 3], [19, 12, 8], config=small_config(num_heads=2), page_size=16)
    check_decode(case, random_q_abs(case), mask=mask, **extra)


@pytest.mark.parametrize("mask,extra", MASKS, ids=[m for m, _ in MASKS])
def test_decode_small_blocks_and_page_layouts(monkeypatch, mask, extra):
    """Tiny key blocks and query chunks force the online softmax across blocks, unaligned block
    edges and several chunks per sequence; the same cache renumbered into ordered pages gives
    the same result."""
    monkeypatch.setattr(tdec, "MAX_BLOCK_KEYS", 24)
    monkeypatch.setattr(tdec, "MAX_QUERY_ROWS", 8)
    case = make_case([0, 50, 133], [3, 6, 5], config=small_config(num_heads=4), page_size=16)
    q_abs = random_q_abs(case)
    out, lse = check_decode(case, q_abs, mask=mask, **extra)
    out2, lse2 = check_decode(contiguous_pages(case), q_abs, mask=mask, **extra)
    assert_close(out2, out, 1e-6, "contiguous vs gathered pages", case.seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_key_far_above_the_rest(dtype):
    """One key far above the others (2^250 relative, in the middle of a block): exact running
    maxima keep every exponential finite."""
    case = make_case([300], [1], config=small_config(num_heads=2), page_size=16, dtype=dtype)
    q_abs = random_q_abs(case)
    q_abs[0] = 0.5
    row = ref.physical_rows(case.batch, 0, torch.tensor([77]))
    case.batch.blocks[case.layer_idx].view(-1, case.batch.head_dim)[row] = 30.0
    out, lse = check_decode(case, q_abs)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_num_partitions_agree(dtype):
    case = make_case([0, 7, 150, 333], [1, 2, 1, 4], config=small_config(num_heads=4), page_size=16, dtype=dtype)
    q_abs = random_q_abs(case)
    results = [check_decode(case, q_abs, num_partitions=p, mask="sliding_window_causal", window_size=100) for p in range(1, 8)]
    results.append(check_decode(case, q_abs, num_partitions=None, mask="sliding_window_causal", window_size=100))
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    for out, lse in results[1:]:
        assert_close(out, results[0][0], tol, "partitions disagree", case.seed)
        assert_lse(lse, results[0][1], tol, case.seed)


def test_decode_fp16_and_mixed_dtypes():
    case = make_case([20, 70], [1, 3], page_size=16, dtype=torch.float16)
    check_decode(case, random_q_abs(case))
    check_decode(case, random_q_abs(case, torch.float32))  # fp32 query against an fp16 cache


def test_decode_negative_and_zero_scale():
    case = make_case([9, 40], [2, 3], page_size=16)
    q_abs = random_q_abs(case)
    L = case.config.kv_lora_rank
    for scale in (-case.scale, 0.0):
        kw = dict(scale=scale, kv_lora_rank=L, return_lse=True, mask="sliding_window_causal", window_size=4)
        got = openmla.flare_mla_decode(q_abs, case.batch, case.layer_idx, backend=BACKEND, **kw)
        want = openmla.flare_mla_decode(q_abs, case.batch, case.layer_idx, backend="reference", **kw)
        assert_close(got[0], want[0], TOL[torch.float32], f"scale={scale}", case.seed)
        assert_lse(got[1], want[1], TOL[torch.float32], case.seed)


def test_key_range_is_exact_for_one_query():
    """The dense path skips the mask inside every query's own key_range: that must be exact."""
    rng = random.Random()
    for name, extra in MASKS:
        mv = MaskVariant.parse(name, **extra)
        for _ in range(50):
            n = rng.randrange(1, 80)
            p = rng.randrange(n)
            lo, hi = mv.key_range(p, p, n)
            vis = mv.visible(torch.tensor(p), torch.arange(n))
            assert torch.equal(vis.nonzero().flatten(), torch.arange(lo, hi)), (name, p, n)


# Sparse ---------------------------------------------------------------------------------
def sparse_case(physical: bool, dtype=torch.float32, H=4, stride=24, with_topk=True, page_size=16):
    case = make_case([0, 40, 90, 7], [2, 1, 3, 0], config=small_config(num_heads=H), page_size=page_size, dtype=dtype)
    g = torch.Generator().manual_seed(case.seed + 2)
    b = case.batch
    seq = torch.repeat_interleave(torch.arange(b.batch_size), torch.tensor(b.new_tokens_list))
    T = seq.shape[0]
    if physical:
        limit = b.num_pages * b.page_size
        idx = torch.randint(0, limit, (T, stride), generator=g)
    else:
        lens = torch.tensor(b.seq_lens_list)[seq]
        idx = (torch.rand(T, stride, generator=g) * lens[:, None]).long()
    idx[:, 3] = idx[:, 2]  # a repeated entry counts twice
    idx[torch.rand(T, stride, generator=g) < 0.2] = -1
    idx[0] = -1  # a query with no key at all
    topk = None
    if with_topk:
        topk = torch.randint(0, stride + 1, (b.batch_size,), generator=g, dtype=torch.int32)
        topk[1] = stride
    return case, idx.to(torch.int32), topk


@pytest.mark.parametrize("physical", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_topk", [True, False])
def test_sparse(physical, dtype, with_topk):
    case, idx, topk = sparse_case(physical, dtype, with_topk=with_topk)
    out, lse = check_decode(case, random_q_abs(case), sparse_indices=idx, topk_lengths=topk, physical_indices=physical)
    assert torch.all(out[0] == 0) and torch.all(lse[0] == -math.inf)


@pytest.mark.parametrize("mask,extra", MASKS[1:], ids=[m for m, _ in MASKS[1:]])
def test_sparse_logical_with_masks_and_partitions(monkeypatch, mask, extra):
    monkeypatch.setattr(tdec, "SPARSE_GATHER_ROWS", 16)
    case, idx, topk = sparse_case(False, H=3, stride=40)
    q_abs = random_q_abs(case)
    first = check_decode(case, q_abs, sparse_indices=idx, topk_lengths=topk, physical_indices=False, mask=mask, **extra)
    for p in (2, 5):
        out, _ = check_decode(case, q_abs, sparse_indices=idx, topk_lengths=topk, physical_indices=False, mask=mask,
                              num_partitions=p, **extra)
        assert_close(out, first[0], 1e-6, "sparse partitions", case.seed)


# Sinks ------------------------------------------------------------------------------------
@pytest.mark.parametrize("per_sequence", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_sink(per_sequence, dtype):
    case = make_case([3, 60, 0], [1, 4, 2], config=small_config(num_heads=5), page_size=16, dtype=dtype)
    H, B = 5, case.batch.batch_size
    sink = torch.randn(B, H) * 2 if per_sequence else torch.randn(H) * 2
    sink[..., 0] = -math.inf  # a sink that never wins
    q_abs = random_q_abs(case)
    for parts in (1, 3):
        check_decode(case, q_abs, attn_sink=sink, num_partitions=parts)


def test_sink_on_rows_without_keys():
    case, idx, topk = sparse_case(True, with_topk=False)
    sink = torch.full((case.config.num_heads,), -math.inf)
    sink[1] = 3.0
    out, lse = check_decode(case, random_q_abs(case), sparse_indices=idx, attn_sink=sink)
    assert torch.all(out[0] == 0)


# The fused op -------------------------------------------------------------------------------
def fused_both(case: Case, **kw):
    mirror = case.clone_cache()
    got = openmla.mla_prefill_decode_graph(*case.fused_args(), scale=case.scale, return_lse=True, backend=BACKEND, **kw)
    want = openmla.mla_prefill_decode_graph(*mirror.fused_args(), scale=case.scale, return_lse=True, backend="reference", **kw)
    return got, want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H", [1, 3, 16, 128])
def test_fused_decode_form(dtype, H):
    case = make_case([0, 16, 47, 3], [1, 6, 2, 0], config=small_config(num_heads=H), page_size=16, dtype=dtype)
    (out, lse), (w_out, w_lse) = fused_both(case)
    assert out.shape == (case.q.shape[0], H, case.config.v_head_dim) and out.dtype == dtype
    assert_close(out, w_out, TOL[dtype], "fused out", case.seed)
    assert_lse(lse, w_lse, TOL[dtype], case.seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_deepseek_dims(dtype):
    case = make_case([0, 130, 64], [2, 1, 5], config=small_config(num_heads=16, **DEEPSEEK), page_size=64, dtype=dtype)
    (out, lse), (w_out, w_lse) = fused_both(case, mask="sliding_window_causal", window_size=100)
    assert_close(out, w_out, TOL[dtype], "fused out", case.seed)
    assert_lse(lse, w_lse, TOL[dtype], case.seed)


def test_fused_sparse_sink_partitions():
    case, idx, topk = sparse_case(False, dtype=torch.bfloat16, H=4)
    sink = torch.randn(case.batch.batch_size, 4)
    kw = dict(sparse_indices=idx, topk_lengths=topk, physical_indices=False, attn_sink=sink, num_partitions=3,
              mask="chunked_causal", chunk_size=16)
    (out, lse), (w_out, w_lse) = fused_both(case, **kw)
    assert_close(out, w_out, TOL[torch.bfloat16], "fused sparse", case.seed)
    assert_lse(lse, w_lse, TOL[torch.bfloat16], case.seed)


def test_absorb_unabsorb():
    case = make_case([5], [3], config=small_config(num_heads=6), dtype=torch.float32)
    from openmla import combine
    q_abs = combine.absorb(case.q, case.w_uk)
    Dn = case.config.qk_nope_head_dim
    want = torch.cat([torch.einsum("thd,hld->thl", case.q[..., :Dn].double(), case.w_uk.double()), case.q[..., Dn:].double()], -1)
    assert_close(q_abs, want, 1e-6, "absorb", case.seed)
    lat = torch.randn(3, 6, case.config.kv_lora_rank)
    assert_close(combine.unabsorb(lat, case.w_uv), torch.einsum("thl,hvl->thv", lat.double(), case.w_uv.double()), 1e-6, "unabsorb", case.seed)


def test_inference_mode_and_grad_inputs():
    """Scratch buffers made under inference_mode must not break later normal calls (and back);
    inputs that require grad give plain outputs."""
    case = make_case([30, 5], [1, 2], dtype=torch.bfloat16)
    q_abs = random_q_abs(case)
    kw = dict(scale=case.scale, kv_lora_rank=case.config.kv_lora_rank, backend=BACKEND)
    with torch.inference_mode():
        first = openmla.flare_mla_decode(q_abs, case.batch, case.layer_idx, **kw)
    second = openmla.flare_mla_decode(q_abs, case.batch, case.layer_idx, **kw)
    with torch.inference_mode():
        third = openmla.flare_mla_decode(q_abs, case.batch, case.layer_idx, **kw)
    assert torch.equal(first, second) and torch.equal(second, third)
    grad_q = q_abs.float().requires_grad_()
    assert_close(openmla.flare_mla_decode(grad_q, case.batch, case.layer_idx, **kw), second, TOL[torch.bfloat16],
                 "requires_grad input", case.seed)


def test_sparse_dropped_slots_never_read_stale_rows():
    """-1 slots and slots past topk_lengths must not touch any cache row: NaN in row 0 stays out."""
    import openmla
    from openmla import reference as ref

    case = make_case([12, 5], [1, 1], config=small_config(num_heads=3), page_size=4, dtype=torch.float32)
    rows = torch.stack([ref.physical_rows(case.batch, b, torch.tensor([1, 3, 2, 0])) for b in (0, 1)])
    rows = torch.where(rows == 0, torch.tensor(-1), rows).int()  # never list physical row 0 itself
    rows[0, 2] = -1
    topk = torch.tensor([4, 2], dtype=torch.int32)
    a, b = case.clone_cache(), case.clone_cache()
    for c in (a, b):
        c.batch.blocks[c.layer_idx].view(-1, c.batch.head_dim)[0] = float("nan")
    q = torch.randn(2, 3, case.batch.head_dim)
    want = openmla.flare_mla_decode(q, a.batch, a.layer_idx, scale=0.1, kv_lora_rank=64, sparse_indices=rows,
                                    topk_lengths=topk, backend="reference")
    got = openmla.flare_mla_decode(q, b.batch, b.layer_idx, scale=0.1, kv_lora_rank=64, sparse_indices=rows,
                                   topk_lengths=topk, backend=BACKEND)
    assert torch.isfinite(want).all()
    assert_close(got, want, 1e-5, "sparse with stale NaN row", case.seed)
