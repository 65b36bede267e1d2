"""``openmla compile-report`` (or ``python -m openmla_tools.compile_report``): print the compile
report (and the static roofline), optionally write it as JSON or merge it into the committed
summary; exit status 1 when a kernel fails to compile, spills or overflows shared memory on a
target, or is never launched.

Only the arguments' names come from modules that need no triton (``targets``, ``select``,
``openmla.fp8``), so ``openmla --help`` works without it; ``run`` imports the compiler side."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from openmla.fp8 import CACHE_FORMATS

from .select import SUBSETS
from .targets import TARGETS

DTYPES = "bfloat16,float16,float32"  # query (and native cache) dtypes, by default all
DESCRIPTION = "compile every Triton kernel launch for sm_90, sm_100 and gfx942 (no GPU needed): registers, spills, shared memory"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--targets", default=",".join(TARGETS), help=f"comma-separated, of {', '.join(TARGETS)}")
    p.add_argument("--dtypes", default=DTYPES, help="query (and native cache) dtypes")
    p.add_argument("--cache-formats", default=",".join(CACHE_FORMATS))
    p.add_argument("--select", choices=sorted(SUBSETS), help="compile only a named subset of the variants")
    p.add_argument("--no-launch-hints", action="store_true", help="compile without a launch's specialisation (the old report)")
    p.add_argument("--jobs", type=int, default=len(os.sched_getaffinity(0)), help="compile processes")
    p.add_argument("--json", help="write the report (and the roofline) to this file")
    p.add_argument("--no-roofline", action="store_true")
    p.add_argument("--summary", help="merge the full report's rows into this committed summary (docs/triton_compile_report.json)")


def argument_error(a: argparse.Namespace) -> str | None:
    """Why ``a`` is not a valid combination (None when it is)."""
    if a.summary and (a.select or a.no_launch_hints or a.dtypes != DTYPES
                      or a.cache_formats != ",".join(CACHE_FORMATS)):
        return "--summary takes the full report: no --select, --no-launch-hints, --dtypes or --cache-formats"
    return None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m openmla_tools.compile_report", description=DESCRIPTION)
    add_arguments(p)
    a = p.parse_args(argv)
    why = argument_error(a)
    if why:
        p.error(why)
    return a


def _resources(r: dict) -> str:
    if "error" in r:
        return "ERROR " + r["error"].splitlines()[0][:160]
    if "vgprs" in r:
        regs = f"vgpr={r['vgprs']:3d} agpr={r['agprs']:3d} sgpr={r['sgprs']:3d} spill v/s={r['vgpr_spills']}/{r['sgpr_spills']} " \
               f"scratch={r['scratch']}"
        occ = f"waves/SIMD={r['waves_per_simd']} (llvm {r['llvm_occupancy']})"
    else:
        regs = f"regs={r['regs']:3d} stack={r['stack']:4d} spill st/ld={r['spill_stores']}/{r['spill_loads']}"
        occ = f"blocks/SM={r['blocks_per_sm']}"
    return f"{regs} smem={r['smem']:6d} {occ} occ={r['occupancy']:.0%} ({r['limiter']})"


def print_row(r: dict) -> None:
    where = f"{r['target']:7s} {r['kernel']:28s} {r['dtype']:9s} {r['cache']:10s} {r.get('mask', '-'):17s} {r.get('sparse', '-'):8s}"
    launch = f"w={r.get('num_warps', '-')} s={r.get('num_stages', '-')}"
    print(f"{where} {r['variant']:52s} {launch:8s} {_resources(r)}  [{r['compile_s']:.1f} s]", flush=True)


def run(a: argparse.Namespace) -> int:
    """The report for parsed (and checked: ``argument_error``) arguments; the exit status."""
    from openmla.backends.triton import _common

    if _common.INTERPRET:
        sys.exit("the compile report compiles real kernels: unset TRITON_INTERPRET")
    import torch

    from . import roofline, summary
    from .launches import all_cases
    from .report import build

    targets = a.targets.split(",")
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        sys.exit(f"--targets: unknown {unknown}; choose from {list(TARGETS)}")
    cases = all_cases(tuple(getattr(torch, d) for d in a.dtypes.split(",")), tuple(a.cache_formats.split(",")))
    start = time.perf_counter()
    report = build(cases, targets, hints=not a.no_launch_hints, jobs=a.jobs, select=SUBSETS.get(a.select), on_row=print_row)
    report["elapsed_s"] = round(time.perf_counter() - start, 1)
    missing = sorted(set(report["kernels_defined"]) - set(report["kernels_reached"]))
    print(f"{len(report['rows'])} binaries for {', '.join(targets)} in {report['elapsed_s']} s; "
          f"kernels never launched here: {missing or 'none'}; {len(report['failures'])} failures")
    for line in report["failures"]:
        print("FAIL", line)
    if not a.no_roofline:
        report["roofline"] = roofline.table()
        roofline.print_table(report["roofline"])
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    if a.summary:
        summary.merge(report, a.summary)
    return 1 if report["failures"] or missing else 0


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))
