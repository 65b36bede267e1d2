"""NVFP4 caches (``nvfp4_ds_mla``, 432 bytes; ``nvfp4_fp8rope``, 352 bytes) on the native ``cpu`` backend.

Every check plans with ``backend="cpu"`` and asserts the plan kept the native backend (no fallback),
then compares against the float64 reference run on a float64 cache holding the DEQUANTISED entries
(``read_pages``: the reference reads what the cache stores). Dense float32 units dequantise next to
the products (``csrc/decode_reg.h`` on AVX2 builds: the test build counts its units, and the check
asserts they ran); sparse units, bf16 products and prefill chunks decode whole records into a buffer.

Random entries with fresh seeds (printed on failure), ragged batches with 0 and 1 cached tokens and
several new tokens per sequence, pages of 1, 16 and 64, 1 to 128 heads; outputs and scratch start as
NaN (``use_backend``), and free pages and page tails hold 0xFF bytes (a NaN scale, -6 codes, a NaN
rope value).
"""

from __future__ import annotations

import math

import pytest
import torch

import openmla
from openmla import reference as ref
from openmla.cache import CacheBatch
from openmla.masks import MaskVariant
from openmla.spec import AttentionSpec

from cases import MASK_CASES, TOL, Case, assert_close, assert_lse, make_case, small_config
from cpu_backends import hooks, use_backend

