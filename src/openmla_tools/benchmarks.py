"""``openmla bench``: decode and prefill over context lengths and head counts, with baselines.

Every rate is printed next to the same run's matmul rate. Baselines, measured in the same run:
- ``eager``: a plain PyTorch MLA in the up-projected form, the way a first implementation
  writes it: gather the latent of every cached token, up-project K and V for all heads,
  bmm-softmax-bmm with a dense mask (contiguous tensors, no paging: favourable to it);
- ``transformers``: Hugging Face's eager DeepseekV3Attention with its own cache, which
  re-expands the cached latent for every token at each step (layer level, projections
  included, compared with openmla's ``LatentAttention`` on the same weights).
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from dataclasses import asdict, dataclass
from typing import Callable, Iterable

import torch

from openmla.cache import PagedLatentCache
from openmla.config import MLAConfig, preset
from .flops import fused_op_flops, projection_flops
from openmla.compat.max import mla_prefill_decode_graph
from openmla.rope import rope_freqs_cis
from .timing import matmul_rate, median_time


@dataclass
class BenchRow:
    phase: str  # decode | prefill | layer-decode
    impl: str  # openmla | eager | transformers | openmla-layer
    heads: int
    context: int
    batch: int
    seconds: float
    flops: int

    @property
    def flops_per_s(self) -> float:
        return self.flops / self.seconds if self.seconds > 0 else 0.0


@dataclass
class Problem:
    """Weights, cache and inputs of one shape, built once and shared by the implementations."""

    cfg: MLAConfig
    cache: PagedLatentCache
    freqs: torch.Tensor
    gamma: torch.Tensor
    w_k: torch.Tensor
    w_uk: torch.Tensor
    w_uv: torch.Tensor


def _problem(cfg: MLAConfig, batch: int, context: int, new: int, page_size: int, dtype: torch.dtype, seed: int = 0,
             cache_dtype: torch.dtype | str | None = None) -> tuple[Problem, object]:
    g = torch.Generator().manual_seed(seed)
    H, L, R, Dn, Dv = cfg.num_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
    pages = batch * -(-(context + new) // page_size)
    cache = PagedLatentCache(1, pages, page_size, L + R, cache_dtype or dtype, rope_dim=R)
    entries = torch.randn(pages * page_size, L + R, generator=g)
    cache.prepare([], []).write_rows(0, torch.arange(pages * page_size), entries)
    ids = list(range(batch))
    if context:
        cache.commit(cache.prepare(ids, [context] * batch))
    kv_b = (torch.randn(H, Dn + Dv, L, generator=g) / math.sqrt(L)).to(dtype)
    prob = Problem(cfg, cache, rope_freqs_cis(cfg, context + new + 1), torch.ones(L, dtype=dtype),
                   kv_b[:, :Dn].reshape(H * Dn, L).contiguous(), kv_b[:, :Dn].transpose(1, 2).contiguous(), kv_b[:, Dn:].contiguous())
    return prob, cache.prepare(ids, [new] * batch)


def _time_fused(prob: Problem, batch, new_total: int, backend: str | None, repeats: int) -> float:
    cfg = prob.cfg
    g = torch.Generator().manual_seed(1)
    dtype = prob.gamma.dtype
    q = torch.randn(new_total, cfg.num_heads, cfg.qk_head_dim, generator=g).to(dtype)
    kv = torch.randn(new_total, cfg.cache_head_dim, generator=g).to(dtype)
    run = lambda: mla_prefill_decode_graph(q, kv, batch.input_row_offsets, prob.freqs, prob.gamma, batch, 0, prob.w_k,  # noqa: E731
                                           prob.w_uk, prob.w_uv, scale=cfg.softmax_scale, backend=backend)
    return median_time(run, repeats=repeats)


def eager_mla(q: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor, w_k: torch.Tensor, w_uv: torch.Tensor,
              scale: float, q_pos: torch.Tensor) -> torch.Tensor:
    """The textbook up-projected MLA for one sequence: ``q [T,H,Dn+R]``, ``latent [S,L]``,
    ``k_rope [S,R]``, causal by absolute positions ``q_pos [T]``. Dense ``[H,T,S]`` scores."""
    H = w_uv.shape[0]
    Dn = w_k.shape[0] // H
    S = latent.shape[0]
    k_nope = (latent @ w_k.T).view(S, H, Dn)  # [S, H, Dn]
    v = torch.einsum("sl,hvl->hsv", latent, w_uv)  # [H, S, Dv]
    k = torch.cat([k_nope, k_rope[:, None, :].expand(S, H, k_rope.shape[1])], dim=-1).transpose(0, 1)  # [H, S, Dn+R]
    scores = torch.bmm(q.transpose(0, 1), k.transpose(1, 2)).float() * scale  # [H, T, S]
    mask = torch.arange(S)[None, :] > q_pos[:, None]
    scores.masked_fill_(mask, -math.inf)
    p = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.bmm(p, v).transpose(0, 1)  # [T, H, Dv]


def _time_eager(prob: Problem, batch_size: int, context: int, new: int, repeats: int) -> float:
    cfg = prob.cfg
    L = cfg.kv_lora_rank
    dtype = prob.gamma.dtype
    view = prob.cache.prepare([], [])  # the baseline gets a dense copy of the cache in the compute dtype
    flat = view.read_pages(0, torch.arange(view.num_pages), dtype).reshape(-1, cfg.cache_head_dim)
    S = context + new
    entries = [flat[i * -(-S // prob.cache.page_size) * prob.cache.page_size:][:S].contiguous() for i in range(batch_size)]
    q = torch.randn(new, cfg.num_heads, cfg.qk_head_dim).to(dtype)
    q_pos = torch.arange(context, context + new)

    def run():
        for e in entries:
            eager_mla(q, e[:, :L], e[:, L:], prob.w_k, prob.w_uv, cfg.softmax_scale, q_pos)

    return median_time(run, repeats=repeats)


def _layer_pair(cfg: MLAConfig, dtype: torch.dtype, backend: str | None):
    """openmla's LatentAttention and transformers' DeepseekV3Attention on the same random weights."""
    import transformers
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    from openmla.layer import LatentAttention

    ys = cfg.rope_scaling
    rope = None if ys is None else {
        "rope_type": "yarn", "factor": ys.factor, "beta_fast": ys.beta_fast, "beta_slow": ys.beta_slow, "mscale": ys.mscale,
        "mscale_all_dim": ys.mscale_all_dim, "original_max_position_embeddings": ys.original_max_position_embeddings,
        "rope_theta": cfg.rope_theta,
    }
    hf_cfg = transformers.DeepseekV3Config(
        hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_heads,
        q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim, rope_theta=cfg.rope_theta, rope_scaling=rope,
        max_position_embeddings=cfg.max_position_embeddings, rope_interleave=True, num_hidden_layers=1,
    )
    hf_cfg._attn_implementation = "eager"
    theirs = hf.DeepseekV3Attention(hf_cfg, layer_idx=0).to(dtype).eval()
    rotary = hf.DeepseekV3RotaryEmbedding(config=hf_cfg)
    ours = LatentAttention(cfg, 0, dtype=dtype, backend=backend)
    ours.load_hf_state_dict({k: v for k, v in theirs.state_dict().items()})
    return ours, theirs, rotary, hf_cfg


def _time_layers(cfg: MLAConfig, batch_size: int, context: int, dtype: torch.dtype, backend: str | None, page_size: int,
                 repeats: int, cache_dtype: torch.dtype | str | None = None) -> tuple[float, float]:
    """Seconds of one decode step (1 new token per sequence) for openmla's layer and transformers'."""
    from transformers import DynamicCache

    ours, theirs, rotary, hf_cfg = _layer_pair(cfg, dtype, backend)
    g = torch.Generator().manual_seed(2)
    prompt = (torch.randn(batch_size, context, cfg.hidden_size, generator=g) * 0.5).to(dtype)
    step = (torch.randn(batch_size, 1, cfg.hidden_size, generator=g) * 0.5).to(dtype)
    with torch.no_grad():
        # transformers: fill its cache with the prompt, then time steps on a copy of the cache state.
        hf_cache = DynamicCache(config=hf_cfg)
        pos = torch.arange(context)[None].expand(batch_size, -1)
        theirs(prompt, rotary(prompt, pos), None, cache=hf_cache)
        cached = [(lay.keys.clone(), lay.values.clone()) for lay in hf_cache.layers]
        step_pos = torch.full((batch_size, 1), context)
        emb = rotary(step, step_pos)

        def hf_step():
            for lay, (k, v) in zip(hf_cache.layers, cached):
                lay.keys, lay.values = k, v  # drop the token the last step appended
            theirs(step, emb, None, cache=hf_cache)

        t_hf = median_time(hf_step, repeats=repeats)
        # openmla: the same prompts in the paged cache, then one decode step per call.
        cache = PagedLatentCache(1, batch_size * -(-(context + 1) // page_size), page_size, cfg.cache_head_dim,
                                 cache_dtype or dtype, rope_dim=cfg.qk_rope_head_dim)
        ids = list(range(batch_size))
        pre = cache.prepare(ids, [context] * batch_size)
        ours(prompt.reshape(-1, cfg.hidden_size), pre)
        cache.commit(pre)
        dec = cache.prepare(ids, [1] * batch_size)
        flat_step = step.reshape(-1, cfg.hidden_size)
        t_ours = median_time(lambda: ours(flat_step, dec), repeats=repeats)
    return t_ours, t_hf


def run_bench(
    *,
    preset_name: str = "deepseek-v3",
    heads: Iterable[int] = (16, 128),
    contexts: Iterable[int] = (512, 1024, 2048, 4096),
    batch: int = 4,
    page_size: int = 64,
    dtype: torch.dtype = torch.bfloat16,
    cache_dtype: torch.dtype | str | None = None,
    backend: str | None = None,
    baselines: bool = True,
    repeats: int = 3,
    log: Callable[[str], None] = print,
) -> tuple[list[BenchRow], float]:
    """Returns the rows and the same run's matmul rate (FLOP/s)."""
    peak = matmul_rate(dtype=dtype)
    log(f"matmul rate ({dtype}, 2048^3): {peak / 1e9:.1f} GFLOP/s")
    rows: list[BenchRow] = []
    for H in heads:
        cfg = preset(preset_name, H)
        for S in contexts:
            # decode: `batch` sequences with S cached tokens, one new token each.
            prob, b = _problem(cfg, batch, S, 1, page_size, dtype, cache_dtype=cache_dtype)
            t = _time_fused(prob, b, batch, backend, repeats)
            decode_flops = fused_op_flops(cfg, [S] * batch, [1] * batch, True)
            rows.append(BenchRow("decode", "openmla", H, S, batch, t, decode_flops))
            if baselines:
                # Every implementation is credited with the work the step needs (openmla's count), so
                # achieved rates compare times directly; the eager form does far more (it up-projects
                # every cached token each step).
                rows.append(BenchRow("decode", "eager", H, S, batch, _time_eager(prob, batch, S, 1, repeats), decode_flops))
                # Credit both layers with the same (openmla's) FLOP count: the work the step needs.
                layer_flops = fused_op_flops(cfg, [S] * batch, [1] * batch, True) + projection_flops(cfg, batch)
                # transformers prefills the prompt with dense [B, H, S, S] float32 scores: keep that under 2 GB.
                scores_bytes = batch * H * S * S * 4
                if scores_bytes > 2**31:
                    log(f"  transformers baseline skipped at H={H}, S={S}: its eager prompt prefill needs "
                        f"{scores_bytes / 2**30:.0f} GiB of scores")
                else:
                    try:
                        t_ours, t_hf = _time_layers(cfg, batch, S, dtype, backend, page_size, repeats, cache_dtype)
                        rows.append(BenchRow("layer-decode", "openmla-layer", H, S, batch, t_ours, layer_flops))
                        rows.append(BenchRow("layer-decode", "transformers", H, S, batch, t_hf, layer_flops))
                    except ImportError as exc:
                        log(f"transformers baseline skipped: {exc}")
            # prefill: one sequence of S new tokens, causal.
            prob, b = _problem(cfg, 1, 0, S, page_size, dtype, cache_dtype=cache_dtype)
            flops = fused_op_flops(cfg, [0], [S], False)
            rows.append(BenchRow("prefill", "openmla", H, S, 1, _time_fused(prob, b, S, backend, repeats), flops))
            dense_bytes = H * S * S * 4
            if baselines and dense_bytes <= 2**31:
                # The eager form computes the full S x S square; credit only the causal half it needs.
                rows.append(BenchRow("prefill", "eager", H, S, 1, _time_eager(prob, 1, 0, S, repeats), flops))
            for r in rows[-4:]:
                if r.heads == H and r.context == S:
                    log(f"  {r.phase:12s} {r.impl:14s} H={H:<4d} S={S:<6d} {r.seconds * 1e3:9.2f} ms  "
                        f"{r.flops_per_s / 1e9:8.1f} GFLOP/s  {r.flops_per_s / peak:5.2f} of matmul")
    return rows, peak


