"""Fixtures of the vLLM tests: the random-weight checkpoints (made once per session) and a
runner of ``generate.py`` in a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from models import deepseek_v2, deepseek_v3, glm4_7_flash, kimi_k2, minicpm3, save_model

HERE = Path(__file__).parent
TIMEOUT_S = 900  # one engine start and a few hundred tokens; minutes only on a loaded 2-core box


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {"v2": save_model(deepseek_v2(), root / "v2"), "v3": save_model(deepseek_v3(), root / "v3")}


@pytest.fixture(scope="session")
def family_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """The other MLA families vLLM serves: Kimi K2, GLM-4.7-Flash and MiniCPM3 shaped."""
    root = tmp_path_factory.mktemp("families")
    return {name: save_model(build(), root / name) for name, build in
            (("kimi_k2", kimi_k2), ("glm4_7_flash", glm4_7_flash), ("minicpm3", minicpm3))}


def generate(spec: dict, tmp_path: Path, *, openmla: bool, env: dict | None = None) -> dict:
    """Run ``generate.py`` on ``spec`` with the plugin opted in (``openmla=True``) or not."""
    return generate_cases([spec], tmp_path, openmla=openmla, env=env, **{k: spec[k] for k in ("no_amx", "compare_with") if k in spec})[0]


def generate_cases(cases: list[dict], tmp_path: Path, *, openmla: bool, env: dict | None = None, **process) -> list[dict]:
    """Run one engine per case, one after the other in one ``generate.py`` process (vLLM's import
    once); ``process``: the options that hold for the whole process (``no_amx``, ``compare_with``).
    vLLM's own runs (``openmla=False``) turn vLLM's CPU rotary op off, as the plugin does, unless a
    case says ``native_rope=False``: the op rotates MLA queries wrong (cpu_platform.py), and the
    tests compare attention backends on the same, right, queries."""
    if not openmla:
        cases = [{"native_rope": True, **case} for case in cases]
    path = tmp_path / f"spec-{openmla}-{len(list(tmp_path.iterdir()))}.json"
    path.write_text(json.dumps({**process, "cases": [{**case, "model": str(case["model"])} for case in cases]}))
    full = {k: v for k, v in os.environ.items() if k not in ("OPENMLA_VLLM", "OPENMLA_BACKEND")}
    full.update(env or {})
    if openmla:
        full["OPENMLA_VLLM"] = "1"
    proc = subprocess.run([sys.executable, str(HERE / "generate.py"), str(path)], capture_output=True, text=True,
                          env=full, timeout=TIMEOUT_S, cwd=tmp_path)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or len(lines) != len(cases):
        raise AssertionError(f"generate.py failed (exit {proc.returncode}):\n{proc.stderr[-6000:]}")
    announce = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "serves the MLA attention layers of this process" in ln]
    return [{**json.loads(line[len("RESULT "):]), "announced": bool(announce), "announce": announce} for line in lines]
