"""The latent-cache formats as objects: one ``CacheFormat`` per format, in one table (``FORMATS``).

| format | stored as | bytes per token and layer (L=512, R=64) | kernel codes | codec |
|---|---|---|---|---|
| ``native`` | the cache's float dtype | ``(L+R) * itemsize`` (1152 in bf16) | bf16 0, fp16 1, fp32 2 (float64: none) | a cast |
| ``fp8_e4m3`` | float8_e4m3fn, one float32 scale per layer | 576 | 3 | ``openmla.fp8`` |
| ``fp8_ds_mla`` | uint8 records | 656 | 4 | ``openmla.fp8`` |
| ``nvfp4_ds_mla`` | uint8 records | 432 | 5 | ``openmla.nvfp4`` |
| ``nvfp4_fp8rope`` | uint8 records | 352 | 6 | ``openmla.nvfp4`` |

A format object is declarative: its storage dtypes, the width ``W`` of a stored row from
``(L, R)`` (``row_width``) and ``L`` back from ``W`` (``latent_rank``), the shapes it refuses
(``shape_error`` names the argument), its kernel code per storage dtype (``codes``: the C++
enumerator and its value; ``openmla.kernel_codes`` writes them into the native kernels'
generated ``codes.h``, so Python and C++ read one table) and its two codecs: ``encode`` (float
entries ``[n, L+R]`` -> stored rows ``[n, W]``: quantise) and ``decode`` (stored rows -> entries in
a float dtype: dequantise, times the layer's scale where the format has one). ``write`` and
``read`` apply them to physical rows of one layer's storage ``[num_pages, page_size, W]``; a read
decodes row by row, so it never mixes two tokens' bytes. The codec math lives in ``openmla.fp8``
and ``openmla.nvfp4``.

A record format packs each token's ``L+R`` entry into one uint8 row of a fixed width (``RECORDS``).

DeepSeek-V4's 512-value entries have their own FP8 form, laid out per page rather than per token
(584 bytes per token, FlashMLA's ``MODEL1_FP8Sparse``): ``openmla.v4.fp8_v4``, an exchange format, not a store format.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from . import fp8, nvfp4
from .basics import FLOAT_DTYPES
from .fp8 import FP8

Tensor = torch.Tensor

__all__ = ["CacheFormat", "FORMATS", "RECORDS", "CACHE_FORMATS", "QUANTIZED_FORMATS", "STORAGE_DTYPES", "cache_format"]


@dataclass(frozen=True)
class CacheFormat:
    """One cache format (see the module's table). ``scale`` arguments are the layer's float32 scale
    (a one-element tensor), read only by a ``scaled`` format."""

    name: str
    storage: tuple[torch.dtype, ...]  # the element types its rows may be stored in
    codes: tuple[tuple[str, int] | None, ...]  # per storage dtype: (C++ enumerator, kernel code), None: no native kernel
    scaled: bool  # entries are stored divided by one float32 scale per layer
    shape_error: Callable[[int, int], "tuple[str, str] | None"]  # (argument, why) when (L, R) cannot be stored
    row_width: Callable[[int, int], int]  # W (stored elements per row) from (L, R), for shapes shape_error accepts
    latent_rank: Callable[[int, "int | None"], int]  # L from (W, R); check the result with shape_error and row_width
    encode: Callable[[Tensor, int, "Tensor | None", torch.dtype], Tensor]  # (entries [n, L+R], L, scale, storage) -> [n, W]
    decode: Callable[[Tensor, int, "Tensor | None", torch.dtype], Tensor]  # (stored [..., W], L, scale, dtype) -> [..., L+R]

    @property
    def is_native(self) -> bool:
        return self.name == "native"

    @property
    def is_record(self) -> bool:
        """Whether tokens are uint8 records (their width in bytes is not L+R)."""
        return self.storage == (torch.uint8,)

    def fits(self, width: int, rope_dim: int | None) -> bool:
        """Whether ``width``-element rows hold a latent the format accepts next to ``rope_dim`` rope values."""
        L = self.latent_rank(width, rope_dim)
        return self.shape_error(L, rope_dim or 0) is None and self.row_width(L, rope_dim or 0) == width

    def entry_width(self, width: int, rope_dim: int | None) -> int:
        """The logical entry width L+R of ``width``-element rows (records: ``rope_dim`` splits them)."""
        return self.latent_rank(width, rope_dim) + (rope_dim or 0)

    def bytes_per_token(self, kv_lora_rank: int, rope_dim: int, storage: torch.dtype | None = None) -> int:
        """Bytes of one token's row in one layer (``storage``: the native format's dtype)."""
        return self.row_width(kv_lora_rank, rope_dim) * torch.empty((), dtype=storage or self.storage[0]).element_size()

    def compute_dtype(self, storage: torch.dtype) -> torch.dtype:
        """The dtype entries are read in: the storage dtype (native) or bfloat16 (the quantised formats)."""
        return storage if self.is_native else torch.bfloat16

    def kernel_code(self, storage: torch.dtype) -> int | None:
        """The native kernels' code for rows of ``storage`` (None: no native kernel reads them)."""
        code = self.codes[self.storage.index(storage)] if storage in self.storage else None
        return None if code is None else code[1]

    # Rows of one layer's storage ------------------------------------------------------------
    def write(self, layer: Tensor, rows: Tensor, entries: Tensor, kv_lora_rank: int, scale: Tensor | None = None) -> None:
        """Store float ``entries [n, L+R]`` at physical ``rows`` of ``layer [num_pages, page_size, W]``
        (quantised as the format says; in place, one ``index_copy_``)."""
        flat = layer.view(-1, layer.shape[-1])
        stored = self.encode(entries, kv_lora_rank, scale, flat.dtype)
        rows = rows.to(flat.device).long()
        if flat.dtype == FP8:  # torch has no fp8 index_copy_: move the bytes
            flat.view(torch.uint8).index_copy_(0, rows, stored.to(flat.device).view(torch.uint8))
        else:
            flat.index_copy_(0, rows, stored.to(flat.device))

    def read(self, layer: Tensor, rows: Tensor, kv_lora_rank: int, dtype: torch.dtype, scale: Tensor | None = None) -> Tensor:
        """Entries ``[n, L+R]`` at physical ``rows`` of ``layer``, dequantised, in ``dtype``."""
        flat = layer.reshape(-1, layer.shape[-1])
        return self.decode(_select(flat, rows), kv_lora_rank, scale, dtype)

    def read_pages(self, layer: Tensor, pages: Tensor, kv_lora_rank: int, dtype: torch.dtype,
                   scale: Tensor | None = None) -> Tensor:
        """Entries ``[n_pages, page_size, L+R]`` of whole physical ``pages`` of ``layer``, dequantised."""
        return self.decode(_select(layer, pages), kv_lora_rank, scale, dtype)


