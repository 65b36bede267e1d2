"""NVFP4 latent-cache records: the latent as FP4 e2m1 values with one e4m3 scale per 16 of them.

Two per-token uint8 records, both for DeepSeek's MLA shape only (L = 512 latent values, R = 64 rope
values; the CUDA writers they come from assert exactly these sizes). Offsets are bytes within a
token's record; "group g" is latent values ``16g .. 16g+15``.

``nvfp4_ds_mla`` (432 bytes): local-inference-lab/vllm pull request 82, byte for byte.

| bytes | content |
|---|---|
| ``[0, 256)`` | the 512 latent values as e2m1 codes, two per byte: value ``2i`` in the LOW nibble of byte ``i``, value ``2i+1`` in the HIGH nibble |
| ``[256, 288)`` | the e4m3 scale of group ``g`` at byte ``256 + g`` (group order) |
| ``[288, 304)`` | zero (alignment padding) |
| ``[304, 432)`` | the 64 rope values as bfloat16 (little-endian), not quantised |

Value = e2m1 * e4m3 scale * 1.0 (an implicit outer scale of 1.0: the writer ignores vLLM's
``k_scale``). Write: ``scale = e4m3(amax_16 * fp32(1/6))`` (round to nearest even, saturating at
448), then each value ``e2m1(x * fp32(1 / float(scale)))`` (round to nearest even, saturating at
+-6); a group whose scale rounds to 0 stores zeros.

Where this comes from (read, not copied): the PR's description (432 B = 256 B FP4 NoPE + 32 B E4M3
group-16 scales + 16 B alignment pad + 128 B BF16 RoPE; ``concat_and_cache_nvfp4_mla``; global scale
1.0, the ``scale`` argument unused; the pad zeroed) and its writer kernel
``concat_and_cache_nvfp4_mla_kernel`` as stored for ``csrc/libtorch_stable/nvfp4_kv_cache_kernels.cu``
of local-inference-lab/vllm (commit 7424d54d229e; the PR's own branch is not in the fetched snapshot,
whose branches are main and three dev/ branches; a standalone torch-extension registration of the
same kernel checks ``kv_lora_rank == 512``, ``pe_dim == 64``, 432-byte entries): ``kNopeBytes = 256``,
``kScaleBytes = 32``, ``kPadBytes = 16``, rope at ``kRopeOffset = 304`` in the input dtype (bf16 for
DeepSeek; openmla always stores bf16, also under a float16 model), group
``g``'s 8 data bytes at ``8g`` stored as one little-endian uint64 ``(hi << 32) | lo`` and its scale
byte at ``256 + g``. The quantisation and the nibble order are vLLM's ``cvt_warp_fp16_to_fp4`` with
``SFScaleVal = 1.0`` and ``fp32_vec16_to_e2m1`` (``csrc/libtorch_stable/quantization/fp4/nvfp4_utils.cuh``,
local-inference-lab/vllm main at 28be48fa9): ``SFValue = vecMax * rcp.approx(6)``, stored as
``__nv_fp8_e4m3`` (``cvt.rn.satfinite``), ``outputScale = rcp.approx(float(SF))`` (0 when SF is 0), and
``cvt.rn.satfinite.e2m1x2.f32 b_k, x[2k+1], x[2k]`` with ``mov.b32 {b0, b1, b2, b3}``: PTX puts the
first source in the high nibble, so element ``2k`` is the low nibble of byte ``k``, bytes in element
order. Differences, stated: the CUDA writer multiplies by ``rcp.approx.ftz`` reciprocals (at most 1 ulp
from the correctly rounded ones used here), so a value lying within an ulp of an e2m1 or e4m3
rounding midpoint may land one step apart; and it quantises the model-dtype (bf16) latent, where
openmla's cache write quantises the float32 RMSNorm output (as it does for fp8_ds_mla). The layout
and the recipe are the same.

``nvfp4_fp8rope`` (352 bytes): vllm-project/FlashMLA pull request 18's ``nvfp4.fp8rope`` record
(vLLM names it ``nvfp4_fp8_ds_mla``, vllm-project/vllm pull request 51724), byte for byte.

| bytes | content |
|---|---|
| ``[0, 256)`` | the latent as e2m1 codes, value ``2i`` in the LOW nibble of byte ``i`` (as above) |
| ``[256, 320)`` | the 64 rope values as e4m3, unscaled |
| ``[320, 352)`` | the 32 e4m3 group scales, PERMUTED: group ``s``'s scale at byte ``320 + 8*(s & 3) + (s >> 2)`` |

Value = e2m1 * e4m3 scale; rope = e4m3. Write: ``scale = max(amax_16 / 6, 2^-9)`` rounded to e4m3
(nearest even) and, when that lands below it, bumped to the next e4m3 value (below 448), so no
value saturates; each value ``e2m1(x * fp32(1 / float(scale)))``; rope ``e4m3(x)`` (saturating).
Sources: the PR's description (the three regions and their sizes); FlashMLA's
``csrc/sm100/decode/head64/config.h`` and ``tests/quant.py`` (vllm-project/FlashMLA commit
6bc49418c5ea: ``BYTES_PER_TOKEN == 352``, ``nvfp4_sf_byte(s) = 8*(s&3) + (s>>2)``, low nibble = even
element, the rounded-up scale with its 2^-9 floor); vLLM's writer ``concat_and_cache_nvfp4_ds_mla_kernel``
(``csrc/libtorch_stable/nvfp4_ds_mla_cache_kernels.cu``, vllm-project/vllm commit 03b6016490cc: the same
layout, ``inv_sf = 1.0f / sf`` multiplied in, rope converted by ``__nv_fp8_e4m3``). FlashMLA's test
quantiser divides by the scale where vLLM's writer multiplies by its reciprocal; this follows the writer.

NaN: neither CUDA writer defines it (their max ignores NaN). Here a group holding a NaN gets the e4m3
NaN byte (0x7F) as its scale and zero codes, so it reads back as NaN, never as a finite value.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
LATENT = 512  # L, the only latent width these records hold
ROPE = 64  # R
GROUP = 16  # latent values per e4m3 scale
GROUPS = LATENT // GROUP  # 32
DATA_BYTES = LATENT // 2  # 256: two e2m1 codes per byte
E4M3_MAX = 448.0
E4M3_MIN = 2.0**-9  # the smallest positive e4m3 value (a subnormal)

# Nibble order of both records: value 2i in the low nibble of byte i, value 2i+1 in the high one.
EVEN_VALUE_IN_LOW_NIBBLE = True

# e2m1 codes: bit 3 the sign, bits 0-2 index these magnitudes.
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_VALUES = torch.tensor(E2M1_MAGNITUDES + tuple(-m for m in E2M1_MAGNITUDES), dtype=torch.float32)
# The midpoint between magnitudes i and i+1 rounds to the even code: down for even i, up for odd i.
_MIDPOINTS = tuple((a + b) / 2 for a, b in zip(E2M1_MAGNITUDES, E2M1_MAGNITUDES[1:]))

# nvfp4_fp8rope: where group s's scale sits in the 32 scale bytes, and which group each byte holds.
SF_BYTE = tuple(8 * (s & 3) + (s >> 2) for s in range(GROUPS))
_SF_GROUP = tuple(sorted(range(GROUPS), key=lambda s: SF_BYTE[s]))


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """float32 ``x`` -> uint8 e2m1 codes: round to nearest, ties to the even code, saturating at +-6
    (PTX ``cvt.rn.satfinite.e2m1x2.f32``); the sign bit is kept (-0.1 -> code 8, -0). NaN -> code 0."""
    a = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for i, mid in enumerate(_MIDPOINTS):
        code += (a > mid) if i % 2 == 0 else (a >= mid)
    return code | (torch.signbit(x).to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """uint8 e2m1 codes (low 4 bits) -> float32 values."""
    return _E2M1_VALUES.to(codes.device)[(codes & 0xF).long()]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Codes ``[..., 2n]`` -> bytes ``[..., n]`` in ``EVEN_VALUE_IN_LOW_NIBBLE`` order."""
    even, odd = codes[..., 0::2], codes[..., 1::2]
    lo, hi = (even, odd) if EVEN_VALUE_IN_LOW_NIBBLE else (odd, even)
    return lo | (hi << 4)


