"""The native ``cpu`` backend against every same-run alternative, as fractions of the roofline.

Run: ``.venv/bin/python bench/bench_cpu_native.py [--threads 2] [--reps 7] [--quick] [--non-amx] [--absorb]``

Shapes (DeepSeek dims: L=512, R=64, Dn=128, Dv=128; bf16):
- decode: B=8 sequences x 4096 cached tokens + 1 new, page 64, pages handed out in a shuffled
  order; H=16 and H=128; ``flare_mla_decode`` (absorbed q given);
- prefill: H=16, 2 sequences x 2048 new tokens, causal, no prefix; ``mla_prefill`` (gather, K/V
  up-projection and attention);
- absorption: ``absorb`` and ``unabsorb`` alone at H=16 and 128, T=8 and 64 tokens (``cpu`` the
  native backend's, ``combine`` one ``torch.bmm``), and the fused op of a decode step
  (``plan.run`` over the decode shapes: cache write, absorb, decode, unabsorb) with the native
  absorption (``cpu``) and with combine's (``cpu+combine``); roofline bytes are the weights (and
  the cache). ``--absorb`` runs only these.

Implementations, all on the same inputs in the same run:
- ``cpu``: openmla's native backend (decode: the one-shot ``flare_mla_decode``, which validates
  and plans on every call; ``cpu/layer``: ``plan.decode`` on a plan made once, as an engine runs
  each layer of a step); ``torch``: openmla's pure-PyTorch backend;
- ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` (its flash kernel), with the
  page gather included: decode with v = k (576 wide, MQA via ``enable_gqa``, the first 512
  outputs kept), prefill with the gather, the up-projection and v padded to 192;
- ``flex``: ``flex_attention`` under ``torch.compile``: decode over the whole page pool with a
  block mask of each sequence's pages (block size = page size), prefill with a causal block mask
  on the gathered, up-projected keys (skipped where it fails to compile on this torch).

Roofline time = max(FLOPs / bf16 2048^3 matmul rate, KV bytes / copy bandwidth), both measured
in this run (copy bandwidth: bytes read plus written by a 256 MiB ``copy_``); FLOPs are the work
the step needs (causal half; decode 2*H*(576+512) per key and query, prefill adds the
up-projection). Every timed function runs round-robin in a shuffled order, ``--reps`` rounds;
fractions use medians (and best rounds, in brackets). The host under this box is shared and its
speed drifts within seconds, so a third figure, ``paired``, takes each round's fraction against
that same round's probes and reports their median.

Two timings per run: wall time with ``--threads`` threads, and single-thread CPU time
(``time.thread_time`` with ``torch.set_num_threads(1)``), which holds when other processes share
the machine. ``--non-amx`` reruns the script with oneDNN limited to AVX512_CORE_BF16 and MKL to
AVX512_E3 (no AMX: what a Zen 4 has). JSON goes to ``bench/out/cpu_native[_absorb][_non_amx].json``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
import openmla  # noqa: E402
from openmla import PagedLatentCache, preset, rope_freqs_cis  # noqa: E402
from openmla_tools.flops import fused_op_flops  # noqa: E402
from openmla_tools.testing import make_case, small_config  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"
# What a Zen 4 has: AVX-512 with bf16 dot products, no AMX. Both libraries that pick kernels by
# ISA are limited (torch's SDPA reaches AMX through MKL, matmul and brgemm through oneDNN).
NON_AMX_ENV = {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16", "MKL_ENABLE_INSTRUCTIONS": "AVX512_E3"}
L, R, DN, DV = 512, 64, 128, 128


# Inputs ------------------------------------------------------------------------------------
def decode_inputs(B: int, S: int, H: int, page_size: int, seed: int = 0):
    cfg = preset("deepseek-v3", H)
    pages = B * -(-(S + 1) // page_size) + 4
    cache = PagedLatentCache(1, pages, page_size=page_size, head_dim=L + R, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(seed)
    cache.allocator._free = torch.randperm(pages, generator=g).tolist()
    cache.blocks.copy_(torch.randn(cache.blocks.shape, generator=g).bfloat16())
    ids = list(range(B))
    cache.commit(cache.prepare(ids, [S] * B))
    batch = cache.prepare(ids, [1] * B)
    q = (torch.randn(B, H, L + R, generator=g) * 0.3).bfloat16()
    return cfg, batch, q


def decode_fns(B: int, S: int, H: int, page_size: int, flex: bool, log) -> tuple[dict, int, int]:
    cfg, batch, q = decode_inputs(B, S, H, page_size)
    scale = cfg.softmax_scale
    n = S + 1
    step = openmla.plan(batch, scale=scale, backend="cpu")  # an engine plans once per step, for every layer
    fns: dict[str, Callable[[], object]] = {
        "cpu": lambda: openmla.flare_mla_decode(q, batch, 0, scale=scale, kv_lora_rank=L, backend="cpu"),
        "cpu/layer": lambda: step.decode(q, 0, kv_lora_rank=L),
        "torch": lambda: openmla.flare_mla_decode(q, batch, 0, scale=scale, kv_lora_rank=L, backend="torch"),
    }
    layer = batch.blocks[0]  # [pages, ps, 576]
    table = batch.block_table.long()
    used = -(-n // page_size)

    def sdpa():
        k = layer.index_select(0, table[:, :used].reshape(-1)).view(B, used * page_size, L + R)[:, :n]
        out = torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k[:, None], k[:, None], scale=scale, enable_gqa=True)
        return out[..., :L]

    fns["sdpa"] = sdpa
    if flex:
        fn = flex_decode(q, batch, n, scale, log)
        if fn is not None:
            fns["flex"] = fn
    flops = 2 * B * H * n * (L + R + L)
    kv_bytes = B * n * (L + R) * 2
    return fns, flops, kv_bytes


def prefill_fns(H: int, seqs: int, n: int, flex: bool, log) -> tuple[dict, int, int]:
    cfg = small_config(num_heads=H, L=L, R=R, Dn=DN, Dv=DV)
    case = make_case([0] * seqs, [n] * seqs, config=cfg, page_size=64, dtype=torch.bfloat16, seed=1)
    q = openmla.mla_write_cache(case.q, case.kv, case.freqs_cis, case.gamma, case.batch, case.layer_idx, backend="torch")
    batch, li, scale = case.batch, case.layer_idx, case.scale
    args = (q, batch, li, case.w_k, case.w_uv)
    fns: dict[str, Callable[[], object]] = {
        "cpu": lambda: openmla.mla_prefill(*args, scale=scale, backend="cpu"),
        "torch": lambda: openmla.mla_prefill(*args, scale=scale, backend="torch"),
    }
    layer = batch.blocks[li]
    ps = batch.page_size
    table = batch.block_table.long()
    pages = -(-n // ps)
    w_v = case.w_uv.reshape(H * DV, L)
    qh = q.view(seqs, n, H, DN + R).transpose(1, 2)  # [seqs, H, n, 192] view

    def gathered_kv(v_depth: int):
        """The textbook gather: latent rows, K_nope/V up-projection, rope broadcast, v padded."""
        e = layer.index_select(0, table[:, :pages].reshape(-1)).view(seqs, pages * ps, L + R)[:, :n]
        lat = e[..., :L]
        k_nope = (lat @ case.w_k.t()).view(seqs, n, H, DN)
        v = (lat @ w_v.t()).view(seqs, n, H, DV)
        k = torch.cat([k_nope, e[..., None, L:].expand(seqs, n, H, R)], dim=-1).transpose(1, 2)
        if v_depth > DV:
            v = torch.nn.functional.pad(v, (0, v_depth - DV))
        return k, v.transpose(1, 2)

    def sdpa():
        k, v = gathered_kv(DN + R)
        return torch.nn.functional.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=scale)[..., :DV]

    fns["sdpa"] = sdpa
    if flex:
        fn = flex_prefill(qh, gathered_kv, n, scale, log)
        if fn is not None:
            fns["flex"] = fn
    flops = fused_op_flops(preset("deepseek-v3", H), [0] * seqs, [n] * seqs, False)
    kv_bytes = seqs * n * (L + R) * 2
    return fns, flops, kv_bytes


# Query absorption and output projection ------------------------------------------------------
def _without_native_absorb(step: openmla.MLAPlan) -> openmla.MLAPlan:
    """A copy of ``step`` whose backend lacks ``absorb``/``unabsorb``: the plan then runs
    ``openmla.combine``'s (one ``torch.bmm`` each), as before the native ones existed."""
    be = step.backend
    hidden = types.SimpleNamespace(**{k: getattr(be, k) for k in dir(be) if not k.startswith("_") and k not in ("absorb", "unabsorb")})
    out = copy.copy(step)
    out.backend = hidden
    return out


