"""LatentAttention against Hugging Face transformers' DeepseekV3Attention / DeepseekV2Attention.

Tiny configs with the real MLA structure and random weights (nothing downloaded). The same
weights go into both; a ragged prefill runs through openmla's paged cache in one call and
through transformers one sequence at a time (eager attention, its causal mask and positions),
then decode steps (and a prefill chunk on top of a cache) run against transformers'
DynamicCache. Outputs after o_proj are compared in float32: transformers' V3 interleaved path
stores its rope dims de-interleaved, openmla keeps DeepSeek's pair layout, so caches differ
by a permutation while attention outputs must agree.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from cases import rel_err  # noqa: E402
from openmla import MLAConfig, PagedLatentCache  # noqa: E402
from openmla.layer import LatentAttention  # noqa: E402
from test_layer import backend  # noqa: E402,F401  (fixture: reference, and torch once built)

from transformers.cache_utils import DynamicCache  # noqa: E402
from transformers.models.deepseek_v2 import modeling_deepseek_v2 as hf_v2  # noqa: E402
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_v3  # noqa: E402

TOL = 1e-4
HIDDEN = 64
# (new tokens per sequence) per step: ragged prefill with a 1-token sequence, single decode,
# multi-token decode with an idle sequence, a prefill chunk on top of a cache, single decode.
STEPS = [[9, 1, 13], [1, 1, 1], [2, 0, 3], [8, 1, 1], [1, 1, 1]]

YARN = {
    None: None,
    # DeepSeek-V3's block (magnitude 1, softmax scale boosted by mscale^2)
    "deepseek": dict(factor=40.0, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0),
    # Kimi-K2-like ramp (beta_fast 1) with mscale != mscale_all_dim so cos/sin carry a magnitude
    "skewed": dict(factor=32.0, original_max_position_embeddings=4096, beta_fast=1, beta_slow=1, mscale=1.0, mscale_all_dim=0.707),
}


def hf_config(kind: str, q_lora: bool, yarn: str | None, interleave: bool = True):
    """A tiny transformers DeepseekV3Config / DeepseekV2Config (eager attention)."""
    theta = 50000.0 if yarn == "skewed" else 10000.0
    rope = {"rope_type": "default", "rope_theta": theta}
    if yarn is not None:
        rope = {"rope_type": "yarn", "rope_theta": theta, **YARN[yarn]}
    common = dict(hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
                  q_lora_rank=48 if q_lora else None, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32,
                  num_hidden_layers=2, max_position_embeddings=4096 * 40, rope_parameters=rope, attention_bias=False)
    if kind == "v3":
        cfg = transformers.DeepseekV3Config(rope_interleave=interleave, **common)
    else:
        cfg = transformers.DeepseekV2Config(**common)
    cfg._attn_implementation = "eager"
    return cfg


class HFAttention:
    """transformers' attention layer plus its rotary embedding, one sequence at a time."""

    def __init__(self, cfg, layer_idx: int) -> None:
        mod = hf_v3 if cfg.model_type == "deepseek_v3" else hf_v2
        self.v2 = mod is hf_v2
        attn_cls = mod.DeepseekV3Attention if not self.v2 else mod.DeepseekV2Attention
        rot_cls = mod.DeepseekV3RotaryEmbedding if not self.v2 else mod.DeepseekV2RotaryEmbedding
        self.attn = attn_cls(cfg, layer_idx).float().eval()
        self.rotary = rot_cls(cfg)

    @torch.no_grad()
    def __call__(self, x: torch.Tensor, cache: DynamicCache, past: int) -> torch.Tensor:
        """``x [S, hidden]`` new tokens of one sequence with ``past`` cached -> ``[S, hidden]``."""
        S = x.shape[0]
        position_ids = torch.arange(past, past + S)[None]
        pos_emb = self.rotary(x[None], position_ids)
        mask = torch.full((S, past + S), float("-inf")).triu(past + 1)[None, None]  # additive causal mask
        out = self.attn(hidden_states=x[None], position_embeddings=pos_emb, attention_mask=mask, cache=cache)[0]
        return out[0]


