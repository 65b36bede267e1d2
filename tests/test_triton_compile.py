"""The Triton kernels compiled, without a GPU, for Hopper (sm_90), Blackwell (sm_100) and MI300X
(gfx942) as a real launch specialises them: ``python -m openmla.backends.triton.aot --select ci``
(the heaviest variant of every kernel; the full report is the same command without ``--select``,
about 15 minutes on 2 cores). No kernel may spill or need more shared memory (LDS) than a block
may have on any target, and every ``@triton.jit`` kernel of the backend must be compiled: a kernel
added later fails here until the report launches it. Runs in a subprocess (the pytest process
has TRITON_INTERPRET=1); about a minute of CPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install 'openmla[triton]')")

import openmla  # noqa: E402
from openmla.backends.triton.aot.targets import TARGETS, AmdLimits, NvidiaLimits  # noqa: E402


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("aot") / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(Path(openmla.__file__).resolve().parents[1]) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-W", "ignore", "-m", "openmla.backends.triton.aot", "--select", "ci", "--no-roofline",
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
