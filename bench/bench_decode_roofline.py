"""Issue 35's decode table: the native op's fraction of the same run's roofline, per shape.

Run: ``.venv/bin/python bench/bench_decode_roofline.py [--reps 5] [--threads 2] [--ab] [--shapes ...]``

Shapes ``H:BxS`` (bf16 cache, page 64, pages handed out in a shuffled order, one new token per
sequence; DeepSeek widths L=512, R=64): by default the issue's five, H=128 8x4096, H=16 8x4096,
1x4096, 1x32768 and 32x1024. The op is ``torch.ops.openmla_cpu.decode`` through
``kernels.decode`` (no validation or plan: the kernel alone).

Roofline time = max(FLOPs / 2048^3 matmul rate (bf16; see --dtype), bytes / copy bandwidth), the rate and the
bandwidth probed in the same run, in the same mode: single-thread CPU time
(``time.thread_time``, ``torch.set_num_threads(1)``: holds when other processes share the box)
and wall time with ``--threads`` threads. FLOPs ``2 * B * H * (S + 1) * (576 + 512)``; bytes
the cache rows read, ``B * (S + 1) * 576 * 2``. Every timed function runs round-robin in a
shuffled order, ``--reps`` rounds; fractions are best round against best probe, medians in the
JSON.

``--ab`` loads the test build and times every shape twice per round, with the register-tiled
kernel on and off (``set_bf16_tiles`` / ``set_f32_tiles``; off: brgemm): the before/after of
issue 35 in one process. ``--dtype float32`` takes a float32 cache and queries (float32 products),
the roofline then on a float32 2048^3 matmul and 4-byte cache values (the matmul is always in
the products' dtype: float32 for bf16 in an AVX2 build, ``OPENMLA_CPU_ISA=avx2``).
JSON goes to ``bench/out/decode_roofline.json``.
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

OUT = Path(__file__).resolve().parent / "out" / "decode_roofline.json"  # float32: decode_roofline_float32.json
D, L = 576, 512
SHAPES = ["128:8x4096", "16:8x4096", "16:1x4096", "16:1x32768", "16:32x1024"]


def parse(shape: str) -> tuple[int, int, int]:
    h, bs = shape.split(":")
    b, s = bs.split("x")
    return int(h), int(b), int(s)


def make_case(H: int, B: int, S: int, page: int = 64, seed: int = 0, dtype: torch.dtype = torch.bfloat16):
    from openmla.backends.cpu import kernels

    g = torch.Generator().manual_seed(seed)
    kv = S + 1
    per = -(-kv // page)
    pages = torch.randn(B * per, page, D, generator=g).to(dtype)
    table = torch.randperm(B * per, generator=g).to(torch.int32).view(B, per).contiguous()
    lens = torch.full((B,), S, dtype=torch.int32)
    offs = torch.arange(B + 1, dtype=torch.int32)
    layer = kernels.PagedLayer(pages, table, lens, offs, kernels.FORMAT_CODES[dtype])
    cdtype = kernels.compute_dtype(dtype)  # bf16 queries compute in float32 without bf16 brgemm (AVX2 builds)
    q = (torch.randn(B, H, D, generator=g) * 0.3).to(dtype).to(cdtype)
    from openmla.masks import MaskVariant

    mask = MaskVariant()

    def run():
        return kernels.decode(q, layer, kv_lora_rank=L, scale=D**-0.5, mask=mask, dtype=cdtype)

    flops = 2 * B * H * kv * (D + L)
    nbytes = B * kv * D * dtype.itemsize
    return run, flops, nbytes


def timed(fn, cpu: bool) -> float:
    clock = time.thread_time if cpu else time.perf_counter
    t0 = clock()
    fn()
    return clock() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--shapes", nargs="+", default=SHAPES)
    ap.add_argument("--ab", action="store_true", help="register tiles on and off in the same run (test build)")
    ap.add_argument("--modes", nargs="+", default=["cpu1", "wall"], choices=["cpu1", "wall"])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    if args.ab:
        os.environ["OPENMLA_CPU_TEST_HOOKS"] = "1"
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from openmla.backends.cpu import build

    ops = build.ops()
    variants = ["tiles", "brgemm"] if args.ab else ["default"]

    def use(v: str) -> None:
        if args.ab:
            ops.set_bf16_tiles(v == "tiles")
            ops.set_f32_tiles(v == "tiles")

    from openmla.backends.cpu import kernels

    mm_dtype = kernels.compute_dtype(dtype)  # the products' dtype (bf16 computes in float32 without bf16 brgemm)
    a = torch.randn(2048, 2048).to(mm_dtype)
    b = torch.randn(2048, 2048).to(mm_dtype)
    src = torch.empty(64 << 20, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    probes = {"matmul": lambda: torch.mm(a, b), "copy": lambda: dst.copy_(src)}
    cases = {s: make_case(*parse(s), dtype=dtype) for s in args.shapes}
    model = ""
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
        if line.startswith("Model name"):
            model = line.split(":", 1)[1].strip()
    res: dict = {"cpu": model, "torch": torch.__version__, "threads": args.threads, "dtype": args.dtype, "loadavg_before": os.getloadavg(),
                 "utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "modes": {}}
    for mode in args.modes:
        cpu = mode == "cpu1"
        torch.set_num_threads(1 if cpu else args.threads)
        keys = list(probes) + [(v, s) for v in variants for s in cases]
        fns = {}
        for k in keys:
            if isinstance(k, str):
                fns[k] = probes[k]
            else:
                v, s = k
                fns[k] = (lambda v=v, s=s: (use(v), cases[s][0]()))
        for f in fns.values():
            f()
        times: dict = {k: [] for k in keys}
        for _ in range(args.reps):
            order = list(keys)
            random.shuffle(order)
            for k in order:
                times[k].append(timed(fns[k], cpu))
        rate = 2 * 2048**3 / min(times["matmul"])
        bw = 2 * src.numel() * 4 / min(times["copy"])
        out = {"matmul_gflops": rate / 1e9, "copy_gbs": bw / 1e9, "shapes": {}}
        print(f"[{mode}] threads {torch.get_num_threads()}: {mm_dtype} matmul {rate / 1e9:.1f} GFLOP/s, copy {bw / 1e9:.1f} GB/s, "
              f"load {os.getloadavg()[0]:.2f}")
        for s, (_, flops, nbytes) in cases.items():
            roof = max(flops / rate, nbytes / bw)
            bound = "compute" if flops / rate >= nbytes / bw else "memory"
            for v in variants:
                t = times[(v, s)]
                best, med = min(t), statistics.median(t)
                out["shapes"].setdefault(s, {})[v] = {"best_ms": best * 1e3, "median_ms": med * 1e3, "roof_ms": roof * 1e3,
                                                      "fraction": roof / best, "fraction_median": roof / med, "bound": bound}
                print(f"  {s:>12} {v:>7}: {best * 1e3:8.2f} ms (median {med * 1e3:8.2f}), roofline {roof * 1e3:7.2f} ms "
                      f"({bound}): {roof / best:.2f} ({roof / med:.2f})")
        res["modes"][mode] = out
    res["loadavg_after"] = os.getloadavg()
    OUT.parent.mkdir(exist_ok=True)
    out_path = OUT if args.dtype == "bfloat16" else OUT.with_name(f"decode_roofline_{args.dtype}.json")
    out_path.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
