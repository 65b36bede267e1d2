"""Host overhead of one decode step over a whole model's layers (issue: plan once per step).

Run: ``.venv/bin/python bench/bench_host.py [--layers 61] [--batch 8 32] [--reps 7]``

DeepSeek-V3 attention dims (L=512, R=64, Dn=128, Dv=128), H=16 (a TP=8 shard), ``--layers``
layers, B sequences of 16 cached tokens and one new token each: the attention work per layer is
tiny, so the step time is mostly host work (argument checks, planning, op dispatch).

The ways to run the same step:
- ``per-op``: the fused ``mla_prefill_decode_graph`` once per layer (what a model built on the
  seed-named ops does: the first call validates and plans, the next ones find the plan kept on
  the batch and compare its metadata by value);
- ``plan``: ``openmla.plan(batch, ...)`` once, then ``plan.run(q, kv, layer, weights, freqs_cis)``
  per layer (the layer's ``LayerWeights`` made once, as a model does);
- ``plan+combine``: the same with ``openmla.combine``'s absorb/unabsorb (one ``torch.bmm`` each)
  instead of the backend's own (only where the backend has them: the native ``cpu`` one).

- ``engine``: what the vLLM plugin does (``openmla.integrations.vllm``): one cache tensor per layer,
  ``openmla.plan`` once per step over the first, then per layer ``plan.with_blocks(its cache)
  .decode(q_abs, 0, return_lse=True)`` (the absorbed form; vLLM absorbs q itself), on the
  native ``cpu`` backend where it builds, under ``torch.inference_mode`` as vLLM runs it.

Each runs twice: on the real backend (the step time), and with null kernels that return at once,
so that the time left is the host path alone. For the first three the null kernels are a null
backend (checks, planning, dispatch; absorption calls excluded); for ``engine`` the native decode
operator is replaced by a no-op, so the cpu backend's own Python (its wrappers, output
allocation) counts too. Host time per layer = null-kernel process CPU time / layers: CPU time
holds when another process shares the box. JSON: ``bench/out/host.json``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
import openmla  # noqa: E402
from openmla import LayerWeights, PagedLatentCache, preset, rope_freqs_cis  # noqa: E402
from openmla.backends import Backend  # noqa: E402

OUT = Path(__file__).resolve().parent / "out" / "host.json"
CACHED = 16


def setup(layers: int, B: int, seed: int = 0):
    cfg = preset("deepseek-v3", num_heads=16)
    H, L, R, Dn, Dv = cfg.num_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
    g = torch.Generator().manual_seed(seed)
    cache = PagedLatentCache(layers, B + 2, page_size=64, head_dim=L + R, dtype=torch.bfloat16)
    cache.blocks.copy_(torch.randn(cache.blocks.shape, generator=g).bfloat16())
    ids = list(range(B))
    cache.commit(cache.prepare(ids, [CACHED] * B))
    batch = cache.prepare(ids, [1] * B)
    bf = lambda *s: torch.randn(*s, generator=g).bfloat16()  # noqa: E731
    w_k = bf(H * Dn, L) * L**-0.5
    weights = dict(w_k=w_k, w_uk=w_k.view(H, Dn, L).transpose(1, 2).contiguous(), w_uv=bf(H, Dv, L) * L**-0.5)
    inputs = dict(q=bf(B, H, Dn + R), kv=bf(B, L + R), freqs_cis=rope_freqs_cis(cfg, 4096), gamma=torch.ones(L).bfloat16())
    weights["layer"] = LayerWeights(inputs["gamma"], weights["w_k"], weights["w_uk"], weights["w_uv"])
    return cfg, cache, batch, weights, inputs


def step_per_op(cfg, batch, w, x, layers: int) -> None:
    for layer in range(layers):
        openmla.mla_prefill_decode_graph(x["q"], x["kv"], batch.input_row_offsets, x["freqs_cis"], x["gamma"], batch, layer,
                                         w["w_k"], w["w_uk"], w["w_uv"], scale=cfg.softmax_scale)


def step_plan(cfg, batch, w, x, layers: int, combine: bool = False) -> None:
    plan = openmla.plan(batch, scale=cfg.softmax_scale)
    if combine:
        plan = without_backend_absorb(plan)
    for layer in range(layers):
        plan.run(x["q"], x["kv"], layer, w["layer"], x["freqs_cis"])


@torch.inference_mode()  # as vLLM's model runner
def step_engine(cfg, batch, w, x, layers: int) -> None:
    plan = openmla.plan(x["engine_batch"], scale=cfg.softmax_scale, decode_max_q_len=1, backend="cpu")
    for layer in range(layers):
        plan.with_blocks(x["engine_blocks"][layer]).decode(x["q_abs"], 0, kv_lora_rank=cfg.kv_lora_rank, return_lse=True)


def engine_inputs(cache, batch, x) -> None:
    """The ``engine`` way's inputs: per-layer float32 cache tensors ``[1, pages, page_size, L+R]``
    (copies of the cache's layers; float32 so that no dtype conversion, which is kernel work on a CPU
    without bf16 products, counts as host path), a batch over the first, an absorbed query ``[B, H, L+R]``."""
    x["engine_blocks"] = [cache.blocks[i:i + 1].float() for i in range(cache.blocks.shape[0])]
    x["engine_batch"] = openmla.CacheBatch(x["engine_blocks"][0], batch.block_table, batch.cache_lengths,
                                           batch.input_row_offsets, page_size=batch.page_size)
    B, H = x["q"].shape[:2]
    x["q_abs"] = torch.randn(B, H, cache.blocks.shape[3])


def null_native(enabled: bool) -> None:
    """Replace the native cpu backend's operators with no-ops (or put them back): its Python stays."""
    from openmla.backends.cpu import build

    real = getattr(build, "_real_ops", build.ops)
    build._real_ops = real
    null = types.SimpleNamespace(decode=lambda *args: None)
    build.ops = (lambda: null) if enabled else real


