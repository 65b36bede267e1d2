"""Fold the stages of ``bench/gpu_check.sh`` into one JSON: ``gpu_check.json``.

    python bench/gpu_summary.py DIR

Reads from DIR what the stages left: ``stages.tsv`` (name, exit status, seconds per stage),
``gpu_tests.xml`` (the Triton tests, JUnit), ``gpu_report_check.json`` (compile report against
real launches), ``gpu_graph.log`` (its last line is the CUDA-graph run's JSON) and
``gpu_bench.json`` (timings against the measured copy bandwidth and matmul rate). A stage that
left nothing is recorded as missing. Needs no GPU and no torch.
"""

from __future__ import annotations

import json
import platform
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def stages(folder: Path) -> dict:
    out = {}
    path = folder / "stages.tsv"
    for line in path.read_text().splitlines() if path.exists() else []:
        name, rc, seconds = line.split("\t")
        out[name] = {"exit_status": int(rc), "seconds": int(seconds)}
    return out


def junit(path: Path) -> dict | None:
    """Totals of a pytest JUnit file, and the ids of the tests that failed."""
    if not path.exists():
        return None
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    failed = [f"{case.get('classname')}::{case.get('name')}" for case in suite.iter("testcase")
              if case.find("failure") is not None or case.find("error") is not None]
    return {k: int(float(suite.get(k, 0))) for k in ("tests", "failures", "errors", "skipped")} | {
        "seconds": float(suite.get("time", 0)), "failed": failed}


def last_json_line(path: Path) -> dict | None:
    if not path.exists():
        return None
    for line in reversed(path.read_text().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                return None
    return None


def json_file(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def summarize(folder: Path) -> dict:
    return {
        "host": platform.node(),
        "stages": stages(folder),
        "triton_tests": junit(folder / "gpu_tests.xml"),
        "report_vs_launch": json_file(folder / "gpu_report_check.json"),
        "cuda_graph": last_json_line(folder / "gpu_graph.log"),
        "bench": json_file(folder / "gpu_bench.json"),
    }


def main() -> int:
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else "bench/out")
    summary = summarize(folder)
    (folder / "gpu_check.json").write_text(json.dumps(summary, indent=1, default=str))
    missing = [k for k, v in summary.items() if v is None]
    print(f"wrote {folder / 'gpu_check.json'}; stages: "
          + ", ".join(f"{k}={v['exit_status']} ({v['seconds']} s)" for k, v in summary["stages"].items())
          + (f"; missing: {missing}" if missing else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
