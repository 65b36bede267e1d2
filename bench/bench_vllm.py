"""openmla inside vLLM against vLLM's own CPU MLA backends: decode tokens/s, per-layer attention
time in the engine, and the standalone decode ops beside them.

Run with the vLLM venv (``make test-vllm`` creates it): ``.venv-vllm/bin/python bench/bench_vllm.py``.
For each head count (H=16, H=128) and backend (vLLM's ``AMX_MLA`` where the CPU has AMX, its
``CPU_MLA`` with AMX hidden, openmla's through ``OPENMLA_VLLM=1``) a fresh process builds a
random-weight 2-layer DeepSeek-V2-shaped checkpoint (the real MLA dims), serves 8 prompts of
4096 tokens with greedy decoding, and times every decode step of the full batch:
- ``step ms``: the model runner's execute + sample of one decode step (8 new tokens);
- ``attn ms/layer``: vLLM's whole MLA attention op per layer (q absorption, kernel, W_UV),
  without the cache write; ``kernel ms/layer``: the backend's ``forward_mqa`` alone;
- ``op ms``: the same decode kernel called directly on random data of the step's shape (8
  sequences of 4096 cached tokens, the engine's page size) in the same process (median, min),
  called back to back (its 38 MB of pages stay in a large last-level cache) and ``cold`` (a
  512 MiB buffer rewritten before each call evicts them);
- ``build ms``: the attention metadata builder's ``build`` per step (wall, and this thread's CPU
  time), vLLM's own builder or openmla's (vLLM's MLA metadata plus the step's openmla plans);
  ``plan cpu ms``: the openmla plans alone (CPU time; 0 for vLLM's backends).
JSON: ``bench/out/bench_vllm.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
B, CONTEXT, NEW = 8, 4096, 16  # sequences, prompt tokens, decode steps timed (--context, --new change the last two)
DTYPE = "bfloat16"  # the engine's and the standalone op's dtype (--dtype; auto: float32 where bf16 matmuls are emulated)


# The child: one engine, one backend ------------------------------------------------------
def _timed(cls, name, sink):
    fn = getattr(cls, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            sink.append(time.perf_counter() - t0)

    setattr(cls, name, wrapper)


def _timed_outer(cls, name, sink):
    """Like ``_timed``, but only the outermost of nested calls (a builder's ``build`` calls its base's);
    records (wall, this thread's CPU time): the host path is one thread, its CPU time holds under load."""
    fn, depth = getattr(cls, name), [0]

    def wrapper(*args, **kwargs):
        depth[0] += 1
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            depth[0] -= 1
            if depth[0] == 0:
                sink.append((time.perf_counter() - t0, time.thread_time() - c0))

    setattr(cls, name, wrapper)


def child(heads: int, backend: str, workdir: Path) -> dict:
    import torch

    global CONTEXT, NEW, DTYPE
    CONTEXT, NEW, DTYPE = int(os.environ["BENCH_CONTEXT"]), int(os.environ["BENCH_NEW"]), os.environ["BENCH_DTYPE"]
    kv_cache_dtype = os.environ.get("BENCH_KV_CACHE_DTYPE", "auto")

    if backend == "CPU_MLA":
        torch.cpu._is_amx_tile_supported = lambda: False  # vLLM's non-AMX path: its reference backend
    sys.path.insert(0, str(ROOT / "tests_vllm"))
    from models import deepseek_v2, save_model
    from vllm import LLM, SamplingParams
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention, MLACommonMetadataBuilder
    from vllm.v1.attention.backends.mla.amx_mla import AMXMLAMetadataBuilder
    from vllm.v1.attention.backends.mla.amx_mla import AMXMLAImpl
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from openmla.integrations.vllm.impl import OpenMLAImpl
    from openmla.integrations.vllm.metadata import OpenMLAMetadataBuilder

    attn, kernel, steps, build, plan = [], [], [], [], []
    for cls in (MLACommonMetadataBuilder, AMXMLAMetadataBuilder, OpenMLAMetadataBuilder):
        _timed_outer(cls, "build", build)
    _timed_outer(OpenMLAMetadataBuilder, "_plan", plan)
    _timed(MLAAttention, "forward_impl", attn)
    for cls in (AMXMLAImpl, CPUMLAImpl, OpenMLAImpl):
        _timed(cls, "forward_mqa", kernel)
    execute, sample = GPUModelRunner.execute_model, GPUModelRunner.sample_tokens
    state = {}

    def execute_model(self, scheduler_output, *a, **k):
        attn.clear(), kernel.clear(), build.clear(), plan.clear()
        state.update(t0=time.perf_counter(), tokens=scheduler_output.total_num_scheduled_tokens,
                     reqs=len(scheduler_output.num_scheduled_tokens))
        return execute(self, scheduler_output, *a, **k)

    def sample_tokens(self, *a, **k):
        out = sample(self, *a, **k)
        if state.get("tokens") == B and state.get("reqs") == B:  # a decode step of the full batch
            steps.append((time.perf_counter() - state["t0"], sum(attn), sum(kernel),
                          sum(w for w, _ in build), sum(c for _, c in build), sum(c for _, c in plan)))
        return out

    GPUModelRunner.execute_model, GPUModelRunner.sample_tokens = execute_model, sample_tokens

    cfg = deepseek_v2(num_heads=heads)
    cfg["max_position_embeddings"] = CONTEXT + 256
    model = save_model(cfg, workdir / f"v2-h{heads}")
    llm = LLM(model=str(model), skip_tokenizer_init=True, dtype=DTYPE, enforce_eager=True, max_model_len=CONTEXT + 64,
              max_num_seqs=B, max_num_batched_tokens=8192, kv_cache_memory_bytes=512 << 20, seed=0,
              kv_cache_dtype=kv_cache_dtype)
    layers = [m for m in llm.llm_engine.vllm_config.compilation_config.static_forward_context.values() if isinstance(m, MLAAttention)]
    impl = type(layers[0].impl).__name__
    block_size = llm.llm_engine.vllm_config.cache_config.block_size
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(2, 512, (CONTEXT,), generator=g).tolist()} for _ in range(B)]
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW + 1, ignore_eos=True), use_tqdm=False)
    total = time.perf_counter() - t0
    n = len(layers)
    step = statistics.median(s[0] for s in steps)
    result = dict(heads=heads, backend=backend, impl=impl, kv_cache_dtype=kv_cache_dtype, block_size=block_size,
                  decode_steps=len(steps), generate_s=total,
                  step_ms=1e3 * step, tokens_per_s=B / step,
                  attn_ms_per_layer=1e3 * statistics.median(s[1] for s in steps) / n,
                  kernel_ms_per_layer=1e3 * statistics.median(s[2] for s in steps) / n,
                  build_ms=1e3 * statistics.median(s[3] for s in steps), build_cpu_ms=1e3 * statistics.median(s[4] for s in steps),
                  plan_cpu_ms=1e3 * statistics.median(s[5] for s in steps),
                  **{f"op_ms_{k}": 1e3 * v for k, v in standalone_op(impl, heads, block_size, layers[0].scale).items()})
    result["cpu_times_s"] = dict(zip(("user", "system"), os.times()[:2]))
    return result


