"""Compile one specialised launch for one target and measure it: one report row.

Each compile runs in an empty Triton cache (nothing is reused from, or left for, another run:
ptxas must run for its log to exist). ``compile_many`` spreads the work over processes.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import tempfile
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from typing import Iterator

import triton
from triton import knobs
from triton.compiler import ASTSource

from .resources import amd_usage, nvidia_usage
from .specialize import Specialization
from .targets import TARGETS, Target

# Triton 3.9 warns that its fp-fusion default (on, as a launch compiles) will change; the report
# compiles with the default a launch gets.
warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")


@dataclass
class Task:
    """What a worker needs to compile one launch: the kernel by module and name, the target's
    name, the specialisation, and the row's labels."""

    module: str
    kernel: str
    target: str
    spec: Specialization
    labels: dict


@contextlib.contextmanager
def _fresh_compile() -> Iterator[io.StringIO]:
    """An empty cache for one compile; yields what Triton prints (ptxas's log among it)."""
    log = io.StringIO()
    with tempfile.TemporaryDirectory(prefix="openmla-aot-") as cache, knobs.cache.scope(), knobs.nvidia.scope():
        knobs.cache.dir = cache
        knobs.nvidia.dump_ptxas_log = True
        with contextlib.redirect_stdout(log):
            yield log


def _usage(target: Target, compiled, log: str) -> dict:
    meta = compiled.metadata
    if target.is_amd:
        use = amd_usage(compiled.asm["amdgcn"], meta.shared)
        occ = target.limits.occupancy(use["vgprs"], use["sgprs"], use["smem"], meta.num_warps)
    else:
        use = nvidia_usage(log, meta.shared)
        occ = target.limits.occupancy(use["regs"], use["smem"], meta.num_warps)
    return {**use, **occ, "num_warps": meta.num_warps, "num_stages": meta.num_stages}


def compile_task(task: Task) -> dict:
    """One report row: the task's labels, then its resources or ``error``."""
    target = TARGETS[task.target]
    kernel = getattr(importlib.import_module(task.module), task.kernel)
    row = {"target": task.target, "kernel": task.kernel, **task.labels}
    src = ASTSource(kernel, task.spec.signature, task.spec.constexprs, task.spec.attrs)
    start = time.perf_counter()
    try:
        with _fresh_compile() as log:
            compiled = triton.compile(src, target=target.gpu_target(), options=task.spec.options)
        row.update(_usage(target, compiled, log.getvalue()))
    except Exception as exc:  # every failure is reported, not only the first
        row["error"] = f"{type(exc).__name__}: {exc}"[:2000]
    row["compile_s"] = round(time.perf_counter() - start, 2)
    return row


def _worker_init() -> None:
    os.environ.pop("TRITON_INTERPRET", None)


def compile_many(tasks: list[Task], jobs: int) -> Iterator[dict]:
    """Rows of ``tasks`` in order, as they are ready, compiled on ``jobs`` processes (1: here)."""
    if jobs <= 1 or len(tasks) <= 1:
        yield from map(compile_task, tasks)
        return
    with ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn"), initializer=_worker_init) as pool:
        yield from pool.map(compile_task, tasks, chunksize=1)
