"""The compile report: every recorded launch, specialised as launched, compiled for each target.

``build`` returns one dict (JSON-ready): the rows (one per distinct binary per target), which
kernels the backend defines and which the launches reached, and the failures ``check`` finds.
"""

from __future__ import annotations

from typing import Callable

from .check import failures
from .compile import Task, compile_many
from .launches import Case, Launch, jit_kernels, record
from .select import matches
from .specialize import Specialization, specialize
from .targets import TARGETS

_CODES = {
    "MASK": ("mask", {0: "causal", 1: "null", 2: "sliding_causal", 3: "sliding_noncausal", 4: "chunked_causal"}),
    "SPARSE": ("sparse", {0: "dense", 1: "physical", 2: "logical"}),
    "COMP": ("compressed", {0: "none", 1: "rule", 2: "indices"}),
}
_SHOWN = ("HAS_TOPK", "BLOCK_H", "BLOCK_N", "BLOCK_M", "DOT_T", "HAS_SINK", "SINK_PER_SEQ")


def labels(launch: Launch, spec: Specialization) -> dict:
    """Row labels: query dtype, cache format, mask and sparse mode (where the kernel has them) and
    a variant string of the other constexprs that tell its specialisations apart."""
    names = launch.kernel.arg_names
    consts = {names[path[0]]: value for path, value in spec.constexprs.items()}
    out = {"dtype": launch.case.dtype_name, "cache": launch.case.cache_format}
    for key, (label, codes) in _CODES.items():
        if key in consts:
            out[label] = codes[consts[key]]
    shown = [f"{k}={getattr(consts[k], 'name', consts[k])}" for k in _SHOWN if k in consts]
    if "out_ptr" in spec.signature:
        shown.append(f"out={spec.signature['out_ptr'].lstrip('*')}")
    out["variant"] = " ".join(shown)
    return out


def tasks_for(cases: list[Case], targets: list[str], hints: bool, select: list[dict] | None = None
              ) -> tuple[list[Task], set[str]]:
    """One task per distinct binary per target (of the rows ``select`` keeps), and the kernel
    names the launches reached."""
    tasks, seen, reached = [], set(), set()
    for case in cases:
        for name in targets:
            for launch in record(case, TARGETS[name].gpu_kind):
                reached.add(launch.name)
                spec = specialize(launch, TARGETS[name], hints)
                key = (name, spec.key(launch.name))
                row_labels = labels(launch, spec)
                if key in seen or (select is not None and not matches({"kernel": launch.name, "target": name, **row_labels}, select)):
                    continue
                seen.add(key)
                tasks.append(Task(launch.kernel.fn.__module__, launch.name, name, spec, row_labels))
    return tasks, reached


def build(cases: list[Case], targets: list[str], hints: bool = True, jobs: int = 1, select: list[dict] | None = None,
          on_row: Callable[[dict], None] = lambda row: None) -> dict:
    """The report; ``on_row`` sees each row as it is compiled."""
    tasks, reached = tasks_for(cases, targets, hints, select)
    rows = []
    for row in compile_many(tasks, jobs):
        rows.append(row)
        on_row(row)
    return {"targets": {n: TARGETS[n].devices for n in targets}, "launch_hints": hints, "rows": rows,
            "kernels_defined": sorted(jit_kernels()), "kernels_reached": sorted(reached),
            "kernels_compiled": sorted({r["kernel"] for r in rows}), "failures": failures(rows)}
