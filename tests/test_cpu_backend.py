"""What only the native ``cpu`` backend has: its dispatch and fallback, in-place page reads next
to garbage rows, its block and page geometry, split-KV across threads, the float32 path of
CPUs without bf16 brgemm, and oneDNN's non-AMX kernels. The shared scenarios (every mask,
sparse, sinks, fp8, page sizes, head counts, dtypes) run in test_torch_decode.py,
test_torch_prefill.py and test_torch_fp8.py on both CPU backends.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
import subprocess
import sys
import textwrap

import pytest
import torch

import openmla
from openmla import reference as ref
from openmla.backends import load_backend, resolve_backend_name

from cases import MASK_CASES, TOL, Case, assert_close, assert_lse, make_case, small_config
from cpu_backends import hooks, use_backend

DEEPSEEK = dict(L=512, R=64, Dn=128, Dv=128)
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def native(monkeypatch):
    """NaN-filled outputs and scratch (skips where the kernels do not build)."""
    use_backend("cpu", monkeypatch)


def random_q_abs(case: Case, dtype: torch.dtype | None = None) -> torch.Tensor:
    cfg = case.config
    g = torch.Generator().manual_seed(case.seed + 1)
    q = torch.randn(case.q.shape[0], cfg.num_heads, cfg.kv_lora_rank + cfg.qk_rope_head_dim, generator=g) * 0.5
    return q.to(dtype or case.q.dtype)


def poison_unused_rows(case: Case) -> None:
    """NaN in every cache row that holds no token of the batch: free pages and page tails (bytes
    0xff: a NaN in every native dtype, fp8 value, fp8_ds_mla scale and bf16 rope value)."""
    b = case.batch
    used = torch.zeros(b.num_pages * b.page_size, dtype=torch.bool)
    for s, n in enumerate(b.seq_lens_list):
        used[ref.physical_rows(b, s, torch.arange(n))] = True
    b.blocks.view(torch.uint8).view(b.num_layers, b.num_pages * b.page_size, -1)[:, ~used] = 0xFF


def check_decode(case: Case, q_abs: torch.Tensor, **kw):
    L = case.config.kv_lora_rank
    args = (q_abs, case.batch, case.layer_idx)
    out, lse = openmla.flare_mla_decode(*args, scale=case.scale, kv_lora_rank=L, return_lse=True, backend="cpu", **kw)
    want, want_lse = openmla.flare_mla_decode(*args, scale=case.scale, kv_lora_rank=L, return_lse=True, backend="reference", **kw)
    tol = TOL[q_abs.dtype]
    assert_close(out, want, tol, "out", case.seed)
    assert_lse(lse, want_lse, tol, case.seed)
    return out, lse


def check_prefill(case: Case, **kw):
    args = (case.q, case.batch, case.layer_idx, case.w_k, case.w_uv)
    out, lse = openmla.mla_prefill(*args, scale=case.scale, return_lse=True, backend="cpu", **kw)
    ref_kw = {k: v for k, v in kw.items() if k != "buffer_size"}
    want, want_lse = openmla.mla_prefill(*args, scale=case.scale, return_lse=True, backend="reference", **ref_kw)
    tol = TOL[case.q.dtype]
    assert_close(out, want, tol, "out", case.seed)
    assert_lse(lse, want_lse, max(tol, 1e-6), case.seed)
    return out, lse


def written(case: Case) -> Case:
    """The case with this call's tokens already in the cache (as after the fused op's write)."""
    ref.write_cache(case.kv, case.freqs_cis, case.gamma, case.batch, case.layer_idx, 1e-6)
    return case


# Dispatch and fallback --------------------------------------------------------------------
def test_cpu_is_the_default_on_cpu_and_env_forces_torch(monkeypatch):
    monkeypatch.delenv("OPENMLA_BACKEND", raising=False)
    assert resolve_backend_name(None, CPU) == "cpu"
    monkeypatch.setenv("OPENMLA_BACKEND", "torch")
    assert resolve_backend_name(None, CPU) == "torch"
    assert resolve_backend_name("cpu", CPU) == "cpu"  # an explicit argument still wins


def test_failed_build_falls_back_to_torch(monkeypatch):
    from openmla.backends.cpu import build

    import openmla.backends as backends

    monkeypatch.delenv("OPENMLA_BACKEND", raising=False)
    monkeypatch.setattr(build, "_state", {"loaded": False, "error": "no compiler"})
    # What a process finds once (the default backend, the loaded backends) starts empty, as in a new process.
    monkeypatch.setattr(backends, "_CPU_DEFAULT", [])
    monkeypatch.setattr(backends, "_LOADED", {})
    assert resolve_backend_name(None, CPU) == "torch"
    assert build.unavailable_reason() == "no compiler"
    with pytest.raises(ValueError, match="backend: the cpu backend is unavailable"):
        load_backend("cpu")


@pytest.mark.parametrize("cache_dtype", ["fp8_e4m3", "fp8_ds_mla", "nvfp4_ds_mla", "nvfp4_fp8rope"])
def test_quantized_caches_plan_cpu(cache_dtype):
    """The fp8 and NVFP4 formats run on the native kernels (NVFP4: tests/test_cpu_nvfp4.py)."""
    cfg = small_config(num_heads=2, L=512, R=64)
    case = make_case([5], [1], config=cfg, dtype=torch.float32, cache_dtype=cache_dtype)
    plan = openmla.plan(case.batch, scale=case.scale, backend="cpu")
    assert plan.backend_name == "cpu" and plan.fallback_reason is None


def test_float64_runs_the_torch_backend():
    case = make_case([20, 3], [2, 1], dtype=torch.float64)
    check_decode(case, random_q_abs(case))


# In-place page reads next to garbage -------------------------------------------------------------
@pytest.mark.parametrize("mask,extra", MASK_CASES, ids=[m for m, _ in MASK_CASES])
@pytest.mark.parametrize("page_size", [16, 64])
def test_decode_reads_pages_in_place_past_nan_rows(mask, extra, page_size):
    """bf16 pages are read whole by the score GEMM: rows past a sequence's end and free pages
    hold NaN and must not reach any output."""
    case = make_case([0, 1, 17, 70, 130], [1, 6, 3, 0, 4], config=small_config(num_heads=3), page_size=page_size,
                     dtype=torch.bfloat16, spare_pages=4)
    poison_unused_rows(case)
    check_decode(case, random_q_abs(case), mask=mask, **extra)


def test_prefill_with_nan_free_rows_chunked():
    case = written(make_case([0, 20, 5], [17, 9, 30], config=small_config(num_heads=2), page_size=16, dtype=torch.bfloat16))
    poison_unused_rows(case)
    one, _ = check_prefill(case)
    many, _ = check_prefill(case, buffer_size=17, attn_sink=torch.tensor([0.5, -1.0]))
    assert torch.isfinite(one).all() and torch.isfinite(many).all()


# Geometry: pages, heads, key blocks, partitions -------------------------------------------------
@pytest.mark.parametrize("page_size", [1, 2, 8, 48, 128, 256])
def test_decode_page_geometries(page_size):
    """Gathered blocks (small pages), several pages per block (48: 96-key blocks), one page per
    block, and slabs inside long pages; long contexts cross many blocks."""
    case = make_case([0, 300, 611], [2, 1, 3], config=small_config(num_heads=4), page_size=page_size, dtype=torch.bfloat16)
    poison_unused_rows(case)
    q_abs = random_q_abs(case)
    check_decode(case, q_abs)
    check_decode(case, q_abs, mask="sliding_window_causal", window_size=150)


@pytest.mark.parametrize("H,new", [(1, 6), (3, 5), (16, 6), (128, 3), (200, 2)])
def test_decode_head_groups_and_tokens(H, new):
    """Query rows (tokens x heads) are cut into groups of at most 128; more heads than that
    split the heads of a token."""
    case = make_case([5, 140], [new, 1], config=small_config(num_heads=H), page_size=16, dtype=torch.bfloat16)
    check_decode(case, random_q_abs(case), mask="chunked_causal", chunk_size=64)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_split_kv_is_the_same_on_any_thread_count(threads):
    """One long sequence: automatic split-KV parts merged by whichever thread ends last."""
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        case = make_case([5000], [1], config=small_config(num_heads=8), page_size=64, dtype=torch.bfloat16, seed=11)
        q_abs = random_q_abs(case)
        out, lse = check_decode(case, q_abs)
        for parts in (1, 7):
            out_p, lse_p = check_decode(case, q_abs, num_partitions=parts)
            assert_close(out_p, out, 1e-2, f"{parts} partitions", case.seed)
    finally:
        torch.set_num_threads(saved)


def test_deepseek_dims_decode_and_prefill():
    case = make_case([0, 200, 64], [2, 1, 5], config=small_config(num_heads=16, **DEEPSEEK), page_size=64,
                     dtype=torch.bfloat16, cache_dtype="fp8_ds_mla")
    check_decode(case, random_q_abs(case), num_partitions=3)
    written(case)
    check_prefill(case, mask="sliding_window_causal", window_size=100)


# The own AMX micro-kernel (bf16 decode where tokens x heads, the entry width and pages come in
# whole 16 x 32 tiles) against brgemm and the reference ----------------------------------------------
TILED = dict(L=64, R=32)  # entry width 96: whole tiles


@pytest.fixture
def own_amx():
    ops = hooks()
    if not ops.set_own_amx(True):
        pytest.skip("no AMX here (or the compiler does not target it)")
    yield ops
    ops.set_own_amx(True)


def random_picks(case: Case, width: int, physical: bool) -> torch.Tensor:
    """``width`` random top-k picks per query token (about a fifth -1), physical cache rows or logical positions."""
    g = torch.Generator().manual_seed(case.seed + 2)
    b = case.batch
    T = sum(b.new_tokens_list)
    if physical:
        idx = torch.randint(0, b.num_pages * b.page_size, (T, width), generator=g)
    else:
        seq = torch.repeat_interleave(torch.arange(b.batch_size), torch.tensor(b.new_tokens_list))
        idx = (torch.rand(T, width, generator=g) * torch.tensor(b.seq_lens_list)[seq][:, None]).long()
    idx[torch.rand(T, width, generator=g) < 0.2] = -1
    return idx


def check_against_brgemm(ops, kernel: str, case: Case, q_abs: torch.Tensor, **kw):
    """Decode on openmla's own ``kernel`` ("own_amx", "bf16_tiles" or "f32_tiles": it must run) and, switched off, on brgemm,
    each against the reference."""
    units, switch = getattr(ops, f"{kernel}_units"), getattr(ops, f"set_{kernel}")
    before = units()
    own, _ = check_decode(case, q_abs, **kw)
    assert units() > before, f"{kernel} did not run"
    switch(False)
    try:
        plain, _ = check_decode(case, q_abs, **kw)
    finally:
        switch(True)
    assert_close(own, plain, 1e-2, f"{kernel} vs brgemm", case.seed)


def check_own_and_brgemm(ops, case: Case, q_abs: torch.Tensor, **kw):
    check_against_brgemm(ops, "own_amx", case, q_abs, **kw)


@pytest.mark.parametrize("mask,extra", MASK_CASES, ids=[m for m, _ in MASK_CASES])
@pytest.mark.parametrize("page_size,H,new", [(16, 16, [1, 2, 1, 0, 3]), (64, 32, [1, 1, 1, 1, 1]),
                                             (48, 8, [2, 2, 1, 2, 2]), (256, 16, [1, 4, 1, 1, 2]),
                                             (64, 64, [1, 1, 2, 1, 1]), (8, 16, [1, 3, 1, 2, 1])])
def test_own_amx_decode(own_amx, mask, extra, page_size, H, new):
    """Pages read in place past NaN rows, several tokens per unit (8 heads x 2 tokens), units of
    both kernels in one call (8 heads x 1 token), slabs of long pages, small pages gathered into
    a key buffer (page 8), split-KV; up to 32 query rows V is read straight from the pages (key
    groups of 16 that a block only partly sees are staged with zeros), at 64 it is packed."""
    case = make_case([0, 1, 37, 300, 611], new, config=small_config(num_heads=H, **TILED), page_size=page_size,
                     dtype=torch.bfloat16, spare_pages=3)
    poison_unused_rows(case)
    q_abs = random_q_abs(case)
    check_own_and_brgemm(own_amx, case, q_abs, mask=mask, **extra)
    check_own_and_brgemm(own_amx, case, q_abs, mask=mask, num_partitions=3, **extra)


@pytest.mark.parametrize("mask,extra", MASK_CASES[::2], ids=[m for m, _ in MASK_CASES[::2]])
def test_own_amx_decode_packs_v_of_odd_width(own_amx, mask, extra):
    """A latent width in whole 16-column tiles but not 32-column chunks: the own kernel with V
    packed (pages still read in place for the scores)."""
    case = make_case([0, 5, 70, 129], [1, 2, 1, 1], config=small_config(num_heads=16, L=48, R=16), page_size=16,
                     dtype=torch.bfloat16, spare_pages=2)
    poison_unused_rows(case)
    check_own_and_brgemm(own_amx, case, random_q_abs(case), mask=mask, **extra)


@pytest.mark.parametrize("cache_dtype", ["fp8_e4m3", "fp8_ds_mla"])
def test_own_amx_decode_fp8_sinks(own_amx, cache_dtype):
    case = make_case([0, 200, 64], [2, 1, 5], config=small_config(num_heads=16, **DEEPSEEK), page_size=64,
                     dtype=torch.bfloat16, cache_dtype=cache_dtype)
    check_own_and_brgemm(own_amx, case, random_q_abs(case), attn_sink=torch.linspace(-1, 1, 16), num_partitions=2)


@pytest.mark.parametrize("physical", [True, False])
def test_own_amx_sparse(own_amx, physical):
    case = make_case([0, 40, 90, 7], [2, 1, 3, 1], config=small_config(num_heads=32, **TILED), dtype=torch.bfloat16)
    idx = random_picks(case, 40, physical)
    check_own_and_brgemm(own_amx, case, random_q_abs(case), sparse_indices=idx.to(torch.int32), physical_indices=physical)


# Register tiles (decode_tiles.h): bf16 on AVX-512-BF16 builds on CPUs without AMX, float32 on
# AVX-512 and AVX2 + FMA builds (float32 queries, and bf16 ones where bf16 computes in float32) ---
TILE_KINDS = [("bf16_tiles", torch.bfloat16), ("f32_tiles", torch.float32), ("f32_tiles", torch.bfloat16)]


@dataclass
class Tiles:
    ops: object
    kernel: str         # "bf16_tiles" or "f32_tiles": the hooks' names
    dtype: torch.dtype  # the queries' (and native caches') dtype


@pytest.fixture(params=TILE_KINDS, ids=["bf16", "f32", "bf16_as_f32"])
def tiles(request):
    from openmla.backends.cpu import kernels

    ops = hooks()
    kernel, dtype = request.param
    switch = getattr(ops, f"set_{kernel}")
    if not switch(True):
        pytest.skip(f"no {kernel} here (build, or a CPU with AMX for bf16)")
    want = torch.bfloat16 if kernel == "bf16_tiles" else torch.float32
    if kernels.compute_dtype(dtype) != want:
        pytest.skip(f"{dtype} does not compute in {want} here")
    yield Tiles(ops, kernel, dtype)
    switch(True)


def check_tiles_and_brgemm(t: Tiles, case: Case, q_abs: torch.Tensor, **kw):
    check_against_brgemm(t.ops, t.kernel, case, q_abs, **kw)


@pytest.mark.parametrize("mask,extra", MASK_CASES, ids=[m for m, _ in MASK_CASES])
@pytest.mark.parametrize("page_size,H,new", [(16, 16, [1, 2, 1, 0, 3]), (64, 1, [1, 1, 1, 1, 1]),
                                             (1, 3, [2, 2, 1, 2, 2]), (256, 20, [1, 4, 1, 1, 2]),
                                             (64, 128, [1, 1, 2, 1, 1]), (8, 33, [1, 3, 1, 2, 1])])
def test_tiles_decode(tiles, mask, extra, page_size, H, new):
    """Every blocking the tiles choose by query rows (bf16 and AVX-512 float32: 1-16, 17-32, 33-48,
    more; AVX2 float32: 1-8, more; heads x tokens), pages in place past NaN rows (blocks that start
    or end mid-page, odd key counts), short pages through the key buffer, slabs of long pages,
    split-KV."""
    case = make_case([0, 1, 37, 300, 611], new, config=small_config(num_heads=H, **TILED), page_size=page_size,
                     dtype=tiles.dtype, spare_pages=3)
    poison_unused_rows(case)
    q_abs = random_q_abs(case)
    check_tiles_and_brgemm(tiles, case, q_abs, mask=mask, **extra)
    check_tiles_and_brgemm(tiles, case, q_abs, mask=mask, num_partitions=3, **extra)


@pytest.mark.parametrize("L,R", [(48, 16), (70, 20), (512, 64)])
def test_tiles_latent_widths(tiles, L, R):
    """Latent widths off the P x V column chunks (masked tail columns) and DeepSeek's."""
    case = make_case([0, 5, 70, 1029], [1, 2, 1, 1], config=small_config(num_heads=16, L=L, R=R), page_size=64,
                     dtype=tiles.dtype, spare_pages=2)
    poison_unused_rows(case)
    check_tiles_and_brgemm(tiles, case, random_q_abs(case), attn_sink=torch.linspace(-1, 1, 16))


