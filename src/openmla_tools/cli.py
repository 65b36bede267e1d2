"""``openmla demo | bench | check | build | compile-report | generate | models``: the main job, the benchmarks, a
smoke test for a new machine, the ahead-of-time build of the native CPU kernels, the Triton compile report, and
whole models."""

from __future__ import annotations

import argparse
import os
import sys

import torch

# cli_options first: without rich it says which extra to install
from .cli_options import AUTO_DTYPE_HELP, CACHE_DTYPES, DTYPES, cache_dtype, console, dtype_name, model_dtype
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from openmla import hardware
from openmla.backends import BACKENDS
from openmla.config import PRESETS, preset



def _si(x: float, unit: str) -> str:
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= factor:
            return f"{x / factor:.2f} {prefix}{unit}"
    return f"{x:.2f} {unit}"


# demo --------------------------------------------------------------------------------
def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    if args.model != "layer":  # a whole transformers model (openmla.hf)
        from .hf.cli import cmd_model_demo

        return cmd_model_demo(args)

    cfg = preset(args.preset, args.heads)
    dtype = model_dtype(args)
    grid = None
    if args.tp * args.cp > 1 or os.environ.get("WORLD_SIZE"):  # torchrun: heads over --tp ranks, cache over --cp
        from .distributed.demo import demo_grid

        grid = demo_grid(args, console)
    console.print(f"[bold]openmla demo[/]: {cfg.name} attention layer, {cfg.num_heads} heads "
                  f"(L={cfg.kv_lora_rank}, R={cfg.qk_rope_head_dim}, Dn={cfg.qk_nope_head_dim}, Dv={cfg.v_head_dim}, "
                  f"hidden={cfg.hidden_size}), {dtype_name(dtype)}, page {args.page_size}, {torch.get_num_threads()} threads")
    console.print(f"serving {args.requests} requests, prompts {args.prompt_min}-{args.prompt_max} tokens, "
                  f"{args.gen_min}-{args.gen_max} generated, at most {args.max_running} running")
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[status]}"),
                  TimeElapsedColumn(), console=console, transient=False) as progress:
        task = progress.add_task("requests done", total=args.requests, status="")

        def on_step(kind: str, finished: int, running: int) -> None:
            progress.update(task, completed=finished, status=f"{kind:7s} running={running}")

        report = run_demo(cfg, num_requests=args.requests, max_running=args.max_running,
                          prompt_range=(args.prompt_min, args.prompt_max), gen_range=(args.gen_min, args.gen_max),
                          page_size=args.page_size, num_pages=args.num_pages, dtype=dtype,
                          cache_dtype=cache_dtype(args), backend=args.backend,
                          seed=args.seed, check=not args.no_check, on_step=on_step, grid=grid, interleave=args.interleave)
    peak = report.matmul_flops_per_s
    table = Table(title=f"openmla demo — backend {report.backend}, {dtype_name(dtype)}, {cfg.num_heads} heads")
    for col in ("phase", "tokens", "steps", "seconds", "tokens/s", "achieved", "of roofline"):
        table.add_column(col, justify="right" if col != "phase" else "left")
    for name, st in (("prefill", report.prefill), ("decode", report.decode)):
        frac, bound = st.roofline(peak, report.copy_bytes_per_s)
        table.add_row(name, str(st.tokens), str(st.steps), f"{st.seconds:.2f}", f"{st.tokens_per_s:,.0f}",
                      _si(st.flops_per_s, "FLOP/s"), f"{frac:.2f} {bound}")
    console.print(table)
    facts = Table(show_header=False, box=None)
    facts.add_row(f"{dtype_name(dtype)} matmul rate (this run)", _si(peak, "FLOP/s"))
    facts.add_row("copy bandwidth (this run, read + write)", _si(report.copy_bytes_per_s, "B/s"))
    facts.add_row("roofline", "max(FLOPs / matmul rate, bytes / copy bandwidth) per phase: cache rows read "
                  "and written, weights read once per step")
    facts.add_row("CPU", hardware.describe())
    facts.add_row("requests served", str(report.requests))
    facts.add_row("cache pages", f"peak {report.peak_pages} of {report.num_pages} (page {report.page_size}), "
                  f"{report.pages_in_use_at_end} in use at the end")
    facts.add_row("cache format", f"{report.cache_format}, {report.bytes_per_token} bytes per token and layer")
    if report.check_error is not None:
        tol = 2e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-4
        verdict = "[green]pass[/]" if report.check_error <= tol else "[red]FAIL[/]"
        facts.add_row("check vs float64 reference", f"{report.check_what}: max rel err {report.check_error:.2e} "
                      f"(tolerance {tol:g}) {verdict}")
    facts.add_row("wall time", f"{report.wall_seconds:.1f} s")
    console.print(facts)
    if grid is not None:
        from .distributed.demo import print_ranks

        print_ranks(grid, report, console)
    if report.check_error is not None and report.check_error > (2e-2 if dtype != torch.float32 else 1e-4):
        return 1
    return 0


