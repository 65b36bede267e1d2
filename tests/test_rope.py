"""RoPE tables and rotation: norms, layouts, YaRN values against transformers."""

import math

import pytest
import torch

from openmla import MLAConfig, YarnScaling, apply_rope, preset, rope_freqs_cis
from openmla import reference as ref
from openmla.rope import rope_inv_freq, rope_magnitude


@pytest.mark.parametrize("interleaved", [True, False])
def test_rotation_preserves_norm_without_yarn(interleaved):
    cfg = MLAConfig(num_heads=4, rope_scaling=None)
    fc = rope_freqs_cis(cfg, 4096)
    x = torch.randn(50, 4, 64, dtype=torch.float64)
    pos = torch.randint(0, 4096, (50,))
    y = apply_rope(x, fc, pos, interleaved=interleaved)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-6, atol=0)


def test_yarn_magnitude_scales_norm_uniformly():
    cfg = MLAConfig(num_heads=1, rope_scaling=YarnScaling(factor=40.0, mscale=1.0, mscale_all_dim=0.0))
    m = rope_magnitude(cfg)
    assert m != 1.0
    x = torch.randn(20, 64, dtype=torch.float64)
    y = apply_rope(x, rope_freqs_cis(cfg, 1000), torch.arange(20))
    torch.testing.assert_close(y.norm(dim=-1), m * x.norm(dim=-1), rtol=1e-6, atol=0)


def test_interleaved_equals_half_split_after_permutation():
    cfg = preset("deepseek-v3")
    fc = rope_freqs_cis(cfg, 512)
    x = torch.randn(30, 3, 64, dtype=torch.float64)
    pos = torch.randint(0, 512, (30,))
    perm = torch.cat([torch.arange(0, 64, 2), torch.arange(1, 64, 2)])  # pair (2i, 2i+1) -> (i, i+32)
    a = apply_rope(x, fc, pos, interleaved=True)[..., perm]
    b = apply_rope(x[..., perm], fc, pos, interleaved=False)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("interleaved", [True, False])
def test_apply_rope_matches_pair_formula(interleaved):
    cfg = preset("kimi-k2")
    fc = rope_freqs_cis(cfg, 300)
    x = torch.randn(17, 2, 64)
    pos = torch.randint(0, 300, (17,))
    torch.testing.assert_close(apply_rope(x, fc, pos, interleaved).double(), ref.rope(x, fc, pos, interleaved), rtol=1e-5, atol=1e-5)


def test_table_layout_and_plain_frequencies():
    cfg = MLAConfig(num_heads=1, rope_scaling=None, rope_theta=10000.0)
    fc = rope_freqs_cis(cfg, 8)
    w = 10000.0 ** (-torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    p = 5
    torch.testing.assert_close(fc[p, 0::2].double(), torch.cos(p * w), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fc[p, 1::2].double(), torch.sin(p * w), rtol=1e-6, atol=1e-6)


def test_softmax_scale_yarn():
    v3 = preset("deepseek-v3")
    mscale = 0.1 * 1.0 * math.log(40.0) + 1.0
    assert v3.softmax_scale == pytest.approx(192**-0.5 * mscale**2)
    assert MLAConfig(num_heads=1).softmax_scale == pytest.approx(192**-0.5)


def _hf_rope(hf_cfg):
    """(inv_freq, attention_scaling, attention.scaling) from transformers' DeepSeek-V3 modules."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m

    rot = m.DeepseekV3RotaryEmbedding(config=hf_cfg)
    attn = m.DeepseekV3Attention(hf_cfg, layer_idx=0)
    return rot.inv_freq.double(), float(rot.attention_scaling), float(attn.scaling)


@pytest.mark.parametrize("name", ["deepseek-v3", "kimi-k2", "deepseek-v2"])
def test_yarn_matches_transformers(name):
    transformers = pytest.importorskip("transformers")
    cfg = preset(name)
    ys = cfg.rope_scaling
    rope_scaling = {
        "type": "yarn", "rope_type": "yarn", "factor": ys.factor, "beta_fast": ys.beta_fast, "beta_slow": ys.beta_slow,
        "mscale": ys.mscale, "mscale_all_dim": ys.mscale_all_dim,
        "original_max_position_embeddings": ys.original_max_position_embeddings, "rope_theta": cfg.rope_theta,
    }
    hf = transformers.DeepseekV3Config(
        hidden_size=256, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
        rope_theta=cfg.rope_theta, rope_scaling=rope_scaling, max_position_embeddings=cfg.max_position_embeddings,
    )
    inv_freq, attn_factor, scaling = _hf_rope(hf)
    torch.testing.assert_close(rope_inv_freq(cfg), inv_freq, rtol=1e-6, atol=0)
    assert rope_magnitude(cfg) == pytest.approx(attn_factor, rel=1e-6)
    assert cfg.with_heads(4).softmax_scale == pytest.approx(scaling, rel=1e-6)
    assert MLAConfig.from_hf(hf).softmax_scale == pytest.approx(scaling, rel=1e-6)
