"""``openmla demo --model tiny-<family>``: a whole random transformers MLA model generating on openmla.

``tiny-v3`` is transformers' ``DeepseekV3ForCausalLM`` (``tiny-v32``: ``DeepseekV32ForCausalLM``,
whose every layer attends only to the 64 keys its top-k indexer picks, dense MLPs) with
DeepSeek-V3's attention dimensions (L=512, R=64, Dn=128, Dv=128, q_lora 1536-style low-rank
queries, YaRN rope) but few heads, few layers and a small MoE, with random weights, so it runs on
a laptop CPU in seconds. ``tiny-<family>`` is the same for every other supported family, from
``openmla.hf.presets`` (the family's real MLA dims, hidden 1024, 4 layers, 8 heads). A stream of
requests is served with continuous batching on the paged latent cache; the first token's logits
of one request are checked against the same model run by transformers alone. The MoE runs with
the experts implementation measured fastest for the demo's steps (``openmla.hf.experts``), and
the report says how much of each step the attention layers and openmla's kernels took.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from openmla.hf.attach import attach, detach
from openmla.hf.state import attachment
from openmla.hf.experts import ExpertsChoice, pick_experts_implementation
from openmla.hf.generate import TokenEvent, stream
from openmla.hf.presets import DEMO_MODELS, build
from openmla.hf.scheduler import Limits
from openmla.hf.stats import GenerationStats

MODELS = tuple(DEMO_MODELS)
TINY_V32_TOPK = 64  # keys per token: below the demo's prompt lengths, so the selection matters


def tiny_v3_config(*, heads: int = 8, layers: int = 4, vocab_size: int = 8192, sparse: bool = False):
    """A small DeepSeek-V3-shaped transformers config: V3's attention dims, a 16-expert MoE;
    ``sparse``: V3.2's (a top-k indexer in every layer: 16 heads of 64, top 64 keys; dense MLPs)."""
    from transformers import DeepseekV3Config, DeepseekV32Config

    # V3.2: dense MLPs, since the check against transformers compares logits and a random MoE's routing
    # near-ties let a 1e-3 perturbation pick another expert (seen: 25% logit change at seed 0)
    extra = (dict(index_topk=TINY_V32_TOPK, index_head_dim=64, index_n_heads=16, first_k_dense_replace=layers) if sparse
             else dict(rope_interleave=True, first_k_dense_replace=1))
    return (DeepseekV32Config if sparse else DeepseekV3Config)(
        vocab_size=vocab_size, hidden_size=1024, intermediate_size=2816, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads,
        kv_lora_rank=512, q_lora_rank=384, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1,
        moe_intermediate_size=256, max_position_embeddings=163840,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4096,
                             beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0),
        tie_word_embeddings=False, **extra,
    )


