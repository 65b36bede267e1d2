"""On a CUDA GPU: does the compile report (``openmla compile-report``) describe the
kernels a real launch compiles?

    python bench/gpu_report_check.py [--out DIR] [--select ci|all]

The report's launches are recorded on CUDA tensors; each one is compiled twice: by the report
(``specialize`` + ``compile_many``, for this GPU's target: sm_90 on H100/H200, sm_100 on B200) and
by Triton's runtime (``kernel.run(..., warmup=True)``: the launch path, compiled and loaded, not
run). Registers, local memory (the driver's ``n_spills`` is local bytes / 4; ptxas's stack frame)
and shared memory must agree. Writes ``gpu_report_check.json``; exit status 1 on a mismatch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402

from openmla_tools.compile_report.compile import Task, compile_many  # noqa: E402
from openmla_tools.compile_report.launches import all_cases, record  # noqa: E402
from openmla_tools.compile_report.report import labels  # noqa: E402
from openmla_tools.compile_report.select import SUBSETS, Heaviest, matches  # noqa: E402
from openmla_tools.compile_report.specialize import specialize  # noqa: E402
from openmla_tools.compile_report.targets import TARGETS  # noqa: E402

TARGET_OF_CAPABILITY = {(9, 0): "sm_90", (10, 0): "sm_100"}
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def real_launch(launch) -> dict:
    """What the runtime compiled for this launch, read from the loaded kernel."""
    kernel = launch.kernel.run(*launch.args, grid=(1,), warmup=True, **launch.kwargs)
    kernel._init_handles()
    return {"regs": kernel.n_regs, "stack": kernel.n_spills * 4, "smem": kernel.metadata.shared}


def selected(target: str, select: list[dict] | Heaviest | None) -> list:
    """The report's launches on CUDA tensors, one per distinct binary, that ``select`` keeps (selectors, or a rule
    applied to all of them)."""
    found, seen = [], set()
    for case in all_cases(DTYPES):
        for launch in record(case, "nvidia", device="cuda"):
            spec = specialize(launch, TARGETS[target])
            key = spec.key(launch.name)
            if key not in seen:
                seen.add(key)
                found.append((launch, spec, {"kernel": launch.name, "target": target, **labels(launch, spec)}))
    if isinstance(select, Heaviest):
        chosen = select.choose([row for _, _, row in found])
        return [(launch, spec) for launch, spec, row in found if (row["target"], row["id"]) in chosen]
    return [(launch, spec) for launch, spec, row in found if select is None or matches(row, select)]


def compare(target: str, select: list[dict] | None, jobs: int) -> list[dict]:
    """Report rows (compiled on ``jobs`` processes) next to what the runtime compiled."""
    chosen = selected(target, select)
    tasks = [Task(launch.kernel.fn.__module__, launch.name, target, spec, labels(launch, spec)) for launch, spec in chosen]
    rows = []
    for (launch, _), report in zip(chosen, compile_many(tasks, jobs)):
        try:
            real = real_launch(launch)
        except Exception as exc:  # recorded; the other launches still run
            real = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
        same = "error" not in report and "error" not in real and all(report[k] == real[k] for k in real)
        rows.append({**report, "launch": real, "match": same})
        print(json.dumps({k: rows[-1].get(k) for k in ("kernel", "dtype", "cache", "variant", "regs", "stack", "smem", "launch",
                                                     "match")}), flush=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "bench" / "out"))
    p.add_argument("--select", default="ci", help="a subset of the report's rows (ci), or all")
    p.add_argument("--jobs", type=int, default=min(8, len(os.sched_getaffinity(0))), help="processes for the report's compiles")
    a = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_report_check: no CUDA device")
    cap = torch.cuda.get_device_capability()
    target = TARGET_OF_CAPABILITY.get(cap)
    result = {"device": torch.cuda.get_device_name(), "capability": list(cap), "target": target, "rows": []}
    if target is None:
        result["skipped"] = f"no report target for compute capability {cap}"
    else:
        start = time.perf_counter()
        result["rows"] = compare(target, None if a.select == "all" else SUBSETS[a.select], a.jobs)
        result["elapsed_s"] = round(time.perf_counter() - start, 1)
    result["mismatches"] = sum(not r["match"] for r in result["rows"])
    out = Path(a.out) / "gpu_report_check.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str))
    print(f"{len(result['rows'])} launches compared, {result['mismatches']} mismatches -> {out}")
    return 1 if result["mismatches"] else 0


if __name__ == "__main__":
    sys.exit(main())
