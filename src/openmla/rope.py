"""Rotary position embedding for the R rope dims of MLA, with DeepSeek's YaRN scaling.

``freqs_cis[p, 2i] = cos(p * w_i) * m`` and ``freqs_cis[p, 2i+1] = sin(p * w_i) * m``, where
``m`` is YaRN's magnitude factor (1 without scaling). The default rotation acts on
interleaved pairs ``(x[2i], x[2i+1])`` (DeepSeek's official layout); ``interleaved=False``
acts on half-split pairs ``(x[i], x[i + R/2])`` (the Hugging Face ``rotate_half`` layout).
"""

from __future__ import annotations

import math

import torch

from .config import MLAConfig, YarnScaling, yarn_get_mscale


def _yarn_correction_dim(num_rotations: float, dim: int, base: float, max_pos: int) -> float:
    return (dim * math.log(max_pos / (num_rotations * 2 * math.pi))) / (2 * math.log(base))


def _yarn_inv_freq(dim: int, base: float, ys: YarnScaling) -> torch.Tensor:
    """Blend of extrapolated (high-frequency) and interpolated (low-frequency) inverse frequencies."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float64) / dim
    freq_extra = 1.0 / (base**exponents)
    freq_inter = 1.0 / (ys.factor * base**exponents)
    low = math.floor(_yarn_correction_dim(ys.beta_fast, dim, base, ys.original_max_position_embeddings))
    high = math.ceil(_yarn_correction_dim(ys.beta_slow, dim, base, ys.original_max_position_embeddings))
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extra_weight = 1.0 - ramp
    return freq_inter * (1 - extra_weight) + freq_extra * extra_weight


def rope_inv_freq(config: MLAConfig) -> torch.Tensor:
    """The R/2 angular frequencies ``w_i`` (float64), YaRN-blended when the config is scaled."""
    dim, base = config.qk_rope_head_dim, config.rope_theta
    if config.rope_scaling is None:
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    return _yarn_inv_freq(dim, base, config.rope_scaling)


def rope_magnitude(config: MLAConfig) -> float:
    """YaRN's factor folded into cos and sin: ``mscale(f, mscale) / mscale(f, mscale_all_dim)``."""
    ys = config.rope_scaling
    if ys is None:
        return 1.0
    return yarn_get_mscale(ys.factor, ys.mscale) / yarn_get_mscale(ys.factor, ys.mscale_all_dim)


def rope_freqs_cis(config: MLAConfig, max_seq_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Interleaved (cos, sin) table, float32 ``[max_seq_len, R]``."""
    if max_seq_len < 1:
        raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
    inv_freq = rope_inv_freq(config)
    angles = torch.arange(max_seq_len, dtype=torch.float64)[:, None] * inv_freq[None, :]
    m = rope_magnitude(config)
    table = torch.stack((angles.cos() * m, angles.sin() * m), dim=-1).reshape(max_seq_len, 2 * inv_freq.shape[0])  # R may be 0
    return table.to(device=device, dtype=torch.float32)


def apply_rope(
    x: torch.Tensor, freqs_cis: torch.Tensor, positions: torch.Tensor, interleaved: bool = True
) -> torch.Tensor:
    """Rotate ``x [T, ..., R]`` by the angles of ``positions [T]``; returns a new tensor of x's dtype.

    The arithmetic runs in float32 (float64 when x is float64).
    """
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    fc = freqs_cis.index_select(0, positions.long()).to(compute)  # [T, R]
    cos, sin = fc[:, 0::2], fc[:, 1::2]  # [T, R/2]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    cos, sin = cos.reshape(shape), sin.reshape(shape)
    xf = x.to(compute)
    if interleaved:
        a, b = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    else:
        half = xf.shape[-1] // 2
        a, b = xf[..., :half], xf[..., half:]
        out = torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)
    return out.to(x.dtype)
