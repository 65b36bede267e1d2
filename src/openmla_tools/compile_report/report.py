"""The compile report: every recorded launch, specialised as launched, compiled for each target.

``build`` returns one dict (JSON-ready): the rows (one per distinct binary per target), which
kernels the backend defines and which the launches reached, and the failures ``check`` finds.
"""

from __future__ import annotations

import hashlib
from typing import Callable

from .check import failures
from .compile import Task, compile_many
from .launches import Case, Launch, jit_kernels, record
from .select import Heaviest, matches
from .specialize import Specialization, specialize
from .targets import TARGETS

_CODES = {
    "MASK": ("mask", {0: "causal", 1: "null", 2: "sliding_causal", 3: "sliding_noncausal", 4: "chunked_causal"}),
    "SPARSE": ("sparse", {0: "dense", 1: "physical", 2: "logical"}),
    "COMP": ("compressed", {0: "none", 1: "rule", 2: "indices"}),
}
_SHOWN = ("HAS_TOPK", "BLOCK_H", "BLOCK_N", "BLOCK_M", "DOT_T", "HAS_SINK", "SINK_PER_SEQ")


def labels(launch: Launch, spec: Specialization) -> dict:
    """Row labels: query dtype, cache format, mask and sparse mode (where the kernel has them), a
    variant string of the other constexprs that tell its specialisations apart, and ``id``: the
    binary's identity (a hash of ``spec.key``; with the target, one row of the report)."""
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
    out["id"] = hashlib.sha1(spec.key(launch.name).encode()).hexdigest()[:12]
    return out


def candidates(cases: list[Case], targets: list[str], hints: bool) -> list[dict]:
    """Every distinct binary per target the launches make, once: its labels and its ``Task``."""
    out, seen = [], set()
    for case in cases:
        for name in targets:
            target = TARGETS[name]
            for launch in record(case, target.gpu_kind):
                spec = specialize(launch, target, hints)
                key = (name, spec.key(launch.name))
                if key in seen:
                    continue
                seen.add(key)
                row_labels = labels(launch, spec)
                out.append({"kernel": launch.name, "target": name, **row_labels,
                            "task": Task(launch.kernel.fn.__module__, launch.name, name, spec, row_labels)})
    return out


def tasks_for(cases: list[Case], targets: list[str], hints: bool, select: list[dict] | Heaviest | None = None
              ) -> tuple[list[Task], set[str], list[dict]]:
    """One task per distinct binary per target (of the rows ``select`` keeps: selectors, or a
    rule applied to these candidates), the kernel names the launches reached, and every
    candidate's labels."""
    cands = candidates(cases, targets, hints)
    reached = {c["kernel"] for c in cands}
    if isinstance(select, Heaviest):
        chosen = select.choose(cands)
        keep = [c for c in cands if (c["target"], c["id"]) in chosen]
    else:
        keep = [c for c in cands if select is None or matches(c, select)]
    return [c["task"] for c in keep], reached, [{k: v for k, v in c.items() if k != "task"} for c in cands]


def build(cases: list[Case], targets: list[str], hints: bool = True, jobs: int = 1,
          select: list[dict] | Heaviest | None = None,
          on_row: Callable[[dict], None] = lambda row: None) -> dict:
    """The report; ``on_row`` sees each row as it is compiled."""
    tasks, reached, cands = tasks_for(cases, targets, hints, select)
    rows = []
    for row in compile_many(tasks, jobs):
        rows.append(row)
        on_row(row)
    return {"targets": {n: TARGETS[n].devices for n in targets}, "launch_hints": hints, "rows": rows,
            "kernels_defined": sorted(jit_kernels()), "kernels_reached": sorted(reached),
            "kernels_compiled": sorted({r["kernel"] for r in rows}), "failures": failures(rows),
            "candidates": cands}
