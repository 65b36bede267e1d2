"""The committed summary of the full report (``docs/triton_compile_report.json``): one line per
row, what it needs from the target, and how long each target took.

``openmla compile-report --summary docs/triton_compile_report.json`` writes it
(``--targets`` one at a time merges: rows of the targets compiled replace that file's rows of
those targets), and the table of the heaviest rows in the Markdown file of the same name. The CI
subset is chosen from it (``select.Heaviest``); ``tests/test_triton_compile.py`` checks that it
still describes the launches the report makes (the binaries' ids) and that the subset holds
every kernel's and target's heaviest rows (``heaviest``).
"""

from __future__ import annotations

import json
from pathlib import Path

from .targets import TARGETS

FIELDS = ("target", "kernel", "id", "dtype", "cache", "mask", "sparse", "compressed", "variant", "num_warps",
          "num_stages", "regs", "stack", "spill_stores", "spill_loads", "vgprs", "agprs", "sgprs", "vgpr_spills",
          "sgpr_spills", "scratch", "smem", "occupancy", "compile_s", "error")


def compact(row: dict) -> dict:
    return {k: row[k] for k in FIELDS if k in row}


def merge(report: dict, path: str | Path) -> dict:
    """``report``'s rows (a full report's, for its targets) into the summary at ``path``."""
    path = Path(path)
    old = json.loads(path.read_text()) if path.exists() else {"rows": [], "elapsed_s": {}}
    targets = set(report["targets"])
    rows = [r for r in old["rows"] if r["target"] not in targets] + [compact(r) for r in report["rows"]]
    rows.sort(key=lambda r: (list(TARGETS).index(r["target"]), r["kernel"], r["dtype"], r["cache"], r["id"]))
    elapsed = {t: s for t, s in old.get("elapsed_s", {}).items() if t not in targets}
    key = ",".join(report["targets"])
    elapsed[key] = report["elapsed_s"]
    out = {"command": "openmla compile-report --summary PATH [--targets T]",
           "elapsed_s": elapsed, "failures": sorted({*[f for f in old.get("failures", []) if f.split()[0] not in targets],
                                                     *report["failures"]}),
           "rows": rows}
    with open(path, "w") as f:
        f.write(_dump(out))
    write_table(out, path.with_suffix(".md"))
    return out


def _dump(summary: dict) -> str:
    """JSON with one row per line (diffs stay readable)."""
    head = {k: v for k, v in summary.items() if k != "rows"}
    body = ",\n".join("  " + json.dumps(r) for r in summary["rows"])
    return json.dumps(head, indent=1)[:-2] + ',\n "rows": [\n' + body + "\n ]\n}\n"


def register_pressure(row: dict, unit: int = 1) -> tuple:
    """How close a row is to spilling: spilled bytes first, then registers (NVIDIA: per thread;
    AMD: VGPRs, arch + acc), rounded up to ``unit`` (8: the allocation unit of both, a warp's 256
    registers on NVIDIA, gfx942's VGPR granule: rows within one unit cost the same)."""
    if "error" in row:
        return (float("inf"), 0)
    if "vgprs" in row:
        return (row["scratch"] + 4 * row["vgpr_spills"], -(-row["vgprs"] // unit) * unit)
    return (row["spill_stores"] + row["spill_loads"], -(-row["regs"] // unit) * unit)


def heaviest(rows: list[dict]) -> dict[tuple[str, str], dict[str, tuple]]:
    """Per (target, kernel): the highest ``register_pressure`` and the most shared memory (LDS)
    any of ``rows`` shows."""
    out: dict[tuple[str, str], dict[str, tuple]] = {}
    for r in rows:
        worst = out.setdefault((r["target"], r["kernel"]), {"registers": (), "shared memory": ()})
        worst["registers"] = max(worst["registers"], register_pressure(r))
        worst["shared memory"] = max(worst["shared memory"], (r.get("smem", 0),))
    return out


BEGIN, END = "<!-- heaviest rows: written by --summary -->", "<!-- end of heaviest rows -->"


def _resources(r: dict) -> str:
    if "error" in r:
        return "compile error"
    if "vgprs" in r:
        return f"{r['vgprs']} VGPRs ({r['agprs']} acc), {r['sgprs']} SGPRs, scratch {r['scratch']}"
    return f"{r['regs']} regs, stack {r['stack']}, spills {r['spill_stores']}/{r['spill_loads']}"


def table(summary: dict) -> str:
    """Markdown: per target and kernel, the row closest to spilling and the most shared memory."""
    rows = summary["rows"]
    out = ["| target | kernel | closest to spilling | its variant | most shared memory (bytes) |", "|---|---|---|---|---|"]
    for (target, kernel), worst in heaviest(rows).items():
        r = next(r for r in rows if r["target"] == target and r["kernel"] == kernel and register_pressure(r) == worst["registers"])
        where = " ".join(str(r[k]) for k in ("dtype", "cache", "mask", "sparse", "compressed") if r.get(k) not in (None, "-"))
        out.append(f"| {target} | `{kernel}` | {_resources(r)} | {where} {r['variant']} w={r.get('num_warps')} "
                   f"s={r.get('num_stages')} | {worst['shared memory'][0]} |")
    return "\n".join(out)


def write_table(summary: dict, md: Path) -> None:
    """Replace the table between ``BEGIN`` and ``END`` in ``md`` (nothing when the markers are absent)."""
    if not md.exists():
        return
    text = md.read_text()
    if BEGIN not in text or END not in text:
        return
    head, rest = text.split(BEGIN, 1)
    md.write_text(head + BEGIN + "\n" + table(summary) + "\n" + END + rest.split(END, 1)[1])