def absorb_fns(H: int, T: int) -> dict[str, tuple[dict, int, int]]:
    """``absorb`` ([T, H, 192] x w_uk [H, 512, 128]) and ``unabsorb`` ([T, H, 512] x w_uv [H, 128, 512])
    alone: ``cpu`` the native backend's, ``combine`` openmla.combine's (torch.bmm). Bytes: the weight."""
    from openmla import combine
    from openmla.backends.cpu import api

    g = torch.Generator().manual_seed(T * H)
    bf = lambda *s: (torch.randn(*s, generator=g) * 0.1).bfloat16()  # noqa: E731
    q, lat, w_uk, w_uv = bf(T, H, DN + R), bf(T, H, L), bf(H, L, DN), bf(H, DV, L)
    flops, w_bytes = 2 * T * H * L * DN, H * L * DN * 2
    return {
        f"absorb H={H} T={T}": ({"cpu": lambda: api.absorb(q, w_uk), "combine": lambda: combine.absorb(q, w_uk)}, flops, w_bytes),
        f"unabsorb H={H} T={T}": ({"cpu": lambda: api.unabsorb(lat, w_uv), "combine": lambda: combine.unabsorb(lat, w_uv)},
                                  flops, w_bytes),
    }


def fused_decode_fns(B: int, S: int, H: int, page_size: int = 64) -> tuple[dict, int, int]:
    """The fused op of one decode step (``plan.run``: cache write, absorb, decode, unabsorb) over
    B x S cached tokens, the plan made once outside the timing; ``cpu`` with the native
    absorption, ``cpu+combine`` the same plan with combine's. Bytes: the cache and both weights."""
    cfg = preset("deepseek-v3", H)
    _, batch, _ = decode_inputs(B, S, H, page_size)
    g = torch.Generator().manual_seed(H)
    bf = lambda *s: (torch.randn(*s, generator=g) * 0.1).bfloat16()  # noqa: E731
    w_k = bf(H * DN, L)
    args = (bf(B, H, DN + R), bf(B, L + R), rope_freqs_cis(cfg, S + 8), torch.ones(L).bfloat16(), 0, w_k,
            w_k.view(H, DN, L).transpose(1, 2).contiguous(), bf(H, DV, L))
    step = openmla.plan(batch, scale=cfg.softmax_scale, backend="cpu")
    before = _without_native_absorb(step)
    fns = {"cpu": lambda: step.run(*args), "cpu+combine": lambda: before.run(*args)}
    n = S + 1
    flops = fused_op_flops(cfg, [S] * B, [1] * B, True)
    return fns, flops, B * n * (L + R) * 2 + 2 * H * L * DN * 2


