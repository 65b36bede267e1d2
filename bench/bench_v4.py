"""DeepSeek-V4 on openmla against transformers: generation, decode step time against context, cache bytes.

Run (each a separate, short process; one torch thread unless ``--threads``):

    .venv/bin/python bench/bench_v4.py generate --impl openmla --batch 1 --prompt 8192 --new 8
    .venv/bin/python bench/bench_v4.py generate --impl transformers --batch 1 --prompt 8192 --new 8
    .venv/bin/python bench/bench_v4.py generate --impl openmla --batch 8 --prompt 1024 --new 16
    .venv/bin/python bench/bench_v4.py kernel     # decode step time per layer kind at several contexts
    .venv/bin/python bench/bench_v4.py bytes      # cache bytes per token against V3's 576-wide entry
    .venv/bin/python bench/bench_v4.py generate --quick   # a smoke run of the script (tiny model)

The model: transformers' ``DeepseekV4ForCausalLM`` built from ``DeepseekV4Config``'s defaults,
which are DeepSeek-V4-Flash's (the config class documents ``deepseek-ai/DeepSeek-V4-Flash-Base``):
hidden 4096, 64 query heads, head_dim 512 (rope 64), q_lora 1024, one shared KV entry,
sliding_window 128, compress rates 4 (CSA) / 128 (HCA), indexer 64 heads x 128 with top 512,
o_groups 8 with o_lora 1024, hyper-connections x4, the first 3 layers hash-routed MoE. Cut
(``flash_cut``): 4 decoder layers (sliding, CSA, HCA, CSA) instead of 43; the MoE to 8 routed
experts top-2 of width 512 (Flash: 256 routed, top-6, width 2048; the shared expert is also 512
wide); the vocabulary to 32768 (Flash: 129280: with 4 of 43 layers the lm_head would otherwise be
as large as the 4 layers). Random weights (sinks, position biases and hash routes drawn as the
tests do), float32.

- ``generate``: ``--impl openmla`` attaches and runs ``openmla.hf.generate`` (prefill chunks of
  ``--chunk`` tokens per sequence); ``--impl transformers`` runs ``model.generate`` (eager
  attention, the only one transformers has for V4) with ``prefill_chunk_size=--chunk``.
  ``--batch`` random prompts of ``--prompt`` tokens, ``--new`` greedy tokens each. Per step (an
  openmla step is timed around ``forward_step_v4``; transformers' from a logits processor's
  timestamps) the wall and process CPU seconds; reported: prefill seconds and tokens/s, decode
  step time and tokens/s, whole-call tokens/s, and for openmla the cache bytes the first
  sequence holds after its prompt. Tokens and rows go to ``bench/out/v4_<impl>_<batch>x<prompt>.json``.
- ``kernel``: ``openmla.v4`` plans on random stores at V4-Flash shapes (B sequences decoding,
  H=64, D=512, window 128, pages of 64): plan and run time of a sliding, an HCA and a CSA layer at
  several context lengths (median of ``--reps``).
- ``bytes``: ``V4Cache.bytes_per_sequence`` of one sequence after a prompt (stores built on the
  meta device: no memory), per layer kind, bf16 and float32, against V3's 576-wide latent entry.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

OUT = Path(__file__).resolve().parent / "out"
SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
SHORT = {SLIDING: "sliding", CSA: "CSA", HCA: "HCA"}
LAYERS = [SLIDING, CSA, HCA, CSA]


def flash_cut(quick: bool = False):
    """V4-Flash's attention, cut (see the module docstring)."""
    from transformers import DeepseekV4Config

    if quick:
        return DeepseekV4Config(vocab_size=256, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
                                head_dim=64, partial_rotary_factor=16 / 64, q_lora_rank=32, n_routed_experts=4, num_experts_per_tok=2,
                                hc_mult=2, sliding_window=8, o_groups=2, o_lora_rank=16, index_n_heads=4, index_head_dim=32, index_topk=4,
                                layer_types=LAYERS, compress_rates={CSA: 4, HCA: 8}, max_position_embeddings=4096)
    return DeepseekV4Config(num_hidden_layers=4, layer_types=LAYERS, n_routed_experts=8, num_experts_per_tok=2,
                            moe_intermediate_size=512, vocab_size=32768, max_position_embeddings=65536)


def build(quick: bool):
    from transformers import DeepseekV4ForCausalLM

    torch.manual_seed(0)
    cfg = flash_cut(quick)
    from openmla_tools.testing import randomize_v4_untrained

    return randomize_v4_untrained(DeepseekV4ForCausalLM(cfg).float().eval()), cfg


