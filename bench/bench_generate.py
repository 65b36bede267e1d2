"""Whole-model generation: ``openmla.hf.generate`` against transformers' ``model.generate``.

Run: ``.venv/bin/python bench/bench_generate.py [--impls openmla eager sdpa] [--model v2-lite|v32|family:NAME] [--quick]``

A DeepSeek-V2-Lite-shaped transformers ``DeepseekV2ForCausalLM`` cut to ``--layers`` layers
(hidden 2048, 16 heads, L=512, R=64, Dn=128, Dv=128, no q_lora, YaRN; layer 0 dense, the others
MoE with 64 routed experts top-6 and 2 shared; vocab 102400), random weights, bf16. ``--model
v32``: the same sizes as a ``DeepseekV32ForCausalLM`` (q_lora 1536 and DeepSeek-V3.2's indexer:
64 heads of 128, top 2048 keys per token), so prompts longer than 2048 run sparse. ``--batch``
prompts of ``--prompt`` random tokens, ``--new`` generated tokens each, greedy, no eos.
``--model family:NAME``: the family's ``openmla demo --model tiny-NAME`` model (``openmla.hf.presets``,
size "demo": the family's real MLA dims, hidden 1024, 4 layers, 8 heads, a 16-expert MoE where the
family has one, vocab 8192). ``--dtype auto`` (the default) is bf16 where the CPU multiplies bf16
natively, else float32 (``openmla.hardware``).

- ``openmla``: ``attach`` + ``generate`` (continuous batching: prompts are prefilled in chunks of
  at most ``--max-batch-tokens`` and the first ones start decoding while later ones prefill).
- ``eager`` / ``sdpa``: the same model (detached) through ``model.generate`` with that
  ``attn_implementation`` (transformers 5's default for DeepSeek is ``sdpa``); the batch has equal
  lengths, so no padding. Its per-step times come from a logits processor's timestamps.

Reported per implementation: wall seconds of the whole call, generated tokens/s (prefill
included), the decode-phase tokens/s, the time per decode step against the step index (first
and last 8 steps, a least-squares slope) and the process CPU seconds of the call; for openmla also
the share of the decode steps' time spent in the attention layers and in openmla's kernels. The load
average and CPU model go with the results, to ``bench/out/generate.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from openmla.hf import GenerationStats, Limits, attach, detach, generate  # noqa: E402

OUT = Path(__file__).resolve().parent / "out" / "generate.json"


def v2_lite_config(layers: int, quick: bool):
    from transformers import DeepseekV2Config

    if quick:  # a smoke run of the script: same structure, small numbers
        return DeepseekV2Config(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=4, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=128,
                                v_head_dim=128, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=128,
                                first_k_dense_replace=1, max_position_embeddings=4096, tie_word_embeddings=False)
    return DeepseekV2Config(
        vocab_size=102400, hidden_size=2048, intermediate_size=10944, num_hidden_layers=layers, num_attention_heads=16,
        num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2, moe_intermediate_size=1408, first_k_dense_replace=1,
        topk_method="greedy", routed_scaling_factor=1.0, max_position_embeddings=163840, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4096,
                             beta_fast=32, beta_slow=1, mscale=0.707, mscale_all_dim=0.707),
    )


def v32_config(layers: int, quick: bool):
    """V2-Lite's sizes with DeepSeek-V3.2's attention (q_lora, the top-k indexer)."""
    from transformers import DeepseekV32Config

    base = v2_lite_config(layers, quick).to_dict()
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "n_routed_experts", "num_experts_per_tok",
            "n_shared_experts", "moe_intermediate_size", "first_k_dense_replace", "max_position_embeddings", "tie_word_embeddings",
            "rope_parameters")
    extra = dict(index_topk=16, index_head_dim=64, index_n_heads=8) if quick else dict(index_topk=2048, index_head_dim=128, index_n_heads=64)
    return DeepseekV32Config(**{k: base[k] for k in keep if k in base}, q_lora_rank=128 if quick else 1536, n_group=1, topk_group=1,
                             **extra)


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def slope_ms(times: list[float]) -> float:
    """Least-squares growth of the step time per step, in ms."""
    n = len(times)
    if n < 2:
        return 0.0
    xm, ym = (n - 1) / 2, sum(times) / n
    num = sum((i - xm) * (t - ym) for i, t in enumerate(times))
    den = sum((i - xm) ** 2 for i in range(n))
    return 1e3 * num / den


def summarise(name: str, wall: float, cpu: float, generated: int, decode_steps: list[float], decode_tokens: int,
              full_steps: list[float]) -> dict:
    """``decode_steps``: seconds of every decode-only step; ``full_steps``: those with the whole batch
    decoding (their time against the step index is the flatness check)."""
    head, tail = full_steps[:8], full_steps[-8:]
    row = dict(impl=name, wall_s=wall, cpu_s=cpu, generated=generated, tokens_per_s=generated / wall,
               decode_tokens_per_s=decode_tokens / sum(decode_steps) if decode_steps else 0.0,
               decode_steps=len(decode_steps), full_batch_steps=len(full_steps), first8_ms=1e3 * sum(head) / max(len(head), 1),
               last8_ms=1e3 * sum(tail) / max(len(tail), 1), slope_ms_per_step=slope_ms(full_steps),
               step_ms=[round(1e3 * t, 2) for t in decode_steps])
    print(f"{name:8s} wall {wall:7.2f} s  cpu {cpu:7.2f} s  {row['tokens_per_s']:7.2f} tok/s  decode {row['decode_tokens_per_s']:7.2f} tok/s  "
          f"full-batch step {row['first8_ms']:.1f} -> {row['last8_ms']:.1f} ms over {len(full_steps)} steps "
          f"(slope {row['slope_ms_per_step']:+.2f} ms/step)", flush=True)
    return row


def run_openmla(model, prompts: list[list[int]], new: int, page_size: int, max_batch_tokens: int) -> dict:
    num_pages = sum(-(-(len(p) + new) // page_size) for p in prompts)
    attach(model, num_pages=num_pages, page_size=page_size)
    try:
        generate(model, [p[:16] for p in prompts[:2]], 2)  # warm-up: first-call costs out of the timing
        stats = GenerationStats()
        cpu0, t0 = cpu_seconds(), time.perf_counter()
        out = generate(model, prompts, new, limits=Limits(max_batch_tokens=max_batch_tokens, max_running=len(prompts)), stats=stats)
        wall, cpu = time.perf_counter() - t0, cpu_seconds() - cpu0
    finally:
        detach(model)
    steps = stats.decode_only()
    row = summarise("openmla", wall, cpu, sum(map(len, out)), [s.seconds for s in steps], sum(s.decode_tokens for s in steps),
                    [s.seconds for s in steps if s.decode_tokens == len(prompts)])
    decode_s = sum(s.seconds for s in steps)
    row["decode_attention_share"] = sum(s.attention_seconds for s in steps) / decode_s if decode_s else 0.0
    row["decode_kernel_share"] = sum(s.kernel_seconds for s in steps) / decode_s if decode_s else 0.0
    print(f"openmla  decode steps: {row['decode_attention_share']:.0%} in the attention layers, "
          f"{row['decode_kernel_share']:.0%} in openmla's kernels", flush=True)
    row["steps"] = len(stats.steps)
    row["preemptions"] = stats.preemptions
    row["tokens"] = out
    return row


class StepClock:
    """A logits processor that only records when transformers asks for each next token."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, input_ids, scores):
        self.stamps.append(time.perf_counter())
        return scores


