"""The CPU backends' prefill form (up-projected MHA) against the float64 reference (torch and cpu).

Every case draws a fresh seed (printed in the failure message). ``make_case`` hands pages out
in a shuffled order; on top of that every cache row that belongs to no sequence is NaN, and
every buffer the backend fills completely starts as NaN, so a wrong gather or a forgotten
write shows as NaN (which ``rel_err`` never passes).
"""

from __future__ import annotations

import importlib
import math
import random
import sys

import pytest
import torch

import openmla
from openmla import chunks as chunks_mod
from openmla import MaskVariant, MlaConfigV2
from openmla import reference as ref
from openmla.masks import MaskKind

from cases import MASK_CASES, TOL, Case, assert_close, assert_lse, make_case, small_config
from cpu_backends import CPU_BACKENDS, use_backend

# The package re-exports the function ``prefill``; the module holds the tunables and helpers.
tpre = importlib.import_module("openmla.backends.torch_cpu.prefill")

MASKS = MASK_CASES
MASK_IDS = [m for m, _ in MASKS]
DEEPSEEK = dict(L=512, R=64, Dn=128, Dv=128)

BACKEND = "torch"  # the backend under test; the autouse fixture below sets it per test


@pytest.fixture(autouse=True, params=CPU_BACKENDS)
def backend(request, monkeypatch):
    """Every test runs on the torch backend and on the native cpu backend."""
    monkeypatch.setattr(sys.modules[__name__], "BACKEND", use_backend(request.param, monkeypatch))


@pytest.fixture(autouse=True)
def poison_buffers(nan_buffers):
    """Packed query/key/value blocks, scratch buffers and outputs start as NaN."""


# Helpers ------------------------------------------------------------------------------
def prefill_case(cache_lens, new_lens, *, heads=3, dims=None, page_size=16, dtype=torch.float32) -> Case:
    """A case whose cache already holds this call's tokens; rows of no sequence are NaN."""
    case = make_case(cache_lens, new_lens, config=small_config(heads, **(dims or {})), page_size=page_size, dtype=dtype)
    ref.write_cache(case.kv, case.freqs_cis, case.gamma, case.batch, case.layer_idx, 1e-6)
    b = case.batch
    used = torch.zeros(b.num_pages * b.page_size, dtype=torch.bool)
    for s, n in enumerate(b.seq_lens_list):
        used[ref.physical_rows(b, s, torch.arange(n))] = True
    b.blocks.view(b.num_layers, -1, b.head_dim)[:, ~used] = math.nan
    return case


def mask_kw(name: str, extra: dict) -> dict:
    return dict(mask=name, **extra)


def ref_prefill(case: Case, mask="causal", window_size=None, chunk_size=None, **kw):
    variant = MaskVariant.parse(mask, window_size, chunk_size)
    return ref.prefill(case.q, case.batch, case.layer_idx, case.w_k, case.w_uv, scale=case.scale, mask=variant, **kw)


def torch_prefill(case: Case, **kw):
    return openmla.mla_prefill(case.q, case.batch, case.layer_idx, case.w_k, case.w_uv, scale=case.scale,
                               return_lse=True, backend=BACKEND, **kw)


def check_prefill(case: Case, **kw):
    """mla_prefill (torch) against the reference; returns the torch result."""
    out, lse = torch_prefill(case, **kw)
    ref_kw = {k: v for k, v in kw.items() if k != "buffer_size"}
    want, want_lse = ref_prefill(case, **ref_kw)
    tol = TOL[case.q.dtype]
    assert out.dtype == case.q.dtype and lse.dtype == torch.float32
    assert out.shape == want.shape and lse.shape == want_lse.shape
    assert_close(out, want, tol, "out", case.seed)
    assert_lse(lse, want_lse, max(tol, 1e-6), case.seed)  # the API returns LSE in float32
    return out, lse


