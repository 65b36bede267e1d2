"""Per-call cost of batch-1 decode at short contexts (issue 35 item 2): the native op alone and
the fused step through ``plan.run``, at 1, 64 and 4096 cached tokens.

Run: ``.venv/bin/python bench/bench_call_cost.py [--callgrind] [--calls 200]``

DeepSeek-V3 dims at H=16 (L=512, R=64, Dn=128, Dv=128), bf16, page 64, one sequence with one new
token, one thread. Two ways:
- ``op``: ``torch.ops.openmla_cpu.decode`` on prepared arguments (absorbed query, outputs
  allocated once): the native operator's own fixed work and its keys;
- ``plan.decode``: ``openmla.plan(batch)`` once, then ``plan.decode(q_abs, layer)`` per call
  (the absorbed form an engine calls per layer when it absorbs the query itself, as vLLM does):
  the native op plus the Python around it;
- ``plan.run``: the same plan, ``plan.run(q, kv, layer, weights, freqs)`` (cache write,
  absorption, decode, output projection, and the Python around them), as a model layer calls
  it; at H=16 its absorption and output projection read 4 MB of weights per call.

Default: single-thread CPU time per call (``time.thread_time``, median of 5 batches of
``--calls``). ``--callgrind`` reruns this script under valgrind's callgrind and reports
instructions per call, which load on a shared box does not move: collection is switched on
around the timed calls only (a 20-line C helper with callgrind's client requests, compiled here
with ``cc``; nothing is fetched), after two warm-up calls. valgrind has no AVX-512, so that run
loads the kernels' AVX2 build (``OPENMLA_CPU_ISA=avx2``, oneDNN capped to AVX2: bf16 computes in
float32 there, as on an AVX2 CPU): the counts are the AVX2 path's. JSON: ``bench/out/call_cost.json``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent / "out" / "call_cost.json"
CONTEXTS = [1, 64, 4096]
HELPER = r"""
#include <valgrind/callgrind.h>
void cg_start(void) { CALLGRIND_ZERO_STATS; CALLGRIND_TOGGLE_COLLECT; }
void cg_stop(const char* name) { CALLGRIND_TOGGLE_COLLECT; CALLGRIND_DUMP_STATS_AT(name); }
void cg_instrument(void) { CALLGRIND_START_INSTRUMENTATION; }
"""


def setup(cached: int, seed: int = 0):
    import torch

    import openmla
    from openmla import LayerWeights, PagedLatentCache, preset, rope_freqs_cis
    from openmla.backends.cpu import build, kernels

    cfg = preset("deepseek-v3", num_heads=16)
    H, L, R, Dn, Dv = cfg.num_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
    g = torch.Generator().manual_seed(seed)
    cache = PagedLatentCache(1, -(-(cached + 1) // 64) + 1, page_size=64, head_dim=L + R, dtype=torch.bfloat16)
    cache.blocks.copy_(torch.randn(cache.blocks.shape, generator=g).bfloat16())
    cache.commit(cache.prepare([0], [cached]))
    batch = cache.prepare([0], [1])
    bf = lambda *s: torch.randn(*s, generator=g).bfloat16()  # noqa: E731
    w_k = bf(H * Dn, L) * L**-0.5
    lw = LayerWeights(torch.ones(L).bfloat16(), w_k, w_k.view(H, Dn, L).transpose(1, 2).contiguous(), bf(H, Dv, L) * L**-0.5)
    q, kv, freqs = bf(1, H, Dn + R), bf(1, L + R), rope_freqs_cis(cfg, cached + 64)
    plan = openmla.plan(batch, scale=cfg.softmax_scale, backend="cpu")

    def run_plan():
        return plan.run(q, kv, 0, lw, freqs)

    q_lat = (torch.randn(1, H, L + R, generator=g) * 0.3).bfloat16()

    def run_decode():
        return plan.decode(q_lat, 0, kv_lora_rank=L, return_lse=True)

    ops = build.ops()
    dt = kernels.compute_dtype(torch.bfloat16)  # float32 under valgrind (no AVX-512 there)
    q_abs = (torch.randn(1, H, L + R, generator=g) * 0.3).to(dt)
    pages = cache.blocks[0]
    table = batch.block_table.to(torch.int32).contiguous()
    lens = batch.cache_lengths.to(torch.int32).contiguous()
    offs = batch.input_row_offsets.to(torch.int32).contiguous()
    out, lse = torch.empty(1, H, L, dtype=dt), torch.empty(1, H)
    fmt = kernels.FORMAT_CODES[torch.bfloat16]

    def run_op():
        ops.decode(q_abs, pages, table, lens, offs, fmt, 1.0, L, cfg.softmax_scale, 0, 0, 0, None, None, True, None, 0, out, lse)

    return {"op": run_op, "plan.decode": run_decode, "plan.run": run_plan}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--callgrind", action="store_true", help="instructions per call under callgrind")
    ap.add_argument("--contexts", type=int, nargs="+", default=CONTEXTS)
    ap.add_argument("--ways", nargs="+", default=["op", "plan.decode", "plan.run"])
    ap.add_argument("--inside", default="", help=argparse.SUPPRESS)  # the helper's path, in the callgrind child
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    if args.callgrind and not args.inside:
        with tempfile.TemporaryDirectory() as tmp:
            so = Path(tmp) / "cg.so"
            src = Path(tmp) / "cg.c"
            src.write_text(HELPER)
            subprocess.run(["cc", "-O1", "-shared", "-fPIC", "-o", str(so), str(src)], check=True)
            cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--collect-atstart=no",
                   f"--callgrind-out-file={tmp}/cg.out", sys.executable, __file__, "--callgrind", "--inside", str(so),
                   "--calls", str(min(args.calls, 20)), "--contexts", *map(str, args.contexts), "--ways", *args.ways]
            # valgrind runs no AVX-512: the kernels' AVX2 build, oneDNN capped to match (bf16 then
            # computes in float32, as on an AVX2 CPU)
            env = dict(os.environ, PYTHONHASHSEED="0", OMP_NUM_THREADS="1", OPENMLA_CPU_ISA="avx2", ONEDNN_MAX_CPU_ISA="AVX2")
            subprocess.run(cmd, env=env, check=True, stderr=subprocess.DEVNULL)
            res = json.loads((Path(tmp) / "calls.json").read_text())
            for f in sorted(Path(tmp).glob("cg.out*")):
                name = total = None
                for line in f.read_text(errors="replace").splitlines():
                    if line.startswith("desc: Trigger: Client Request: "):
                        name = line.split(": ", 3)[-1].strip()
                    if line.startswith(("totals:", "summary:")):
                        total = int(line.split()[1])
                if name in res["calls"] and total is not None:
                    res["instructions_per_call"][name] = total / res["calls"][name]
        for k, v in res["instructions_per_call"].items():
            print(f"{k:>16}: {v / 1e3:9.1f} k instructions per call")
        OUT.parent.mkdir(exist_ok=True)
        OUT.with_name("call_cost_callgrind.json").write_text(json.dumps(res, indent=1))
        return

    import torch

    torch.set_num_threads(1)
    cg = ctypes.CDLL(args.inside) if args.inside else None
    if cg:
        cg.cg_instrument()
    res: dict = {"calls": {}, "instructions_per_call": {}, "us_per_call": {}, "loadavg": os.getloadavg()}
    for cached in args.contexts:
        fns = setup(cached)
        for way, fn in fns.items():
            if way not in args.ways:
                continue
            name = f"{way}@{cached}"
            fn()
            fn()
            if cg:
                cg.cg_start()
                for _ in range(args.calls):
                    fn()
                cg.cg_stop(name.encode())
                res["calls"][name] = args.calls
                continue
            per = []
            for _ in range(5):
                t0 = time.thread_time()
                for _ in range(args.calls):
                    fn()
                per.append((time.thread_time() - t0) / args.calls)
            res["us_per_call"][name] = statistics.median(per) * 1e6
            print(f"{name:>16}: {statistics.median(per) * 1e6:8.1f} us per call (thread CPU time, best {min(per) * 1e6:.1f})")
    if cg:
        Path(args.inside).with_name("calls.json").write_text(json.dumps(res))
        return
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
