"""What a latent-cache format costs in accuracy (issue #23): attention errors and a whole model.

1. Attention. The same entries and queries for every format: B sequences of S tokens (DeepSeek-V3's
   shape: H=16 heads of a TP=8 shard, L=512, R=64, its YaRN softmax scale), the last ``--queries``
   tokens of each attending causally (decode form, torch backend, float32 queries: the error
   measured is what the cache stores, not bf16 arithmetic). Per (query token, head) row: the
   relative error of the attention output (latent, [L]) ``|o - o*| / |o*|`` and the LSE error
   ``|lse - lse*|``, against the float64 truth on the unquantised entries and against the bf16
   cache's result; median, p99 and max over rows and seeds.
   Activations like real ones: the latent is RMSNorm(x) * gamma with per-channel spreads
   (lognormal), four outlier channels (x20 before the norm) and a lognormal gamma; the rope part has
   a wider range (per-channel lognormal scales up to ~30x). Queries give logits of std ~2 and each
   raises 4 earlier keys' logits by ``--lift`` (8: those 4 hold most of the weight at 1k tokens,
   the diffuse rest most of it at 32k; a mix of peaked and diffuse attention).
   fp8_e4m3 gets a calibrated per-tensor scale (amax / 448).
2. A tiny random DeepSeek-V3 (transformers, float32 weights, L=512, R=64, 2 layers, 4 heads; weights
   of std 0.05, lm_head x6 for a peaked next-token distribution) attached with each ``cache_dtype``:
   the KL divergence of the next-token distributions against the float32 cache, teacher-forced over
   prompt + N tokens (the float32 run's greedy tokens, one prefill through the format's cache), the
   top-1 agreement there, and free-running greedy agreement over N generated tokens (fraction
   equal, and the first position that differs). ``attach`` uses fp8_e4m3's default kv_scale of 1.0
   (what a user of attach gets). How much a random model amplifies cache errors depends on its
   weight scale (std 0.3 and lm_head x1 instead: 17-35x the KL), so these numbers rank the formats;
   they do not predict a trained model's.

Writes <out>.json, <out>.md (tables) and <out>.png (the plot, with matplotlib installed).

Run: ``openmla accuracy [--formats bf16,fp8_ds_mla] [--contexts 1024,...,32768] [--model-tokens 512]``
(part 2 needs transformers; without it the run says so and skips it).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch

from openmla import planning
from openmla.cache import PagedLatentCache
from openmla.config import preset
from openmla.formats import QUANTIZED_FORMATS

L, R = 512, 64
FORMATS = ("bf16", *QUANTIZED_FORMATS)  # bf16: the baseline every format is also compared with
PAGE = 64


def bytes_per_token(fmt: str) -> int:
    return PagedLatentCache(1, 1, 1, L + R, storage(fmt), rope_dim=R).bytes_per_token


def storage(fmt: str) -> "torch.dtype | str":
    return torch.bfloat16 if fmt == "bf16" else fmt


# 1. Attention ------------------------------------------------------------------------------------
def activations(n: int, g: torch.Generator, chan: torch.Tensor, gamma: torch.Tensor, rope_scale: torch.Tensor) -> torch.Tensor:
    """``n`` cache entries [n, L+R] (float32) with the statistics described above."""
    x = torch.randn(n, L, generator=g) * chan
    latent = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * gamma
    rope = torch.randn(n, R, generator=g) * rope_scale
    return torch.cat([latent, rope], dim=-1)


def layer_statistics(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    chan = torch.exp(0.5 * torch.randn(L, generator=g))
    chan[torch.randperm(L, generator=g)[:4]] *= 20.0  # outlier channels
    gamma = torch.exp(0.3 * torch.randn(L, generator=g))
    rope_scale = torch.exp(0.5 + 0.8 * torch.randn(R, generator=g))
    return chan, gamma, rope_scale


def queries(entries: torch.Tensor, positions: list[int], H: int, scale: float, g: torch.Generator, lift: float) -> torch.Tensor:
    """[len(positions), H, L+R] float64: logits of std ~2, plus 4 earlier keys' logits raised by ``lift``."""
    q = torch.randn(len(positions), H, L + R, generator=g, dtype=torch.float64)
    k = entries.double()
    std = (scale * (q[0] @ k[: min(4096, len(k))].T)).std()
    q *= 2.0 / float(std)
    for t, p in enumerate(positions):
        for j in torch.randint(0, p + 1, (4,), generator=g).tolist():
            kj = k[j]
            q[t] += (lift / scale) * kj / kj.dot(kj)  # key j's logit + lift in every head: a standout
    return q


