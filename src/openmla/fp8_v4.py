"""DeepSeek-V4's FP8 cache pages (FlashMLA's ``MODEL1_FP8Sparse``): 584 bytes per token, laid out per page.

A V4 entry is ``D = 512`` values (448 "nope" values, then the 64-value rope slice). One page of
``S`` tokens is one uint8 row of ``page_bytes(S)`` bytes, NOT ``S`` token records side by side:

| page bytes | content |
|---|---|
| ``[576 t, 576 t + 448)`` | token ``t``'s nope values as float8_e4m3fn, tile ``j`` (values ``64j .. 64j+63``) divided by its scale |
| ``[576 t + 448, 576 t + 576)`` | token ``t``'s 64 rope values as bfloat16 (little-endian), not quantised |
| ``[576 S + 8 t, 576 S + 8 t + 7)`` | token ``t``'s 7 tile scales as float8_e8m0fnu (a power of two: byte ``e`` is ``2^(e-127)``) |
| ``576 S + 8 t + 7`` | padding (written as 0) |
| ``[584 S, page_bytes(S))`` | padding to a multiple of 576 bytes (written as 0) |

So a token holds 448 + 128 + 7 + 1 = 584 bytes, against 1024 for a bf16 V4 entry. Write: per tile,
``scale = 2^ceil(log2(max(amax / 448, 1e-4)))`` and each value ``e4m3(x / scale)`` (round to nearest
even; ``|x / scale| <= 448``, so nothing saturates); the rope slice rounded to bfloat16. Read:
``e4m3 * scale`` (exact: the scale is a power of two), the rope slice as stored.

Source (read, not copied): FlashMLA's ``tests/quant.py`` (deepseek-ai/FlashMLA commit 082094b,
2026-01-16, ``FP8KVCacheLayout.MODEL1_FP8Sparse``: ``(d, d_nope, d_rope, tile_size, num_tiles) =
(512, 448, 64, 64, 7)``, ``bytes_per_token = d_nope + 2 * d_rope + num_tiles + 1``, the page padded to
a multiple of 576 bytes, the nope-and-rope region first and the scale region after it, the ue8m0 scale
rule above). openmla's writer was checked against that file's ``quantize_k_cache`` byte for byte on
random bf16 pages of 1, 16 and 64 tokens (tests/test_fp8_v4.py holds an independent check written
from the table). Differences: FlashMLA leaves the padding bytes unwritten (``torch.empty``); openmla
zeroes them.
"""

from __future__ import annotations

import torch