def child_tp(heads: int, backend: str, workdir: Path, tp: int) -> dict:
    """Tensor parallelism: ``tp`` worker processes (vLLM's multiprocess executor), so no per-step
    hooks reach the model runners; the decode step time comes from vLLM's own request timestamps
    (engine core, monotonic): (last token - first token) / (tokens - 1) per request, median over the
    batch; decode tokens/s = B / that. (The difference of two whole ``generate`` calls, used before,
    is swamped by the prefill's run-to-run spread.) Fresh prompts each call (no prefix-cache hits)."""
    import torch

    global CONTEXT, NEW, DTYPE
    CONTEXT, NEW, DTYPE = int(os.environ["BENCH_CONTEXT"]), int(os.environ["BENCH_NEW"]), os.environ["BENCH_DTYPE"]
    sys.path.insert(0, str(ROOT / "tests_vllm"))
    from models import deepseek_v2, save_model
    from vllm import LLM, SamplingParams

    cfg = deepseek_v2(num_heads=heads)
    cfg["max_position_embeddings"] = CONTEXT + 256
    model = save_model(cfg, workdir / f"v2-h{heads}")
    llm = LLM(model=str(model), skip_tokenizer_init=True, dtype=DTYPE, enforce_eager=True, max_model_len=CONTEXT + 64,
              max_num_seqs=B, max_num_batched_tokens=8192, kv_cache_memory_bytes=512 << 20, seed=0,
              kv_cache_dtype=os.environ.get("BENCH_KV_CACHE_DTYPE", "auto"), tensor_parallel_size=tp,
              distributed_executor_backend="mp" if tp > 1 else None, disable_log_stats=False)
    g = torch.Generator().manual_seed(0)

    def generate(max_tokens: int, context: int = CONTEXT):
        prompts = [{"prompt_token_ids": torch.randint(2, 512, (context,), generator=g).tolist()} for _ in range(B)]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - t0, outs

    generate(2, 64)  # warm-up
    prefill, _ = generate(1)
    full, outs = generate(NEW + 1)
    step = statistics.median((o.metrics.last_token_ts - o.metrics.first_token_ts) / (len(o.outputs[0].token_ids) - 1) for o in outs)
    return dict(heads=heads, backend=backend, tp=tp, prefill_s=prefill, generate_s=full,
                decode_tokens_per_s=B / step, decode_step_ms=1e3 * step)