def unpack_nibbles(data: torch.Tensor) -> torch.Tensor:
    """Bytes ``[..., n]`` -> codes ``[..., 2n]`` (inverse of ``pack_nibbles``)."""
    lo, hi = data & 0xF, data >> 4
    pair = (lo, hi) if EVEN_VALUE_IN_LOW_NIBBLE else (hi, lo)
    return torch.stack(pair, dim=-1).flatten(-2)


def _e4m3(x: torch.Tensor) -> torch.Tensor:
    """float32 -> float8_e4m3fn, nearest even, saturating at +-448 (NaN stays NaN)."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(FP8)


def _quantize_groups(latent: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``latent [n, GROUPS, GROUP]`` over e4m3 ``scale [n, GROUPS]`` -> packed data bytes ``[n, 256]``.
    Zero and NaN scales store zero codes (the NaN scale alone carries the NaN)."""
    dec = scale.float()
    inv = torch.where(dec > 0, 1.0 / dec, torch.zeros_like(dec))
    return pack_nibbles(e2m1_encode(latent * inv[..., None]).flatten(-2))


def _group_amax(latent: torch.Tensor) -> torch.Tensor:
    """Per-group max |x| (NaN when the group holds a NaN)."""
    return latent.abs().amax(dim=-1)


def _dequantize_latent(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Data bytes ``[..., 256]`` and group-ordered e4m3 scales ``[..., 32]`` -> float32 ``[..., 512]``
    (e2m1 * e4m3 is exact in float32)."""
    vals = e2m1_decode(unpack_nibbles(data)).unflatten(-1, (GROUPS, GROUP))
    return (vals * scales.float()[..., None]).flatten(-2)


def shape_error(fmt: str, kv_lora_rank: int, rope_dim: int) -> tuple[str, str] | None:
    """``(argument, why)`` when an NVFP4 record cannot hold ``L`` latent and ``R`` rope values."""
    if rope_dim != ROPE:
        return "rope_dim", f"{fmt} holds {ROPE} rope values per token (DeepSeek's record), got rope_dim {rope_dim}"
    if kv_lora_rank != LATENT:
        return "head_dim", (f"{fmt} holds a {LATENT}-value latent (head_dim {LATENT + ROPE}), got head_dim - rope_dim = "
                            f"{kv_lora_rank}")
    return None


# nvfp4_ds_mla ------------------------------------------------------------------------------------
DS_MLA_SCALES_AT = DATA_BYTES  # 256
DS_MLA_PAD_AT = DS_MLA_SCALES_AT + GROUPS  # 288
DS_MLA_ROPE_AT = DS_MLA_PAD_AT + 16  # 304
DS_MLA_BYTES = DS_MLA_ROPE_AT + 2 * ROPE  # 432
_ONE_SIXTH = torch.tensor(1 / 6, dtype=torch.float32)  # fp32(1/6); the CUDA writer's rcp.approx(6)


def pack_ds_mla(entries: torch.Tensor) -> torch.Tensor:
    """``entries [n, 576]`` (float) -> uint8 nvfp4_ds_mla records ``[n, 432]``."""
    n = entries.shape[0]
    latent = entries[:, :LATENT].float().reshape(n, GROUPS, GROUP)
    scale = _e4m3(_group_amax(latent) * _ONE_SIXTH.to(entries.device))
    out = torch.zeros(n, DS_MLA_BYTES, dtype=torch.uint8, device=entries.device)
    out[:, :DATA_BYTES] = _quantize_groups(latent, scale)
    out[:, DS_MLA_SCALES_AT:DS_MLA_PAD_AT] = scale.view(torch.uint8)
    out[:, DS_MLA_ROPE_AT:].view(torch.bfloat16).copy_(entries[:, LATENT:].to(torch.bfloat16))
    return out


def unpack_ds_mla(records: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """uint8 nvfp4_ds_mla records ``[..., 432]`` -> entries ``[..., 576]`` in ``dtype``."""
    latent = _dequantize_latent(records[..., :DATA_BYTES], records[..., DS_MLA_SCALES_AT:DS_MLA_PAD_AT].view(FP8))
    rope = records[..., DS_MLA_ROPE_AT:].view(torch.bfloat16)
    return torch.cat([latent.to(dtype), rope.to(dtype)], dim=-1)


# nvfp4_fp8rope -----------------------------------------------------------------------------------
FP8ROPE_ROPE_AT = DATA_BYTES  # 256
FP8ROPE_SCALES_AT = FP8ROPE_ROPE_AT + ROPE  # 320
FP8ROPE_BYTES = FP8ROPE_SCALES_AT + GROUPS  # 352


def pack_fp8rope(entries: torch.Tensor) -> torch.Tensor:
    """``entries [n, 576]`` (float) -> uint8 nvfp4_fp8rope records ``[n, 352]``."""
    n = entries.shape[0]
    latent = entries[:, :LATENT].float().reshape(n, GROUPS, GROUP)
    target = (_group_amax(latent) / 6.0).clamp_min(E4M3_MIN)  # NaN stays NaN
    scale = _e4m3(target)
    bits = scale.view(torch.uint8)
    bump = (scale.float() < target) & (bits < 0x7E)  # round up: positive e4m3 bit patterns are monotonic
    scale = torch.where(bump, bits + 1, bits).view(FP8)
    out = torch.empty(n, FP8ROPE_BYTES, dtype=torch.uint8, device=entries.device)
    out[:, :DATA_BYTES] = _quantize_groups(latent, scale)
    out[:, FP8ROPE_ROPE_AT:FP8ROPE_SCALES_AT] = _e4m3(entries[:, LATENT:].float()).view(torch.uint8)
    out[:, FP8ROPE_SCALES_AT:] = scale.view(torch.uint8)[:, list(_SF_GROUP)]  # byte p holds group _SF_GROUP[p]
    return out


def unpack_fp8rope(records: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """uint8 nvfp4_fp8rope records ``[..., 352]`` -> entries ``[..., 576]`` in ``dtype``."""
    scales = records[..., FP8ROPE_SCALES_AT:][..., list(SF_BYTE)].view(FP8)  # back to group order
    latent = _dequantize_latent(records[..., :DATA_BYTES], scales)
    rope = records[..., FP8ROPE_ROPE_AT:FP8ROPE_SCALES_AT].view(FP8)
    return torch.cat([latent.to(dtype), rope.float().to(dtype)], dim=-1)
