"""Decode benchmark of the torch CPU backend (bf16), against this machine's own matmul rate.

Run: ``.venv/bin/python bench/bench_decode.py [--reps N] [--heads 128 16] [--layouts shuffled contiguous]``

For each head count it times, on B sequences of S cached tokens with one new token each:
- ``flare_mla_decode`` alone (attention FLOPs ``2*B*H*S*(576+512)``);
- the fused ``mla_prefill_decode_graph`` (cache write, absorption, attention, output projection;
  FLOPs add ``2*B*H*Dn*L*2``);
- a plain ``bmm -> softmax -> bmm`` decode on contiguous tensors (the baseline to beat).

Results are medians over ``--reps`` runs (min also kept); the 2048^3 bf16 matmul rate is measured
in the same run, and the load average is recorded because the machine may be shared. JSON goes
to ``bench/out/decode.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
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


def timeit(fn: Callable[[], object], reps: int) -> dict:
    """Median and min wall time (s) of ``fn`` after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(times), "min_s": min(times)}


def matmul_rate(reps: int) -> dict:
    """bf16 2048^3 torch.matmul rate, GFLOP/s (median and best)."""
    a = torch.randn(2048, 2048).bfloat16()
    b = torch.randn(2048, 2048).bfloat16()
    t = timeit(lambda: a @ b, reps)
    flops = 2 * 2048**3
    return {"median_gflops": flops / t["median_s"] / 1e9, "best_gflops": flops / t["min_s"] / 1e9}


def build_cache(B: int, S: int, page_size: int, layout: str, seed: int = 0):
    """A one-layer bf16 cache holding S random tokens per sequence, pages shuffled or in order."""
    cfg = preset("deepseek-v3")
    D = cfg.cache_head_dim
    pages = B * (-(-(S + 1) // page_size)) + 4
    cache = PagedLatentCache(1, pages, page_size=page_size, head_dim=D, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(seed)
    if layout == "shuffled":  # pages of every sequence scattered over the pool
        cache.allocator._free = torch.randperm(pages, generator=g).tolist()
    cache.blocks.copy_(torch.randn(cache.blocks.shape, generator=g).bfloat16())
    ids = list(range(B))
    cache.commit(cache.prepare(ids, [S] * B))
    return cfg, cache, cache.prepare(ids, [1] * B)


def baseline(B: int, H: int, S: int, scale: float) -> Callable[[], torch.Tensor]:
    """Plain decode on contiguous tensors: bmm, float32 softmax, bmm."""
    q = torch.randn(B, H, 576).bfloat16()
    k = torch.randn(B, S, 576).bfloat16()

    def run() -> torch.Tensor:
        s = torch.bmm(q, k.transpose(1, 2))
        p = torch.softmax(s.float() * scale, dim=-1).bfloat16()
        return torch.bmm(p, k[..., :512])

    return run


def bench_heads(H: int, B: int, S: int, page_size: int, layout: str, reps: int, rate: float) -> dict:
    cfg, cache, batch = build_cache(B, S, page_size, layout)
    cfg = cfg.with_heads(H)
    L, R, Dn, Dv = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
    g = torch.Generator().manual_seed(1)
    rnd = lambda *s, scale=1.0: (torch.randn(*s, generator=g) * scale).bfloat16()  # noqa: E731
    q = rnd(B, H, Dn + R)
    kv = rnd(B, L + R)
    w_k = rnd(H * Dn, L, scale=L**-0.5)
    w_uk = w_k.view(H, Dn, L).transpose(1, 2).contiguous()
    w_uv = rnd(H, Dv, L, scale=L**-0.5)
    freqs = rope_freqs_cis(cfg, S + 8)
    gamma = torch.ones(L).bfloat16()
    q_abs = rnd(B, H, L + R, scale=0.3)
    scale = cfg.softmax_scale

    attn_flops = 2 * B * H * S * (L + R + L)
    fused_flops = attn_flops + 2 * B * H * Dn * L * 2
    cache_bytes = B * S * (L + R) * 2
    decode = lambda: openmla.flare_mla_decode(q_abs, batch, 0, scale=scale, kv_lora_rank=L, backend="torch")  # noqa: E731
    fused = lambda: openmla.mla_prefill_decode_graph(  # noqa: E731
        q, kv, batch.input_row_offsets, freqs, gamma, batch, 0, w_k, w_uk, w_uv, scale=scale, backend="torch")
    rows = {}
    for name, fn, flops in (("flare_mla_decode", decode, attn_flops), ("fused", fused, fused_flops),
                            ("baseline_bmm_softmax_bmm", baseline(B, H, S, scale), attn_flops)):
        t = timeit(fn, reps)
        gf = flops / t["median_s"] / 1e9
        rows[name] = {**t, "gflops": gf, "frac_matmul": gf / rate, "cache_gbps": cache_bytes / t["median_s"] / 1e9,
                      "best_frac_matmul": flops / t["min_s"] / 1e9 / rate}
    base = rows["baseline_bmm_softmax_bmm"]["median_s"]
    for name in ("flare_mla_decode", "fused"):
        rows[name]["speedup_vs_baseline"] = base / rows[name]["median_s"]
    return {"H": H, "B": B, "S": S, "page_size": page_size, "layout": layout, "results": rows}


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
    mm_before = matmul_rate(args.reps)
    rate = mm_before["median_gflops"]
    print(f"{info['cpu']}, {info['threads']} threads, torch {info['torch']}, load {info['loadavg_before']}")
    print(f"bf16 2048^3 matmul: {rate:.0f} GFLOP/s (best {mm_before['best_gflops']:.0f})")
    runs = []
    for layout in args.layouts:
        for H in args.heads:
            r = bench_heads(H, args.batch, args.seq, args.page_size, layout, args.reps, rate)
            runs.append(r)
            for name, v in r["results"].items():
                extra = f"  x{v['speedup_vs_baseline']:.2f} vs baseline" if "speedup_vs_baseline" in v else ""
                print(f"H={H:3d} {layout:10s} {name:25s} {v['median_s'] * 1e3:7.2f} ms {v['gflops']:6.0f} GFLOP/s "
                      f"{v['frac_matmul']:.2f} of matmul (best {v['best_frac_matmul']:.2f}) "
                      f"{v['cache_gbps']:5.1f} GB/s cache{extra}")
    mm_after = matmul_rate(args.reps)
    info["loadavg_after"] = os.getloadavg()
    print(f"bf16 matmul after: {mm_after['median_gflops']:.0f} GFLOP/s; load {info['loadavg_after']}")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": info, "matmul": mm_before,
                               "matmul_after": mm_after, "runs": runs}, indent=2))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