def save_results(rows: list[BenchRow], peak: float, out_dir: str, dtype: torch.dtype) -> tuple[str, str | None]:
    """Write ``bench.json`` and, when matplotlib is installed, ``bench.png``; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": platform.processor() or platform.machine(),
            "cpu": _cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__, "dtype": str(dtype),
            "matmul_flops_per_s": peak}
    data = {"meta": meta, "rows": [dict(asdict(r), flops_per_s=r.flops_per_s, of_matmul=r.flops_per_s / peak) for r in rows]}
    json_path = os.path.join(out_dir, "bench.json")
    with open(json_path, "w") as f:
        json.dump(data, f, indent=1)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return json_path, None
    phases = [p for p in ("decode", "layer-decode", "prefill") if any(r.phase == p for r in rows)]
    fig, axes = plt.subplots(1, len(phases), figsize=(5.5 * len(phases), 4.2), squeeze=False)
    for ax, phase in zip(axes[0], phases):
        for impl, heads in sorted({(r.impl, r.heads) for r in rows if r.phase == phase}):
            pts = sorted((r.context, r.flops_per_s / 1e9) for r in rows if r.phase == phase and r.impl == impl and r.heads == heads)
            style = "-o" if impl.startswith("openmla") else "--x"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=f"{impl} H={heads}")
        ax.set_ylabel("useful GFLOP/s (work the step needs / time)")
        ax.axhline(peak / 1e9, color="gray", linestyle=":", label="bf16 matmul rate")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context length (tokens)")
        ax.set_title(phase)
        ax.legend(fontsize=7)
    fig.suptitle(f"openmla on {meta['cpu']} ({meta['threads']} threads), {meta['date'][:10]}", fontsize=9)
    fig.tight_layout()
    png_path = os.path.join(out_dir, "bench.png")
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return json_path, png_path


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"