def randomize(hf: HFAttention, layer_idx: int, seed: int) -> dict[str, torch.Tensor]:
    """Random weights into transformers' layer; returns them as a whole-model state dict."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    with torch.no_grad():
        for name, p in hf.attn.named_parameters():
            if "layernorm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 1.5 * p.shape[1] ** -0.5)  # sharper than uniform
            sd[f"model.layers.{layer_idx}.self_attn.{name}"] = p.detach().clone()
    return sd


def compare(hf_cfg, backend: str, seed: int = 0, layer_idx: int = 1, page_size: int = 4) -> float:
    """Max relative error of LatentAttention vs transformers over ``STEPS``."""
    hf = HFAttention(hf_cfg, layer_idx)
    sd = randomize(hf, layer_idx, seed)
    config = MLAConfig.from_hf(hf_cfg)
    assert config.softmax_scale == pytest.approx(hf.attn.scaling, rel=1e-12)
    layer = LatentAttention(config, layer_idx, dtype=torch.float32, backend=backend, max_position=16)
    layer.load_hf_state_dict(sd)
    B = len(STEPS[0])
    cache = PagedLatentCache(layer_idx + 1, 32, page_size=page_size, head_dim=config.cache_head_dim, dtype=torch.float32)
    hf_caches = [DynamicCache() for _ in range(B)]
    past = [0] * B
    g = torch.Generator().manual_seed(seed + 1)
    worst = 0.0
    for new in STEPS:
        xs = [torch.randn(n, HIDDEN, generator=g) for n in new]
        want = torch.cat([hf(x, hf_caches[b], past[b]) for b, x in enumerate(xs) if x.shape[0]])
        batch = cache.prepare(list(range(B)), new)
        with torch.no_grad():
            got = layer(torch.cat(xs), batch)
        cache.commit(batch)
        past = [p + n for p, n in zip(past, new)]
        worst = max(worst, rel_err(got, want))
    return worst


V3_CASES = [(q, y, i) for q in (True, False) for y in (None, "deepseek", "skewed") for i in (True, False)]


@pytest.mark.parametrize("q_lora,yarn,interleave", V3_CASES, ids=[f"qlora={q}-yarn={y}-interleave={i}" for q, y, i in V3_CASES])
def test_deepseek_v3_attention(backend, q_lora, yarn, interleave):
    err = compare(hf_config("v3", q_lora, yarn, interleave), backend)
    assert err <= TOL


V2_CASES = [(q, y) for q in (True, False) for y in (None, "deepseek", "skewed")]


@pytest.mark.parametrize("q_lora,yarn", V2_CASES, ids=[f"qlora={q}-yarn={y}" for q, y in V2_CASES])
def test_deepseek_v2_attention(backend, q_lora, yarn):
    # transformers' V2 ropes interleaved pairs with complex numbers: DeepSeek's own convention
    err = compare(hf_config("v2", q_lora, yarn), backend)
    assert err <= TOL


def test_config_from_transformers_object():
    cfg = hf_config("v3", q_lora=True, yarn="skewed", interleave=False)
    mc = MLAConfig.from_hf(cfg)
    assert (mc.num_heads, mc.kv_lora_rank, mc.q_lora_rank, mc.qk_rope_head_dim, mc.qk_nope_head_dim, mc.v_head_dim) == (4, 32, 48, 16, 16, 32)
    assert mc.rope_theta == 50000.0 and mc.rope_interleave is False
    assert mc.rope_scaling is not None and mc.rope_scaling.mscale_all_dim == pytest.approx(0.707)


def test_bfloat16_layer_close_to_float32_transformers(backend):
    """bf16 weights, activations and cache stay near transformers in fp32."""
    hf_cfg = hf_config("v3", q_lora=True, yarn="deepseek")
    hf = HFAttention(hf_cfg, 0)
    sd = randomize(hf, 0, seed=5)
    layer = LatentAttention(MLAConfig.from_hf(hf_cfg), 0, dtype=torch.bfloat16, backend=backend)
    layer.load_hf_state_dict(sd)
    cache = PagedLatentCache(1, 16, page_size=16, head_dim=48)  # bf16 cache
    g = torch.Generator().manual_seed(6)
    hf_caches, past = [DynamicCache(), DynamicCache()], [0, 0]
    for new in ([12, 5], [1, 1]):
        xs = [torch.randn(n, HIDDEN, generator=g) for n in new]
        want = torch.cat([hf(x, hf_caches[b], past[b]) for b, x in enumerate(xs)])
        batch = cache.prepare([0, 1], new)
        with torch.no_grad():
            got = layer(torch.cat(xs).bfloat16(), batch)
        cache.commit(batch)
        past = [p + n for p, n in zip(past, new)]
        assert got.dtype == torch.bfloat16
        assert rel_err(got, want) <= 3e-2