@pytest.mark.parametrize("cache_dtype", ["fp8_e4m3", "fp8_ds_mla", "nvfp4_ds_mla", "nvfp4_fp8rope", torch.float16,
                                         torch.bfloat16, torch.float32])
def test_tiles_cache_formats(tiles, cache_dtype):
    """Every cache format whose products the tiles run (the key buffer; float32 pages in place)."""
    from openmla.backends.cpu import kernels

    if isinstance(cache_dtype, torch.dtype):
        want = torch.bfloat16 if tiles.kernel == "bf16_tiles" else torch.float32
        if kernels.compute_dtype(tiles.dtype, cache_dtype) != want:
            pytest.skip(f"{tiles.dtype} queries on a {cache_dtype} cache do not compute in {want}")
    elif tiles.kernel == "f32_tiles" and tiles.ops.set_reg_dequant(True):
        pytest.skip("dense fp8 / NVFP4 decode with float32 products runs decode_reg.h in this build")
    case = make_case([0, 200, 64], [2, 1, 5], config=small_config(num_heads=16, **DEEPSEEK), page_size=64,
                     dtype=tiles.dtype, cache_dtype=cache_dtype)
    check_tiles_and_brgemm(tiles, case, random_q_abs(case), attn_sink=torch.linspace(-1, 1, 16), num_partitions=2)