def machine() -> dict:
    name = platform.processor()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return dict(cpu=name, cores=os.cpu_count(), threads=torch.get_num_threads(), torch=torch.__version__,
                load_before=os.getloadavg(), date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))


class Clock:
    """Wall and process CPU time since the start, stamped at each step."""

    def __init__(self) -> None:
        self.t0, self.c0 = time.perf_counter(), time.process_time()
        self.stamps: list[tuple[float, float]] = []

    def now(self) -> tuple[float, float]:
        return time.perf_counter() - self.t0, time.process_time() - self.c0


def summary(name: str, batch: int, prompt: int, prefill: tuple[float, float], decode: list[tuple[float, float]], total: tuple[float, float],
            generated: int) -> dict:
    dw = sum(w for w, _ in decode)
    dc = sum(c for _, c in decode)
    row = dict(impl=name, batch=batch, prompt=prompt, prefill_wall_s=prefill[0], prefill_cpu_s=prefill[1],
               prefill_tokens_per_s=batch * prompt / prefill[0], prefill_tokens_per_cpu_s=batch * prompt / prefill[1],
               decode_steps=len(decode), decode_step_ms=1e3 * dw / max(len(decode), 1), decode_step_cpu_ms=1e3 * dc / max(len(decode), 1),
               decode_tokens_per_s=batch * len(decode) / dw if dw else 0.0,
               decode_tokens_per_cpu_s=batch * len(decode) / dc if dc else 0.0,
               wall_s=total[0], cpu_s=total[1], generated=generated, tokens_per_s=generated / total[0],
               step_ms=[round(1e3 * w, 1) for w, _ in decode])
    print(f"{name:12s} {batch}x{prompt}: prefill {prefill[0]:7.1f} s wall / {prefill[1]:7.1f} s cpu ({row['prefill_tokens_per_s']:6.1f} tok/s);"
          f" decode step {row['decode_step_ms']:7.1f} ms wall / {row['decode_step_cpu_ms']:7.1f} ms cpu ({row['decode_tokens_per_s']:6.2f} tok/s);"
          f" whole call {total[0]:7.1f} s, {row['tokens_per_s']:.3f} generated tok/s", flush=True)
    return row


def run_openmla(model, prompts: list[list[int]], new: int, chunk: int, page_size: int) -> dict:
    import openmla.hf.v4 as hv4
    from openmla.hf import Limits, detach, generate

    # pools sized to the run: a sliding store holds about chunk + window entries per sequence
    raw_pages = sum(-(-(min(len(p) + new, chunk + model.config.sliding_window)) // page_size) + 2 for p in prompts)
    comp_pages = sum(-(-(len(p) + new) // page_size) + 1 for p in prompts)
    cache = hv4.attach_v4(model, num_pages=raw_pages, page_size=page_size, compressed_pages=comp_pages,
                         backend="torch")  # the native cpu backend declines V4 and falls back to torch: name it
    steps: list[dict] = []
    inner = hv4.forward_step_v4

    def timed(model_, seq_ids, input_ids, logit_rows):
        w0, c0 = time.perf_counter(), time.process_time()
        out = inner(model_, seq_ids, input_ids, logit_rows)
        w, c = time.perf_counter() - w0, time.process_time() - c0
        s0 = seq_ids[0]
        steps.append(dict(wall=w, cpu=c, tokens=[len(x) for x in input_ids], length=cache.length(s0),
                          bytes=cache.bytes_per_sequence(s0)))
        return out

    try:
        generate(model, [p[:8] for p in prompts[:2]], 2)  # warm-up
        hv4.forward_step_v4 = timed
        clock = Clock()
        out = generate(model, prompts, new, limits=Limits(max_batch_tokens=chunk, max_running=len(prompts)))
        total = clock.now()
    finally:
        hv4.forward_step_v4 = inner
        detach(model)
    decode = [s for s in steps if max(s["tokens"]) == 1]
    pre = [s for s in steps if max(s["tokens"]) > 1]
    # the step that ends the prompts also yields each first token (as transformers' prefill does)
    row = summary("openmla", len(prompts), len(prompts[0]), (sum(s["wall"] for s in pre), sum(s["cpu"] for s in pre)),
                  [(s["wall"], s["cpu"]) for s in decode], total, sum(map(len, out)))
    after_prompt = pre[-1]
    row["bytes_after_prompt"] = dict(length=after_prompt["length"], **after_prompt["bytes"])
    row["steps"] = [dict(wall_ms=round(1e3 * s["wall"], 1), cpu_ms=round(1e3 * s["cpu"], 1), tokens=sum(s["tokens"])) for s in steps]
    row["tokens"] = out
    return row


def run_transformers(model, prompts: list[list[int]], new: int, chunk: int) -> dict:
    from transformers import LogitsProcessorList

    class Stamp:
        def __init__(self) -> None:
            self.clock = None
            self.stamps: list[tuple[float, float]] = []

        def __call__(self, input_ids, scores):
            self.stamps.append(self.clock.now())
            return scores

    ids = torch.tensor(prompts)
    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0, prefill_chunk_size=chunk)
    with torch.inference_mode():
        model.generate(ids[:2, :8], attention_mask=torch.ones_like(ids[:2, :8]), max_new_tokens=2, **kwargs)  # warm-up
        stamp = Stamp()
        stamp.clock = clock = Clock()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                             logits_processor=LogitsProcessorList([stamp]), **kwargs)
        total = clock.now()
    s = stamp.stamps
    decode = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(s, s[1:])]
    row = summary("transformers", len(prompts), len(prompts[0]), s[0], decode, total, (out.shape[1] - ids.shape[1]) * ids.shape[0])
    row["tokens"] = out[:, ids.shape[1]:].tolist()
    return row


def cmd_generate(args) -> None:
    torch.set_num_threads(args.threads)
    info = machine()
    print(f"{info['cpu']}, {info['cores']} cores, {args.threads} torch thread(s), load {info['load_before']}", flush=True)
    model, cfg = build(args.quick)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, cfg.vocab_size, (args.prompt,), generator=g).tolist() for _ in range(args.batch)]
    with torch.no_grad():
        if args.impl == "openmla":
            row = run_openmla(model, prompts, args.new, args.chunk, args.page_size)
        else:
            row = run_transformers(model, prompts, args.new, args.chunk)
    info["load_after"] = os.getloadavg()
    params = sum(p.numel() for p in model.parameters())
    result = dict(machine=info, model=dict(params=params, layers=LAYERS, quick=args.quick, config=cfg.to_diff_dict()),
                  chunk=args.chunk, new=args.new, **row)
    name = f"v4_{args.impl}_{args.batch}x{args.prompt}{'_quick' if args.quick else ''}.json"
    OUT.mkdir(exist_ok=True)
    (OUT / name).write_text(json.dumps(result, indent=1, default=str))
    print(f"{params / 1e9:.2f} B parameters; load after {info['load_after']}; wrote bench/out/{name}", flush=True)


