"""The latent-cache formats, and the token-record ones among them (one table every layer reads).

| format | stored as | bytes per token and layer (L=512, R=64) | module |
|---|---|---|---|
| ``native`` | the cache's float dtype | ``(L+R) * itemsize`` (1152 in bf16) | |
| ``fp8_e4m3`` | float8_e4m3fn, one float32 scale per layer | 576 | ``openmla.fp8`` |
| ``fp8_ds_mla`` | uint8 records | 656 | ``openmla.fp8`` |
| ``nvfp4_ds_mla`` | uint8 records | 432 | ``openmla.nvfp4`` |
| ``nvfp4_fp8rope`` | uint8 records | 352 | ``openmla.nvfp4`` |

A record format packs each token's ``L+R`` entry into one uint8 row of a fixed width; the cache
reads ``L`` back from that width and the rope width R (``latent_rank``), and refuses shapes the
format cannot hold (``shape_error`` names the argument). Writes quantise (``pack``), reads
dequantise (``unpack``) row by row, so a read never mixes two tokens' bytes.

DeepSeek-V4's 512-value entries have their own FP8 form, laid out per page rather than per token
(584 bytes per token, FlashMLA's ``MODEL1_FP8Sparse``): ``openmla.fp8_v4``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from . import fp8, nvfp4


@dataclass(frozen=True)
class RecordFormat:
    name: str
    shape_error: Callable[[int, int], "tuple[str, str] | None"]  # (argument, why) when (L, R) cannot be stored
    record_bytes: Callable[[int, int], int]  # W from (L, R), for shapes shape_error accepts
    latent_rank: Callable[[int, int], int]  # L from (W, R); check the result with shape_error and record_bytes
    pack: Callable[[torch.Tensor, int], torch.Tensor]  # (entries [n, L+R] float, L) -> uint8 [n, W]
    unpack: Callable[[torch.Tensor, int, torch.dtype], torch.Tensor]  # (uint8 [..., W], L, dtype) -> [..., L+R]

    def fits(self, width: int, rope_dim: int) -> bool:
        """Whether ``width``-byte records hold a latent the format accepts next to ``rope_dim`` rope values."""
        L = self.latent_rank(width, rope_dim)
        return self.shape_error(L, rope_dim) is None and self.record_bytes(L, rope_dim) == width


def _ds_mla_shape_error(L: int, R: int) -> tuple[str, str] | None:
    if L < fp8.DS_MLA_GROUP or L % fp8.DS_MLA_GROUP:
        return "head_dim", (f"fp8_ds_mla needs head_dim - rope_dim (the kv_lora_rank L) a positive multiple of {fp8.DS_MLA_GROUP}, "
                            f"got {L + R} - {R}")
    if R < 2 or R % 2:
        return "rope_dim", f"fp8_ds_mla needs an even rope width >= 2 (its record has a bf16 rope part), got {R}"
    return None


def _fixed(fmt: str, width: int) -> tuple:
    """shape_error, record_bytes and latent_rank of an NVFP4 record (L=512, R=64 only)."""
    return (lambda L, R: nvfp4.shape_error(fmt, L, R), lambda L, R: width,
            lambda W, R: nvfp4.LATENT if W == width else -1)


RECORDS: dict[str, RecordFormat] = {
    "fp8_ds_mla": RecordFormat("fp8_ds_mla", _ds_mla_shape_error, fp8.ds_mla_record_bytes, fp8.ds_mla_latent_rank,
                               fp8.pack_ds_mla, fp8.unpack_ds_mla),
    "nvfp4_ds_mla": RecordFormat("nvfp4_ds_mla", *_fixed("nvfp4_ds_mla", nvfp4.DS_MLA_BYTES),
                                 lambda e, L: nvfp4.pack_ds_mla(e), lambda r, L, dtype: nvfp4.unpack_ds_mla(r, dtype)),
    "nvfp4_fp8rope": RecordFormat("nvfp4_fp8rope", *_fixed("nvfp4_fp8rope", nvfp4.FP8ROPE_BYTES),
                                  lambda e, L: nvfp4.pack_fp8rope(e), lambda r, L, dtype: nvfp4.unpack_fp8rope(r, dtype)),
}
CACHE_FORMATS = ("native", "fp8_e4m3", *RECORDS)
QUANTIZED_FORMATS = CACHE_FORMATS[1:]  # the string dtypes PagedLatentCache takes