def _omp_bind(tp: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``tp`` ranks on this process's cores: consecutive groups
    (vLLM's default binds a NUMA node per rank and refuses two ranks on a one-node machine)."""
    cores = sorted(os.sched_getaffinity(0))
    per = max(1, len(cores) // tp)
    groups = [cores[i * per:(i + 1) * per] for i in range(tp)]
    return "|".join(f"{c[0]}-{c[-1]}" if len(c) > 1 else str(c[0]) for c in groups)


def standalone_op(impl: str, heads: int, block_size: int, scale: float, reps: int = 10) -> dict[str, float]:
    """Median and min seconds of the backend's decode kernel on 8 x 4096 random cached tokens."""
    import torch

    import openmla

    L, R = 512, 64
    dt = getattr(torch, DTYPE)
    pages_per_seq = -(-(CONTEXT + 1) // block_size)
    cache = torch.randn(B * pages_per_seq + 1, block_size, L + R).to(dt)
    table = (1 + torch.arange(B * pages_per_seq, dtype=torch.int32)).view(B, pages_per_seq)
    seq_lens = torch.full((B,), CONTEXT + 1, dtype=torch.int32)
    q = torch.randn(B, heads, L + R).to(dt)
    if impl == "OpenMLAImpl":
        batch = openmla.CacheBatch(cache.unsqueeze(0), table, seq_lens - 1, torch.arange(B + 1, dtype=torch.int32), block_size)
        plan = openmla.plan(batch, scale=scale)
        run = lambda: plan.decode(q, 0, kv_lora_rank=L)  # noqa: E731
    elif impl == "AMXMLAImpl":
        from vllm import _custom_ops as ops

        flat = cache.view(-1, 1, L + R)
        req_to_token = (table.long().unsqueeze(-1) * block_size + torch.arange(block_size)).view(B, -1)
        splits = 1
        while splits < min(CONTEXT // 512, 2 * torch.get_num_threads()):
            splits *= 2
        logits = torch.zeros(B, heads, splits, L + 1)
        out = torch.zeros(B, heads, L, dtype=dt)
        pool, lens = torch.arange(B), seq_lens.long()
        run = lambda: ops.cpu_mla_decode(q, flat, flat[..., :L], out, None, None, None, logits, req_to_token, pool, lens,  # noqa: E731
                                         scale, 0.0, False, 0, None, None)
    else:
        from vllm import _custom_ops as ops

        out = torch.zeros(B, heads, L, dtype=dt)
        run = lambda: ops.mla_decode_kvcache_cpu(out, q, cache, scale, table, seq_lens)  # noqa: E731
    for _ in range(2):
        run()
    times, cold = [], []
    flush = torch.ones(512 << 20, dtype=torch.uint8)  # more than the last-level cache (300 MiB here)
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    for _ in range(reps):
        flush.add_(1)  # the cache pages leave the last-level cache
        t0 = time.perf_counter()
        run()
        cold.append(time.perf_counter() - t0)
    return dict(median=statistics.median(times), min=min(times), cold_median=statistics.median(cold), cold_min=min(cold))


# The parent: every configuration in its own process ------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    ap.add_argument("--backends", nargs="+", default=["AMX_MLA", "CPU_MLA", "OPENMLA"])
    ap.add_argument("--child", nargs=3, metavar=("HEADS", "BACKEND", "DIR"), help=argparse.SUPPRESS)
    ap.add_argument("--context", type=int, default=CONTEXT)
    ap.add_argument("--new", type=int, default=NEW)
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                    help="engine dtype (auto: bfloat16 where the CPU multiplies it natively, else float32)")
    ap.add_argument("--kv-cache-dtype", default="auto", help="vLLM's kv_cache_dtype for every engine (fp8, fp8_ds_mla: "
                    "openmla only; vLLM's CPU backends take none); the standalone op column stays the unquantised cache's")
    ap.add_argument("--tp", type=int, nargs="+", help="tensor-parallel sizes: time whole generate calls instead "
                    "(decode tokens/s from a 1-token and a NEW+1-token generate; workers are separate processes)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "bench_vllm.json"))
    args = ap.parse_args()
    if args.child:
        tp = int(os.environ.get("BENCH_TP", "0"))
        res = (child_tp(int(args.child[0]), args.child[1], Path(args.child[2]), tp) if tp
               else child(int(args.child[0]), args.child[1], Path(args.child[2])))
        print("RESULT " + json.dumps(res), flush=True)
        return
    import torch

    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "float32")
    print(f"engine dtype {dtype}, context {args.context}, {args.new} decode steps timed", flush=True)
    backends = [b for b in args.backends if b != "AMX_MLA" or torch.cpu._is_amx_tile_supported()]
    if args.tp and "CPU_MLA" in backends and torch.cpu._is_amx_tile_supported():
        sys.exit("--tp: CPU_MLA is reached by hiding AMX in the engine's process; TP workers are other processes "
                 "(they would run AMX_MLA): on this CPU compare AMX_MLA and OPENMLA")
    results = []
    common = dict(BENCH_CONTEXT=str(args.context), BENCH_NEW=str(args.new), BENCH_DTYPE=dtype, BENCH_KV_CACHE_DTYPE=args.kv_cache_dtype)
    with tempfile.TemporaryDirectory() as tmp:
        for heads, tp, backend in [(h, t, b) for h in args.heads for t in (args.tp or [0]) for b in backends]:
            env = {k: v for k, v in os.environ.items() if k != "OPENMLA_VLLM"}
            env.update(common)
            if tp:  # whole-generate timing (see child_tp)
                env.update(BENCH_TP=str(tp), VLLM_CPU_OMP_THREADS_BIND=_omp_bind(tp))
            else:
                env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0")
            if backend == "OPENMLA":
                env["OPENMLA_VLLM"] = "1"
            proc = subprocess.run([sys.executable, __file__, "--child", str(heads), backend, tmp], env=env,
                                  capture_output=True, text=True)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if not lines:
                sys.exit(f"{backend} H={heads}{f' TP={tp}' if tp else ''} failed:\n{proc.stderr[-4000:]}")
            results.append(r := json.loads(lines[-1][7:]))
            if tp:
                print(f"| {heads} | {backend} | TP={tp} | {r['decode_tokens_per_s']:.1f} | {r['decode_step_ms']:.1f} | "
                      f"{r['prefill_s']:.1f} |", flush=True)
            else:
                print(f"| {heads} | {backend} ({r['impl']}, page {r['block_size']}) | {r['tokens_per_s']:.1f} | {r['step_ms']:.1f} | "
                      f"{r['attn_ms_per_layer']:.2f} | {r['kernel_ms_per_layer']:.2f} | {r['op_ms_median']:.2f} ({r['op_ms_min']:.2f}) | "
                      f"{r['op_ms_cold_median']:.2f} ({r['op_ms_cold_min']:.2f}) | {r['build_ms']:.3f} | {r['build_cpu_ms']:.3f} | "
                      f"{r['plan_cpu_ms']:.3f} |", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(load=os.getloadavg(), context=args.context, dtype=dtype, results=results), indent=1))


if __name__ == "__main__":
    main()
