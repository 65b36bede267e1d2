"""Slowdown beside a busy process: openmla's native decode against plain bf16 matmuls.

Run: ``.venv/bin/python bench/bench_busy.py [--threads 2] [--rounds 15] [--phases 4]``

Issue #11 asks that a call slow down, when another process holds a core, no more than a plain
matmul of similar length does (a call is one parallel region; a kernel made of many small
regions collapses instead). Phases alternate quiet / busy (a second process spinning in a
Python loop, started and stopped by this script); in each phase every function runs
``--rounds`` times in shuffled order, pages evicted before each call (a 256 MiB copy). Reported
per function: median wall time quiet and busy, and their ratio; the matmuls (sizes chosen to
take about as long as the decodes) are the yardstick. JSON: ``bench/out/busy.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
import openmla  # noqa: E402
from bench_cpu_native import L, decode_inputs, machine  # noqa: E402

OUT = Path(__file__).resolve().parent / "out" / "busy.json"


def functions() -> dict:
    fns = {}
    for H in (16, 128):
        cfg, batch, q = decode_inputs(8, 4096, H, 64)
        fns[f"decode H={H} 8x4096"] = lambda q=q, batch=batch, s=cfg.softmax_scale: openmla.flare_mla_decode(
            q, batch, 0, scale=s, kv_lora_rank=L, backend="cpu")
    for n in (256, 512, 1024, 2048):
        a, b = torch.randn(n, 2048).bfloat16(), torch.randn(2048, 2048).bfloat16()
        fns[f"matmul {n}x2048x2048"] = lambda a=a, b=b: a @ b
    return fns


def phase(fns: dict, rounds: int) -> dict[str, list[float]]:
    x = torch.ones(256 << 20, dtype=torch.uint8)
    y = torch.empty_like(x)
    times: dict[str, list[float]] = {k: [] for k in fns}
    order = list(fns)
    for _ in range(rounds):
        random.shuffle(order)
        for k in order:
            y.copy_(x)  # evict the pages (and everything else) from the caches
            t0 = time.perf_counter()
            fns[k]()
            times[k].append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--phases", type=int, default=4, help="quiet/busy phases, alternating (even)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    fns = functions()
    for fn in fns.values():
        fn()
    quiet: dict[str, list[float]] = {k: [] for k in fns}
    busy: dict[str, list[float]] = {k: [] for k in fns}
    for p in range(args.phases):
        if p % 2 == 0:
            for k, v in phase(fns, args.rounds).items():
                quiet[k] += v
            continue
        spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            time.sleep(0.5)
            for k, v in phase(fns, args.rounds).items():
                busy[k] += v
        finally:
            spin.kill()
            spin.wait()
    info = machine()
    print(f"{info['cpu']}, AMX {'yes' if info['amx'] else 'no'}, {args.threads} threads, load before {info['loadavg_before']}")
    print(f"{'function':24s} {'quiet ms':>9s} {'busy ms':>9s} {'slowdown':>9s}")
    rows = []
    for k in fns:
        q, b = statistics.median(quiet[k]), statistics.median(busy[k])
        rows.append({"function": k, "quiet_ms": q * 1e3, "busy_ms": b * 1e3, "slowdown": b / q})
        print(f"{k:24s} {q * 1e3:9.2f} {b * 1e3:9.2f} {b / q:8.2f}x")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"machine": info, "args": vars(args), "load_after": os.getloadavg(), "rows": rows}, indent=1))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
