"""Decode benchmark of the torch CPU backend (bf16), against this machine's own matmul rate.

Run: ``.venv/bin/python bench/bench_decode.py [--reps N] [--heads 128 16] [--layouts shuffled contiguous]``

On B sequences of S cached tokens with one new token each (page size P), for each head count:
- ``flare_mla_decode`` alone (attention FLOPs ``2*B*H*S*(576+512)``);
- the fused ``mla_prefill_decode_graph`` (cache write, absorption, attention, output projection;
  FLOPs add the two absorption products ``2*B*H*Dn*L*2``);
- a plain ``bmm -> float32 softmax -> bmm`` decode on contiguous tensors (the baseline to beat),
  and the same with K^T and V pre-laid out contiguously (a reference point; see ``baseline``).

Page layouts: ``shuffled`` hands out every page at random (worst case: every key block is a
gather), ``contiguous`` allocates each sequence's cached pages in order, as a fresh prefill does.

The machine may be shared, so all measurements (the bf16 2048^3 matmul included) run
round-robin in a shuffled order, ``--reps`` rounds; each result keeps the median and the best
round, and fractions use the matmul rate of the same statistic. The load average is recorded.
JSON goes to ``bench/out/decode.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
import openmla  # noqa: E402
from openmla import PagedLatentCache, preset, rope_freqs_cis  # noqa: E402

OUT = Path(__file__).resolve().parent / "out" / "decode.json"
MATMUL = "matmul_2048"


def build_cache(B: int, S: int, page_size: int, layout: str, seed: int = 0):
    """A one-layer bf16 cache holding S random tokens per sequence, and the batch view that adds
    one new token to each. ``contiguous``: each sequence's cached pages in order (the new
    token's page comes after everyone's); ``shuffled``: all pages at random."""
    cfg = preset("deepseek-v3")
    pages = B * (-(-(S + 1) // page_size)) + 4
    cache = PagedLatentCache(1, pages, page_size=page_size, head_dim=cfg.cache_head_dim, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(seed)
    if layout == "shuffled":
        cache.allocator._free = torch.randperm(pages, generator=g).tolist()
    cache.blocks.copy_(torch.randn(cache.blocks.shape, generator=g).bfloat16())
    ids = list(range(B))
    cache.commit(cache.prepare(ids, [S] * B))
    return cache, cache.prepare(ids, [1] * B)


def baseline(B: int, H: int, S: int, scale: float, pre_laid: bool = False) -> Callable[[], torch.Tensor]:
    """Plain decode on contiguous tensors: bmm, float32 softmax, bmm. Keys are ``[B, S, 576]``
    as a cache stores them (K^T a transposed view, V a slice); ``pre_laid`` instead hands the
    GEMMs a contiguous K^T ``[B, 576, S]`` and V ``[B, S, 512]`` made outside the timing, a
    layout a paged cache cannot offer without a copy (reference point only)."""
    q = torch.randn(B, H, 576).bfloat16()
    k = torch.randn(B, S, 576).bfloat16()
    k_t, v = (k.transpose(1, 2).contiguous(), k[..., :512].contiguous()) if pre_laid else (k.transpose(1, 2), k[..., :512])

    def run() -> torch.Tensor:
        s = torch.bmm(q, k_t)
        p = torch.softmax(s.float() * scale, dim=-1).bfloat16()
        return torch.bmm(p, v)

    return run


def workloads(H: int, batch, S: int) -> dict[str, tuple[Callable[[], object], int]]:
    """``name -> (fn, flops)`` for one head count on one cache layout."""
    cfg = preset("deepseek-v3", num_heads=H)
    B = batch.batch_size
    L, R, Dn, Dv = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
    g = torch.Generator().manual_seed(1)
    rnd = lambda *s, scale=1.0: (torch.randn(*s, generator=g) * scale).bfloat16()  # noqa: E731
    q, kv = rnd(B, H, Dn + R), rnd(B, L + R)
    w_k = rnd(H * Dn, L, scale=L**-0.5)
    w_uk = w_k.view(H, Dn, L).transpose(1, 2).contiguous()
    w_uv = rnd(H, Dv, L, scale=L**-0.5)
    freqs, gamma = rope_freqs_cis(cfg, S + 8), torch.ones(L).bfloat16()
    q_abs = rnd(B, H, L + R, scale=0.3)
    scale = cfg.softmax_scale
    attn = 2 * B * H * S * (L + R + L)
    return {
        "flare_mla_decode": (lambda: openmla.flare_mla_decode(q_abs, batch, 0, scale=scale, kv_lora_rank=L, backend="torch"), attn),
        "fused": (lambda: openmla.mla_prefill_decode_graph(
            q, kv, batch.input_row_offsets, freqs, gamma, batch, 0, w_k, w_uk, w_uv, scale=scale, backend="torch"),
            attn + 2 * B * H * Dn * L * 2),
        "baseline_bmm_softmax_bmm": (baseline(B, H, S, scale), attn),
        "baseline_pre_laid_kT_v": (baseline(B, H, S, scale, pre_laid=True), attn),
    }


def round_robin(fns: dict[str, Callable[[], object]], reps: int) -> dict[str, list[float]]:
    """Wall times of every fn, ``reps`` rounds, each round in a fresh random order."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    order = list(fns)
    for _ in range(reps):
        random.shuffle(order)
        for k in order:
            t0 = time.perf_counter()
            fns[k]()
            times[k].append(time.perf_counter() - t0)
    return times