def up_projected_buffer(case: Case, bro: torch.Tensor, co: torch.Tensor):
    """k [S, H, Dn], v [S, H, Dv] of one plan chunk, up-projected in float64 from the cache."""
    cfg, b = case.config, case.batch
    H, L, Dn = cfg.num_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim
    rows = [ref.physical_rows(b, s, int(co[s]) + torch.arange(int(bro[s + 1] - bro[s]))) for s in range(b.batch_size)]
    latent = ref.cache_rows(b, case.layer_idx, torch.cat(rows))[:, :L]
    w_uk = case.w_k.double().reshape(H, Dn, L)
    k = torch.einsum("hdl,nl->nhd", w_uk, latent).to(case.q.dtype)
    v = torch.einsum("hdl,nl->nhd", case.w_uv.double(), latent).to(case.q.dtype)
    return k, v


def one_chunk(case: Case):
    """The whole batch as one plan chunk: (k, v, buffer_row_offsets, cache_offsets)."""
    total = sum(case.batch.seq_lens_list)
    bro, co, _ = openmla.mla_prefill_plan(case.batch.input_row_offsets, case.batch, max(total, 1), 1)
    k, v = up_projected_buffer(case, bro[0], co[0])
    return k, v, bro[0], co[0]


# mla_prefill against the reference --------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mask,extra", MASKS, ids=MASK_IDS)
def test_masks_ragged_batch(mask, extra, dtype):
    # lengths 0 and 1, a prefix, page boundaries (16), many pages
    case = prefill_case([0, 3, 16, 0, 31], [9, 1, 30, 0, 17], dtype=dtype)
    check_prefill(case, **mask_kw(mask, extra))


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_page_sizes(page_size):
    case = prefill_case([5, 64, 0], [12, 3, 65], page_size=page_size)
    check_prefill(case)
    check_prefill(case, mask="sliding_window_causal", window_size=20)


@pytest.mark.parametrize("heads", [1, 3, 16, 128])
def test_head_counts(heads):
    new = [7, 11] if heads == 128 else [13, 20]
    case = prefill_case([4, 0], new, heads=heads)
    check_prefill(case)


def test_deepseek_dims_bf16():
    case = prefill_case([20, 0], [9, 13], heads=4, dims=DEEPSEEK, dtype=torch.bfloat16)
    check_prefill(case)
    check_prefill(case, mask="chunked_causal", chunk_size=8)


@pytest.mark.parametrize("mask,extra", [MASKS[0], MASKS[2]], ids=["causal", "swc"])
def test_fp16(mask, extra):
    case = prefill_case([6, 0], [17, 25], dtype=torch.float16)
    check_prefill(case, **mask_kw(mask, extra))


def test_float64_keeps_its_precision():
    case = prefill_case([3, 0], [20, 9], dtype=torch.float64)
    check_prefill(case, mask="chunked_causal", chunk_size=5, buffer_size=6)


def test_no_new_tokens():
    case = prefill_case([5, 9], [0, 0])
    out, lse = torch_prefill(case)
    assert out.shape == (0, 3, 32) and lse.shape == (0, 3)


# Chunking and tiles -----------------------------------------------------------------
@pytest.mark.parametrize("mask,extra", [MASKS[0], MASKS[2], MASKS[4]], ids=["causal", "swc", "chunked"])
def test_chunked_equals_one_shot(mask, extra):
    case = prefill_case([10, 0, 3], [30, 1, 22])
    whole, whole_lse = check_prefill(case, **mask_kw(mask, extra))  # one shot against the reference
    for buffer_size in (1, 5, 16, 37):  # smaller than one sequence
        out, lse = torch_prefill(case, buffer_size=buffer_size, **mask_kw(mask, extra))
        assert_close(out, whole, 1e-5, f"buffer_size={buffer_size} vs one shot", case.seed)
        assert_lse(lse, whole_lse, 1e-5, case.seed)