FORMATS = ["nvfp4_ds_mla", "nvfp4_fp8rope"]
L, R = 512, 64
pytestmark = pytest.mark.usefixtures("one_thread")  # small calls: one thread, no stall when another process takes a core
ONE_LAYER = dict(num_layers=1, layer_idx=0)  # make_case's default is 2 layers (reading layer 1)
SCALES_AT = {"nvfp4_ds_mla": lambda g: 256 + g, "nvfp4_fp8rope": lambda g: 320 + 8 * (g % 4) + g // 4}


@pytest.fixture(autouse=True)
def native(monkeypatch):
    """NaN-filled outputs and scratch (skips where the kernels do not build)."""
    use_backend("cpu", monkeypatch)


@pytest.fixture
def reg_units():
    """The count of units decode_reg.h ran (a callable), or None in builds without it (AVX-512)."""
    ops = hooks()
    return ops.reg_dequant_units if ops.set_reg_dequant(True) else None


def config(H: int, Dn: int = 32):
    return small_config(num_heads=H, L=L, R=R, Dn=Dn, Dv=32)


def q_abs_for(case: Case, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(case.seed + 1)
    return (torch.randn(case.q.shape[0], case.config.num_heads, L + R, generator=g) * 0.5).to(dtype)


def raw(batch: CacheBatch, layer: int) -> torch.Tensor:
    """A layer's records, one row per cache row."""
    return batch.blocks[layer].view(batch.num_pages * batch.page_size, -1)


def poison_unused_rows(case: Case) -> None:
    """0xFF in every byte of every row no sequence of the batch holds."""
    b = case.batch
    used = torch.zeros(b.num_pages * b.page_size, dtype=torch.bool)
    for s, n in enumerate(b.seq_lens_list):
        used[ref.physical_rows(b, s, torch.arange(n))] = True
    for layer in range(b.num_layers):
        raw(b, layer)[~used] = 0xFF


def dequantised(batch: CacheBatch) -> CacheBatch:
    """The same batch over a float64 cache holding the stored records' values."""
    dense = torch.stack([batch.read_pages(i, torch.arange(batch.num_pages), torch.float64) for i in range(batch.num_layers)])
    return CacheBatch(dense, batch.block_table, batch.cache_lengths, batch.input_row_offsets, batch.page_size)


def native_plan(batch: CacheBatch, scale: float, **kw):
    plan = openmla.plan(batch, scale=scale, backend="cpu", **kw)
    assert plan.backend_name == "cpu" and plan.fallback_reason is None, plan.fallback_reason
    return plan


def check_decode(case: Case, q_abs: torch.Tensor, reg_units=None, dense: CacheBatch | None = None, **kw):
    """Native decode against the float64 reference on the dequantised cache (``dense``: made here
    when not given); where the build has the register path and the products are float32 (dense
    decode), that path must be the one that ran."""
    from openmla.backends.cpu import kernels

    before = reg_units() if reg_units else None
    out, lse = native_plan(case.batch, case.scale, **kw).decode(q_abs, case.layer_idx, kv_lora_rank=L, return_lse=True)
    ref_plan = openmla.plan(dense or dequantised(case.batch), scale=case.scale, backend="reference", **kw)
    want, want_lse = ref_plan.decode(q_abs.double(), case.layer_idx, kv_lora_rank=L, return_lse=True)
    if reg_units is not None and kernels.compute_dtype(q_abs.dtype) == torch.float32 and "sparse_indices" not in kw:
        assert reg_units() > before, "the register-dequantising decode did not run"
    tol = TOL[q_abs.dtype]
    assert_close(out, want, tol, "out", case.seed)
    assert_lse(lse, want_lse, max(tol, 1e-6), case.seed)
    return out, lse


# Decode: ragged batches, page sizes, head counts, several query tokens --------------------------
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("page_size,H", [(1, 1), (1, 20), (16, 16), (16, 128), (64, 3), (64, 20), (64, 128)])
def test_decode_ragged(reg_units, fmt, page_size, H):
    """Caches of 0, 1 and longer (past a 256-key block), 0 to 3 new tokens per sequence, free pages
    of 0xFF; default and forced split-KV with sinks."""
    case = make_case([0, 1, 37, 300, 4], [1, 2, 1, 3, 0], config=config(H), page_size=page_size, cache_dtype=fmt,
                     spare_pages=3, **ONE_LAYER)
    poison_unused_rows(case)
    q_abs, dense = q_abs_for(case), dequantised(case.batch)
    check_decode(case, q_abs, reg_units, dense)
    check_decode(case, q_abs, reg_units, dense, num_partitions=3, attn_sink=torch.linspace(-1, 1, H))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("mask,extra", MASK_CASES, ids=[m for m, _ in MASK_CASES])
def test_decode_masks_multi_token(reg_units, fmt, mask, extra):
    """Several query tokens per sequence see different key ranges of one block (per-row columns)."""
    case = make_case([0, 5, 70, 129], [3, 6, 1, 4], config=config(4), page_size=16, cache_dtype=fmt)
    poison_unused_rows(case)
    check_decode(case, q_abs_for(case), reg_units, mask=mask, **extra)


@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_bf16_query(reg_units, fmt):
    """bf16 queries: float32 products where the CPU has no bf16 brgemm (the register path), bf16
    products over a key buffer of exact bf16 values where it has."""
    case = make_case([0, 90, 1], [1, 1, 2], config=config(16), page_size=16, cache_dtype=fmt, dtype=torch.bfloat16,
                     **ONE_LAYER)
    poison_unused_rows(case)
    check_decode(case, q_abs_for(case, torch.bfloat16), reg_units)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("physical", [True, False])
def test_sparse_decode(fmt, physical):
    """Sparse top-k units decode the listed records into the key buffer."""
    case = make_case([40, 0, 300], [1, 1, 2], config=config(8), page_size=16, cache_dtype=fmt, **ONE_LAYER)
    poison_unused_rows(case)
    b = case.batch
    g = torch.Generator().manual_seed(case.seed + 2)
    seq, lens = [0, 1, 2, 2], [41, 1, 301, 302]  # each token's sequence and visible keys
    logical = torch.stack([torch.randint(0, n, (24,), generator=g) for n in lens])
    logical[:, -3:] = -1  # unused slots
    idx = logical.clone()
    if physical:
        for t, s in enumerate(seq):
            valid = logical[t] >= 0
            idx[t, valid] = ref.physical_rows(b, s, logical[t, valid])
    check_decode(case, q_abs_for(case), sparse_indices=idx.int(), physical_indices=physical)


# The register path --------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_register_path_matches_widened_path(reg_units, fmt):
    """The register path and the key buffer (the test hook's switch), one long sequence split
    across two threads: both within float32 tolerance of the reference and of each other."""
    if reg_units is None:
        pytest.skip("this build has no register-dequantising decode (AVX-512, or no AVX2 + F16C)")
    ops = hooks()
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        case = make_case([1200, 1], [1, 1], config=config(8), page_size=64, cache_dtype=fmt, **ONE_LAYER)
        poison_unused_rows(case)
        q_abs, dense = q_abs_for(case), dequantised(case.batch)
        reg, _ = check_decode(case, q_abs, reg_units, dense)
        ops.set_reg_dequant(False)
        before = reg_units()
        wide, _ = check_decode(case, q_abs, dense=dense)
        assert reg_units() == before
        assert_close(reg, wide, 1e-5, "register vs widened", case.seed)
    finally:
        ops.set_reg_dequant(True)
        torch.set_num_threads(saved)


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_code_and_scale_byte(reg_units, fmt):
    """Records of random bytes: all 16 e2m1 codes in every nibble position, every finite e4m3
    scale byte (subnormals, both signs, 448), random rope bytes (finite bf16, or finite e4m3)."""
    case = make_case([255], [1], config=config(8), page_size=16, cache_dtype=fmt, **ONE_LAYER)
    b = case.batch
    g = torch.Generator().manual_seed(case.seed)
    rows = ref.physical_rows(b, 0, torch.arange(256))
    rec = raw(b, case.layer_idx)[rows]
    rec[:, :256] = torch.randint(0, 256, (256, 256), generator=g, dtype=torch.uint8)
    finite = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)  # 254 bytes
    scales = finite[torch.randperm(256 * 32, generator=g) % finite.numel()].view(256, 32)
    for grp in range(32):
        rec[:, SCALES_AT[fmt](grp)] = scales[:, grp]
    if fmt == "nvfp4_ds_mla":
        rec[:, 304:].view(torch.bfloat16).copy_(torch.randn(256, R, generator=g) * 4)
    else:
        rec[:, 256:320] = finite[torch.randint(0, finite.numel(), (256, R), generator=g)]
    raw(b, case.layer_idx)[rows] = rec
    vals = dequantised(b).blocks[case.layer_idx].reshape(-1, L + R)[rows]
    assert torch.isfinite(vals).all() and (vals[:, :L] != 0).any()
    check_decode(case, q_abs_for(case) * 1e-3, reg_units)  # keys up to 6 * 448: small queries keep the scores spread


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("part", ["scale", "rope"])
def test_nan_in_a_visible_key_reaches_only_the_rows_that_see_it(reg_units, fmt, part):
    """A NaN scale (or rope value) in key 7 of sequence 0: NaN in every output row that sees that
    key, as in the reference; rows whose window ends before it and the other sequence stay finite
    (the V stripe reads a NaN scale as 0 where P is 0)."""
    case = make_case([40, 9], [1, 1], config=config(2), page_size=16, cache_dtype=fmt, **ONE_LAYER)
    b = case.batch
    cols = [SCALES_AT[fmt](3)] if part == "scale" else ([304, 305] if fmt == "nvfp4_ds_mla" else [256])
    raw(b, case.layer_idx)[ref.physical_rows(b, 0, torch.tensor([7]))[:, None], torch.tensor(cols)] = 0xFF
    q_abs = q_abs_for(case)
    for kw in ({}, {"mask": "sliding_window_causal", "window_size": 20}):
        out = native_plan(b, case.scale, **kw).decode(q_abs, case.layer_idx, kv_lora_rank=L)
        want = openmla.plan(dequantised(b), scale=case.scale, backend="reference", **kw).decode(
            q_abs.double(), case.layer_idx, kv_lora_rank=L)
        sees = not kw  # the window of sequence 0's query (position 40) starts at 21
        assert torch.isnan(want[0]).all() == sees and torch.isnan(out[0]).all() == sees, f"{kw} seed {case.seed}"
        if not sees:
            assert_close(out[0], want[0], TOL[torch.float32], "the row past the NaN key", case.seed)
        assert_close(out[1], want[1], TOL[torch.float32], "the other sequence", case.seed)


# Prefill and the cache write ----------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("buffer_size", [None, 29])
def test_prefill_natively(fmt, buffer_size):
    """Prefill per chunk: the native gather decodes the rows the chunk's queries see, torch matmuls
    up-project them, native flash attention (several chunks with a small buffer)."""
    case = make_case([0, 20, 1], [17, 9, 30], config=config(4), page_size=16, cache_dtype=fmt)
    poison_unused_rows(case)
    kw = {} if buffer_size is None else {"buffer_size": buffer_size}
    q_rot = case.q  # already "roped": the prefill form takes q as given
    got, lse = native_plan(case.batch, case.scale, **kw).prefill(q_rot, case.layer_idx, case.w_k, case.w_uv,
                                                                  return_lse=True)
    want, want_lse = openmla.plan(dequantised(case.batch), scale=case.scale, backend="reference").prefill(
        q_rot.double(), case.layer_idx, case.w_k.double(), case.w_uv.double(), return_lse=True)
    assert_close(got, want, TOL[torch.float32], "out", case.seed)
    assert_lse(lse, want_lse, 1e-6, case.seed)


@pytest.mark.parametrize("fmt", FORMATS)
def test_native_write_stores_the_reference_records(fmt):
    """``plan.run``'s native cache write (RMSNorm, RoPE, NVFP4 quantisation) stores the records the
    reference write stores (float64 entries on both sides, rounded to float32 first: a value within
    rounding of an e2m1 or e4m3 midpoint may flip one code), and the run matches the reference over
    what it stored. A NaN in a token's kv makes every latent group of its record a NaN scale (0x7F)
    over zero codes (+-0), and the rows that see it NaN (here the decode token of sequence 1 only:
    a NaN key inside a prefill chunk also reaches earlier rows of the chunk, on every backend)."""
    case = make_case([0, 3, 50], [40, 1, 7], config=config(4), page_size=16, cache_dtype=fmt)
    mine, theirs = case.clone_cache(), case.clone_cache()
    kv = case.kv.clone()
    kv[40, 100] = math.nan  # sequence 1's one new token
    got = native_plan(mine.batch, case.scale).run(case.q, kv, case.layer_idx, case.weights, case.freqs_cis)
    ref.write_cache(kv, theirs.freqs_cis, theirs.gamma, theirs.batch, theirs.layer_idx, 1e-6)
    nan_row = int(ref.physical_rows(mine.batch, 1, torch.tensor([3]))[0])
    rec = raw(mine.batch, case.layer_idx)[nan_row]
    assert all(int(rec[SCALES_AT[fmt](g)]) == 0x7F for g in range(32)) and not (rec[:256] & 0x77).any()
    a, b = raw(mine.batch, case.layer_idx).clone(), raw(theirs.batch, case.layer_idx).clone()
    a[nan_row, :256] = b[nan_row, :256] = 0  # the codes' signs of a NaN group are not specified
    assert int((a != b).sum()) <= 3, f"{int((a != b).sum())} bytes differ (seed {case.seed})"
    Dn = case.w_uk.shape[2]
    q = case.q.double()
    q_rot = torch.cat([q[..., :Dn], ref.rope(q[..., Dn:], case.freqs_cis, ref.token_positions(mine.batch))], dim=-1)
    want, _ = ref.prefill(q_rot, dequantised(mine.batch), case.layer_idx, case.w_k, case.w_uv,
                          AttentionSpec.build(scale=case.scale))
    sees = torch.zeros(got.shape[0], dtype=torch.bool)
    sees[40] = True
    assert torch.isnan(got[sees]).all() and torch.isnan(want[sees]).all()
    assert_close(got[~sees], want[~sees], TOL[torch.float32], "out", case.seed)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cols", [(0, L + R), (L, L + R), (100, 530)], ids=["entry", "rope", "middle"])
def test_gather_decodes_records_exactly(fmt, dtype, cols):
    """The native gather (prefill chunks; the key buffer uses the same row decoder) in float32 and
    in bf16 (what bf16 products read): e2m1 x e4m3 and the rope values are exact in both, so it
    equals the cache's own read, column range by column range."""
    from openmla.backends.cpu import kernels
    from openmla.backends.cpu.backend import _layer

    case = make_case([37, 0, 80], [2, 1, 3], config=config(2), page_size=16, cache_dtype=fmt)
    b = case.batch
    spans = [(0, 3, 30), (2, 0, 83), (1, 0, 1)]
    got = kernels.gather(_layer(b, case.layer_idx), spans, kv_lora_rank=L, rope_dim=R, cols=cols, dtype=dtype)
    rows = torch.cat([ref.physical_rows(b, s, torch.arange(p, p + n)) for s, p, n in spans])
    want = b.read_rows(case.layer_idx, rows, torch.float64)[:, cols[0]:cols[1]]
    assert got.dtype == dtype and torch.equal(got.double(), want), f"seed {case.seed}"


def test_the_kernels_refuse_records_of_another_shape():
    """Memory safety below the validated API: an NVFP4 format code with L != 512 is an error."""
    from openmla.backends.cpu import kernels

    case = make_case([5], [1], config=small_config(num_heads=2, L=64, R=16), page_size=16)
    layer = kernels.PagedLayer(case.batch.blocks[0].view(torch.uint8), case.batch.block_table, case.batch.cache_lengths,
                               case.batch.input_row_offsets, kernels.FORMAT_CODES["nvfp4_ds_mla"])
    with pytest.raises(RuntimeError, match="NVFP4 records hold L = 512 and R = 64"):
        kernels.decode(torch.zeros(1, 2, 80), layer, kv_lora_rank=64, scale=1.0, mask=MaskVariant.parse("causal"),
                       dtype=torch.float32)