@pytest.mark.parametrize("physical", [True, False])
@pytest.mark.parametrize("H", [5, 32])
def test_tiles_sparse(tiles, physical, H):
    case = make_case([0, 40, 90, 7], [2, 1, 3, 1], config=small_config(num_heads=H, **TILED), dtype=tiles.dtype)
    idx = random_picks(case, 41, physical)
    check_tiles_and_brgemm(tiles, case, random_q_abs(case), sparse_indices=idx.to(torch.int32), physical_indices=physical)


def test_tiles_long_context_many_heads():
    """One 33k-token sequence at 128 heads and a 1-token one, float32 and bf16, against the reference."""
    for dtype in (torch.float32, torch.bfloat16):
        case = make_case([33000, 0], [1, 1], config=small_config(num_heads=128, L=64, R=32), page_size=64, dtype=dtype,
                         spare_pages=1)
        check_decode(case, random_q_abs(case))


AVX2_TILES_SCRIPT = """
import sys, pytest
class Passed:
    n = 0
    def pytest_runtest_logreport(self, report):
        Passed.n += report.when == "call" and report.passed
rc = pytest.main(["-q", "-x", "-p", "no:cacheprovider", "-k", "tiles and not avx2_build and not long_context", sys.argv[1]],
                 plugins=[Passed()])
print("passed:", Passed.n)
sys.exit(rc)
"""