def test_default_buffer_bounds_memory(monkeypatch):
    # DeepSeek-V3 shapes: the default chunk keeps the K/V buffer near KV_BUFFER_BYTES.
    rows = chunks_mod.default_buffer_size(128, 192, 128, 512, torch.bfloat16)
    assert 0.5 * chunks_mod.KV_BUFFER_BYTES <= rows * 128 * (192 + 128) * 2 <= chunks_mod.KV_BUFFER_BYTES
    # A tiny budget forces many chunks by default; the result does not change.
    case = prefill_case([12, 0], [20, 9])
    want, _ = torch_prefill(case)
    chunks = []
    real_chunks = openmla.MLAPlan.chunks
    monkeypatch.setattr(chunks_mod, "KV_BUFFER_BYTES", 1)
    monkeypatch.setattr(chunks_mod, "MIN_BUFFER_ROWS", 8)
    monkeypatch.setattr(openmla.MLAPlan, "chunks", lambda self, size: chunks.append(size) or real_chunks(self, size))
    got, _ = torch_prefill(case)
    assert chunks == [8]
    assert_close(got, want, 1e-5, "default chunks", case.seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_tiles_give_equal_results(dtype):
    case = prefill_case([9, 0, 40], [21, 5, 33], dtype=dtype)
    k, v, bro, co = one_chunk(case)
    want, want_lse = ref.flare_mla_prefill(case.q, k, v, bro, co, case.batch, case.layer_idx, scale=case.scale)
    cfg = case.config
    results = []
    for bm, bn in [(2, 4), (8, 8), (16, 64), (64, 16), (128, 1024)]:
        tile = MlaConfigV2(cfg.num_heads, cfg.qk_head_dim, cfg.v_head_dim, bm, bn, dtype, dtype)
        out, lse = openmla.mla_prefill_v2_ragged(case.q, k, v, bro, co, case.batch, case.layer_idx, scale=case.scale,
                                                 config=tile, return_lse=True, backend=BACKEND)
        assert_close(out, want, TOL[dtype], f"tile {bm}x{bn}", case.seed)
        assert_lse(lse, want_lse, TOL[dtype], case.seed)
        results.append(out)
    if dtype == torch.float32:
        for out in results[1:]:
            assert_close(out, results[0], 1e-5, "tiles agree", case.seed)


@pytest.mark.parametrize("mask,extra", [MASKS[0], MASKS[3], MASKS[4]], ids=["causal", "swn", "chunked"])
def test_flare_chunks_merge_to_full(mask, extra):
    case = prefill_case([7, 0, 2], [25, 4, 30])
    b = case.batch
    bro, co, blen = openmla.mla_prefill_plan(b.input_row_offsets, b, 19, 8)
    out = lse = None
    for c in range(int((blen >= 0).sum())):
        k, v = up_projected_buffer(case, bro[c], co[c])
        part = openmla.flare_mla_prefill(case.q, k, v, bro[c], co[c], b, case.layer_idx, scale=case.scale,
                                         return_lse=True, backend=BACKEND, **mask_kw(mask, extra))
        assert not torch.isnan(part[0]).any(), f"NaN in chunk {c} (seed {case.seed})"
        out, lse = part if out is None else openmla.merge_states(out, lse, *part)
    want, want_lse = ref_prefill(case, **mask_kw(mask, extra))
    assert_close(out, want, 1e-5, "merged chunks", case.seed)
    assert_lse(lse, want_lse, 1e-5, case.seed)


def test_flare_chunks_without_rope():
    """R = 0: q is Dn wide, k Dn wide, no rope columns are read from the L-wide entries."""
    case = prefill_case([7, 0, 2], [9, 1, 12], dims=dict(R=0), page_size=4)
    b = case.batch
    bro, co, blen = openmla.mla_prefill_plan(b.input_row_offsets, b, 11, 8)
    out = lse = None
    for c in range(int((blen >= 0).sum())):
        k, v = up_projected_buffer(case, bro[c], co[c])
        part = openmla.flare_mla_prefill(case.q, k, v, bro[c], co[c], b, case.layer_idx, scale=case.scale,
                                         return_lse=True, backend=BACKEND, mask="sliding_window_causal", window_size=5)
        out, lse = part if out is None else openmla.merge_states(out, lse, *part)
    want, want_lse = ref_prefill(case, mask="sliding_window_causal", window_size=5)
    assert_close(out, want, 1e-5, "merged chunks", case.seed)
    assert_lse(lse, want_lse, 1e-5, case.seed)


def test_flare_rows_without_keys():
    # A chunk with only late keys: early queries see none of them -> zeros and -inf, never NaN.
    case = prefill_case([0, 4], [24, 12])
    b = case.batch
    bro = torch.tensor([0, 8, 12], dtype=torch.int32)
    co = torch.tensor([16, 4, 4], dtype=torch.int32)
    k, v = up_projected_buffer(case, bro, co)
    out, lse = openmla.flare_mla_prefill(case.q, k, v, bro, co, b, case.layer_idx, scale=case.scale,
                                         return_lse=True, backend=BACKEND)
    want, want_lse = ref.flare_mla_prefill(case.q, k, v, bro, co, b, case.layer_idx, scale=case.scale)
    assert bool(torch.isinf(want_lse).any())
    assert_close(out, want, 1e-5, "flare", case.seed)
    assert_lse(lse, want_lse, 1e-5, case.seed)
    assert bool((out[torch.isinf(want_lse).all(dim=1)] == 0).all())


def test_flare_matches_reference_bf16_deepseek():
    case = prefill_case([15, 0], [11, 19], heads=2, dims=DEEPSEEK, dtype=torch.bfloat16)
    k, v, bro, co = one_chunk(case)
    out, lse = openmla.flare_mla_prefill(case.q, k, v, bro, co, case.batch, case.layer_idx, scale=case.scale,
                                         mask="sliding_window_causal", window_size=6, return_lse=True, backend=BACKEND)
    want, want_lse = ref.flare_mla_prefill(case.q, k, v, bro, co, case.batch, case.layer_idx, scale=case.scale,
                                           mask=MaskVariant.parse("sliding_window_causal", 6))
    assert_close(out, want, TOL[torch.bfloat16], "flare bf16", case.seed)
    assert_lse(lse, want_lse, TOL[torch.bfloat16], case.seed)


@pytest.mark.parametrize("mask,extra", MASKS, ids=MASK_IDS)
def test_small_default_tiles_on_masked_blocks(mask, extra, monkeypatch):
    # Small sequences fit one default tile; shrink the defaults so every mask edge falls inside
    # some blocks and not others, and rows see their first key in a later block or chunk.
    monkeypatch.setattr(tpre, "DEFAULT_BLOCK_M", 4)
    monkeypatch.setattr(tpre, "MIN_BLOCK_M", 4)
    monkeypatch.setattr(tpre, "DEFAULT_BLOCK_N", 8)
    case = prefill_case([6, 0, 11], [29, 3, 18])
    check_prefill(case, **mask_kw(mask, extra))
    check_prefill(case, buffer_size=9, **mask_kw(mask, extra))


# Sinks, sparse, the fused op ----------------------------------------------------------
@pytest.mark.parametrize("per_sequence", [False, True], ids=["[H]", "[B,H]"])
def test_attention_sink(per_sequence):
    case = prefill_case([3, 0, 20], [14, 9, 6], dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(case.seed)
    shape = (case.batch.batch_size, 3) if per_sequence else (3,)
    sink = torch.randn(shape, generator=g) * 3
    sink.view(-1)[0] = -math.inf  # a sink that never wins
    check_prefill(case, attn_sink=sink, buffer_size=7)


@pytest.mark.parametrize("physical", [True, False], ids=["physical", "logical"])
def test_sparse(physical):
    case = prefill_case([9, 0], [8, 15], dtype=torch.bfloat16)
    b = case.batch
    # torch_cpu.decode reads physical row 0 for dropped slots (-1, past topk) and zeroes their
    # weight, which a NaN row there would defeat; poison unused rows with a finite value instead.
    b.blocks.nan_to_num_(nan=1e3)
    g = torch.Generator().manual_seed(case.seed)
    T, stride = case.q.shape[0], 6
    owner = torch.repeat_interleave(torch.arange(2), torch.tensor(b.new_tokens_list))
    lens = torch.tensor(b.seq_lens_list)[owner]
    pos = (torch.rand(T, stride, generator=g) * lens[:, None]).long()
    if physical:
        idx = torch.stack([ref.physical_rows(b, int(owner[t]), pos[t]) for t in range(T)])
    else:
        idx = pos
    idx = idx.to(torch.int32)
    idx[:, -1] = -1
    topk = torch.tensor([5, 6], dtype=torch.int32)
    kw = dict(sparse_indices=idx, topk_lengths=topk, physical_indices=physical)
    check_prefill(case, **kw)
    if not physical:
        check_prefill(case, mask="sliding_window_causal", window_size=4, **kw)


@pytest.mark.parametrize("mask,extra", [MASKS[0], MASKS[2]], ids=["causal", "swc"])
def test_fused_op_runs_prefill_form(mask, extra):
    case = make_case([5, 0, 17], [12, 1, 9], config=small_config(4), dtype=torch.bfloat16)
    other = case.clone_cache()
    assert case.batch.max_new_tokens > openmla.DECODE_MAX_Q_LEN
    out, lse = openmla.mla_prefill_decode_graph(*case.fused_args(), scale=case.scale, return_lse=True, backend=BACKEND,
                                                **mask_kw(mask, extra))
    want, want_lse = ref.mla_prefill_decode_graph(
        other.q, other.kv, other.freqs_cis, other.gamma, other.batch, other.layer_idx, other.w_k, other.w_uk,
        other.w_uv, scale=case.scale, mask=MaskVariant.parse(mask, **extra))
    assert_close(out, want, TOL[torch.bfloat16], "fused", case.seed)
    assert_lse(lse, want_lse, TOL[torch.bfloat16], case.seed)


# Internals with a contract of their own ----------------------------------------------
@pytest.mark.parametrize("mask,extra", MASKS, ids=MASK_IDS)
def test_fully_visible_and_key_range(mask, extra):
    """Block skipping relies on these: keys outside key_range are invisible to every query of
    the block; keys inside fully_visible are visible to all of them."""
    variant = MaskVariant.parse(mask, **extra)
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    for _ in range(200):
        kv_len = rng.randrange(1, 60)
        p_lo = rng.randrange(kv_len)
        p_hi = rng.randrange(p_lo, kv_len)
        q = torch.arange(p_lo, p_hi + 1)[:, None]
        k = torch.arange(kv_len)[None, :]
        vis = variant.visible(q, k)
        lo, hi = variant.key_range(p_lo, p_hi, kv_len)
        outside = torch.ones(kv_len, dtype=torch.bool)
        outside[lo:hi] = False
        assert not bool(vis[:, outside].any()), f"key_range misses a visible key (seed {seed})"
        f0, f1 = tpre.fully_visible(variant, p_lo, p_hi, kv_len)
        if f0 < f1:
            assert bool(vis[:, f0:f1].all()), f"fully_visible {f0, f1} not visible to all (seed {seed})"
        if variant.kind != MaskKind.CHUNKED_CAUSAL or p_lo // extra.get("chunk_size", 1) == p_hi // extra.get("chunk_size", 1):
            assert bool(vis.all(dim=0).sum() == max(0, f1 - f0)), f"fully_visible misses keys (seed {seed})"


def test_scratch_survives_switching_inference_mode():
    """Scratch buffers made under inference_mode must not be reused (written) outside it."""
    case = prefill_case([4, 0], [9, 7])
    with torch.inference_mode():
        a, _ = torch_prefill(case)
    with torch.no_grad():
        b, _ = torch_prefill(case)
    assert_close(b, a, 0.0, "no_grad after inference_mode", case.seed)
