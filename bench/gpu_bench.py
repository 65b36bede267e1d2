"""Time the triton backend on a CUDA GPU against that GPU's own measured ceilings.

    python bench/gpu_bench.py [--out DIR] [--budget-s 300]     # on a CUDA machine
    python bench/gpu_bench.py --dry-run                          # CPU, Triton interpreter, tiny shapes

Measures, in this order, writing ``gpu_bench.json`` after every step (a timeout keeps what
was done): the device's copy bandwidth (a device-to-device copy, bytes read + written)
and bf16 matmul rate; decode (B 64/128 x H 16/128 x context 4k/32k, page 64, one new token
per sequence, DeepSeek dims L=512, R=64) as CUDA-graph replays of the two decode launches
and as eager calls; prefill (H 128, one 8k-token sequence, and 8 x 1k) as the flash kernel
alone and as the whole chunked path (gather, up-projection, kernel); the cache write of 8k
tokens; decode on fp8 caches (fp8_ds_mla's 656-byte records and fp8_e4m3; B 64 x H 16/128 x
4k, page 64, bf16 q) as graph replays; and a small tile sweep for decode and prefill.
Times are medians of CUDA-event intervals. Decode GB/s counts the cache bytes read once
(the useful traffic: 1152 bytes a token for bf16, 576 for fp8_e4m3, 656 for fp8_ds_mla)
and reports it against the copy bandwidth (fp8 rows also give their speed-up over the bf16
row of the same shape); TFLOP/s count the math actually needed (causal pairs only) against
the matmul rate. A shape that fails is recorded under ``errors`` and the run goes on.
``--dry-run`` only proves the script: its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "bench" / "out"), help="folder for gpu_bench.json")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    p.add_argument("--budget-s", type=float, default=300.0, help="skip what is left once this many seconds have passed")
    p.add_argument("--no-sweep", action="store_true", help="skip the tile sweeps")
    return p.parse_args()


ARGS = parse_args()
if ARGS.dry_run:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

import openmla  # noqa: E402
from openmla import CacheBatch  # noqa: E402
from openmla.backends.triton import _common  # noqa: E402
from openmla_tools.compile_report import roofline  # noqa: E402
from openmla.cache import HostLists  # noqa: E402
from openmla.backends.triton.decode import decode_config, decode_into, default_num_splits  # noqa: E402
from openmla.backends.triton.prefill import flare_prefill_into, gather_up_project, prefill_config  # noqa: E402
from openmla.fp8 import FP8, ds_mla_record_bytes  # noqa: E402
from openmla.masks import MaskVariant  # noqa: E402

DEV = torch.device("cpu" if ARGS.dry_run else "cuda")
BF16 = torch.bfloat16
START = time.perf_counter()

if ARGS.dry_run:
    DIMS = dict(L=128, R=16, Dn=32, Dv=32)  # L: a multiple of 128 for fp8_ds_mla
    DECODE = [(2, 2, 40), (2, 16, 70)]  # (B, H, context)
    FP8_DECODE = [(2, 2, 40)]
    PREFILL = [(1, 40), (3, 12)]  # (B, new tokens each)
    PREFILL_H, PAGE, WRITE_T = 2, 16, 16
    WARMUP, ITERS, GRAPH_REPLAYS = 1, 2, 2
else:  # the shapes of the static roofline (openmla compile-report)
    DIMS = dict(L=roofline.L, R=roofline.R, Dn=roofline.DN, Dv=roofline.DV)
    DECODE, FP8_DECODE, PREFILL = roofline.DECODE, roofline.FP8_DECODE, roofline.PREFILL
    PREFILL_H, PAGE, WRITE_T = roofline.PREFILL_H, 64, roofline.WRITE_T
    WARMUP, ITERS, GRAPH_REPLAYS = 3, 20, 20


# Timing ----------------------------------------------------------------------------
def sync() -> None:
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def time_ms(fn: Callable[[], object], iters: int = ITERS, warmup: int = WARMUP) -> dict:
    """Median / min milliseconds of ``fn()`` (CUDA events on the GPU, wall clock on the CPU)."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(iters):
        if DEV.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return {"median_ms": statistics.median(times), "min_ms": min(times)}


def graph_time_ms(fn: Callable[[], object]) -> dict | None:
    """Per-call milliseconds of ``fn`` captured once in a CUDA graph and replayed (no Python
    launch overhead). None off CUDA."""
    if DEV.type != "cuda":
        return None
    fn()  # compiled and warm before capture
    sync()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return time_ms(graph.replay, iters=GRAPH_REPLAYS)


