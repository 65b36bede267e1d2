"""Wall-clock helpers for benchmarks: median timing and the machine's matmul rate, measured in-run."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from openmla.hardware import fast_matmul


def sync(device: torch.device | str = "cpu") -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def median_time(fn: Callable[[], object], *, repeats: int = 5, warmup: int = 1, device: torch.device | str = "cpu") -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmul_rate(n: int = 2048, dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu", repeats: int = 5) -> float:
    """FLOP/s of an ``n x n x n`` matmul in ``dtype``: the roofline every ratio is taken against.
    Where the CPU emulates ``dtype`` (``hardware.fast_matmul``) ``n`` is cut to 512: a 2048^3 probe
    would take minutes there."""
    if torch.device(device).type == "cpu" and not fast_matmul(dtype):
        n = min(n, 512)
    g = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(n, n, generator=g).to(device=device, dtype=dtype)
    b = torch.randn(n, n, generator=g).to(device=device, dtype=dtype)
    t = median_time(lambda: a @ b, repeats=repeats, device=device)
    return 2 * n**3 / t
