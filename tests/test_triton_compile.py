"""The Triton kernels compiled, without a GPU, for Hopper (sm_90), Blackwell (sm_100) and MI300X
(gfx942) as a real launch specialises them: ``openmla compile-report --select ci``
(chosen by rule, ``openmla_tools/compile_report/select.py``, from the committed summary of the full report,
docs/triton_compile_report.json: per kernel, target and dot width the variant closest to
spilling and the one with the most shared memory, plus any binary never measured; the full
report is the same command without ``--select``). No kernel may spill or
need more shared memory (LDS) than a block may have on any target, every ``@triton.jit`` kernel
of the backend must be compiled (a kernel added later fails here until the report launches it),
and the subset must hold the heaviest rows of the full report. Runs in a subprocess (the pytest
process has TRITON_INTERPRET=1); 36 binaries, about 75 s of CPU (2 cores)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install 'openmla[triton]')")

import openmla  # noqa: E402
import torch  # noqa: E402
from openmla_tools.compile_report.select import Heaviest, dot_width  # noqa: E402
from openmla_tools.compile_report.summary import heaviest, register_pressure  # noqa: E402
from openmla_tools.compile_report.targets import TARGETS, AmdLimits, NvidiaLimits  # noqa: E402

SUMMARY = Path(__file__).resolve().parents[1] / "docs" / "triton_compile_report.json"
REGENERATE = "openmla compile-report --summary docs/triton_compile_report.json"


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("aot") / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(Path(openmla.__file__).resolve().parents[1]) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-W", "ignore", "-m", "openmla_tools.compile_report", "--select", "ci", "--no-roofline",
           "--jobs", "2", "--json", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if not out.exists():
        pytest.fail(f"the compile report wrote nothing (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def test_no_kernel_spills_or_overflows_shared_memory(report):
    assert not report["failures"], "\n".join(report["failures"])


def test_every_kernel_compiled_for_every_target(report):
    defined = set(report["kernels_defined"])
    assert {"_cache_write_kernel", "_decode_split_kernel", "_flare_prefill_kernel", "_merge_kernel"} <= defined
    assert set(report["kernels_reached"]) == defined, "kernels the report never launches"
    for target in TARGETS:
        compiled = {r["kernel"] for r in report["rows"] if r["target"] == target}
        assert compiled == defined, f"{target}: not compiled: {sorted(defined - compiled)}"


@pytest.fixture(scope="module")
def full() -> dict:
    """The committed summary of the full report (every variant, every target)."""
    return json.loads(SUMMARY.read_text())


def test_full_report_describes_todays_launches(report, full):
    """The committed full report has one row for each binary the launches make now (kernel bodies
    aside: a changed tile, mask or launch changes the set). Stale: regenerate it."""
    have = {(r["target"], r["id"]) for r in full["rows"]}
    now = {(c["target"], c["id"]) for c in report["candidates"]}
    assert have == now, f"{len(now - have)} binaries not in {SUMMARY.name}, {len(have - now)} gone: run {REGENERATE}"


def test_full_report_passes(full):
    """The full report's own verdict: nothing spills, overflows shared memory or fails, anywhere."""
    assert {r["target"] for r in full["rows"]} == set(TARGETS)
    assert not full["failures"], "\n".join(full["failures"])


def test_ci_subset_holds_the_worst_rows_of_the_full_report(report, full):
    """The CI subset compiles, for every target, the full report's worst row (closest to spilling:
    spilled bytes, then registers); for every kernel, target and dot width the row closest to
    spilling; for every kernel and target a row with the most shared memory. It stays a small
    part of the report."""
    ci = {(r["target"], r["id"]) for r in report["rows"]}
    rows = full["rows"]
    assert len(ci) < len(rows) / 4, "the CI subset is meant to be small"
    for target in TARGETS:
        worst = max((r for r in rows if r["target"] == target), key=register_pressure)
        assert any(register_pressure(r) == register_pressure(worst) for r in rows if (target, r["id"]) in ci), \
            f"{target}: the worst row (or one as heavy) is not compiled: {worst}"
    for target, kernel in heaviest(rows):
        group = [r for r in rows if (r["target"], r["kernel"]) == (target, kernel)]
        mine = [r for r in group if (target, r["id"]) in ci]
        assert max(r["smem"] for r in mine) == max(r["smem"] for r in group), (target, kernel)
        for width in {dot_width(r) for r in group}:
            assert max(register_pressure(r) for r in mine if dot_width(r) == width) == \
                max(register_pressure(r) for r in group if dot_width(r) == width), (target, kernel, width)


