"""FP8 latent-cache formats and FP8 queries.

Two cache formats besides the native one (entries stored in the cache's float dtype):

- ``fp8_e4m3``: the whole ``L+R`` entry as float8_e4m3fn, divided by one float32 scale per
  layer (``kv_scale``, the common engine format). Dequantised value = ``fp8 * kv_scale``.
- ``fp8_ds_mla``: DeepSeek-V3.2's token record, ``L + 4*(L/128) + 2*R`` bytes (656 for
  L=512, R=64): the latent as float8_e4m3fn in groups of 128 values, one float32 scale per
  group (``amax / 448``), then the rope part as bfloat16, not quantised.

Attention always computes on dequantised values (bfloat16 matmul inputs, float32 softmax).
The 4-bit formats are in ``openmla.nvfp4``; ``openmla.formats`` lists every format.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
DS_MLA_GROUP = 128  # latent values per scale in fp8_ds_mla
CACHE_FORMATS = ("native", "fp8_e4m3", "fp8_ds_mla")  # the native and fp8 ones; every format: openmla.formats.CACHE_FORMATS


def quantize_e4m3(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """``x / scale`` saturated to +-448 and rounded to float8_e4m3fn (no NaN from overflow)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def ds_mla_record_bytes(kv_lora_rank: int, rope_dim: int) -> int:
    """Bytes of one fp8_ds_mla token record."""
    if kv_lora_rank % DS_MLA_GROUP:
        raise ValueError(f"kv_lora_rank: fp8_ds_mla needs a multiple of {DS_MLA_GROUP}, got {kv_lora_rank}")
    return kv_lora_rank + 4 * (kv_lora_rank // DS_MLA_GROUP) + 2 * rope_dim


def ds_mla_latent_rank(record_bytes: int, rope_dim: int) -> int:
    """L from a record width: ``W = L * (1 + 4/128) + 2R``."""
    return (record_bytes - 2 * rope_dim) * DS_MLA_GROUP // (DS_MLA_GROUP + 4)


def ds_mla_views(records: torch.Tensor, kv_lora_rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Typed views of uint8 records ``[..., W]``: latent fp8 ``[..., L]``, scales float32
    ``[..., L/128]``, rope bfloat16 ``[..., R]``. Views share storage (no copy)."""
    L, G = kv_lora_rank, kv_lora_rank // DS_MLA_GROUP
    latent = records[..., :L].view(FP8)
    scales = records[..., L: L + 4 * G].view(torch.float32)
    rope = records[..., L + 4 * G:].view(torch.bfloat16)
    return latent, scales, rope


def pack_ds_mla(entries: torch.Tensor, kv_lora_rank: int) -> torch.Tensor:
    """``entries [n, L+R]`` (float) -> uint8 records ``[n, W]``; scale = amax/448 per 128 values."""
    n = entries.shape[0]
    L = kv_lora_rank
    R = entries.shape[1] - L
    latent = entries[:, :L].float().reshape(n, L // DS_MLA_GROUP, DS_MLA_GROUP)
    # A group of zeros keeps scale 1 (any positive scale stores them exactly).
    amax = latent.abs().amax(dim=-1)
    scales = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (latent / scales[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).reshape(n, L)
    out = torch.empty(n, ds_mla_record_bytes(L, R), dtype=torch.uint8, device=entries.device)
    lat_v, sc_v, rope_v = ds_mla_views(out, L)
    lat_v.copy_(q)
    sc_v.copy_(scales)
    rope_v.copy_(entries[:, L:].to(torch.bfloat16))
    return out


def unpack_ds_mla(records: torch.Tensor, kv_lora_rank: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """uint8 records ``[..., W]`` -> entries ``[..., L+R]`` in ``dtype`` (dequantised)."""
    lat, sc, rope = ds_mla_views(records, kv_lora_rank)
    shape = lat.shape[:-1]
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    latent = lat.to(wide).reshape(*shape, kv_lora_rank // DS_MLA_GROUP, DS_MLA_GROUP) * sc[..., None].to(wide)  # 0 rows too
    return torch.cat([latent.reshape(*shape, kv_lora_rank).to(dtype), rope.to(dtype)], dim=-1)


def dequantize_q(q: torch.Tensor, q_scale: torch.Tensor | float | None, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """float8_e4m3fn ``q [T, H, D]`` times its float32 scale (a scalar, ``[1]`` or per token ``[T]``)."""
    qf = q.float()
    if q_scale is None:
        return qf.to(dtype)
    s = torch.as_tensor(q_scale, dtype=torch.float32, device=q.device)
    if s.dim() == 1 and s.numel() == q.shape[0] and q.shape[0] != 1:
        s = s.view(-1, 1, 1)
    return (qf * s).to(dtype)