ENTRY = 512  # values per V4 entry
NOPE = 448  # quantised values per entry
ROPE = ENTRY - NOPE  # bf16 values per entry (the trailing rope slice)
TILE = 64  # values per scale
TILES = NOPE // TILE  # 7 scales per token
DATA_BYTES = NOPE + 2 * ROPE  # 576: one token's nope and rope bytes
SCALE_BYTES = TILES + 1  # 8: one token's scales and its pad byte
TOKEN_BYTES = DATA_BYTES + SCALE_BYTES  # 584
PAGE_ALIGN = DATA_BYTES  # a page's bytes round up to a multiple of this
MIN_SCALE = 1e-4  # FlashMLA's floor on amax / 448 before the power-of-two rounding
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def page_bytes(page_size: int) -> int:
    """Bytes of one page of ``page_size`` tokens (584 per token, rounded up to a multiple of 576)."""
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size: a positive int, got {page_size!r}")
    return -(-page_size * TOKEN_BYTES // PAGE_ALIGN) * PAGE_ALIGN


def _regions(pages: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 views of ``pages``: each token's 576 nope-and-rope bytes ``[P, S, 576]`` and its 7 scale
    bytes ``[P, S, 7]``."""
    if pages.dtype != torch.uint8 or pages.dim() != 2 or pages.shape[1] != page_bytes(page_size):
        raise ValueError(f"pages: uint8 [num_pages, {page_bytes(page_size)}] for pages of {page_size} tokens, "
                         f"got {pages.dtype} {tuple(pages.shape)}")
    P, S = pages.shape[0], page_size
    data = pages[:, : S * DATA_BYTES].view(P, S, DATA_BYTES)
    return data, pages[:, S * DATA_BYTES: S * TOKEN_BYTES].view(P, S, SCALE_BYTES)[..., :TILES]


def views(pages: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Typed views of uint8 pages ``[P, page_bytes(S)]`` (no copy): nope float8_e4m3fn ``[P, S, 448]``,
    rope bfloat16 ``[P, S, 64]``, scales float8_e8m0fnu ``[P, S, 7]``."""
    data, scales = _regions(pages, page_size)
    return data[..., :NOPE].view(torch.float8_e4m3fn), data[..., NOPE:].view(torch.bfloat16), scales.view(torch.float8_e8m0fnu)


def _token_bytes(nope: torch.Tensor, rope: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token's 576 data bytes ``[n, 576]`` and 7 scale bytes ``[n, 7]`` from ``quantize``'s parts."""
    data = torch.cat([nope.view(torch.uint8), rope.view(torch.uint8)], dim=-1)
    return data, scales.to(torch.float8_e8m0fnu).view(torch.uint8)


def new_pages(num_pages: int, page_size: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Zeroed uint8 pages ``[num_pages, page_bytes(page_size)]``."""
    return torch.zeros(num_pages, page_bytes(page_size), dtype=torch.uint8, device=device)


def quantize(entries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``entries [n, 512]`` (float) -> (nope float8_e4m3fn ``[n, 448]``, rope bfloat16 ``[n, 64]``,
    scales float32 ``[n, 7]``, powers of two)."""
    if entries.dim() != 2 or entries.shape[1] != ENTRY or not entries.is_floating_point():
        raise ValueError(f"entries: a float [n, {ENTRY}] tensor, got {entries.dtype} {tuple(entries.shape)}")
    tiles = entries[:, :NOPE].float().reshape(-1, TILES, TILE)
    amax = tiles.abs().amax(dim=-1)
    scales = torch.exp2(torch.ceil(torch.log2((amax / FP8_MAX).clamp_min(MIN_SCALE))))
    nope = (tiles / scales[..., None]).to(torch.float8_e4m3fn).reshape(-1, NOPE)
    return nope, entries[:, NOPE:].to(torch.bfloat16), scales


def _page_offset(rows: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = rows.long()
    return rows // page_size, rows % page_size


def write_rows(pages: torch.Tensor, page_size: int, rows: torch.Tensor, entries: torch.Tensor) -> None:
    """Quantise ``entries [n, 512]`` into the tokens at physical ``rows [n]`` (``page * page_size +
    offset``) of ``pages``, in place."""
    data_v, scale_v = _regions(pages, page_size)
    if rows.dim() != 1 or rows.shape[0] != entries.shape[0] or rows.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"rows: int [n] with n = entries.shape[0] = {entries.shape[0]}, got {rows.dtype} {tuple(rows.shape)}")
    data, scales = _token_bytes(*quantize(entries))
    page, offset = _page_offset(rows, page_size)
    data_v[page, offset] = data
    scale_v[page, offset] = scales


def read_rows(pages: torch.Tensor, page_size: int, rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The entries ``[n, 512]`` in ``dtype`` stored at physical ``rows [n]`` of ``pages`` (dequantised)."""
    data_v, scale_v = _regions(pages, page_size)
    page, offset = _page_offset(rows, page_size)
    data, scales = data_v[page, offset], scale_v[page, offset].view(torch.float8_e8m0fnu)
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    nope = data[:, :NOPE].view(torch.float8_e4m3fn).to(wide).reshape(-1, TILES, TILE) * scales.to(wide)[..., None]
    rope = data[:, NOPE:].contiguous().view(torch.bfloat16).to(wide)
    return torch.cat([nope.reshape(-1, NOPE), rope], dim=-1).to(dtype)


def pack_pages(entries: torch.Tensor) -> torch.Tensor:
    """``entries [P, S, 512]`` (float) -> uint8 pages ``[P, page_bytes(S)]``, padding zeroed."""
    if entries.dim() != 3:
        raise ValueError(f"entries: [num_pages, page_size, {ENTRY}], got {tuple(entries.shape)}")
    P, S = entries.shape[:2]
    pages = new_pages(P, S, entries.device)
    write_rows(pages, S, torch.arange(P * S, device=entries.device), entries.reshape(P * S, -1))
    return pages


def unpack_pages(pages: torch.Tensor, page_size: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 pages ``[P, page_bytes(S)]`` -> entries ``[P, S, 512]`` in ``dtype``."""
    P = pages.shape[0]
    return read_rows(pages, page_size, torch.arange(P * page_size, device=pages.device), dtype).reshape(P, page_size, ENTRY)
