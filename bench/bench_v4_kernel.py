"""DeepSeek-V4 shared-KV attention kernel: the native ``cpu`` backend against the ``torch`` one.

    .venv/bin/python bench/bench_v4_kernel.py                 # B=8 decode, H=64, D=512, window 128, context 8192
    .venv/bin/python bench/bench_v4_kernel.py --context 2048 --batch 4 --reps 5 --dtype bfloat16

One torch thread (``--threads``). Random stores at V4-Flash's attention shapes: B sequences of
``--context`` tokens decoding one token each, 64 heads, entries of 512 (pages of 64), a
128-token window; the raw store holds only the pages a window reads (the rest freed, as a V4
sliding store). Three layer kinds: ``sliding`` (window only), ``HCA`` (rate 128, every
compressed entry the rule allows: context / 128), ``CSA`` (rate 4, a top-512 list per query of
distinct entries). Per backend the plan is made once (``openmla.v4.plan_shared_kv``) and
``plan.run`` is timed, the backends taking turns (ABAB, so the box's other load hits both
alike): process CPU seconds, min and median of ``--reps`` runs after a warm-up, and wall.
The stores are the same every run (they stay in the last-level cache where they fit: at B=8 a CSA
step reads 8 x 640 entries of 2 KB).

Roofline: the kernel's flops are 4 H D per (query row, key) (scores and P x V, K = V); the
fp32 matmul rate is measured in the same run (``torch.mm`` of 512 x 512 x 512 on the same
threads: best of 5 before and after, and taking its turn among the timed calls) and its best
taken as the practical peak; the fraction is the
kernel's flops over its minimum CPU time, over that rate.
Prints a markdown table; ``--json`` writes the rows too.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from openmla.v4 import CompressedKeys, EntryLayout, PagedEntries, SharedKVSpec, plan_shared_kv  # noqa: E402


def store(g: torch.Generator, lengths: list[int], first: list[int], page_size: int, D: int, dtype: torch.dtype) -> PagedEntries:
    """Entries of each sequence in shuffled pages; pages wholly before ``first[b]`` freed (-1)."""
    need = [-(-n // page_size) for n in lengths]
    keep = [[j for j in range(n) if (j + 1) * page_size > f] for n, f in zip(need, first)]
    num_pages = sum(len(k) for k in keep)
    order = torch.randperm(num_pages, generator=g).tolist()
    blocks = torch.randn(num_pages, page_size, D, generator=g).to(dtype)
    blocks /= blocks.float().norm(dim=-1, keepdim=True).clamp_min(1e-6).to(dtype) / D ** 0.5  # RMS-normed entries
    table = torch.full((len(lengths), max(need + [1])), -1, dtype=torch.int32)
    for b, js in enumerate(keep):
        for j in js:
            table[b, j] = order.pop()
    return PagedEntries(blocks, table, torch.tensor(lengths, dtype=torch.int32))


def case(kind: str, B: int, context: int, H: int, D: int, window: int, page_size: int, topk: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    kv = [context] * B
    raw = store(g, kv, [max(0, n - window) for n in kv], page_size, D, dtype)
    q = (torch.randn(B, H, D, generator=g)).to(dtype)
    offsets = torch.arange(B + 1, dtype=torch.int64)
    sink = torch.randn(H, generator=g)
    comp, ck = None, None
    if kind != "sliding":
        rate = 128 if kind == "HCA" else 4
        c_lens = [n // rate for n in kv]
        comp = store(g, c_lens, [0] * B, page_size, D, dtype)
        idx = None
        if kind == "CSA":
            idx = torch.stack([torch.randperm(c_lens[b], generator=g)[:topk] for b in range(B)]).to(torch.int32)
        ck = CompressedKeys(rate, idx)
    spec = SharedKVSpec(D ** -0.5, window, EntryLayout(D, 64), ck, sink)
    return q, offsets, raw, spec, comp


def timed(fns: dict, reps: int) -> dict:
    """Per name: process CPU seconds and wall seconds of ``reps`` calls after one warm-up, the
    functions taking turns (ABAB: the others' load hits every one alike)."""
    times = {name: ([], []) for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(reps):
        for name, fn in fns.items():
            w0, c0 = time.perf_counter(), time.process_time()
            fn()
            times[name][1].append(time.perf_counter() - w0)
            times[name][0].append(time.process_time() - c0)
    return times


def mm_rate(n: int = 512, reps: int = 5) -> float:
    """Best fp32 flops/s of ``torch.mm`` at n x n x n."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    c = torch.empty(n, n)
    torch.mm(a, b, out=c)
    best = float("inf")
    for _ in range(reps):
        c0 = time.process_time()
        for _ in range(4):
            torch.mm(a, b, out=c)
        best = min(best, (time.process_time() - c0) / 4)
    return 2 * n**3 / best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--topk", type=int, default=512)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--kinds", default="sliding,HCA,CSA")
    ap.add_argument("--backends", default="cpu,torch")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    B, H, D = args.batch, args.heads, args.dim
    load = os.getloadavg()
    peak_before = mm_rate()
    rows, mm_rates = [], []
    for kind in args.kinds.split(","):
        q, offsets, raw, spec, comp = case(kind, B, args.context, H, D, args.window, args.page_size, args.topk, dtype, seed=1)
        ref_out, plans, errs = None, {}, {}
        for name in args.backends.split(","):
            plan = plans[name] = plan_shared_kv(q, offsets, raw, spec, comp, backend=name)
            assert plan.backend_name == name, plan.fallback_reason
            out, _ = plan.run(q)
            if ref_out is None:
                ref_out = out.float()
            errs[name] = float((out.float() - ref_out).abs().max() / ref_out.abs().max().clamp_min(1e-30))
        a, b, c = torch.randn(512, 512), torch.randn(512, 512), torch.empty(512, 512)
        fns = {name: (lambda p=plan: p.run(q)) for name, plan in plans.items()}
        fns["mm"] = lambda: [torch.mm(a, b, out=c) for _ in range(4)]  # the matmul rate under the same load, in turn
        times = timed(fns, args.reps)
        mm_rates.append(4 * 2 * 512**3 / min(times.pop("mm")[0]))
        for name, plan in plans.items():
            cpu, wall = times[name]
            keys = min(args.window, args.context) + plan.compressed_keys
            flops = 4.0 * B * H * D * keys
            rows.append(dict(kind=kind, backend=name, keys_per_row=keys, cpu_ms=statistics.median(cpu) * 1e3,
                             cpu_min_ms=min(cpu) * 1e3, wall_ms=statistics.median(wall) * 1e3,
                             gflops=flops / min(cpu) / 1e9, max_rel_diff=errs[name]))
    peak = max([peak_before, mm_rate()] + mm_rates)
    print(f"date {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores, torch {torch.__version__}, threads {args.threads}, load before {load[0]:.2f} "
          f"after {os.getloadavg()[0]:.2f}")
    print(f"B={B} decode, H={H}, D={D}, window {args.window}, context {args.context}, pages of {args.page_size}, {args.dtype}; "
          f"fp32 torch.mm 512^3: {peak / 1e9:.1f} GFLOP/s")
    print()
    first = args.backends.split(",")[0]
    print("| layer | backend | keys/row | CPU ms min | CPU ms median | wall ms median | GFLOP/s (min) | of mm rate | "
          f"vs torch (min / median) | max rel diff vs {first} |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    base = {r["kind"]: r for r in rows if r["backend"] == "torch"}
    for r in rows:
        t = base.get(r["kind"])
        speed = f"{t['cpu_min_ms'] / r['cpu_min_ms']:.2f}x / {t['cpu_ms'] / r['cpu_ms']:.2f}x" if t else "-"
        r["fraction_of_mm_peak"] = r["gflops"] * 1e9 / peak
        print(f"| {r['kind']} | {r['backend']} | {r['keys_per_row']} | {r['cpu_min_ms']:.2f} | {r['cpu_ms']:.2f} | {r['wall_ms']:.2f} | "
              f"{r['gflops']:.1f} | {r['fraction_of_mm_peak']:.0%} | {speed} | {r['max_rel_diff']:.1e} |")
    if args.json:
        args.json.write_text(json.dumps(dict(args={k: str(v) for k, v in vars(args).items()}, load=load, mm_flops=peak, rows=rows),
                                        indent=1))


if __name__ == "__main__":
    main()
