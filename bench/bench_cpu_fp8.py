"""Decode from quantized caches on the native ``cpu`` backend: time against cache bytes (issue #23).

Run: ``.venv/bin/python bench/bench_cpu_fp8.py [--rounds 5] [--heads 16 128] [--threads 2] [--widened] [--prefill]
[--formats float32 bf16 ...]``

Decode ``plan.decode`` (the absorbed form, a plan made once as an engine runs each layer):
B=8 sequences x 4096 cached tokens + 1 new, L=512, R=64, pages of 64 handed out in a shuffled
order, float32 queries (what an AVX2 CPU multiplies natively; bf16 inputs compute in float32
there), per cache format: ``float32`` (2304 bytes per token), ``bf16`` (1152), ``fp8_e4m3`` (576),
``fp8_ds_mla`` (656), ``nvfp4_ds_mla`` (432), ``nvfp4_fp8rope`` (352). Every format runs round-robin
in a shuffled order, ``--rounds`` rounds:

- single-thread CPU time (``torch.set_num_threads(1)``, ``time.process_time``), which holds
  when other processes share the machine;
- wall time with ``--threads`` threads.

In the same run: copy bandwidth (bytes read plus written by a 256 MiB ``copy_``, CPU time on
one thread and wall on ``--threads``) and the float32 matmul rate (1024^3, same two timings).
Roofline time = max(FLOPs / matmul rate, cache bytes / copy bandwidth); FLOPs
2*B*H*n*(576+512). Times are also given relative to bf16 and to float32. ``--widened`` also times
the quantized formats on the path that widens each key block into a buffer first (the test
build's switch; builds the test variant of the kernels). ``--torch`` also times the NVFP4 formats on
the ``torch`` backend (what ``backend="cpu"`` fell back to for them before the native kernels read
them).
``--prefill``: ``mla_prefill`` of 2 x 512 new tokens at H=16 per format (1 thread CPU time).
JSON goes to ``bench/out/cpu_fp8.json`` (``--json``).
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

OUT = Path(__file__).resolve().parent / "out"
B, S, L, R, PAGE = 8, 4096, 512, 64, 64
FORMATS = ("float32", "bf16", "fp8_e4m3", "fp8_ds_mla", "nvfp4_ds_mla", "nvfp4_fp8rope")
NATIVE = {"float32": torch.float32, "bf16": torch.bfloat16}


def decode_inputs(H: int, fmt: str, seed: int = 0):
    """A cache of ``fmt`` holding B x S tokens of random entries (the same entries per seed),
    a batch of one new token each, float32 absorbed queries."""
    import openmla
    from openmla.formats import RECORDS
    from openmla.fp8 import quantize_e4m3

    cfg = openmla.preset("deepseek-v3", H)
    pages = B * -(-(S + 1) // PAGE) + 4
    kv_scale = 0.05
    cache = openmla.PagedLatentCache(1, pages, page_size=PAGE, head_dim=L + R,
                                     dtype=NATIVE.get(fmt, fmt), kv_scale=kv_scale)
    g = torch.Generator().manual_seed(seed)
    cache.allocator._free = torch.randperm(pages, generator=g).tolist()
    entries = torch.randn(pages * PAGE, L + R, generator=g)
    if fmt in NATIVE:
        stored = entries.to(NATIVE[fmt])
    elif fmt == "fp8_e4m3":
        stored = quantize_e4m3(entries, kv_scale)
    else:
        stored = RECORDS[fmt].pack(entries, L)
    cache.blocks.view(-1, cache.blocks.shape[-1]).copy_(stored)
    ids = list(range(B))
    cache.commit(cache.prepare(ids, [S] * B))
    batch = cache.prepare(ids, [1] * B)
    q = torch.randn(B, H, L + R, generator=g) * 0.3
    step = openmla.plan(batch, scale=cfg.softmax_scale, backend="cpu")
    assert step.backend_name == "cpu", step.fallback_reason
    return step, q, cache.bytes_per_token


def prefill_inputs(fmt: str, n: int = 512, H: int = 16):
    """Prefill of 2 x ``n`` new tokens (no prefix, causal) over a cache of ``fmt``: ``mla_prefill``
    (per chunk: the native gather dequantises the visible rows, two torch matmuls up-project them,
    native flash attention), float32 inputs."""
    import openmla
    from openmla_tools.testing import make_case, small_config

    cfg = small_config(num_heads=H, L=L, R=R, Dn=128, Dv=128)
    case = make_case([0, 0], [n, n], config=cfg, page_size=PAGE, dtype=torch.float32, seed=1,
                     cache_dtype=None if fmt in NATIVE else fmt, kv_scale=0.05)
    if fmt == "bf16":  # make_case's native cache is float32: the same entries in a bf16 cache
        case.batch = case.batch.with_blocks(case.cache.blocks.bfloat16())
    q = openmla.mla_write_cache(case.q, case.kv, case.freqs_cis, case.gamma, case.batch, case.layer_idx, backend="cpu")
    args = (q, case.batch, case.layer_idx, case.w_k, case.w_uv)
    return lambda: openmla.mla_prefill(*args, scale=case.scale, backend="cpu")


def cpu_seconds(fn) -> float:
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def wall_seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def probes(threads: int) -> dict:
    """Copy bandwidth and float32 matmul rate: single-thread CPU time and ``threads``-thread wall."""
    src = torch.empty(64 * 2**20, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    a = torch.randn(1024, 1024)
    b = torch.randn(1024, 1024)
    copy = lambda: dst.copy_(src)  # noqa: E731
    mm = lambda: a @ b  # noqa: E731
    out = {}
    for name, n_threads, timer in (("1t_cpu", 1, cpu_seconds), (f"{threads}t_wall", threads, wall_seconds)):
        torch.set_num_threads(n_threads)
        copy(), mm()
        bw = max(2 * src.numel() * 4 / timer(copy) for _ in range(5))
        rate = max(2 * 1024**3 / timer(mm) for _ in range(5))
        out[name] = {"copy_GBps": bw / 1e9, "matmul_fp32_GFLOPs": rate / 1e9}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--widened", action="store_true", help="also the quantized formats on the widening path (test build)")
    ap.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    ap.add_argument("--torch", action="store_true", help="also the NVFP4 formats on the torch backend (the old fallback)")
    ap.add_argument("--prefill", action="store_true", help="also prefill, 2 x 512 new tokens at H=16, per cache format")
    ap.add_argument("--json", default=str(OUT / "cpu_fp8.json"))
    args = ap.parse_args()
    if args.widened and os.environ.get("OPENMLA_CPU_TEST_HOOKS") != "1":
        os.environ["OPENMLA_CPU_TEST_HOOKS"] = "1"  # before the kernels load
    from openmla.backends.cpu import build

    assert build.load(), build.unavailable_reason()
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"uptime before: {uptime}", flush=True)
    hooks = build.ops() if args.widened else None
    results = {"uptime_before": uptime, "probes_before": probes(args.threads), "decode": {}}
    for H in args.heads:
        cases = {}
        for fmt in args.formats:
            step, q, bpt = decode_inputs(H, fmt)
            cases[fmt] = (step, q, bpt, True)
            if args.widened and fmt not in NATIVE:
                cases[f"{fmt} widened"] = (step, q, bpt, False)
            if args.torch and fmt.startswith("nvfp4"):
                import openmla

                cases[f"{fmt} torch"] = (openmla.plan(step.batch, scale=step.spec.scale, backend="torch"), q, bpt, True)

        def call(name):
            step, q, _, reg = cases[name]
            if hooks is not None:
                hooks.set_reg_dequant(reg)
            step.decode(q, 0, kv_lora_rank=L)

        times = {name: {"1t_cpu": [], f"{args.threads}t_wall": []} for name in cases}
        for name in cases:
            torch.set_num_threads(1)
            call(name)  # warm: scratch, packed buffers
        for _ in range(args.rounds):
            order = list(cases)
            random.shuffle(order)
            for name in order:
                torch.set_num_threads(1)
                times[name]["1t_cpu"].append(cpu_seconds(lambda: call(name)))
                torch.set_num_threads(args.threads)
                times[name][f"{args.threads}t_wall"].append(wall_seconds(lambda: call(name)))
        if hooks is not None:
            hooks.set_reg_dequant(True)
        n = S + 1
        flops = 2 * B * H * n * (L + R + L)
        res = {}
        for name, t in times.items():
            bpt = cases[name][2]
            res[name] = {"bytes": B * n * bpt, "flops": flops,
                         **{k: {"best_ms": min(v) * 1e3, "median_ms": statistics.median(v) * 1e3} for k, v in t.items()}}
        results["decode"][f"H={H}"] = res
    if args.prefill:
        fns = {fmt: prefill_inputs(fmt) for fmt in args.formats}
        torch.set_num_threads(1)
        for fn in fns.values():
            fn()
        ptimes = {fmt: [] for fmt in fns}
        for _ in range(max(2, args.rounds // 2)):
            for fmt in random.sample(list(fns), len(fns)):
                ptimes[fmt].append(cpu_seconds(fns[fmt]))
        results["prefill_2x512_H16_1t_cpu_ms"] = {f: {"best": min(v) * 1e3, "median": statistics.median(v) * 1e3}
                                                  for f, v in ptimes.items()}
        print("prefill 2 x 512, H=16, 1 thread CPU time (best / median ms): "
              + ", ".join(f"{f} {min(v) * 1e3:.0f} / {statistics.median(v) * 1e3:.0f}" for f, v in ptimes.items()), flush=True)
    results["probes_after"] = probes(args.threads)
    results["uptime_after"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"uptime after: {results['uptime_after']}")
    for key in ("1t_cpu", f"{args.threads}t_wall"):
        bw = max(results[p][key]["copy_GBps"] for p in ("probes_before", "probes_after")) * 1e9
        rate = max(results[p][key]["matmul_fp32_GFLOPs"] for p in ("probes_before", "probes_after")) * 1e9
        print(f"\n{key}: copy {bw / 1e9:.1f} GB/s, fp32 matmul {rate / 1e9:.1f} GFLOP/s (best probes)")
        print(f"{'shape':8s} {'cache':22s} {'bytes':>8s} {'best ms':>8s} {'median':>8s} {'vs bf16':>8s} {'vs fp32':>8s} "
              f"{'bytes time':>10s} {'flops time':>10s} {'of roofline':>11s}")
        for shape, res in results["decode"].items():
            base = res["bf16"][key]["best_ms"] if "bf16" in res else float("nan")
            base32 = res["float32"][key]["best_ms"] if "float32" in res else float("nan")
            for name, r in res.items():
                t_bytes, t_flops = r["bytes"] / bw * 1e3, r["flops"] / rate * 1e3
                best = r[key]["best_ms"]
                r[key]["roofline_fraction"] = max(t_bytes, t_flops) / best
                print(f"{shape:8s} {name:22s} {r['bytes'] / 1e6:7.1f}M {best:8.2f} {r[key]['median_ms']:8.2f} "
                      f"{best / base:8.2f} {best / base32:8.2f} {t_bytes:9.2f}m {t_flops:9.2f}m {max(t_bytes, t_flops) / best:11.2f}")
    OUT.mkdir(exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
