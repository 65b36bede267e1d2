"""README.md's Python examples run as written.

Every ```python block of the README runs, top to bottom, in one namespace (the page reads as one
session). A checkpoint folder the README names (``/models/<name>``) is replaced by a tiny random
checkpoint of the same family, written once for the module. The distributed block runs under a
4-process gloo world on the CPU, as ``torchrun --nproc-per-node 4`` would start it.
"""

from __future__ import annotations

import os
import pathlib
import re
import socket
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"^```python\n(.*?)^```", README, re.S | re.M)
# The checkpoint folders the README names -> the openmla.hf.presets family of their tiny stand-in.
STAND_INS = {"/models/DeepSeek-V3": ("deepseek_v3", dict(num_hidden_layers=4, num_attention_heads=4)),
             "/models/DeepSeek-V2-Lite": ("deepseek_v2", {})}


def _distributed(block: str) -> bool:
    return "init_grid(" in block


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    """A tiny random checkpoint folder for each folder the README names."""
    from openmla.hf.presets import build

    named = set(re.findall(r'"(/models/[^"]+)"', README))
    unknown = named - set(STAND_INS)
    assert not unknown, f"README names checkpoint folders without a stand-in here: {sorted(unknown)}"
    folders = {}
    for path in sorted(named):
        family, overrides = STAND_INS[path]
        folder = tmp_path_factory.mktemp(family)
        build(family, "test", dtype=torch.bfloat16, **overrides).save_pretrained(folder)
        folders[path] = str(folder)
    return folders


def _with_stand_ins(block: str, checkpoints: dict[str, str]) -> str:
    for path, folder in checkpoints.items():
        block = block.replace(f'"{path}"', repr(folder))
    return block


def test_the_readme_has_python_examples():
    assert len(BLOCKS) >= 5
    assert sum(map(_distributed, BLOCKS)) == 1


def test_readme_python_blocks_run(checkpoints):
    namespace: dict = {"__name__": "readme"}
    for i, block in enumerate(BLOCKS):
        if _distributed(block):
            continue
        try:
            exec(compile(_with_stand_ins(block, checkpoints), f"README.md python block {i}", "exec"), namespace)
        except Exception as exc:  # name the block that failed
            raise AssertionError(f"README.md python block {i} failed: {type(exc).__name__}: {exc}\n{block}") from exc
    assert namespace["y"].shape[0] == 7  # the layer block: [T, hidden]
    assert namespace["out"].shape == (2, 1, 16, 512)  # the FlashMLA block: [b, s_q, h_q, 512]


def test_readme_distributed_block_runs_on_four_ranks(checkpoints, tmp_path):
    block = next(b for b in BLOCKS if _distributed(b))
    script = tmp_path / "readme_distributed.py"
    script.write_text(_with_stand_ins(block, checkpoints) + "\nprint('rank', grid.rank, 'ok', tuple(y.shape))\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(4):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="4", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=300)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    for rank, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and " ok " in out, f"rank {rank}:\n{out}"