def _select(t: Tensor, index: Tensor) -> Tensor:
    """``t.index_select(0, index)``, through a byte view for float8 (torch has no fp8 kernel)."""
    index = index.to(t.device).long()
    if t.dtype == FP8:
        return t.view(torch.uint8).index_select(0, index).view(FP8)
    return t.index_select(0, index)


# The codecs (the math is openmla.fp8's and openmla.nvfp4's) ---------------------------------
def _native_decode(stored: Tensor, L: int, scale: Tensor | None, dtype: torch.dtype) -> Tensor:
    return stored.to(dtype)


def _e4m3_decode(stored: Tensor, L: int, scale: Tensor | None, dtype: torch.dtype) -> Tensor:
    wide = torch.float64 if dtype == torch.float64 else torch.float32  # fp8 * fp32 scale is exact in float64
    return (stored.to(wide) * scale.to(wide)).to(dtype)


def _ds_mla_shape_error(L: int, R: int) -> tuple[str, str] | None:
    if L < fp8.DS_MLA_GROUP or L % fp8.DS_MLA_GROUP:
        return "head_dim", (f"fp8_ds_mla needs head_dim - rope_dim (the kv_lora_rank L) a positive multiple of {fp8.DS_MLA_GROUP}, "
                            f"got {L + R} - {R}")
    if R < 2 or R % 2:
        return "rope_dim", f"fp8_ds_mla needs an even rope width >= 2 (its record has a bf16 rope part), got {R}"
    return None