def run_transformers(model, prompts: list[list[int]], new: int, impl: str) -> dict:
    from transformers import LogitsProcessorList

    model.set_attn_implementation(impl)
    ids = torch.tensor(prompts)
    kwargs = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids[:2, :16], attention_mask=torch.ones_like(ids[:2, :16]), **{**kwargs, "max_new_tokens": 2, "min_new_tokens": 2})
        clock = StepClock()
        cpu0, t0 = cpu_seconds(), time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), logits_processor=LogitsProcessorList([clock]), **kwargs)
        wall, cpu = time.perf_counter() - t0, cpu_seconds() - cpu0
    steps = [b - a for a, b in zip(clock.stamps, clock.stamps[1:])]  # the forwards of tokens 2..new
    row = summarise(impl, wall, cpu, (out.shape[1] - ids.shape[1]) * ids.shape[0], steps, len(steps) * ids.shape[0], steps)
    row["tokens"] = out[:, ids.shape[1]:].tolist()
    return row


def machine() -> dict:
    model = platform.processor()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            text = f.read()
        model = next(line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name"))
        amx = " amx_bf16" in text
    except (OSError, StopIteration):
        amx = False
    return dict(cpu=model, amx_bf16=amx, cores=os.cpu_count(), threads=torch.get_num_threads(), torch=torch.__version__,
                load_before=os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impls", nargs="+", default=["openmla", "eager", "sdpa"], choices=["openmla", "eager", "sdpa"])
    ap.add_argument("--model", default="v2-lite", help="v2-lite, v32 or family:NAME (a preset of openmla.hf.presets)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--max-batch-tokens", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    ap.add_argument("--quick", action="store_true", help="a tiny model and batch: checks the script runs")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    if args.quick:
        args.batch, args.prompt, args.new = 3, 40, 6
    import transformers

    if args.threads:
        torch.set_num_threads(args.threads)
    info = machine()
    print(f"{info['cpu']} (AMX bf16: {info['amx_bf16']}), {info['threads']} threads, load {info['load_before']}", flush=True)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    from openmla.hardware import model_dtype

    dtype = model_dtype(None if args.dtype == "auto" else getattr(torch, args.dtype))
    info["dtype"] = str(dtype)
    if args.model.startswith("family:"):
        from openmla.hf import presets

        model = presets.build(args.model.split(":", 1)[1], "test" if args.quick else "demo", dtype=dtype)
    elif args.model in ("v2-lite", "v32"):
        config = (v32_config if args.model == "v32" else v2_lite_config)(args.layers, args.quick)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    else:
        raise SystemExit(f"--model: v2-lite, v32 or family:NAME, got {args.model!r}")
    model.generation_config.eos_token_id = None
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters, built in {time.perf_counter() - t0:.0f} s", flush=True)
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, model.config.vocab_size, (args.batch, args.prompt), generator=g).tolist()
    rows = []
    for impl in args.impls:
        if impl == "openmla":
            rows.append(run_openmla(model, prompts, args.new, args.page_size, args.max_batch_tokens))
        else:
            rows.append(run_transformers(model, prompts, args.new, impl))
    base = {r["impl"]: r for r in rows}
    if "openmla" in base:
        for r in rows:
            if r["impl"] != "openmla":
                print(f"openmla vs {r['impl']}: {base['openmla']['tokens_per_s'] / r['tokens_per_s']:.2f}x tokens/s, "
                      f"decode {base['openmla']['decode_tokens_per_s'] / r['decode_tokens_per_s']:.2f}x; "
                      f"same greedy tokens: {r['tokens'] == base['openmla']['tokens']}")
    info["load_after"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(machine=info, args={k: str(v) for k, v in vars(args).items()},
                                        transformers=transformers.__version__, rows=rows), indent=1))
    print(f"load after {info['load_after']}; wrote {args.out}")


if __name__ == "__main__":
    main()