def demo_model(model_name: str, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    """The random model of ``model_name`` (one of ``MODELS``) in ``dtype``, eval mode."""
    if model_name not in MODELS:
        raise ValueError(f"model_name: expected one of {MODELS}, got {model_name!r}")
    family = DEMO_MODELS[model_name]
    if family is not None:
        return build(family, "demo", dtype=dtype, seed=seed)
    import transformers

    torch.manual_seed(seed)
    config = tiny_v3_config(sparse=model_name == "tiny-v32")
    return transformers.AutoModelForCausalLM.from_config(config).to(dtype).eval()


def describe(model: torch.nn.Module) -> tuple[str, int]:
    """``(a line naming the attached model's family and dims, its top-k or 0)`` (call while attached)."""
    state = attachment(model)
    c, hf = state.config, state.family.decoder_of(model).config
    layers = len(state.layers)
    topk = state.index_topk
    experts = getattr(hf, "n_routed_experts", None)
    moe = f"{experts} experts top-{hf.num_experts_per_tok}" if experts and any(
        getattr(getattr(layer, "mlp", None), "experts", None) is not None for layer in state.family.decoder_of(model).layers
    ) else "dense MLPs"
    sparse = f"top-{topk} sparse attention, " if topk else ""
    q = f"q_lora={c.q_lora_rank}" if c.q_lora_rank else "q_proj"
    return (f"{type(model).__name__} ({layers} layers, {c.num_heads} heads, L={c.kv_lora_rank} R={c.qk_rope_head_dim} "
            f"Dn={c.qk_nope_head_dim} Dv={c.v_head_dim} {q}, {sparse}{moe}, vocab {state.vocab_size})"), topk


@dataclass
class ModelDemoReport:
    model: str
    parameters: int
    dtype: torch.dtype
    stats: GenerationStats
    requests: int
    num_pages: int
    page_size: int
    pages_in_use_at_end: int
    check_error: float
    check_what: str
    wall_seconds: float
    outputs: list[list[int]] = field(default_factory=list)
    sparse_topk: int = 0  # keys per token of a top-k sparse model (0: dense attention)
    experts: ExpertsChoice | None = None  # the MoE experts implementation chosen (measured), if the model has a MoE


def run_model_demo(
    *,
    model_name: str = "tiny-v3",
    num_requests: int = 16,
    prompt_range: tuple[int, int] = (16, 256),
    max_new_tokens: int = 32,
    max_running: int = 8,
    max_batch_tokens: int = 512,
    page_size: int = 64,
    num_pages: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    cache_dtype: torch.dtype | str | None = None,
    backend: str | None = None,
    seed: int = 0,
    on_event: Callable[[TokenEvent], None] | None = None,
) -> ModelDemoReport:
    """Build the model, serve ``num_requests`` random prompts, and check one request against transformers."""
    rng = random.Random(seed)
    model = demo_model(model_name, dtype, seed)
    text = model.config.get_text_config()
    prompts = [[rng.randrange(text.vocab_size) for _ in range(rng.randint(*prompt_range))] for _ in range(num_requests)]
    # the MoE's experts implementation: the fastest for this run's steps (decodes of max_running tokens, prefill
    # chunks of max_batch_tokens), chosen before the reference run so both use the same MoE code
    prompt_tokens = sum(map(len, prompts))
    shapes = [(max_running, num_requests * max_new_tokens / max_running),
              (max_batch_tokens, prompt_tokens / max_batch_tokens)]
    experts = pick_experts_implementation(model, shapes, text.hidden_size)
    with torch.no_grad():  # transformers alone: the next-token logits of request 0
        want = model(torch.tensor([prompts[0]])).logits[0, -1].float()
    longest = prompt_range[1] + max_new_tokens
    if num_pages is None:  # room for about half the running limit at full length: requests have to wait
        num_pages = -(-longest // page_size) * max(2, max_running // 2)
    cache = attach(model, num_pages=num_pages, page_size=page_size, cache_dtype=cache_dtype, backend=backend)
    name, topk = describe(model)
    stats = GenerationStats()
    outputs: list[list[int]] = [[] for _ in prompts]
    first: torch.Tensor | None = None
    t0 = time.perf_counter()
    try:
        for ev in stream(model, prompts, max_new_tokens, limits=Limits(max_batch_tokens=max_batch_tokens, max_running=max_running),
                         stats=stats, return_logits=True):
            if ev.request == 0 and first is None:
                first = ev.logits
            outputs[ev.request].append(ev.token)
            if on_event is not None:
                on_event(ev)
        wall = time.perf_counter() - t0
        in_use = cache.pages_in_use
    finally:
        detach(model)
    err = float((first - want).abs().max() / want.abs().max())
    return ModelDemoReport(
        model=f"{model_name}: {name}", parameters=sum(p.numel() for p in model.parameters()), dtype=dtype, stats=stats,
        requests=num_requests, num_pages=num_pages, page_size=page_size, pages_in_use_at_end=in_use, check_error=err,
        check_what=f"request 0's first-token logits ({len(prompts[0])}-token prompt) vs transformers alone",
        wall_seconds=wall, outputs=outputs, sparse_topk=topk, experts=experts,
    )