# check -------------------------------------------------------------------------------
def _available_backends(only: str | None = None) -> list[tuple[str, str]]:
    """(backend, why-not) pairs (``only``: just that backend): why-not is empty when the backend
    can run here."""
    out = [("torch", "")]
    if only in (None, "cpu"):  # asking builds the native kernels
        from openmla.backends.cpu import build

        reason = build.unavailable_reason()
        out.append(("cpu", f"the native kernels did not build: {reason}" if reason else ""))
    try:
        import triton  # noqa: F401

        if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
            out.append(("triton", ""))
        else:
            out.append(("triton", "no CUDA device (set TRITON_INTERPRET=1 to run it on the CPU, slowly)"))
    except ImportError:
        out.append(("triton", "triton is not installed (pip install 'openmla[triton]')"))
    return out


def cmd_check(args: argparse.Namespace) -> int:
    from .check import run_checks

    table = Table(title="openmla check — each backend against the float64 reference")
    for col in ("backend", "case", "dtype", "max rel err", "tolerance", "result"):
        table.add_column(col)
    failures = 0
    for backend, why_not in _available_backends(args.backend):
        if args.backend and backend != args.backend:
            continue
        if why_not:
            table.add_row(backend, "—", "—", "—", "—", f"[yellow]skipped[/]: {why_not}")
            continue
        for row in run_checks(backend, seed=args.seed, quick=backend == "triton" and not torch.cuda.is_available()):
            ok = row.error <= row.tolerance
            failures += not ok
            table.add_row(backend, row.case, row.dtype, f"{row.error:.1e}", f"{row.tolerance:g}",
                          "[green]pass[/]" if ok else f"[red]FAIL[/] {row.note}")
    console.print(table)
    console.print(f"{'all checks passed' if not failures else f'{failures} checks failed'}")
    return 1 if failures else 0


# bench -------------------------------------------------------------------------------
def cmd_bench(args: argparse.Namespace) -> int:
    from .benchmarks import run_bench, save_results

    dtype = model_dtype(args)
    rows, peak = run_bench(preset_name=args.preset, heads=args.heads, contexts=args.contexts, batch=args.batch,
                           page_size=args.page_size, dtype=dtype, cache_dtype=cache_dtype(args), backend=args.backend,
                           baselines=not args.no_baselines,
                           repeats=args.repeats, log=lambda s: console.print(s, highlight=False))
    from openmla.backends import resolve_backend_name

    ran = resolve_backend_name(args.backend, torch.device("cpu"))
    table = Table(title=f"openmla bench — backend {ran}, {dtype_name(dtype)}, matmul rate {_si(peak, 'FLOP/s')} (this run)")
    for col in ("phase", "impl", "heads", "context", "batch", "ms", "achieved", "of matmul", "openmla speed-up"):
        table.add_column(col, justify="left" if col in ("phase", "impl") else "right")
    ours = {(r.phase, r.heads, r.context): r.seconds for r in rows if r.impl.startswith("openmla")}
    for r in rows:
        mine = ours.get((r.phase, r.heads, r.context)) if not r.impl.startswith("openmla") else None
        table.add_row(r.phase, r.impl, str(r.heads), str(r.context), str(r.batch), f"{r.seconds * 1e3:.2f}",
                      _si(r.flops_per_s, "FLOP/s"), f"{r.flops_per_s / peak:.2f}",
                      f"{r.seconds / mine:.1f}x" if mine else "")
    console.print(table)
    json_path, png_path = save_results(rows, peak, args.out, dtype)
    console.print(f"wrote {json_path}" + (f" and {png_path}" if png_path else " (install matplotlib for the plot)"))
    return 0


# accuracy ----------------------------------------------------------------------------
def cmd_accuracy(args: argparse.Namespace) -> int:
    from .accuracy import run

    run(args, log=lambda s: console.print(s, highlight=False, markup=False, soft_wrap=True))
    return 0


# build -------------------------------------------------------------------------------
def cmd_build(args: argparse.Namespace) -> int:
    import time

    from openmla.backends.cpu import build, kernels

    t0 = time.perf_counter()
    if not build.load(verbose=args.verbose):
        console.print(f"[red]the native CPU kernels did not build[/]: {build.unavailable_reason()}")
        return 1
    console.print(f"native CPU kernels ready in {time.perf_counter() - t0:.1f} s: {build.build_dir()}")
    console.print(f"bf16 brgemm: {'yes' if kernels.bf16_gemm() else 'no (bf16 inputs compute in float32)'}; "
                  f"oneDNN picks AMX or AVX-512 at run time (ONEDNN_MAX_CPU_ISA limits it)")
    console.print(f"own AMX tile kernel for bf16 decode: {'yes' if kernels.own_amx_runs() else 'no (brgemm runs those products)'}")
    return 0


