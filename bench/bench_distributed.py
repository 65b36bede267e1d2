"""Scale-out on this machine: per-rank cache bytes, bytes sent per step, step time, for tp/cp grids.

Run: ``.venv/bin/python bench/bench_distributed.py [--context 2048] [--batch 4] [--reps 5]``

One world of 4 gloo processes (spawned once) runs each grid in turn on a subset of its ranks:
tp x cp in (1x1, 2x1, 4x1, 1x2, 1x4, 2x2); idle ranks wait. The layer: DeepSeek-V3 dims with
H=16 heads in all (a TP=8 shard of V3 stands for "the model" here), hidden 7168, bf16, one layer,
page 64, interleave 64. Workload per grid:

- cache: ``batch`` sequences of ``context`` tokens, reserved and committed without running the
  layer (entries are zeros: the timing does not depend on them);
- prefill: 2 new sequences of 512 tokens (under cp > 1 this runs the absorbed form with per-token
  key gathers, see docs/distributed.md);
- decode: one new token for each of the ``batch`` sequences, once to warm up, then ``reps``
  times (median).

Bytes are what ``Grid.stats`` counts (ring-algorithm bytes sent by one rank, the NCCL figure):
per layer call, and the per-step agreement (prepare + plan) separately. Times on 2 shared cores
with up to 4 processes are for the record; the memory and byte figures are the point. Also prints
the 8-GPU model of bench/RESULTS.md. JSON: ``bench/out/distributed.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from openmla import LatentAttention, preset  # noqa: E402
from openmla import distributed  # noqa: E402
from openmla.distributed import ContextParallelCache, TensorParallelAttention, init_grid  # noqa: E402

OUT = Path(__file__).resolve().parent / "out" / "distributed.json"
WORLD = 4
GRIDS = [(1, 1), (2, 1), (4, 1), (1, 2), (1, 4), (2, 2)]
HEADS = 16
PAGE = 64


def run_grid(grid, cfg, whole: LatentAttention, context: int, batch: int, reps: int) -> dict:
    torch.set_num_threads(1)  # one thread per rank: 2-thread processes thrash when the shared box is loaded
    layer = TensorParallelAttention(cfg, 0, grid=grid, dtype=torch.bfloat16)
    layer.load_hf_state_dict(whole.state_dict())
    pages = -(-(batch * context + 2 * 512 + batch * (reps + 2)) // PAGE) // grid.cp + 2 * batch + 4
    cache = ContextParallelCache(grid, 1, pages, PAGE, cfg.cache_head_dim, torch.bfloat16, rope_dim=cfg.qk_rope_head_dim)
    ids = list(range(batch))
    cache.commit(cache.prepare(ids, [context] * batch))
    g = torch.Generator().manual_seed(0)
    stats = grid.stats
    row: dict = {"tp": grid.tp, "cp": grid.cp, "threads": torch.get_num_threads()}

    def step(seq_ids, counts) -> tuple[float, int, int]:
        sent0 = stats.bytes_sent
        b = cache.prepare(seq_ids, counts)
        plan = distributed.plan(b, scale=cfg.softmax_scale)
        agreed = stats.bytes_sent - sent0
        hidden = torch.randn(sum(counts), cfg.hidden_size, generator=g).bfloat16()
        dist.barrier(group=grid.group)
        t0 = time.perf_counter()
        sent1 = stats.bytes_sent
        with torch.inference_mode():
            layer(hidden, plan)
        dt = time.perf_counter() - t0
        cache.commit(b)
        return dt, stats.bytes_sent - sent1, agreed

    t, sent, agreed = step(["p0", "p1"], [512, 512])
    row.update(prefill_s=t, prefill_bytes_per_layer=sent, agree_bytes_per_step=agreed)
    step(ids, [1] * batch)  # warm-up
    times, sents = [], []
    for _ in range(reps):
        t, sent, _ = step(ids, [1] * batch)
        times.append(t)
        sents.append(sent)
    row.update(decode_s=statistics.median(times), decode_bytes_per_layer=sents[-1])
    row.update(cache_bytes_in_use=cache.pages_in_use * PAGE * cache.bytes_per_token, cache_pool_bytes=cache.storage_bytes,
               tokens_held=sum(cache.local_length(s) for s in cache.sequences),
               tokens_total=sum(cache.length(s) for s in cache.sequences))
    return row


def worker(rank: int, store: str, args: argparse.Namespace, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=600))
    cfg = preset("deepseek-v3", num_heads=HEADS)
    whole = LatentAttention(cfg, 0, dtype=torch.bfloat16)  # the same seeded weights on every rank
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in whole.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / (p.shape[1] ** 0.5 if p.dim() == 2 else 1.0))
    whole.split_kv_b()
    rows = []
    grids = [init_grid(tp, cp, ranks=list(range(tp * cp)), timeout=datetime.timedelta(seconds=600)) for tp, cp in GRIDS]
    for grid in grids:
        if grid is not None:
            per_rank: list = [None] * grid.size
            mine = run_grid(grid, cfg, whole, args.context, args.batch, args.reps)
            dist.all_gather_object(per_rank, mine, group=grid.group)
            rows.append({"tp": grid.tp, "cp": grid.cp, "ranks": per_rank})
            if rank == 0:
                print(summary(rows[-1]), flush=True)
        dist.barrier()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def summary(r: dict) -> str:
    ranks = r["ranks"]
    mib = 1 << 20
    return (f"tp={r['tp']} cp={r['cp']}: cache in use per rank {max(x['cache_bytes_in_use'] for x in ranks) / mib:7.2f} MiB "
            f"({min(x['tokens_held'] for x in ranks)}-{max(x['tokens_held'] for x in ranks)} of {ranks[0]['tokens_total']} tokens); "
            f"bytes sent per layer: decode {max(x['decode_bytes_per_layer'] for x in ranks):>9,} "
            f"prefill {max(x['prefill_bytes_per_layer'] for x in ranks):>11,}; agreement per step {ranks[0]['agree_bytes_per_step']:,}; "
            f"decode {max(x['decode_s'] for x in ranks) * 1e3:7.1f} ms, prefill {max(x['prefill_s'] for x in ranks):6.2f} s")


def model_8gpu() -> str:
    """DeepSeek-V3 (61 layers, H=128, Dv=128, hidden 7168), 128k context, batch 32, bf16 cache."""
    layers, H, Dv, hidden, entry = 61, 128, 128, 7168, 1152
    tokens = 32 * 131072
    cache = layers * entry * tokens  # bytes, all ranks together
    T = 32  # one new token per sequence
    lines = [f"DeepSeek-V3, 128k context x batch 32 = {tokens:,} tokens, {layers} layers x {entry} B = {cache / 1e9:.1f} GB of latent cache",
             "grid (GPUs) | cache GB per GPU | CP merge bytes sent per GPU per decode step | TP all-reduce bytes per GPU per step"]
    for tp, cp in ((8, 1), (1, 8), (2, 4), (8, 8)):
        heads = H // tp
        merge = 0.0
        if cp > 1:  # all-gather of lse [T, H/tp] fp32 + all-reduce of out [T, H/tp, Dv] fp32, per layer
            merge = layers * ((cp - 1) * T * heads * 4 + 2 * (cp - 1) / cp * T * heads * Dv * 4)
        tp_bytes = layers * 2 * (tp - 1) / tp * T * hidden * 2 if tp > 1 else 0.0  # bf16 [T, hidden]
        lines.append(f"tp={tp} x cp={cp} ({tp * cp}) | {cache / cp / 1e9:.1f} | {merge / 1e6:.2f} MB | {tp_bytes / 1e6:.2f} MB")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    import torch.multiprocessing as mp

    OUT.parent.mkdir(parents=True, exist_ok=True)
    print(f"torch {torch.__version__}, {os.cpu_count()} cpus, load {os.getloadavg()[0]:.1f}; H={HEADS}, "
          f"{args.batch} x {args.context} cached, bf16, page {PAGE}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(os.path.join(tmp, "store"), args, str(OUT)), nprocs=WORLD, join=True)
    print(model_8gpu())
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
