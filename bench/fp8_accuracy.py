"""FP8 accuracy report: decode error of each cache format against the float64 truth.

The truth is the float64 oracle on the *unquantised* entries, so the error includes the
quantisation itself (that is what a user sees). Latents are drawn two ways: plain normal, and
"outlier-heavy" like real ones after kv_a_layernorm (1% of channels scaled x8 by gamma, a
heavy-tailed rope part, token norms spread over 3x). Then a long multi-turn run: a 16k
context grown by repeated decode steps, checking every step for NaN/Inf.

Run: .venv/bin/python bench/fp8_accuracy.py [--context 16384] [--steps 64]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

import openmla
from openmla import PagedLatentCache
from openmla import reference as ref

L, R, H = 512, 64, 16
FORMATS = ("bfloat16", "fp8_e4m3", "fp8_ds_mla")


def entries(n: int, kind: str, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(n, L + R, generator=g, dtype=torch.float64)
    if kind == "outliers":
        gamma = torch.ones(L + R, dtype=torch.float64)
        gamma[torch.randperm(L, generator=g)[: L // 100]] = 8.0
        x = x * gamma
        x[:, L:] = torch.distributions.StudentT(4.0).sample((n, R)).double()
        x = x * torch.exp(torch.rand(n, 1, generator=g, dtype=torch.float64) * 1.1)  # token norms over ~3x
    return x


def make_cache(fmt: str, pages: int, page: int, e: torch.Tensor) -> PagedLatentCache:
    dtype = torch.bfloat16 if fmt == "bfloat16" else fmt
    kv_scale = float(e.abs().max() / 448) if fmt == "fp8_e4m3" else 1.0  # calibrated per-tensor scale
    return PagedLatentCache(1, pages, page, L + R, dtype, rope_dim=R, kv_scale=kv_scale)


def decode_errors(context: int, kind: str, seed: int, page: int = 64) -> dict[str, float]:
    """Max relative error of one 4-sequence decode step per format, vs float64 on exact entries."""
    g = torch.Generator().manual_seed(seed)
    B = 4
    pages = B * -(-(context + 1) // page)
    e = entries(pages * page, kind, g)
    q = torch.randn(B, H, L + R, generator=g, dtype=torch.float64)
    scale = 192**-0.5
    exact = PagedLatentCache(1, pages, page, L + R, torch.float64)
    exact.blocks.view(-1, L + R).copy_(e)
    ids = list(range(B))
    exact.commit(exact.prepare(ids, [context] * B))
    truth, _ = ref.decode(q, exact.prepare(ids, [1] * B), 0, scale=scale, kv_lora_rank=L)
    out = {}
    for fmt in FORMATS:
        cache = make_cache(fmt, pages, page, e)
        cache.prepare([], []).write_rows(0, torch.arange(pages * page), e)
        cache.commit(cache.prepare(ids, [context] * B))
        got = openmla.flare_mla_decode(q.bfloat16(), cache.prepare(ids, [1] * B), 0, scale=scale, kv_lora_rank=L, backend="torch")
        assert torch.isfinite(got).all(), f"{fmt}: non-finite output"
        out[fmt] = float((got.double() - truth).abs().max() / truth.abs().max())
    return out


def multi_turn(context: int, steps: int, seed: int, page: int = 64) -> dict[str, dict[str, float]]:
    """One sequence grown from ``context`` by ``steps`` fused decode steps per format; worst error and
    a NaN/Inf count over all steps (outlier-heavy inputs through the real cache write)."""
    g = torch.Generator().manual_seed(seed)
    cfg = openmla.preset("deepseek-v3", H)
    total = context + steps
    pages = -(-total // page)
    freqs = openmla.rope_freqs_cis(cfg, total + 1)
    kv = entries(total, "outliers", g)  # kv_a_proj output stand-ins (normed inside the op)
    q = torch.randn(total, H, cfg.qk_head_dim, generator=g)
    kv_b = torch.randn(H, 256, L, generator=g) / L**0.5
    w_k, w_uk, w_uv = kv_b[:, :128].reshape(H * 128, L), kv_b[:, :128].transpose(1, 2).contiguous(), kv_b[:, 128:].contiguous()
    gamma = torch.ones(L)
    gamma[torch.randperm(L, generator=g)[:5]] = 8.0
    res = {}
    for fmt in ("float64",) + FORMATS:
        dt = torch.float64 if fmt == "float64" else torch.bfloat16
        cache = PagedLatentCache(1, pages, page, L + R, dt if fmt in ("float64", "bfloat16") else fmt, rope_dim=R,
                                 kv_scale=float(kv.abs().max() / 448) if fmt == "fp8_e4m3" else 1.0)
        args = lambda b, lo, hi: (q[lo:hi].to(dt), kv[lo:hi].to(dt), b.input_row_offsets, freqs, gamma.to(dt), b, 0,  # noqa: E731
                                  w_k.to(dt), w_uk.to(dt), w_uv.to(dt))
        b = cache.prepare([0], [context])
        openmla.mla_prefill_decode_graph(*args(b, 0, context), scale=cfg.softmax_scale, backend="torch")
        cache.commit(b)
        outs = []
        for s in range(steps):
            b = cache.prepare([0], [1])
            outs.append(openmla.mla_prefill_decode_graph(*args(b, context + s, context + s + 1), scale=cfg.softmax_scale,
                                                         backend="torch").double())
            cache.commit(b)
        res[fmt] = torch.cat(outs)
    truth = res.pop("float64")
    report = {}
    for fmt, o in res.items():
        bad = int((~torch.isfinite(o)).sum())
        per_step = ((o - truth).abs().amax(dim=(1, 2)) / truth.abs().amax(dim=(1, 2))).tolist()
        report[fmt] = {"max_rel_err": max(per_step), "last_step_rel_err": per_step[-1], "non_finite": bad}
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/out/fp8_accuracy.json")
    args = ap.parse_args()
    t0 = time.time()
    result: dict = {"date": time.strftime("%Y-%m-%d"), "context": args.context, "steps": args.steps, "decode": {}}
    for kind in ("normal", "outliers"):
        for ctx in (1024, args.context):
            errs = decode_errors(ctx, kind, args.seed)
            result["decode"][f"{kind}/{ctx}"] = errs
            print(f"decode {kind:8s} ctx={ctx:6d}: " + "  ".join(f"{f}={e:.2e}" for f, e in errs.items()), flush=True)
    result["multi_turn"] = multi_turn(args.context, args.steps, args.seed)
    for fmt, r in result["multi_turn"].items():
        print(f"multi-turn {args.context}+{args.steps} steps, {fmt:10s}: max rel err {r['max_rel_err']:.2e}, "
              f"last step {r['last_step_rel_err']:.2e}, non-finite values {r['non_finite']}", flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out} in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