# Kernel: decode step time against context -----------------------------------------------------
def cmd_kernel(args) -> None:
    from openmla.v4 import CompressedKeys, EntryLayout, PagedEntries, SharedKVSpec, plan_shared_kv

    torch.set_num_threads(args.threads)
    info = machine()
    B, H, D, R, W, ps = args.batch, 64, 512, 64, 128, 64
    g = torch.Generator().manual_seed(0)
    rows = []
    print(f"{info['cpu']}, {args.threads} thread(s), load {info['load_before']}; B={B} decode, H={H}, D={D}, window {W}, pages of {ps}")
    print(f"{'context':>8s} {'kind':>9s} {'keys/query':>10s} {'plan ms':>8s} {'run ms (cpu)':>13s} {'run ms (wall)':>13s}")
    for ctx in args.contexts:
        # raw: only the pages of the window are real (as after V4Cache.trim); the rest -1
        lp = -(-ctx // ps)
        live = list(range(max(0, (ctx - W) // ps), lp))
        raw_blocks = torch.randn(B * len(live), ps, D, generator=g) / D ** 0.5
        table = torch.full((B, lp), -1, dtype=torch.int32)
        for b in range(B):
            table[b, live] = torch.arange(b * len(live), (b + 1) * len(live), dtype=torch.int32)
        lengths = torch.full((B,), ctx, dtype=torch.int32)
        raw = PagedEntries(raw_blocks, table, lengths)
        q = torch.randn(B, H, D, generator=g)
        offs = torch.arange(B + 1, dtype=torch.int64)
        sinks = torch.randn(H, generator=g)
        for kind, rate in ((SLIDING, None), (HCA, 128), (CSA, 4)):
            comp, keys = None, None
            if rate is not None:
                n = ctx // rate
                cp = max(1, -(-n // ps))
                comp = PagedEntries(torch.randn(B * cp, ps, D, generator=g) / D ** 0.5,
                                    torch.arange(B * cp, dtype=torch.int32).view(B, cp), torch.full((B,), n, dtype=torch.int32))
                idx = None
                if kind == CSA:
                    k = min(512, n)
                    idx = torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(B)]).to(torch.int32)
                keys = CompressedKeys(rate, idx)
            spec = SharedKVSpec(D ** -0.5, W, EntryLayout(D, R), keys, sinks)
            plan = plan_shared_kv(q, offs, raw, spec, comp, backend=args.backend)
            plan.run(q)
            pt, rt, rw = [], [], []
            for _ in range(args.reps):
                c0 = time.process_time()
                plan = plan_shared_kv(q, offs, raw, spec, comp, backend=args.backend)
                c1, w1 = time.process_time(), time.perf_counter()
                plan.run(q)
                rt.append(time.process_time() - c1)
                rw.append(time.perf_counter() - w1)
                pt.append(c1 - c0)
            nk = plan.window_keys + plan.compressed_keys
            row = dict(context=ctx, kind=kind, keys_per_query=nk, plan_ms=1e3 * statistics.median(pt),
                       run_cpu_ms=1e3 * statistics.median(rt), run_wall_ms=1e3 * statistics.median(rw), backend=plan.backend_name)
            rows.append(row)
            print(f"{ctx:8d} {SHORT[kind]:>9s} {nk:10d} {row['plan_ms']:8.2f} {row['run_cpu_ms']:13.2f} {row['run_wall_ms']:13.2f}", flush=True)
    info["load_after"] = os.getloadavg()
    OUT.mkdir(exist_ok=True)
    (OUT / "v4_kernel.json").write_text(json.dumps(dict(machine=info, B=B, H=H, D=D, window=W, page_size=ps, rows=rows), indent=1))
    print(f"load after {info['load_after']}; wrote bench/out/v4_kernel.json")


# Bytes: the cache per token against V3 --------------------------------------------------------
def cmd_bytes(args) -> None:
    from openmla.v4.cache import V4Cache, V4Layout

    cfg = flash_cut()
    D, ps = cfg.head_dim, args.page_size
    rows = []
    print(f"bytes one sequence holds per layer after its prompt (pages of {ps}); V3: 576-wide latent entry, every token")
    print(f"{'dtype':>8s} {'context':>8s} {'kind':>9s} {'bytes':>12s} {'B/token':>8s} {'V3 B/token':>10s} {'V3/V4':>7s}")
    for dtype in (torch.bfloat16, torch.float32):
        es = torch.tensor([], dtype=dtype).element_size()
        for ctx in args.contexts:
            for kind in (SLIDING, CSA, HCA):
                rates = () if kind == SLIDING else ((kind, cfg.compress_rates[kind]),)
                layout = V4Layout((kind,), D, cfg.qk_rope_head_dim, cfg.sliding_window, rates,
                                  cfg.index_head_dim if kind == CSA else None)
                pages = -(-ctx // ps) + 1
                cache = V4Cache(layout, pages, ps, dtype, "meta")
                cache.extend(["s"], [ctx])
                cache.trim(["s"])
                got = cache.bytes_per_sequence("s")
                v3 = 576 * es
                rows.append(dict(dtype=str(dtype).split(".")[1], context=ctx, kind=kind, **got, per_token=got["total"] / ctx, v3_per_token=v3))
                print(f"{rows[-1]['dtype']:>8s} {ctx:8d} {SHORT[kind]:>9s} {got['total']:12d} {got['total'] / ctx:8.1f} {v3:10d} "
                      f"{v3 * ctx / got['total']:7.1f}")
    OUT.mkdir(exist_ok=True)
    (OUT / "v4_bytes.json").write_text(json.dumps(dict(page_size=ps, rows=rows), indent=1))
    print("(compressor state is held per sequence by whoever runs the compressor: counted in the generate rows, not here)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate")
    g.add_argument("--impl", choices=["openmla", "transformers"], default="openmla")
    g.add_argument("--batch", type=int, default=1)
    g.add_argument("--prompt", type=int, default=8192)
    g.add_argument("--new", type=int, default=8)
    g.add_argument("--chunk", type=int, default=512, help="prefill chunk per sequence (both implementations)")
    g.add_argument("--page-size", type=int, default=64)
    g.add_argument("--threads", type=int, default=1)
    g.add_argument("--quick", action="store_true", help="a tiny model: checks the script runs")
    k = sub.add_parser("kernel")
    k.add_argument("--batch", type=int, default=8)
    k.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192, 32768, 65536])
    k.add_argument("--reps", type=int, default=5)
    k.add_argument("--backend", default="torch")
    k.add_argument("--threads", type=int, default=1)
    b = sub.add_parser("bytes")
    b.add_argument("--contexts", type=int, nargs="+", default=[8192, 65536])
    b.add_argument("--page-size", type=int, default=64)
    args = ap.parse_args()
    {"generate": cmd_generate, "kernel": cmd_kernel, "bytes": cmd_bytes}[args.cmd](args)


if __name__ == "__main__":
    main()