# Ceilings --------------------------------------------------------------------------
def copy_bandwidth() -> dict:
    n = (2 << 30) if DEV.type == "cuda" else (32 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    t = time_ms(lambda: dst.copy_(src), iters=10)
    return {"bytes": 2 * n, "GBps": 2 * n / (t["median_ms"] * 1e-3) / 1e9, **t}


def matmul_rate() -> dict:
    n = 8192 if DEV.type == "cuda" else 256
    a = torch.randn(n, n, device=DEV, dtype=BF16)
    b = torch.randn(n, n, device=DEV, dtype=BF16)
    t = time_ms(lambda: a @ b, iters=10)
    return {"n": n, "TFLOPs": 2 * n**3 / (t["median_ms"] * 1e-3) / 1e12, **t}


# Problem builders --------------------------------------------------------------------
FP8_FORMATS = ("fp8_ds_mla", "fp8_e4m3")
KV_SCALE = 1 / 64  # fp8_e4m3: unit-normal entries / (1/64) stay far below 448


def bytes_per_token(cache_format: str) -> int:
    L, R = DIMS["L"], DIMS["R"]
    return {"native": 2 * (L + R), "fp8_e4m3": L + R, "fp8_ds_mla": ds_mla_record_bytes(L, R)}[cache_format]


def random_batch(cache_lens: list[int], new_lens: list[int], page: int, gen: torch.Generator,
                 cache_format: str = "native") -> CacheBatch:
    """A one-layer cache holding random entries for every position (pages shuffled): bf16, or an
    fp8 format filled through ``CacheBatch.write_rows`` (the quantising writer)."""
    L, R = DIMS["L"], DIMS["R"]
    per_seq = [-(-(c + n) // page) for c, n in zip(cache_lens, new_lens)]
    num_pages = sum(per_seq)
    if cache_format == "native":
        blocks = torch.randn(1, num_pages, page, L + R, device=DEV, dtype=BF16, generator=gen)
    elif cache_format == "fp8_e4m3":
        blocks = torch.zeros(1, num_pages, page, L + R, device=DEV, dtype=FP8)
    else:
        blocks = torch.zeros(1, num_pages, page, ds_mla_record_bytes(L, R), device=DEV, dtype=torch.uint8)
    perm = torch.randperm(num_pages, device=DEV, generator=gen).to(torch.int32)
    table = torch.zeros(len(per_seq), max(per_seq), dtype=torch.int32, device=DEV)
    start = 0
    for b, n in enumerate(per_seq):
        table[b, :n] = perm[start:start + n]
        start += n
    offsets = [0]
    for n in new_lens:
        offsets.append(offsets[-1] + n)
    batch = CacheBatch(blocks, table, torch.tensor(cache_lens, dtype=torch.int32, device=DEV),
                       torch.tensor(offsets, dtype=torch.int32, device=DEV), page, cache_format=cache_format,
                       kv_scale=torch.full((1,), KV_SCALE, device=DEV) if cache_format == "fp8_e4m3" else None, rope_dim=R)
    batch._host = HostLists(list(cache_lens), offsets)
    if cache_format != "native":
        rows = num_pages * page
        for r0 in range(0, rows, 1 << 16):  # bounded float32 staging
            r = torch.arange(r0, min(rows, r0 + (1 << 16)), device=DEV)
            batch.write_rows(0, r, torch.randn(r.numel(), L + R, device=DEV, generator=gen))
    return batch


def generator() -> torch.Generator:
    return torch.Generator(device=DEV).manual_seed(0)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.float(), want.float()
    if not bool(torch.isfinite(got).all()):
        return float("inf")
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def check_decode(batch: CacheBatch, q: torch.Tensor, out: torch.Tensor, scale: float) -> float:
    """Spot check: the first and last sequence recomputed in float32 with torch."""
    L = out.shape[2]
    worst = 0.0
    for b in {0, q.shape[0] - 1}:
        n = int(batch.cache_lengths[b]) + 1
        pos = torch.arange(n, device=DEV)
        rows = batch.block_table[b, pos // PAGE].long() * PAGE + pos % PAGE
        keys = batch.read_rows(0, rows, torch.float32)  # dequantised for the fp8 formats
        p = torch.softmax(scale * q[b].float() @ keys.T, dim=-1)
        worst = max(worst, rel_err(out[b], p @ keys[:, :L]))
    return worst


def check_prefill(batch, q, k_nope, v, out, n: int, scale: float) -> float:
    """Spot check: the last two tokens of sequence 0 (they see nearly every key) in float32."""
    Dn, R = k_nope.shape[2], q.shape[2] - k_nope.shape[2]
    pos = torch.arange(n, device=DEV)
    rows = batch.block_table[0, pos // PAGE].long() * PAGE + pos % PAGE
    k_rope = batch.blocks[0].reshape(-1, batch.blocks.shape[3])[rows, -R:].float()
    worst = 0.0
    for t in (n - 2, n - 1):
        s = torch.einsum("hd,nhd->hn", q[t, :, :Dn].float(), k_nope[: t + 1].float()) + q[t, :, Dn:].float() @ k_rope[: t + 1].T
        p = torch.softmax(scale * s, dim=-1)
        worst = max(worst, rel_err(out[t], torch.einsum("hn,nhd->hd", p, v[: t + 1].float())))
    return worst


# Benchmarks --------------------------------------------------------------------------
def bench_decode(B: int, H: int, ctx: int, ceil: dict, config: dict | None = None, eager: bool = True,
                 cache_format: str = "native") -> dict:
    """One new token per sequence at position ctx-1 (so it sees ctx keys); bf16 q and output."""
    L, R = DIMS["L"], DIMS["R"]
    gen = generator()
    batch = random_batch([ctx - 1] * B, [1] * B, PAGE, gen, cache_format)
    q = torch.randn(B, H, L + R, device=DEV, dtype=BF16, generator=gen)
    kv_scale = batch.kv_scale[:1] if cache_format == "fp8_e4m3" else None
    compute = _common.cache_views(batch.blocks[0], cache_format, L, kv_scale).compute_dtype(BF16)
    config = config or decode_config(compute, DEV, H, cache_format)
    splits = default_num_splits(B, H, ctx, DEV, config["BLOCK_H"])
    out = torch.empty(B, H, L, device=DEV, dtype=BF16)
    lse = torch.empty(B, H, device=DEV)
    ws = (torch.empty(splits, B, H, L, device=DEV), torch.empty(splits, B, H, device=DEV))
    scale = (DIMS["Dn"] + R) ** -0.5

    def step():
        decode_into(q, batch.blocks[0], batch.block_table, batch.cache_lengths, batch.input_row_offsets, PAGE,
                    scale=scale, kv_lora_rank=L, num_splits=splits, out=out, lse=lse, workspace=ws, config=config,
                    cache_format=cache_format, kv_scale=kv_scale)

    res = {"B": B, "H": H, "context": ctx, "page_size": PAGE, "cache_format": cache_format, "num_splits": splits,
           "config": config}
    graph = graph_time_ms(step)
    t = graph or time_ms(step)
    res["graph" if graph else "eager"] = t
    if eager and graph:
        res["eager"] = time_ms(step)
    res["check_rel_err"] = check_decode(batch, q, out, scale)
    cache_bytes = B * ctx * bytes_per_token(cache_format)
    flops = 2 * B * H * ctx * (L + R + L)
    sec = t["median_ms"] * 1e-3
    res.update(bytes_per_token=bytes_per_token(cache_format), cache_bytes=cache_bytes, GBps=cache_bytes / sec / 1e9,
               TFLOPs=flops / sec / 1e12, frac_copy_bw=cache_bytes / sec / 1e9 / ceil["copy"]["GBps"],
               frac_matmul=flops / sec / 1e12 / ceil["matmul"]["TFLOPs"])
    return res


def with_bf16_speedup(res: dict, bf16_rows: list[dict]) -> dict:
    """Adds ``speedup_vs_bf16``: the bf16 decode time of the same shape over this one's."""
    for row in bf16_rows:
        if (row["B"], row["H"], row["context"]) == (res["B"], res["H"], res["context"]):
            key = "graph" if "graph" in res else "eager"
            if key in row:
                res["speedup_vs_bf16"] = row[key]["median_ms"] / res[key]["median_ms"]
    return res


def prefill_problem(B: int, n: int):
    """B sequences of n new tokens each (empty cache before), H heads, DeepSeek dims."""
    L, R, Dn, Dv, H = DIMS["L"], DIMS["R"], DIMS["Dn"], DIMS["Dv"], PREFILL_H
    gen = generator()
    batch = random_batch([0] * B, [n] * B, PAGE, gen)
    q = torch.randn(B * n, H, Dn + R, device=DEV, dtype=BF16, generator=gen)
    w_k = (torch.randn(H * Dn, L, device=DEV, generator=gen) * L**-0.5).to(BF16)
    w_uv = (torch.randn(H, Dv, L, device=DEV, generator=gen) * L**-0.5).to(BF16)
    return batch, q, w_k, w_uv


def bench_prefill(B: int, n: int, ceil: dict, config: dict | None = None, full_path: bool = True) -> dict:
    batch, q, w_k, w_uv = prefill_problem(B, n)
    H, Dn, Dv, R, L = PREFILL_H, DIMS["Dn"], DIMS["Dv"], DIMS["R"], DIMS["L"]
    T = B * n
    scale = (Dn + R) ** -0.5
    mask = MaskVariant()
    seq = torch.repeat_interleave(torch.arange(B), torch.tensor([n] * B))
    pos = torch.arange(T) - seq * n
    k_nope, v = gather_up_project(batch, 0, seq, pos, w_k, w_uv, BF16)
    offs = batch.input_row_offsets
    zeros = torch.zeros(B + 1, dtype=torch.int32, device=DEV)
    out = torch.empty(T, H, Dv, device=DEV, dtype=BF16)
    lse = torch.empty(T, H, device=DEV)

    def kernel():
        flare_prefill_into(q, k_nope, v, offs, zeros, batch, 0, out, lse, scale=scale, mask=mask,
                           max_new_tokens=n, config=config)

    res = {"B": B, "new_tokens": n, "H": H, "config": config or prefill_config(BF16, DEV)}
    pairs = B * n * (n + 1) // 2
    attn_flops = 2 * pairs * H * (Dn + R + Dv)
    t = time_ms(kernel)
    res["check_rel_err"] = check_prefill(batch, q, k_nope, v, out, n, scale)
    res["kernel"] = {**t, "TFLOPs": attn_flops / (t["median_ms"] * 1e-3) / 1e12,
                     "frac_matmul": attn_flops / (t["median_ms"] * 1e-3) / 1e12 / ceil["matmul"]["TFLOPs"]}
    if full_path:
        del k_nope, v
        up_flops = 2 * T * L * H * (Dn + Dv)

        step = openmla.plan(batch, scale=scale, backend="triton")  # the host work once, as a model step does

        def full():
            step.prefill(q, 0, w_k, w_uv)

        t = time_ms(full, iters=max(2, ITERS // 4))
        tf = (attn_flops + up_flops) / (t["median_ms"] * 1e-3) / 1e12
        res["full_path"] = {**t, "TFLOPs": tf, "frac_matmul": tf / ceil["matmul"]["TFLOPs"]}
    return res


def bench_write(T: int, ceil: dict) -> dict:
    L, R, Dn, H = DIMS["L"], DIMS["R"], DIMS["Dn"], PREFILL_H
    gen = generator()
    batch = random_batch([0], [T], PAGE, gen)
    q = torch.randn(T, H, Dn + R, device=DEV, dtype=BF16, generator=gen)
    kv = torch.randn(T, L + R, device=DEV, dtype=BF16, generator=gen)
    freqs = torch.randn(T, R, device=DEV, generator=gen)
    gamma = torch.ones(L, device=DEV, dtype=BF16)
    step = openmla.plan(batch, scale=1.0, backend="triton")
    t = time_ms(lambda: step.write_cache(q, kv, freqs, gamma, 0))
    moved = 2 * q.numel() * 2 + kv.numel() * 2 + T * (L + R) * 2 + freqs.numel() * 4
    gbps = moved / (t["median_ms"] * 1e-3) / 1e9
    return {"T": T, "H": H, **t, "bytes": moved, "GBps": gbps, "frac_copy_bw": gbps / ceil["copy"]["GBps"]}


DECODE_SWEEP = [  # BLOCK_H, BLOCK_N, num_warps, num_stages (64-head blocks spill on sm_90: one kept as a data point)
    (16, 32, 4, 2), (16, 32, 8, 2), (16, 64, 4, 2), (16, 16, 4, 3), (32, 32, 8, 2), (32, 16, 8, 2), (32, 16, 4, 2),
    (64, 16, 8, 1),
]
DECODE_SWEEP_SHAPES = [(128, 128, 4096), (64, 16, 32768)]  # B, H, context
PREFILL_SWEEP = [(128, 32, 8, 3), (64, 64, 8, 2), (128, 64, 8, 2), (128, 64, 8, 3), (64, 32, 4, 3)]  # M, N, warps, stages


# Driver ----------------------------------------------------------------------------
class Recorder:
    """Collects results and rewrites the JSON after each step."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict = {"dry_run": ARGS.dry_run, "errors": [], "skipped": []}

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data, indent=1, default=str))

    def run(self, section: str, label: str, fn: Callable[[], dict]) -> dict | None:
        if time.perf_counter() - START > ARGS.budget_s:
            self.data["skipped"].append(f"{section} {label}: time budget spent")
            print(f"[skip] {section} {label}: time budget spent", flush=True)
            return None
        try:
            res = fn()
        except Exception as exc:  # one shape failing must not end the run
            self.data["errors"].append({"section": section, "label": label, "error": repr(exc)[:2000],
                                        "trace": traceback.format_exc()[-4000:]})
            print(f"[error] {section} {label}: {exc!r}"[:600], flush=True)
            res = None
        else:
            self.data.setdefault(section, []).append(res)
            print(f"[{section}] {label}: {summary(res)}", flush=True)
        finally:
            if DEV.type == "cuda":
                torch.cuda.empty_cache()
        self.save()
        return res


def summary(res: dict) -> str:
    keys = ("check_rel_err", "GBps", "TFLOPs", "frac_copy_bw", "frac_matmul", "speedup_vs_bf16", "median_ms")
    parts = [f"{k}={res[k]:.4g}" for k in keys if isinstance(res.get(k), (int, float))]
    for sub in ("graph", "eager", "kernel", "full_path"):
        if isinstance(res.get(sub), dict):
            parts.append(f"{sub}: " + " ".join(f"{k}={v:.4g}" for k, v in res[sub].items() if isinstance(v, float)))
    return "  ".join(parts)


def main() -> int:
    rec = Recorder(Path(ARGS.out) / "gpu_bench.json")
    info = {"torch": torch.__version__, "python": platform.python_version()}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if DEV.type == "cuda":
        prop = torch.cuda.get_device_properties(DEV)
        info.update(name=prop.name, sms=prop.multi_processor_count, memory_GiB=round(prop.total_memory / 2**30, 1))
    rec.data["device"] = info
    print(json.dumps(info), flush=True)
    ceil = {"copy": copy_bandwidth(), "matmul": matmul_rate()}
    rec.data["ceilings"] = ceil
    rec.save()
    print(f"[ceilings] copy {ceil['copy']['GBps']:.0f} GB/s, bf16 matmul {ceil['matmul']['TFLOPs']:.0f} TFLOP/s", flush=True)

    for B, H, ctx in DECODE:
        rec.run("decode", f"B={B} H={H} ctx={ctx}", lambda: bench_decode(B, H, ctx, ceil))
    for B, n in PREFILL:
        rec.run("prefill", f"B={B} n={n} H={PREFILL_H}", lambda: bench_prefill(B, n, ceil))
    rec.run("write_cache", f"T={WRITE_T}", lambda: bench_write(WRITE_T, ceil))
    for fmt in FP8_FORMATS:
        for B, H, ctx in FP8_DECODE:
            rec.run("decode_fp8", f"{fmt} B={B} H={H} ctx={ctx}", lambda: with_bf16_speedup(
                bench_decode(B, H, ctx, ceil, eager=False, cache_format=fmt), rec.data.get("decode", [])))
    if not ARGS.no_sweep:
        for B, H, ctx in DECODE[-1:] if ARGS.dry_run else DECODE_SWEEP_SHAPES:
            for bh, bn, w, s in DECODE_SWEEP[: 2 if ARGS.dry_run else None]:
                if bh > max(16, H):
                    continue  # a head block wider than the heads only pads
                cfg = dict(BLOCK_H=bh, BLOCK_N=bn, num_warps=w, num_stages=s)
                if DEV.type != "cuda":
                    cfg = dict(BLOCK_H=bh, BLOCK_N=bn)
                rec.run("decode_sweep", f"B={B} H={H} ctx={ctx} {cfg}",
                        lambda: bench_decode(B, H, ctx, ceil, config=cfg, eager=False))
        B, n = PREFILL[0]
        for bm, bn, w, s in PREFILL_SWEEP[: 2 if ARGS.dry_run else None]:
            cfg = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s)
            if DEV.type != "cuda":
                cfg = dict(BLOCK_M=bm // 4, BLOCK_N=bn // 4)
            rec.run("prefill_sweep", str(cfg), lambda: bench_prefill(B, n, ceil, config=cfg, full_path=False))
    rec.data["elapsed_s"] = time.perf_counter() - START
    rec.save()
    print(f"wrote {rec.path} ({len(rec.data['errors'])} errors, {len(rec.data['skipped'])} skipped, "
          f"{rec.data['elapsed_s']:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    if not ARGS.dry_run and not torch.cuda.is_available():
        sys.exit("gpu_bench: no CUDA device (use --dry-run to check the script on the CPU)")
    sys.exit(main())
