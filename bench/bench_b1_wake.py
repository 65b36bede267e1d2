"""Batch-1 decode on all threads: where the median goes (issue 35 item 2).

Run: ``.venv/bin/python bench/bench_b1_wake.py [--rounds 200] [--shape 16:1x4096] [--gap-ms 2]``

Times one native decode call (``kernels.decode``, the op alone; bf16 cache, page 64, shuffled
pages, as ``bench_decode_roofline.py``) right after each of these, all conditions taken in a
shuffled order every round (wall time, ``--threads`` threads):

- ``idle``: ``--gap-ms`` of sleep (``idleN``: N ms);
- ``hot``: nothing (the decode right after the previous round's last call; its cache is warm
  only if that was this decode);
- ``mm``: a 512 x 2048 x 512 float32 matmul on all threads (the earlier session's filler);
- ``gemv``: a bf16 projection GEMV, [1, 7168] x [7168, 2048] (29 MB of weights streamed: the
  layer's projection before the attention of a batch-1 step);
- ``gemv_warm``: the GEMV, then the same decode on another cache of the same size (the code, the
  Python path and the scratch warm again; this call's keys still evicted by the GEMV);
- ``mm_small``: a 128 x 256 x 128 float32 matmul on all threads (the threads busy, nothing of the
  cache evicted);
- ``evict``: a single-threaded 32 MiB numpy copy (the cache evicted, the worker thread left idle);
- ``evict_wake``: the same copy, then a tiny 2-thread op (the worker woken, the cache evicted).

Besides the decode, the same conditions are followed by an "empty" 2-thread region (``probe``:
``x.add_(1)`` on 64 Ki floats, ~5 us of work per thread) to time the pool's wake-up alone.
Prints best / median / p90 per condition and the run's roofline (FLOPs / the same run's 2-thread
bf16 2048^3 matmul rate, as ``bench_decode_roofline.py``); JSON to ``bench/out/b1_wake[_TAG].json``.
Test wait policies as separate processes (``OMP_WAIT_POLICY=ACTIVE .venv/bin/python ...``:
libgomp reads them once). The per-thread breakdown in ``bench/RESULTS.md`` (issue 35, "Batch 1
on two threads: where the median goes") came from timestamps added to ``run_units`` for that
measurement only (not in the kernels).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from bench_decode_roofline import make_case, parse  # noqa: E402

OUT = Path(__file__).resolve().parent / "out" / "b1_wake.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--shape", default="16:1x4096")
    ap.add_argument("--gap-ms", type=float, default=2.0)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--conditions", nargs="+", default=["idle", "hot", "mm", "gemv", "mm_small", "evict", "evict_wake"])
    ap.add_argument("--no-probe", action="store_true")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    run, flops, nbytes = make_case(*parse(args.shape))
    other, _, _ = make_case(*parse(args.shape), seed=1)  # the same call on another cache of the same size
    a = torch.randn(512, 2048)
    b = torch.randn(2048, 512)
    sa, sb = torch.randn(128, 256), torch.randn(256, 128)
    x = torch.randn(1, 7168).bfloat16()
    w = torch.randn(7168, 2048).bfloat16()
    src = np.ones(8 << 20, dtype=np.float32)
    dst = np.empty_like(src)
    tiny = torch.zeros(1 << 16)
    gap = args.gap_ms / 1e3
    before = {
        "idle": lambda: time.sleep(gap),
        "hot": lambda: None,
        "mm": lambda: torch.mm(a, b),
        "gemv": lambda: torch.mm(x, w),
        "gemv_warm": lambda: (torch.mm(x, w), other()),
        "mm_small": lambda: torch.mm(sa, sb),
        "evict": lambda: np.copyto(dst, src),
        "evict_wake": lambda: (np.copyto(dst, src), tiny.add_(1.0)),
    }
    for c in args.conditions:  # "idleN": N ms of sleep
        if c.startswith("idle") and c[4:]:
            before[c] = (lambda s: lambda: time.sleep(s))(float(c[4:]) / 1e3)
    targets = {"decode": run}
    if not args.no_probe:
        targets["probe"] = lambda: tiny.add_(1.0)
    keys = [(t, c) for t in targets for c in args.conditions]
    for _ in range(3):
        for t, c in keys:
            before[c]()
            targets[t]()
    times: dict = {k: [] for k in keys}
    load0 = os.getloadavg()
    for _ in range(args.rounds):
        order = list(keys)
        random.shuffle(order)
        for t, c in order:
            if c == "hot":
                targets[t]()  # warm: the same call just before
            before[c]()
            t0 = time.perf_counter()
            targets[t]()
            times[(t, c)].append(time.perf_counter() - t0)
    load1 = os.getloadavg()
    # roofline as the earlier sessions quote it (2-thread bf16 2048^3 matmul rate of the same run)
    ma, mb = torch.randn(2048, 2048).bfloat16(), torch.randn(2048, 2048).bfloat16()
    rate = 2 * 2048**3 / min(timeit(lambda: torch.mm(ma, mb)) for _ in range(5))
    roof = flops / rate
    env = {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_PROC_BIND")}
    print(f"{args.tag} shape {args.shape}, threads {args.threads}, env {env}, load {load0[0]:.2f} -> {load1[0]:.2f}, "
          f"bf16 matmul {rate / 1e9:.0f} GFLOP/s, roofline {roof * 1e3:.3f} ms")
    res = {"shape": args.shape, "threads": args.threads, "env": env, "load": [load0, load1], "roof_ms": roof * 1e3,
           "utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "rounds": args.rounds, "stats": {}}
    for t in targets:
        for c in args.conditions:
            v = sorted(times[(t, c)])
            best, med, p90 = v[0] * 1e3, statistics.median(v) * 1e3, v[int(0.9 * len(v))] * 1e3
            frac = f"  roofline/median {roof * 1e3 / med:.2f}" if t == "decode" else ""
            print(f"  {t:>6} after {c:>10}: best {best:7.3f}  median {med:7.3f}  p90 {p90:7.3f} ms{frac}")
            res["stats"][f"{t}/{c}"] = {"best_ms": best, "median_ms": med, "p90_ms": p90}
    OUT.parent.mkdir(exist_ok=True)
    out = OUT.with_name(f"b1_wake{('_' + args.tag) if args.tag else ''}.json")
    out.write_text(json.dumps(res, indent=1))


def timeit(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