def _plain() -> dict:
    """shape_error, row_width and latent_rank of a format storing each value in one element."""
    return dict(shape_error=lambda L, R: None, row_width=lambda L, R: L + R, latent_rank=lambda W, R: W - (R or 0))


def _nvfp4(fmt: str, width: int, pack: Callable, unpack: Callable) -> dict:
    """The fields of an NVFP4 record (L=512, R=64 only)."""
    return dict(shape_error=lambda L, R: nvfp4.shape_error(fmt, L, R), row_width=lambda L, R: width,
                latent_rank=lambda W, R: nvfp4.LATENT if W == width else -1,
                encode=lambda e, L, s, st: pack(e), decode=lambda r, L, s, dtype: unpack(r, dtype))


_NATIVE_CODES = {torch.bfloat16: ("FMT_BF16", 0), torch.float16: ("FMT_F16", 1), torch.float32: ("FMT_F32", 2)}
FORMATS: dict[str, CacheFormat] = {f.name: f for f in (
    CacheFormat("native", FLOAT_DTYPES, tuple(_NATIVE_CODES.get(d) for d in FLOAT_DTYPES), False, **_plain(),
                encode=lambda e, L, s, storage: e.to(storage), decode=_native_decode),
    CacheFormat("fp8_e4m3", (FP8,), (("FMT_E4M3", 3),), True, **_plain(),
                encode=lambda e, L, s, storage: fp8.quantize_e4m3(e, s), decode=_e4m3_decode),
    CacheFormat("fp8_ds_mla", (torch.uint8,), (("FMT_DS_MLA", 4),), False, _ds_mla_shape_error, fp8.ds_mla_record_bytes,
                fp8.ds_mla_latent_rank, encode=lambda e, L, s, st: fp8.pack_ds_mla(e, L),
                decode=lambda r, L, s, dtype: fp8.unpack_ds_mla(r, L, dtype)),
    CacheFormat("nvfp4_ds_mla", (torch.uint8,), (("FMT_NVFP4_DS", 5),), False,
                **_nvfp4("nvfp4_ds_mla", nvfp4.DS_MLA_BYTES, nvfp4.pack_ds_mla, nvfp4.unpack_ds_mla)),
    CacheFormat("nvfp4_fp8rope", (torch.uint8,), (("FMT_NVFP4_FP8ROPE", 6),), False,
                **_nvfp4("nvfp4_fp8rope", nvfp4.FP8ROPE_BYTES, nvfp4.pack_fp8rope, nvfp4.unpack_fp8rope)),
)}
RECORDS: dict[str, CacheFormat] = {name: f for name, f in FORMATS.items() if f.is_record}
CACHE_FORMATS = tuple(FORMATS)
QUANTIZED_FORMATS = CACHE_FORMATS[1:]  # the string dtypes PagedLatentCache takes
STORAGE_DTYPES = {name: f.storage for name, f in FORMATS.items()}


def cache_format(name: str) -> CacheFormat:
    """The format object of ``name`` (``ValueError`` naming the known ones for any other)."""
    fmt = FORMATS.get(name) if isinstance(name, str) else None
    if fmt is None:
        raise ValueError(f"cache_format: expected one of {CACHE_FORMATS}, got {name!r}")
    return fmt
