"""A decode step over all layers of a model, captured in one CUDA graph and replayed.

Run: ``python bench/gpu_graph.py [--layers 8] [--batch 8] [--context 1000] [--steps 4]``
(on a CUDA device; ``--device cpu`` runs the same steps without capture, to check the script).

The plan is made once with fixed capacities (``num_partitions``, ``max_pages``); the graph is
captured from ``plan.run`` over every layer; each later step commits, prepares the next batch,
``plan.refill``s it in place and replays. Every replayed step is compared with an eager run of
the same step (fresh plan, its own copy of the cache), and both caches must stay equal.
Prints one JSON line with the errors and the eager / replay step times.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
import openmla  # noqa: E402
from openmla import LatentAttention, PagedLatentCache, preset  # noqa: E402
from openmla_tools.testing import rel_err  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    dev = torch.device(args.device)
    capture = dev.type == "cuda"
    torch.manual_seed(0)
    cfg = preset("deepseek-v3", num_heads=args.heads)
    dtype = torch.bfloat16
    page = 64
    longest = args.context + args.steps + 2
    layers = [LatentAttention(cfg, i, dtype=dtype, device=dev, max_position=longest) for i in range(args.layers)]
    with torch.no_grad():
        for layer in layers:
            for p in layer.parameters():
                p.normal_(0, 0.02)
            layer.split_kv_b()
    pages = args.batch * -(-longest // page) + 2
    caches = [PagedLatentCache(args.layers, pages, page_size=page, head_dim=cfg.cache_head_dim, dtype=dtype, device=dev)
              for _ in range(2)]  # [0]: replayed, [1]: eager
    ids = list(range(args.batch))
    for cache in caches:  # the same prompts in both
        cache.blocks.normal_(generator=torch.Generator(device=dev).manual_seed(1))
        cache.commit(cache.prepare(ids, [args.context] * args.batch))
    max_pages = -(-longest // page)
    hidden = torch.zeros(args.batch, cfg.hidden_size, dtype=dtype, device=dev)  # the graph's static input
    batch = caches[0].prepare(ids, [1] * args.batch)
    plan = openmla.plan(batch, scale=cfg.softmax_scale, num_partitions=4, max_pages=max_pages)

    def step() -> torch.Tensor:
        x = hidden
        for layer in layers:
            x = x + layer(x, plan)
        return x

    with torch.inference_mode():
        hidden.normal_()
        step()  # warm-up (compiles the kernels) on this step's batch; rewritten identically below
        if capture:
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out_static = step()
        errors, t_eager, t_replay = [], [], []
        for i in range(args.steps):
            if i:
                caches[0].commit(batch)
                batch = caches[0].prepare(ids, [1] * args.batch)
                plan.refill(batch)
            hidden.normal_()
            t0 = time.perf_counter()
            if capture:
                graph.replay()
                torch.cuda.synchronize()
                got = out_static.clone()
            else:
                got = step()
            t_replay.append(time.perf_counter() - t0)
            eager_batch = caches[1].prepare(ids, [1] * args.batch)
            t0 = time.perf_counter()
            x = hidden.clone()
            eager_plan = openmla.plan(eager_batch, scale=cfg.softmax_scale)
            for layer in layers:
                x = x + layer(x, eager_plan)
            if capture:
                torch.cuda.synchronize()
            t_eager.append(time.perf_counter() - t0)
            caches[1].commit(eager_batch)
            errors.append(rel_err(got, x))
        caches[0].commit(batch)
    cache_err = rel_err(caches[0].blocks.float(), caches[1].blocks.float())
    ok = max(errors) <= 2e-2 and cache_err <= 1e-2
    print(json.dumps(dict(device=str(dev), captured=capture, layers=args.layers, batch=args.batch, context=args.context,
                          max_rel_err=max(errors), cache_rel_err=cache_err, eager_ms=[t * 1e3 for t in t_eager],
                          replay_ms=[t * 1e3 for t in t_replay], ok=ok)))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