def test_tiles_in_avx2_build():
    """The tile tests on the kernels' AVX2 build (OPENMLA_CPU_ISA=avx2, oneDNN capped to AVX2: 8-lane
    float32 tiles, bf16 computing in float32), in a subprocess: its own build and library."""
    env = dict(os.environ, OPENMLA_CPU_ISA="avx2", ONEDNN_MAX_CPU_ISA="AVX2")
    res = subprocess.run([sys.executable, "-c", AVX2_TILES_SCRIPT, __file__], env=env, capture_output=True, text=True,
                         timeout=1800)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    assert int(res.stdout.split("passed:")[-1]) > 50, res.stdout[-2000:]


def test_isa_cap_builds_for_less(monkeypatch):
    """OPENMLA_CPU_ISA=avx2 compiles without AVX-512 or AMX (at::vec at 256 bits) under its own key,
    so the AVX2 paths can run on a newer CPU; unset, the CPU's own flags decide."""
    from openmla.backends.cpu import build

    flags = ["avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "amx_tile"]
    monkeypatch.delenv("OPENMLA_CPU_ISA", raising=False)
    native, key = build.compile_flags(flags), build.build_key()
    assert "-DCPU_CAPABILITY_AVX512" in native and "-mno-avx512f" not in native
    monkeypatch.setenv("OPENMLA_CPU_ISA", "avx2")
    capped = build.compile_flags(flags)
    assert "-DCPU_CAPABILITY_AVX2" in capped and "-mno-avx512f" in capped and "-mno-amx-tile" in capped
    assert "-DCPU_CAPABILITY_AVX512" not in capped and build.build_key() != key
    monkeypatch.setenv("OPENMLA_CPU_ISA", "avx512")
    assert "-DCPU_CAPABILITY_AVX512" in build.compile_flags(flags) and "-mno-amx-tile" in build.compile_flags(flags)


# fp8 caches: dense decode dequantises next to the products (decode_reg.h: float32 products on
# AVX2 + F16C builds), sparse units and bf16 products convert key blocks into a buffer ------------
FP8_FORMATS = ["fp8_e4m3", "fp8_ds_mla"]


def fp8_config(cache_dtype: str, H: int, aligned: bool = True):
    """fp8_ds_mla needs L in groups of 128; fp8_e4m3 also takes widths off the kernel's vectors:
    L = 70 leaves 6 latent columns past its 16-wide stripes, D = 90 two values past 8-wide ones."""
    if cache_dtype == "fp8_ds_mla":
        return small_config(num_heads=H, L=128, R=16)
    return small_config(num_heads=H, L=64, R=16) if aligned else small_config(num_heads=H, L=70, R=20)


@pytest.fixture
def reg_units():
    """The count of native units decode_reg.h ran so far (a callable), or None in builds without
    that path (AVX-512 ones keep the key buffer; no AVX2 + F16C): the scenarios still run there."""
    ops = hooks()
    return ops.reg_dequant_units if ops.set_reg_dequant(True) else None


def ran_reg(reg_units, before: int | None) -> bool:
    return reg_units is not None and reg_units() > before


def check_fp8_decode(case: Case, q_abs: torch.Tensor, reg_units, **kw):
    """Decode against the reference on the same stored bytes; where the build has the register
    path and the products are float32, it must be the path that ran."""
    from openmla.backends.cpu import kernels

    before = reg_units() if reg_units else None
    out, lse = check_decode(case, q_abs, **kw)
    if reg_units is not None and kernels.compute_dtype(q_abs.dtype) == torch.float32 and "sparse_indices" not in kw:
        assert ran_reg(reg_units, before), "the register-dequantising decode did not run"
    return out, lse


@pytest.mark.parametrize("cache_dtype", FP8_FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("H", [1, 3, 16])
def test_fp8_decode_ragged(reg_units, cache_dtype, dtype, page_size, H):
    """Ragged batches (0, 1 and longer caches; 0 to 3 new tokens) with NaN in free pages and page
    tails, default and forced split-KV, sinks, against the reference reading the same fp8 bytes."""
    case = make_case([0, 1, 37, 300, 4], [1, 2, 1, 3, 0], config=fp8_config(cache_dtype, H, aligned=H != 3),
                     page_size=page_size, dtype=dtype, cache_dtype=cache_dtype, kv_scale=0.4, spare_pages=3)
    poison_unused_rows(case)
    q_abs = random_q_abs(case)
    check_fp8_decode(case, q_abs, reg_units)
    check_fp8_decode(case, q_abs, reg_units, num_partitions=3, attn_sink=torch.linspace(-1, 1, H))


@pytest.mark.parametrize("cache_dtype", FP8_FORMATS)
@pytest.mark.parametrize("mask,extra", MASK_CASES, ids=[m for m, _ in MASK_CASES])
def test_fp8_decode_masks_multi_token(reg_units, cache_dtype, mask, extra):
    """Several query tokens per sequence see different key ranges of one block (per-row columns)."""
    case = make_case([0, 5, 70, 129], [3, 6, 1, 4], config=fp8_config(cache_dtype, 4, aligned=False), page_size=16,
                     dtype=torch.float32, cache_dtype=cache_dtype, kv_scale=2.5)
    poison_unused_rows(case)
    check_fp8_decode(case, random_q_abs(case), reg_units, mask=mask, **extra)


@pytest.mark.parametrize("cache_dtype", FP8_FORMATS)
@pytest.mark.parametrize("H,new", [(128, [1, 1]), (200, [2, 1]), (40, [5, 3])])
def test_fp8_decode_many_query_rows(reg_units, cache_dtype, H, new):
    """Units of up to 128 query rows (tokens x heads), heads split across units above that:
    every score column chunk and P x V row group size of the register tiles."""
    case = make_case([517, 64], new, config=fp8_config(cache_dtype, H), page_size=64, dtype=torch.float32,
                     cache_dtype=cache_dtype, kv_scale=0.7)
    poison_unused_rows(case)
    check_fp8_decode(case, random_q_abs(case), reg_units)


@pytest.mark.parametrize("cache_dtype", FP8_FORMATS)
def test_fp8_register_path_matches_widened_path(reg_units, cache_dtype):
    """The register path and the key buffer (switched by the test hook) on one long sequence,
    split across threads: both within float32 tolerance of the reference and of each other."""
    if reg_units is None:
        pytest.skip("this build has no register-dequantising decode (AVX-512, or no AVX2 + F16C)")
    ops = hooks()
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        case = make_case([3000, 1], [1, 1], config=fp8_config(cache_dtype, 8), page_size=64, dtype=torch.float32,
                         cache_dtype=cache_dtype, kv_scale=0.05)
        poison_unused_rows(case)
        q_abs = random_q_abs(case)
        reg, reg_lse = check_fp8_decode(case, q_abs, reg_units)
        ops.set_reg_dequant(False)
        before = reg_units()
        wide, wide_lse = check_decode(case, q_abs)
        assert reg_units() == before
        assert_close(reg, wide, 1e-5, "register vs widened", case.seed)
    finally:
        ops.set_reg_dequant(True)
        torch.set_num_threads(saved)


def test_fp8_values_cover_every_byte(reg_units):
    """Every finite e4m3 byte (subnormals, both signs, the +-448 ends) as a key and value entry:
    the register conversion against the reference's float64 reading of the same bytes."""
    case = make_case([255], [1], config=small_config(num_heads=8, L=64, R=16), page_size=16, dtype=torch.float32,
                     cache_dtype="fp8_e4m3", kv_scale=0.01)
    b = case.batch
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)  # 254 finite bytes
    rows = ref.physical_rows(b, 0, torch.arange(256))
    g = torch.Generator().manual_seed(case.seed)
    stored = codes[torch.randint(0, codes.numel(), (256, 80), generator=g)]
    stored[:, :64] = codes.repeat(256 * 64 // codes.numel() + 1)[: 256 * 64].view(256, 64)  # every code in every column group
    b.blocks[case.layer_idx].view(-1, 80)[rows] = stored.view(torch.float8_e4m3fn)
    check_fp8_decode(case, random_q_abs(case), reg_units)


@pytest.mark.parametrize("cache_dtype", FP8_FORMATS)
@pytest.mark.parametrize("part", ["latent", "tail"])  # tail: a rope value (fp8_e4m3), a group scale (fp8_ds_mla)
def test_fp8_nan_in_a_visible_key_reaches_the_output(reg_units, cache_dtype, part):
    """A NaN byte in a key the query sees is NaN in the output, as in the reference (the
    register path reads NaN bytes as NaN, not as the 480 of the bit trick)."""
    case = make_case([40, 9], [1, 1], config=fp8_config(cache_dtype, 2), page_size=16, dtype=torch.float32,
                     cache_dtype=cache_dtype)
    b = case.batch
    raw = b.blocks.view(torch.uint8)[case.layer_idx].view(b.num_pages * b.page_size, -1)
    L = case.config.kv_lora_rank
    cols = [3] if part == "latent" else [L + 5] if cache_dtype == "fp8_e4m3" else [L, L + 1, L + 2, L + 3]
    raw[ref.physical_rows(b, 0, torch.tensor([7]))[:, None], torch.tensor(cols)] = 0xFF
    q_abs = random_q_abs(case)
    before = reg_units() if reg_units else None
    out = openmla.flare_mla_decode(q_abs, b, case.layer_idx, scale=case.scale, kv_lora_rank=L, backend="cpu")
    want = openmla.flare_mla_decode(q_abs, b, case.layer_idx, scale=case.scale, kv_lora_rank=L, backend="reference")
    assert reg_units is None or ran_reg(reg_units, before)
    assert torch.isnan(want[0]).all() and torch.isnan(out[0]).all(), f"seed {case.seed}"
    assert_close(out[1], want[1], TOL[torch.float32], "the other sequence", case.seed)


# CPUs without bf16 brgemm -------------------------------------------------------------------------
def test_bf16_computes_in_float32_without_bf16_brgemm(monkeypatch):
    from openmla.backends.cpu import kernels

    monkeypatch.setattr(kernels, "_bf16_gemm", [False])
    monkeypatch.setattr(kernels, "_COMPUTE", {})  # compute_dtype's answers, kept per process
    assert kernels.compute_dtype(torch.bfloat16) == torch.float32
    case = make_case([0, 37, 80], [3, 1, 12], config=small_config(num_heads=3), page_size=16, dtype=torch.bfloat16)
    check_decode(case, random_q_abs(case), mask="sliding_window_noncausal", window_size=9)
    written(case)
    check_prefill(case, mask="causal", buffer_size=32)


NON_AMX_SCRIPT = textwrap.dedent("""
    import torch, openmla
    from openmla_tools.testing import make_case, small_config, rel_err
    for new in ([9, 2], [1, 3]):  # the prefill form, then the decode form
        case = make_case([0, 130], new, config=small_config(8, 512, 64, 128, 128), page_size=64, dtype=torch.bfloat16)
        got = openmla.mla_prefill_decode_graph(*case.clone_cache().fused_args(), scale=case.scale, backend="cpu")
        want = openmla.mla_prefill_decode_graph(*case.clone_cache().fused_args(), scale=case.scale, backend="reference")
        print(rel_err(got, want))
""")

@pytest.mark.parametrize("isa", ["AVX512_CORE_BF16", "AVX2"])
def test_non_amx_isa(isa):
    """oneDNN limited to an older ISA (Zen 4 has AVX512_CORE_BF16; AVX2 has no bf16 brgemm at
    all, so bf16 computes in float32): the fused op still matches the reference."""
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA=isa)
    res = subprocess.run([sys.executable, "-c", NON_AMX_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    errors = [float(x) for x in res.stdout.split()]
    assert len(errors) == 2 and max(errors) < 2e-2, res.stdout


# Commands ---------------------------------------------------------------------------------------
def test_build_and_check_commands(capsys):
    from openmla_tools.cli import main

    assert main(["build"]) == 0
    assert main(["check", "--backend", "cpu", "--seed", "7"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "native CPU kernels ready" in out and "all checks passed" in out and "own AMX tile kernel for bf16 decode:" in out