# compile-report -----------------------------------------------------------------------
def cmd_compile_report(args: argparse.Namespace) -> int:
    from .compile_report.command import argument_error, run

    why = argument_error(args)
    if why:
        raise ValueError(why)
    return run(args)


# entry point --------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    from openmla.hf.presets import DEMO_MODELS  # the whole-model demos (built with transformers when run)

    p = argparse.ArgumentParser(prog="openmla", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="serve a stream of requests through one MLA layer (continuous batching)")
    d.add_argument("--model", default="layer", choices=["layer", *DEMO_MODELS],
                   help="layer: one attention layer (default); tiny-v3: a small random whole DeepSeek-V3-shaped model; "
                        "tiny-v32: the same with DeepSeek-V3.2's top-k sparse attention; tiny-<family>: another "
                        "transformers MLA family (openmla models)")
    d.add_argument("--preset", default="deepseek-v3", choices=sorted(PRESETS))
    d.add_argument("--heads", type=int, default=16, help="query heads in this shard (default 16: V3 over TP=8)")
    d.add_argument("--requests", type=int, default=24)
    d.add_argument("--max-running", type=int, default=8, help="batch limit of running sequences")
    d.add_argument("--prompt-min", type=int, default=64)
    d.add_argument("--prompt-max", type=int, default=768)
    d.add_argument("--gen-min", type=int, default=8)
    d.add_argument("--gen-max", type=int, default=48)
    d.add_argument("--page-size", type=int, default=64)
    d.add_argument("--num-pages", type=int, default=None, help="page pool size (default: a tight pool)")
    d.add_argument("--dtype", default="auto", choices=["auto", *sorted(DTYPES)], help=AUTO_DTYPE_HELP)
    d.add_argument("--cache-dtype", default="same", choices=CACHE_DTYPES, help="latent cache format (default: --dtype)")
    d.add_argument("--backend", default=None, choices=list(BACKENDS))
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--no-check", action="store_true", help="skip the float64 reference check")
    d.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (heads split); run under torchrun")
    d.add_argument("--cp", type=int, default=1, help="context-parallel ranks (cache split); run under torchrun")
    d.add_argument("--interleave", type=int, default=None, help="CP: tokens per run on one rank (default: page size)")
    d.add_argument("--timeout", type=float, default=120.0, help="seconds a collective waits for a missing rank")
    d.set_defaults(func=cmd_demo)

    b = sub.add_parser("bench", help="decode and prefill over context lengths and head counts, with baselines")
    b.add_argument("--preset", default="deepseek-v3", choices=sorted(PRESETS))
    b.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    b.add_argument("--contexts", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    b.add_argument("--batch", type=int, default=4, help="sequences per decode step")
    b.add_argument("--page-size", type=int, default=64)
    b.add_argument("--dtype", default="auto", choices=["auto", *sorted(DTYPES)], help=AUTO_DTYPE_HELP)
    b.add_argument("--cache-dtype", default="same", choices=CACHE_DTYPES, help="latent cache format (default: --dtype)")
    b.add_argument("--backend", default=None, choices=list(BACKENDS))
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--no-baselines", action="store_true")
    b.add_argument("--out", default="bench/out", help="folder for bench.json and bench.png")
    b.set_defaults(func=cmd_bench)

    c = sub.add_parser("check", help="run each available backend against the reference on random cases")
    c.add_argument("--backend", default=None, choices=["cpu", "torch", "triton"])
    c.add_argument("--seed", type=int, default=None)
    c.set_defaults(func=cmd_check)

    a = sub.add_parser("accuracy", help="what each latent-cache format costs in accuracy: attention errors, a tiny model's KL")
    from .accuracy import add_arguments as add_accuracy_arguments

    add_accuracy_arguments(a)
    a.set_defaults(func=cmd_accuracy)

    k = sub.add_parser("build", help="compile the native CPU kernels now (otherwise on first use)")
    k.add_argument("--verbose", action="store_true", help="show the compiler's output")
    k.set_defaults(func=cmd_build)

    from .compile_report.command import DESCRIPTION as REPORT, add_arguments as add_report_arguments

    r = sub.add_parser("compile-report", help=REPORT + " (needs triton)", description=REPORT)
    add_report_arguments(r)
    r.set_defaults(func=cmd_compile_report)

    from .hf.cli import add_generate_parser, add_models_parser  # openmla generate / models (need transformers when run)

    add_generate_parser(sub, DTYPES, CACHE_DTYPES)
    add_models_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:
        console.print(f"[red]error[/]: {exc}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