def machine() -> dict:
    model = ""
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name"):
                model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    return {"cpu": model or platform.processor(), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "loadavg_before": os.getloadavg()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--heads", type=int, nargs="+", default=[128, 16])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--layouts", nargs="+", default=["shuffled", "contiguous"], choices=["shuffled", "contiguous"])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    info = machine()
    a, b = torch.randn(2048, 2048).bfloat16(), torch.randn(2048, 2048).bfloat16()
    fns: dict[str, Callable[[], object]] = {MATMUL: lambda: a @ b}
    flops: dict[str, int] = {MATMUL: 2 * 2048**3}
    for layout in args.layouts:
        _, batch = build_cache(args.batch, args.seq, args.page_size, layout)
        for H in args.heads:
            for name, (fn, fl) in workloads(H, batch, args.seq).items():
                if name.startswith("baseline") and layout != args.layouts[0]:
                    continue  # the baseline does not depend on the cache layout
                key = f"H={H}/{layout}/{name}"
                fns[key], flops[key] = fn, fl
    times = round_robin(fns, args.reps)
    info["loadavg_after"] = os.getloadavg()
    rate = {stat: flops[MATMUL] / f(times[MATMUL]) / 1e9 for stat, f in (("median", statistics.median), ("best", min))}
    print(f"{info['cpu']}, {info['threads']} threads, torch {info['torch']}, load {info['loadavg_before']} -> {info['loadavg_after']}")
    print(f"bf16 2048^3 matmul: {rate['median']:.0f} GFLOP/s median, {rate['best']:.0f} best ({args.reps} rounds)")
    cache_bytes = args.batch * args.seq * 576 * 2
    results = {}
    for key in fns:
        if key == MATMUL:
            continue
        med, best = statistics.median(times[key]), min(times[key])
        results[key] = {
            "median_ms": med * 1e3, "best_ms": best * 1e3, "gflops": flops[key] / med / 1e9,
            "frac_matmul": flops[key] / med / 1e9 / rate["median"], "best_frac_matmul": flops[key] / best / 1e9 / rate["best"],
            "cache_gbps": cache_bytes / med / 1e9,
        }
    for key, r in results.items():
        H = key.split("/")[0]
        base = results.get(f"{H}/{args.layouts[0]}/baseline_bmm_softmax_bmm")
        if base and "baseline" not in key:
            r["speedup_vs_baseline"] = base["median_ms"] / r["median_ms"]
        extra = f"  x{r['speedup_vs_baseline']:.2f} vs baseline" if "speedup_vs_baseline" in r else ""
        print(f"{key:45s} {r['median_ms']:7.2f} ms {r['gflops']:5.0f} GFLOP/s {r['frac_matmul']:.2f} of matmul "
              f"(best {r['best_frac_matmul']:.2f}) {r['cache_gbps']:5.1f} GB/s cache{extra}")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": info, "args": vars(args),
                               "matmul_gflops": rate, "results": results}, indent=2))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