# FlexAttention (compiled) ------------------------------------------------------------------
def _flex():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    return create_block_mask, torch.compile(flex_attention, dynamic=False)


def flex_decode(q: torch.Tensor, batch, n: int, scale: float, log):
    """Each sequence's query against the whole page pool; the block mask (one block per page)
    keeps only its own pages, so only those are read."""
    try:
        create_block_mask, flex = _flex()
        layer = batch.blocks[0]
        P, ps, D = layer.shape
        B, H, _ = q.shape
        pool = layer.reshape(1, 1, P * ps, D)
        owner = torch.full((P,), -1, dtype=torch.long)
        logical = torch.zeros(P, dtype=torch.long)
        used = -(-n // ps)
        for b in range(B):
            pages = batch.block_table[b, :used].long()
            owner[pages] = b
            logical[pages] = torch.arange(used)

        def mask_mod(b, h, q_idx, kv_idx):
            page = kv_idx // ps
            return (owner[page] == b) & (logical[page] * ps + kv_idx % ps < n)

        bm = create_block_mask(mask_mod, B, None, 1, P * ps, device="cpu", BLOCK_SIZE=(1, ps))
        qq = q[:, :, None]
        k = pool.expand(B, 1, P * ps, D)
        fn = lambda: flex(qq, k, k, block_mask=bm, scale=scale, enable_gqa=True)[..., :L]  # noqa: E731
        fn()
        return fn
    except Exception as exc:  # not every torch compiles flex attention for the CPU
        log(f"flex decode skipped: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
        return None


def flex_prefill(qh: torch.Tensor, gathered_kv, n: int, scale: float, log):
    try:
        create_block_mask, flex = _flex()
        bm = create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx <= q_idx, None, None, n, n, device="cpu")

        def fn():
            k, v = gathered_kv(DV)
            return flex(qh, k, v, block_mask=bm, scale=scale)

        fn()
        return fn
    except Exception as exc:
        log(f"flex prefill skipped: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
        return None


# Timing ------------------------------------------------------------------------------------
def ceilings() -> dict[str, Callable[[], object]]:
    a, b = torch.randn(2048, 2048).bfloat16(), torch.randn(2048, 2048).bfloat16()
    x = torch.ones(256 << 20, dtype=torch.uint8)
    y = torch.zeros_like(x)
    return {"matmul": lambda: a @ b, "copy": lambda: y.copy_(x)}


def round_robin(fns: dict[str, Callable[[], object]], reps: int, clock: Callable[[], float]) -> dict[str, list[float]]:
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    order = list(fns)
    for _ in range(reps):
        random.shuffle(order)
        for k in order:
            t0 = clock()
            fns[k]()
            times[k].append(clock() - t0)
    return times


def measure(workloads: dict, reps: int, clock, threads: int) -> dict:
    torch.set_num_threads(threads)
    fns = dict(ceilings())
    for shape, (impls, _, _) in workloads.items():
        for impl, fn in impls.items():
            fns[f"{shape}/{impl}"] = fn
    times = round_robin(fns, reps, clock)
    out = {"threads": threads, "ceilings": {}, "rows": []}
    for stat, f in (("median", statistics.median), ("best", min)):
        out["ceilings"][stat] = {"matmul_flops": 2 * 2048**3 / f(times["matmul"]),
                                 "copy_bytes_per_s": 2 * (256 << 20) / f(times["copy"])}
    for shape, (impls, flops, kv_bytes) in workloads.items():
        for impl in impls:
            t = times[f"{shape}/{impl}"]
            row = {"shape": shape, "impl": impl, "flops": flops, "kv_bytes": kv_bytes}
            for stat, f in (("median", statistics.median), ("best", min)):
                c = out["ceilings"][stat]
                roof = max(flops / c["matmul_flops"], kv_bytes / c["copy_bytes_per_s"])
                row[f"{stat}_ms"] = f(t) * 1e3
                row[f"{stat}_of_roofline"] = roof / f(t)
            row["times_ms"] = [round(x * 1e3, 3) for x in t]
            row["paired_of_roofline"] = statistics.median(
                max(flops * tm / (2 * 2048**3), kv_bytes * tc / (2 * (256 << 20))) / ti
                for ti, tm, tc in zip(t, times["matmul"], times["copy"]))
            out["rows"].append(row)
    return out


def machine() -> dict:
    flags = ""
    model = platform.processor()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = line
    except OSError:
        pass
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "")
    return {"cpu": model, "amx": "amx_bf16" in flags and not isa, "onednn_max_cpu_isa": isa or None,
            "mkl_enable_instructions": os.environ.get("MKL_ENABLE_INSTRUCTIONS"),
            "cores": os.cpu_count(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "loadavg_before": os.getloadavg()}


def print_table(title: str, res: dict) -> None:
    c = res["ceilings"]["median"]
    print(f"\n{title}: matmul {c['matmul_flops'] / 1e9:.0f} GFLOP/s, copy {c['copy_bytes_per_s'] / 1e9:.1f} GB/s (medians)")
    print(f"{'shape':22s} {'impl':9s} {'ms':>9s} {'best ms':>9s} {'of roofline':>12s} {'paired':>6s} {'vs cpu':>7s}")
    cpu = {r["shape"]: r["median_ms"] for r in res["rows"] if r["impl"] == "cpu"}
    for r in res["rows"]:
        vs = f"{r['median_ms'] / cpu[r['shape']]:.2f}x" if r["shape"] in cpu else ""
        print(f"{r['shape']:22s} {r['impl']:9s} {r['median_ms']:9.2f} {r['best_ms']:9.2f} "
              f"{r['median_of_roofline']:6.2f} ({r['best_of_roofline']:.2f}) {r['paired_of_roofline']:6.2f} {vs:>7s}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="small shapes, 2 rounds (a smoke run)")
    ap.add_argument("--no-flex", action="store_true", help="skip FlexAttention (its compile takes a while)")
    ap.add_argument("--no-cpu-time", action="store_true", help="skip the single-thread CPU-time pass")
    ap.add_argument("--non-amx", action="store_true", help="rerun with oneDNN and MKL limited to AVX-512 (no AMX)")
    ap.add_argument("--absorb", action="store_true", help="only the absorption shapes (absorb/unabsorb alone, fused decode op)")
    args = ap.parse_args()
    if args.non_amx and any(os.environ.get(k) != v for k, v in NON_AMX_ENV.items()):
        sys.exit(subprocess.call([sys.executable, *sys.argv], env=dict(os.environ, **NON_AMX_ENV)))
    reps = 2 if args.quick else args.reps
    B, S, seq_len = (2, 512, 256) if args.quick else (8, 4096, 2048)
    info = machine()
    print(f"{info['cpu']}, AMX {'yes' if info['amx'] else 'no'}"
          f"{' (oneDNN ISA ' + info['onednn_max_cpu_isa'] + ')' if info['onednn_max_cpu_isa'] else ''}, "
          f"torch {info['torch']}, load {info['loadavg_before']}")
    torch.set_num_threads(args.threads)
    flex = not args.no_flex
    log = lambda s: print(s, flush=True)  # noqa: E731
    workloads = {}
    if not args.absorb:
        for H in (16, 128):
            workloads[f"decode H={H} {B}x{S}"] = decode_fns(B, S, H, 64, flex, log)
        workloads[f"prefill H=16 2x{seq_len}"] = prefill_fns(16, 2, seq_len, flex, log)
    for H in (16, 128):
        for T in (8, 64):
            workloads.update(absorb_fns(H, T))
    for H in (16, 128):
        workloads[f"fused decode H={H} {B}x{S}"] = fused_decode_fns(B, S, H)
    results = {"machine": info, "args": vars(args)}
    results["wall"] = measure(workloads, reps, time.perf_counter, args.threads)
    print_table(f"wall time, {args.threads} threads", results["wall"])
    if not args.no_cpu_time:
        results["cpu_time"] = measure(workloads, reps, time.thread_time, 1)
        print_table("single-thread CPU time", results["cpu_time"])
    info["loadavg_after"] = os.getloadavg()
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / (f"cpu_native{'_absorb' if args.absorb else ''}{'_non_amx' if info['onednn_max_cpu_isa'] else ''}"
                  f"{'_quick' if args.quick else ''}.json")
    path.write_text(json.dumps(results, indent=1))
    print(f"\nload {info['loadavg_before']} -> {info['loadavg_after']}; wrote {path}")


if __name__ == "__main__":
    main()