def truth(q: torch.Tensor, keys: torch.Tensor, positions: list[int], scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 causal attention of one sequence's queries: out [T, H, L], lse [T, H]."""
    k = keys.double()
    s = scale * torch.einsum("thd,nd->thn", q, k)
    pos = torch.tensor(positions)[:, None, None]
    s = s.masked_fill(torch.arange(k.shape[0])[None, None, :] > pos, -math.inf)
    lse = torch.logsumexp(s, -1)
    return torch.einsum("thn,nl->thl", torch.exp(s - lse[..., None]), k[:, :L]), lse


def attention_errors(S: int, B: int, Tq: int, H: int, seed: int, lift: float, formats: tuple[str, ...]) -> dict:
    """Per format: output rel errors and LSE errors (per row) vs float64 and vs the bf16 cache."""
    g = torch.Generator().manual_seed(seed * 1000 + S)
    cfg = preset("deepseek-v3", num_heads=H)
    scale = cfg.softmax_scale
    stats = layer_statistics(g)
    E = [activations(S, g, *stats) for _ in range(B)]
    pos = list(range(S - Tq, S))
    Q = [queries(e, pos, H, scale, g, lift) for e in E]
    want = [truth(q, e, pos, scale) for q, e in zip(Q, E)]
    o64, l64 = torch.cat([w[0] for w in want]), torch.cat([w[1] for w in want])
    amax = float(max(e.abs().max() for e in E))
    ids = list(range(B))
    got = {}
    for fmt in formats:
        cache = PagedLatentCache(1, B * -(-S // PAGE), PAGE, L + R, storage(fmt), rope_dim=R,
                                 kv_scale=amax / 448 if fmt == "fp8_e4m3" else 1.0)
        pre = cache.prepare(ids, [S - Tq] * B)
        for b in range(B):
            rows = pre.physical_rows(torch.full((S - Tq,), b), torch.arange(S - Tq))
            for c in range(0, S - Tq, 8192):
                pre.write_rows(0, rows[c: c + 8192], E[b][c: min(c + 8192, S - Tq)])
        cache.commit(pre)
        batch = cache.prepare(ids, [Tq] * B)  # the query tokens' own entries, as a decode step's cache write stores them
        seq, p = batch.token_positions()
        batch.write_rows(0, batch.physical_rows(seq, p), torch.cat([e[S - Tq:] for e in E]))
        plan = planning.plan(batch, scale=scale, backend="torch")
        out, lse = plan.decode(torch.cat(Q).float(), 0, kv_lora_rank=L, return_lse=True)
        assert torch.isfinite(out).all() and torch.isfinite(lse).all(), f"{fmt}: non-finite output"
        got[fmt] = (out.double(), lse.double())

    def rel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return ((a - b).norm(dim=-1) / b.norm(dim=-1)).flatten()

    res = {}
    for fmt, (o, lse) in got.items():
        res[fmt] = {"rel_f64": rel(o, o64).tolist(), "lse_f64": (lse - l64).abs().flatten().tolist(),
                    "rel_bf16": rel(o, got["bf16"][0]).tolist(), "lse_bf16": (lse - got["bf16"][1]).abs().flatten().tolist()}
    return res


def summary(values: list[float]) -> dict:
    t = torch.tensor(values, dtype=torch.float64)
    return {"median": float(t.median()), "p99": float(torch.quantile(t, 0.99)), "max": float(t.max())}


# 2. A tiny random DeepSeek-V3 --------------------------------------------------------------------
def tiny_model(seed: int):
    import transformers

    cfg = transformers.DeepseekV3Config(
        vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, kv_lora_rank=L, q_lora_rank=None, qk_rope_head_dim=R, qk_nope_head_dim=64, v_head_dim=64,
        first_k_dense_replace=2, n_routed_experts=4, num_experts_per_tok=2, initializer_range=0.05, max_position_embeddings=4096,
        tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        model.lm_head.weight *= 6.0  # next-token entropy ~1.7 nats: peaked like a trained model's, not near-uniform
    return model


def model_run(tokens: int, seed: int, formats: tuple[str, ...]) -> dict:
    from openmla.hf import attach, detach, forward_step, generate

    model = tiny_model(seed)
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 1024, (16,), generator=g).tolist()
    pages = -(-(len(prompt) + tokens) // PAGE) + 1
    dtypes = {"fp32": None, **{f: storage(f) for f in formats}}
    free, forced = {}, {}
    for name, dt in dtypes.items():
        attach(model, num_pages=pages, page_size=PAGE, cache_dtype=dt, backend="torch")
        free[name] = generate(model, [prompt], tokens)[0]
        detach(model)
    seq = torch.tensor(prompt + free["fp32"][:-1])  # teacher forcing: the float32 run's tokens
    for name, dt in dtypes.items():
        cache = attach(model, num_pages=pages, page_size=PAGE, cache_dtype=dt, backend="torch")
        batch = cache.prepare(["a"], [len(seq)])
        forced[name] = forward_step(model, batch, seq, torch.arange(len(prompt) - 1, len(seq))).double().log_softmax(-1)
        detach(model)
    ref_lp = forced["fp32"]
    p = ref_lp.exp()
    ent = -(p * ref_lp).sum(-1)
    out = {"tokens": tokens, "prompt": len(prompt), "mean_entropy_nats": float(ent.mean()), "formats": {}}
    for name in dtypes:
        kl = (p * (ref_lp - forced[name])).sum(-1).clamp_min(0)
        same = [a == b for a, b in zip(free[name], free["fp32"])]
        out["formats"][name] = {
            "kl_mean": float(kl.mean()), "kl_p99": float(torch.quantile(kl, 0.99)), "kl_max": float(kl.max()),
            "top1_teacher_forced": float((forced[name].argmax(-1) == ref_lp.argmax(-1)).double().mean()),
            "greedy_agreement": sum(same) / len(same), "first_divergence": same.index(False) if False in same else len(same)}
    return out


# Report ------------------------------------------------------------------------------------------
def markdown(result: dict) -> str:
    att = result["attention"]
    lines = [f"Attention, decode form, H={result['heads']}, L={L}, R={R}, contexts {', '.join(str(c) for c in result['contexts'])}, "
             f"{result['batch']} sequences x {result['queries']} query tokens x {result['heads']} heads x {len(result['seeds'])} seeds "
             "per context (rows); relative error of the output |o - o*|/|o*| per row and |LSE - LSE*|, over all rows:", "",
             "| cache | bytes/token | out vs float64: median | p99 | max | LSE vs float64: median | p99 | max "
             "| out vs bf16 cache: median | p99 | max |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for fmt in result["formats"]:
        a = att["all"][fmt]
        cells = [a["rel_f64"], a["lse_f64"], a["rel_bf16"]]
        lines.append(f"| {fmt} | {bytes_per_token(fmt)} | " + " | ".join(f"{c[k]:.1e}" for c in cells for k in ("median", "p99", "max")) + " |")
    lines += ["", "p99 of the output's relative error vs float64, per context:", "",
              "| cache | " + " | ".join(str(c) for c in result["contexts"]) + " |", "|---|" + "---:|" * len(result["contexts"])]
    for fmt in result["formats"]:
        lines.append(f"| {fmt} | " + " | ".join(f"{att[str(c)][fmt]['rel_f64']['p99']:.1e}" for c in result["contexts"]) + " |")
    if "model" in result:
        m = result["model"]
        lines += ["", f"Tiny random DeepSeek-V3 (float32, 2 layers, H=4, L=512, R=64, vocab 1024; mean next-token entropy "
                  f"{m['mean_entropy_nats']:.2f} nats), {m['prompt']}-token prompt, {m['tokens']} tokens; against the float32 cache:", "",
                  "| cache | KL mean (nats) | KL p99 | KL max | top-1 agreement, teacher-forced | greedy agreement, free-running "
                  "| first differing token |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for name, r in m["formats"].items():
            if name == "fp32":
                continue
            lines.append(f"| {name} | {r['kl_mean']:.1e} | {r['kl_p99']:.1e} | {r['kl_max']:.1e} | {r['top1_teacher_forced']:.1%} | "
                         f"{r['greedy_agreement']:.1%} | {r['first_divergence']} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> bool:
    """The plot at ``path``; False (nothing written) without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    ctx = result["contexts"]
    for fmt in result["formats"]:
        for key, ax in (("rel_f64", axes[0]), ("lse_f64", axes[1])):
            p99 = [result["attention"][str(c)][fmt][key]["p99"] for c in ctx]
            med = [result["attention"][str(c)][fmt][key]["median"] for c in ctx]
            line, = ax.plot(ctx, p99, marker="o", label=f"{fmt} p99")
            ax.plot(ctx, med, marker=".", linestyle=":", color=line.get_color(), label=f"{fmt} median")
    for ax, title in zip(axes, ("attention output: |o - o*| / |o*| vs float64", "LSE: |lse - lse*| vs float64")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context (tokens)")
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7, ncol=2)
    fig.suptitle(f"openmla cache formats, H={result['heads']}, L=512, R=64 (torch backend, {result['date']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def add_arguments(ap: argparse.ArgumentParser, out: str = "openmla_accuracy") -> None:
    ap.add_argument("--formats", default=",".join(FORMATS),
                    help=f"cache formats, comma-separated (bf16 always runs: the baseline); default all: {','.join(FORMATS)}")
    ap.add_argument("--contexts", default="1024,2048,4096,8192,16384,32768")
    ap.add_argument("--batch", type=int, default=2, help="sequences per context")
    ap.add_argument("--queries", type=int, default=4, help="query tokens per sequence (the last ones)")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--lift", type=float, default=8.0, help="logit added to 4 earlier keys per query (background logits: std 2)")
    ap.add_argument("--model-tokens", type=int, default=512, help="generated tokens of the tiny model (0: skip it)")
    ap.add_argument("--out", default=out, help="path prefix of the .json, .md and .png written")


def _int_list(name: str, text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise ValueError(f"{name}: comma-separated integers, got {text!r}") from None
    return values


def _formats(text: str) -> tuple[str, ...]:
    asked = [f for f in text.split(",") if f]
    unknown = [f for f in asked if f not in FORMATS]
    if unknown:
        raise ValueError(f"formats: unknown {unknown}; choose from {list(FORMATS)}")
    return tuple(f for f in FORMATS if f == "bf16" or f in asked)


def run(args: argparse.Namespace, log=print) -> dict:
    """The whole measurement for parsed ``args``; writes the files and returns the result."""
    t0 = time.time()
    formats = _formats(args.formats)
    contexts = _int_list("contexts", args.contexts)
    seeds = _int_list("seeds", args.seeds)
    if min(contexts) <= args.queries:
        raise ValueError(f"contexts: each must exceed --queries ({args.queries}), got {min(contexts)}")
    result: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "formats": list(formats), "contexts": contexts,
                    "batch": args.batch, "lift": args.lift, "queries": args.queries, "heads": args.heads, "seeds": seeds,
                    "threads": torch.get_num_threads(), "attention": {}}
    pooled: dict = {fmt: {k: [] for k in ("rel_f64", "lse_f64", "rel_bf16", "lse_bf16")} for fmt in formats}
    for S in contexts:
        per: dict = {fmt: {k: [] for k in pooled[fmt]} for fmt in formats}
        for seed in seeds:
            for fmt, errs in attention_errors(S, args.batch, args.queries, args.heads, seed, args.lift, formats).items():
                for k, v in errs.items():
                    per[fmt][k] += v
                    pooled[fmt][k] += v
        result["attention"][str(S)] = {fmt: {k: summary(v) for k, v in d.items()} for fmt, d in per.items()}
        log(f"context {S:6d} ({time.time() - t0:5.0f} s): p99 rel err vs float64 " + "  ".join(
            f"{fmt} {result['attention'][str(S)][fmt]['rel_f64']['p99']:.1e}" for fmt in formats))
    result["attention"]["all"] = {fmt: {k: summary(v) for k, v in d.items()} for fmt, d in pooled.items()}
    if args.model_tokens:
        try:
            import transformers  # noqa: F401
        except ImportError:
            log("tiny model skipped: it needs transformers (pip install 'openmla[hf]')")
        else:
            result["model"] = model_run(args.model_tokens, seeds[0], formats)
            log(f"tiny model ({time.time() - t0:.0f} s): " + "  ".join(
                f"{n} KL {r['kl_mean']:.1e} greedy {r['greedy_agreement']:.0%}" for n, r in result["model"]["formats"].items()))
    result["seconds"] = round(time.time() - t0)
    if os.path.dirname(args.out):
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    md = markdown(result)
    with open(args.out + ".md", "w") as f:
        f.write(md)
    plotted = plot(result, args.out + ".png")
    log(md)
    log(f"wrote {args.out}.json, .md" + (" and .png" if plotted else " (install matplotlib for the plot)") + f" in {result['seconds']} s")
    return result


def main(argv: list[str] | None = None, out: str = "openmla_accuracy") -> None:
    ap = argparse.ArgumentParser(prog="openmla accuracy", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap, out)
    run(ap.parse_args(argv))
