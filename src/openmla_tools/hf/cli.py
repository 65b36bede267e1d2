"""``openmla generate``, ``openmla models`` and ``openmla demo --model tiny-<family>``: whole models on the command line."""

from __future__ import annotations

import argparse
import os
import re
import time

import torch

from openmla.backends import BACKENDS

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def add_generate_parser(sub: argparse._SubParsersAction, dtypes: dict, cache_dtypes: tuple) -> None:
    g = sub.add_parser("generate", help="generate with a transformers DeepSeek checkpoint folder on openmla (continuous batching)")
    g.add_argument("model_dir", help="a folder with config.json and safetensors weights (loaded offline)")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt-ids", action="append", metavar="IDS", help="one prompt as token ids, e.g. '1,2,3' (repeatable)")
    src.add_argument("--prompts-file", metavar="FILE", help="one prompt per line, token ids separated by commas or spaces")
    src.add_argument("--prompt", action="append", metavar="TEXT", help="one prompt as text, with the folder's tokenizer (repeatable)")
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--eos-id", type=int, action="append", help="stop token id (repeatable; default: the checkpoint's generation config)")
    g.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    g.add_argument("--dtype", default="bf16", choices=sorted(dtypes))
    g.add_argument("--cache-dtype", default="same", choices=cache_dtypes, help="latent cache format (default: --dtype)")
    g.add_argument("--page-size", type=int, default=64)
    g.add_argument("--num-pages", type=int, default=None, help="cache pages (default: every prompt at full length at once)")
    g.add_argument("--max-batch-tokens", type=int, default=2048, help="new tokens per step (prefill chunks + decodes)")
    g.add_argument("--max-running", type=int, default=64, help="sequences decoding at once")
    g.add_argument("--backend", default=None, choices=list(BACKENDS))
    g.set_defaults(func=cmd_generate)


def _parse_ids(text: str, where: str) -> list[int]:
    parts = [p for p in re.split(r"[,\s]+", text.strip()) if p]
    try:
        ids = [int(p) for p in parts]
    except ValueError:
        raise ValueError(f"{where}: expected token ids separated by commas or spaces, got {text.strip()[:60]!r}") from None
    if not ids:
        raise ValueError(f"{where}: no token ids")
    return ids


def _load_tokenizer(folder: str):
    """(tokenizer or None, a note saying why not)."""
    if not any(os.path.isfile(os.path.join(folder, f)) for f in _TOKENIZER_FILES):
        return None, "no tokenizer in the folder: token ids are printed"
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(folder, local_files_only=True), ""
    except Exception as exc:  # an optional extra: any failure only means ids are printed
        return None, f"tokenizer not loaded ({type(exc).__name__}: {exc}): token ids are printed"


def _prompts(args: argparse.Namespace, tokenizer) -> list[list[int]]:
    if args.prompt_ids:
        return [_parse_ids(s, f"--prompt-ids #{i + 1}") for i, s in enumerate(args.prompt_ids)]
    if args.prompts_file:
        if not os.path.isfile(args.prompts_file):
            raise ValueError(f"--prompts-file: {args.prompts_file!r} not found")
        with open(args.prompts_file, encoding="utf-8") as f:
            lines = [(n, line) for n, line in enumerate(f, 1) if line.strip()]
        if not lines:
            raise ValueError(f"--prompts-file: {args.prompts_file!r} has no prompts")
        return [_parse_ids(line, f"--prompts-file line {n}") for n, line in lines]
    if tokenizer is None:
        raise ValueError("--prompt: text prompts need a tokenizer in the model folder; pass --prompt-ids instead")
    return [tokenizer(t, add_special_tokens=True)["input_ids"] for t in args.prompt]


def load_model(folder: str, dtype: torch.dtype):
    """The checkpoint in ``folder``, offline: the class its config.json names when that class is one a
    supported family attaches to (some, like Mistral 4's, are not ``AutoModelForCausalLM``'s), else
    ``AutoModelForCausalLM``'s choice."""
    import json

    import transformers

    from openmla.hf.families import FAMILIES

    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        names = json.load(f).get("architectures") or []
    known = {cls for family in FAMILIES for cls in family.model_classes}
    cls = next((getattr(transformers, n) for n in names if n in known and hasattr(transformers, n)), transformers.AutoModelForCausalLM)
    return cls.from_pretrained(folder, dtype=dtype, local_files_only=True).eval()


def cmd_generate(args: argparse.Namespace) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from ..cli_options import DTYPES, cache_dtype, console
    from openmla.hf import GenerationStats, Limits, Sampling, attach, attachment, stream

    folder = args.model_dir
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise ValueError(f"model_dir: no config.json in {folder!r}")
    sampling = Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    limits = Limits(max_batch_tokens=args.max_batch_tokens, max_running=args.max_running)
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens: expected a positive int, got {args.max_new_tokens}")
    tokenizer, note = _load_tokenizer(folder)
    prompts = _prompts(args, tokenizer)
    t_load = time.perf_counter()
    model = load_model(folder, DTYPES[args.dtype])
    t_load = time.perf_counter() - t_load
    eos = None if args.ignore_eos else (args.eos_id or model.generation_config.eos_token_id)
    num_pages = args.num_pages
    if num_pages is None:
        num_pages = sum(-(-(len(p) + args.max_new_tokens) // args.page_size) for p in prompts)
    cache = attach(model, num_pages=num_pages, page_size=args.page_size, cache_dtype=cache_dtype(args), backend=args.backend)
    console.print(f"[bold]openmla generate[/]: {type(model).__name__} from {folder} ({len(attachment(model).layers)} layers, "
                  f"{args.dtype}, loaded in {t_load:.1f} s); {len(prompts)} prompts, {sum(map(len, prompts))} prompt tokens; "
                  f"cache {num_pages} pages x {args.page_size} ({cache.cache_format}); {torch.get_num_threads()} threads")
    if note:
        console.print(f"[dim]{note}[/]")
    total = len(prompts) * args.max_new_tokens
    outputs: list[list[int]] = [[] for _ in prompts]
    reasons: list[str] = [""] * len(prompts)
    stats = GenerationStats()
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[rate]}"),
                  TimeElapsedColumn(), console=console) as progress:
        task = progress.add_task("tokens", total=total, rate="")
        t0 = time.perf_counter()
        for ev in stream(model, prompts, args.max_new_tokens, sampling=sampling, eos_token_id=eos, limits=limits, stats=stats):
            outputs[ev.request].append(ev.token)
            step = 1
            if ev.finish_reason:
                reasons[ev.request] = ev.finish_reason
                step += args.max_new_tokens - len(outputs[ev.request])  # an early stop: its unused budget is done too
            elapsed = time.perf_counter() - t0
            progress.update(task, advance=step, rate=f"{stats.generated_tokens / elapsed:,.1f} tok/s" if elapsed else "")
    table = Table(title="outputs")
    for col in ("request", "prompt", "new", "finish", "text" if tokenizer is not None else "token ids"):
        table.add_column(col, justify="right" if col in ("request", "prompt", "new") else "left")
    for i, out in enumerate(outputs):
        shown = tokenizer.decode(out) if tokenizer is not None else " ".join(map(str, out))
        table.add_row(str(i), str(len(prompts[i])), str(len(out)), reasons[i], shown)
    console.print(table)
    console.print(f"{stats.generated_tokens} tokens generated in {stats.seconds:.2f} s: [bold]{stats.tokens_per_s:,.1f} tokens/s[/] "
                  f"({stats.prefill_tokens} prompt tokens prefilled, {len(stats.steps)} steps, peak {stats.peak_pages} of "
                  f"{num_pages} pages, {stats.preemptions} preemptions)")
    return 0


def cmd_model_demo(args: argparse.Namespace) -> int:
    """``openmla demo --model tiny-<family>``."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from ..cli_options import cache_dtype, console, dtype_name, model_dtype
    from .demo import run_model_demo

    dtype = model_dtype(args)  # --dtype auto: bf16 where this CPU multiplies it at full speed
    max_new = args.gen_max
    console.print(f"[bold]openmla demo --model {args.model}[/]: a random whole transformers MLA model on openmla, "
                  f"{dtype_name(dtype)}, page {args.page_size}, {torch.get_num_threads()} threads")
    console.print(f"serving {args.requests} requests, prompts {args.prompt_min}-{args.prompt_max} tokens, {max_new} generated each, "
                  f"at most {args.max_running} running")
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console) as progress:
        task = progress.add_task("tokens", total=args.requests * max_new)
        report = run_model_demo(model_name=args.model, num_requests=args.requests, prompt_range=(args.prompt_min, args.prompt_max),
                                max_new_tokens=max_new,
                                max_running=args.max_running, page_size=args.page_size, num_pages=args.num_pages, dtype=dtype,
                                cache_dtype=cache_dtype(args), backend=args.backend, seed=args.seed,
                                on_event=lambda ev: progress.advance(task))
    st = report.stats
    table = Table(title=f"openmla demo — {report.model}, {dtype_name(dtype)}")
    for col in ("steps", "count", "prompt tokens", "generated tokens", "seconds", "tokens/s"):
        table.add_column(col, justify="left" if col == "steps" else "right")
    mixed = [s for s in st.steps if s.prefill_tokens]
    decode = [s for s in st.steps if not s.prefill_tokens]
    for name, steps in (("with prefill", mixed), ("decode only", decode), ("all", st.steps)):
        sec = sum(s.seconds for s in steps)
        toks = sum(s.prefill_tokens + s.decode_tokens for s in steps)
        table.add_row(name, str(len(steps)), str(sum(s.prefill_tokens for s in steps)),
                      str(sum(s.decode_tokens for s in steps)), f"{sec:.2f}", f"{toks / sec:,.0f}" if sec else "-")
    console.print(table)
    facts = Table(show_header=False, box=None)
    facts.add_row("parameters", f"{report.parameters / 1e6:.1f} M")
    facts.add_row("generated", f"{st.generated_tokens} tokens, {st.tokens_per_s:,.1f} tokens/s")
    facts.add_row("cache pages", f"peak {st.peak_pages} of {report.num_pages} (page {report.page_size}), "
                  f"{report.pages_in_use_at_end} in use at the end, {st.preemptions} preemptions")
    if st.seconds:
        attn, kern = st.attention_seconds / st.seconds, st.kernel_seconds / st.seconds
        facts.add_row("step time", f"attention layers {attn:.0%} (openmla's cache write and attention kernels {kern:.0%}; "
                      f"projections, indexer, gates {attn - kern:.0%}); the rest {1 - attn:.0%} (MoE / MLP, norms, "
                      "embeddings, lm_head, sampling, scheduling)")
    if report.experts is not None and report.experts.chosen is not None:
        timed = ", ".join(f"{k} {v:.2f} s" if v < float("inf") else f"{k} unavailable" for k, v in report.experts.seconds.items())
        facts.add_row("MoE experts", f"{report.experts.chosen}, the fastest of transformers' implementations for this run's "
                      f"steps (estimated from one MoE block: {timed})")
    # top-k selection in bf16/fp16: near-ties at the cut can pick other keys than transformers does
    # (7% seen at a 458-token prompt, top 64); float32 checks the sparse model at 1e-4 too. An fp8
    # latent cache rounds every entry to e4m3 (transformers keeps them exact): 4-12% seen; an NVFP4 one
    # to 4-bit e2m1 in groups of 16: 10-28% seen (tiny-v3, seeds 0-3, fp32 and bf16).
    quantized = cache_dtype(args)
    fp8 = isinstance(quantized, str)
    tol = 1e-4 if dtype == torch.float32 else (0.1 if report.sparse_topk else 3e-2)
    note = " (top-k cut in low precision: --dtype fp32 checks at 1e-4)" if report.sparse_topk and dtype != torch.float32 else ""
    if fp8 and quantized.startswith("nvfp4"):
        tol, note = max(tol, 0.5), " (4-bit NVFP4 latent cache against transformers' exact one)"
    elif fp8:
        tol, note = max(tol, 0.15), " (fp8 latent cache against transformers' exact one)"
    verdict = "[green]pass[/]" if report.check_error <= tol else "[red]FAIL[/]"
    facts.add_row("check vs transformers", f"{report.check_what}: max rel err {report.check_error:.2e} (tolerance {tol:g}){note} {verdict}")
    facts.add_row("wall time", f"{report.wall_seconds:.1f} s")
    console.print(facts)
    return 0 if report.check_error <= tol else 1


def add_models_parser(sub: argparse._SubParsersAction) -> None:
    m = sub.add_parser("models", help="the transformers MLA families openmla.hf runs, with their MLA dims, and those it refuses")
    m.set_defaults(func=cmd_models)


def family_dims(family) -> str:
    """The MLA dims of ``family``'s flagship checkpoint (its transformers config class's defaults)."""
    import transformers

    from openmla.hf.presets import PRESETS

    preset = PRESETS.get(family.name) or PRESETS["deepseek_v3"]
    config = getattr(transformers, preset.config_class)().get_text_config()

    def dims(c) -> str:
        q = f"q_lora {c.q_lora_rank}" if getattr(c, "q_lora_rank", None) else "q_proj"
        return f"H={c.num_attention_heads} L={c.kv_lora_rank} R={c.qk_rope_head_dim} Dn={c.qk_nope_head_dim} Dv={c.v_head_dim} {q}"

    if 0 in (getattr(config, "no_rope_layers", None) or ()):  # Mistral Large 4: its NoPE layers fold R into Dn
        return f"{dims(config)}; NoPE layers R=0 Dn={config.qk_nope_head_dim + config.qk_rope_head_dim}"
    if family.per_layer:  # dims per layer type (dots3: its per_layer_config)
        kinds = list(dict.fromkeys(config.layer_types))
        return "; ".join(f"{kind}: {dims(config.per_layer_config[config.layer_types.index(kind)])}" for kind in kinds)
    return dims(config)


def cmd_models(args: argparse.Namespace) -> int:
    from rich.table import Table

    from ..cli_options import console
    from openmla.hf.families import FAMILIES, REFUSED
    from openmla.hf.presets import DEMO_MODELS

    demos = {family: name for name, family in DEMO_MODELS.items() if family}
    demos.update({"deepseek_v3": "tiny-v3", "deepseek_v32": "tiny-v32"})
    table = Table(title="transformers MLA families openmla.hf runs (attach, generate, stream, openmla generate)")
    for col in ("family", "model class", "MLA dims (transformers' defaults)", "attention features", "demo"):
        table.add_column(col)
    for family in FAMILIES:
        table.add_row(family.name + "".join(f", {t}" for t in family.model_types if t != family.name),
                      ", ".join(family.model_classes), family_dims(family), family.features(), demos.get(family.name, ""))
    console.print(table)
    if not REFUSED:  # every MLA family of the transformers release openmla is tested against attaches
        return 0
    refused = Table(title="MLA families attach refuses (ValueError), and what openmla lacks for them")
    refused.add_column("family")
    refused.add_column("model class")
    refused.add_column("gap")
    by_family: dict = {}
    for cls, gap in REFUSED.items():
        by_family.setdefault(gap, []).append(cls)
    for gap, classes in by_family.items():
        refused.add_row(gap.family, ", ".join(classes), gap.gap)
    console.print(refused)
    return 0