def test_rule_takes_the_heaviest_per_dot_width_and_every_unmeasured_binary():
    """Per kernel, target and dot width (float32 apart from half: a float32 variant is never
    outweighed by a half-precision one) the row closest to spilling; per kernel and target a row
    with the most shared memory (one already chosen if it has as much); a binary the summary does
    not have (never measured) is always compiled."""
    def row(i, dot, regs, smem, spilled=0):
        return {"target": "sm_90", "kernel": "k", "id": i, "variant": f"BLOCK_N=16 DOT_T={dot}", "regs": regs,
                "stack": 0, "spill_stores": spilled, "spill_loads": 0, "smem": smem}

    measured = [row("a", "bf16", 200, 10), row("b", "fp16", 100, 90), row("c", "fp32", 50, 5),
                row("d", "fp32", 40, 8, spilled=4), row("e", "bf16", 150, 50)]
    cands = [{"target": "sm_90", "id": i} for i in "abcdefg"]
    assert Heaviest(measured).choose(cands) == {("sm_90", i) for i in "abdfg"}
    measured[1]["smem"] = measured[4]["smem"] = 8  # now a, chosen for its registers, has the most shared memory
    assert Heaviest(measured).choose(cands) == {("sm_90", i) for i in "adfg"}


def test_amd_occupancy_matches_llvm(report):
    """Where LDS does not limit, the waves per SIMD computed from the published limits equal the
    occupancy LLVM prints for the kernel (registers only)."""
    rows = [r for r in report["rows"] if r["target"] == "gfx942" and "error" not in r and r["limiter"] != "LDS"]
    assert rows
    for r in rows:
        assert r["waves_per_simd"] == r["llvm_occupancy"], r


def test_nvidia_occupancy_from_published_limits():
    """cuda_occupancy.h's arithmetic: 4 register sub-partitions, 256-register warp units."""
    h100 = NvidiaLimits()
    assert h100.occupancy(212, 56448, 4) == {"blocks_per_sm": 2, "warps_per_sm": 8, "occupancy": 0.125, "limiter": "registers"}
    assert h100.occupancy(32, 0, 4)["occupancy"] == 1.0
    assert h100.occupancy(64, 120 * 1024, 4)["limiter"] == "shared memory"
    assert not h100.smem_ok(227 * 1024 + 1) and h100.smem_ok(227 * 1024)


def test_amd_occupancy_from_published_limits():
    mi300 = AmdLimits()
    assert mi300.occupancy(249, 106, 0, 4)["waves_per_simd"] == 2  # LLVM prints "Occupancy: 2" for this kernel
    assert mi300.occupancy(26, 48, 0, 4)["waves_per_simd"] == 8
    assert mi300.occupancy(64, 48, 36864, 4) == {"waves_per_simd": 1, "occupancy": 0.125, "limiter": "LDS"}
    assert not mi300.smem_ok(64 * 1024 + 1)


def test_launcher_reads_the_tile_tables(monkeypatch):
    """What the report compiles is what runs: the launch code takes its tiles from the same tables
    on each GPU kind (float64 queries compute on the float32 tiles)."""
    from openmla.backends.triton import _common
    from openmla.backends.triton.decode import DECODE_TILES_F32, decode_config
    from openmla.backends.triton.shared_kv import SHARED_KV_TILES, shared_kv_config

    keys = ("BLOCK_H", "BLOCK_N", "num_warps", "num_stages")
    dev = torch.device("cpu")
    for gpu in ("nvidia", "amd"):
        monkeypatch.setattr(_common, "gpu_kind", lambda device, gpu=gpu: gpu)
        for dtype in (torch.float32, torch.float64):
            for fmt, tiles in DECODE_TILES_F32[gpu].items():
                assert decode_config(dtype, dev, 16, fmt) == dict(zip(keys, tiles))
            assert shared_kv_config(dtype, dev, 16) == dict(zip(keys, SHARED_KV_TILES[gpu]["float32"]))