def without_backend_absorb(plan):
    """``plan`` with a backend that lacks its own ``absorb``/``unabsorb`` (the plan then runs
    ``openmla.combine``'s, one ``torch.bmm`` each); unchanged on the null backend."""
    be = plan.backend
    if isinstance(be, NullBackend) or type(be).absorb is Backend.absorb:
        return plan
    out = copy.copy(plan)
    out.backend = copy.copy(be)
    out.backend.absorb = types.MethodType(Backend.absorb, out.backend)
    out.backend.unabsorb = types.MethodType(Backend.unabsorb, out.backend)
    return out


class NullBackend(Backend):
    """Kernels that do no work: what is left of a step's time is the host path."""

    name = "torch"

    @staticmethod
    def _q(*args):
        return next(a for a in args if isinstance(a, torch.Tensor) and a.dim() == 3)

    def write_cache(self, *args):
        return self._q(*args)

    def absorb(self, q_rot, w_uk):
        return q_rot.new_empty(q_rot.shape[0], q_rot.shape[1], w_uk.shape[1] + 64)

    def unabsorb(self, out_lat, w_uv):
        return out_lat.new_empty(out_lat.shape[0], out_lat.shape[1], w_uv.shape[1])

    def decode(self, *args, **kw):
        q = self._q(*args)
        return q.new_empty(q.shape[0], q.shape[1], 512), q.new_empty(q.shape[0], q.shape[1], dtype=torch.float32)  # LSE: float32


def null_backend(enabled: bool) -> None:
    """Route the ``torch`` backend to ``NullBackend`` (or back)."""
    import openmla.backends as backends

    real = getattr(backends, "_real_load", backends.load_backend)
    backends._real_load = real
    null = NullBackend()  # one instance: the seed-named ops keep their plan per backend
    backends.load_backend = (lambda name: null) if enabled else real  # choose_backend looks it up here
    for mod in ("openmla.ops", "openmla.planning", "openmla.kept_plans"):  # modules that imported the name
        if mod in sys.modules and hasattr(sys.modules[mod], "load_backend"):
            sys.modules[mod].load_backend = backends.load_backend


def measure(fn, reps: int) -> tuple[float, float]:
    """(median wall seconds, median process CPU seconds) of ``fn()`` after two warm-up calls."""
    fn()
    fn()
    wall, cpu = [], []
    for _ in range(reps):
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return statistics.median(wall), statistics.median(cpu)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: host work is single-threaded anyway)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ways = {"per-op": (step_per_op, null_backend), "plan": (step_plan, null_backend)}
    from openmla.backends import load_backend, resolve_backend_name

    default = resolve_backend_name(None, torch.device("cpu"))
    if type(load_backend(default)).absorb is not Backend.absorb:
        ways["plan+combine"] = (lambda *a: step_plan(*a, combine=True), null_backend)
    if default == "cpu":  # the native kernels built here
        ways["engine"] = (step_engine, null_native)
    rows = []
    print(f"load average {os.getloadavg()}, {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{args.threads} thread(s), {args.layers} layers, H=16, {CACHED} cached tokens per sequence")
    for B in args.batch:
        cfg, cache, batch, w, x = setup(args.layers, B)
        if "engine" in ways:
            engine_inputs(cache, batch, x)
        for name, (f, null) in ways.items():
            null(True)
            null_wall, null_cpu = measure(lambda f=f: f(cfg, batch, w, x, args.layers), args.reps)
            null(False)
            wall, cpu = measure(lambda f=f: f(cfg, batch, w, x, args.layers), args.reps)
            host = null_cpu / args.layers
            rows.append(dict(batch=B, way=name, step_ms=wall * 1e3, step_cpu_ms=cpu * 1e3, host_step_cpu_ms=null_cpu * 1e3,
                             host_per_layer_us=host * 1e6))
            print(f"B={B:3d} {name:12s} step {wall * 1e3:8.2f} ms (cpu {cpu * 1e3:8.2f} ms)  host path: {null_cpu * 1e3:7.2f} ms "
                  f"per step, {host * 1e6:7.1f} us per layer")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(dict(load=os.getloadavg(), layers=args.layers, threads=args.threads, rows=rows), indent=1))


if __name__ == "__main__":
    main()
