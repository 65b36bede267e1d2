"""Pieces shared by the Triton kernels: device checks, dtype choices, and three ``@triton.jit``
helpers (which sequence a ragged row belongs to, the physical cache row of a position, and
the contiguous key range a mask leaves visible to one query).

Why a visible key range is enough: for every mask variant the keys one query at position
``p`` sees form one interval ``[lo, hi)`` of positions (see ``key_range``), so a kernel can
both skip whole key tiles and test single keys with two comparisons.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ...masks import MaskKind, MaskVariant

# Read once, like triton.jit does: TRITON_INTERPRET must be set before this backend is imported.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

MASK_CODES = {
    MaskKind.CAUSAL: 0,
    MaskKind.NULL: 1,
    MaskKind.SLIDING_WINDOW_CAUSAL: 2,
    MaskKind.SLIDING_WINDOW_NONCAUSAL: 3,
    MaskKind.CHUNKED_CAUSAL: 4,
}

_ROUND_BF16_BY_HAND = tl.constexpr(INTERPRET)


def mask_args(mask: MaskVariant) -> tuple[int, int, int]:
    """``(code, window, chunk)`` kernel arguments of a mask (unused sizes are 1)."""
    return MASK_CODES[mask.kind], int(mask.window_size or 1), int(mask.chunk_size or 1)


def _interpreter_ready() -> bool:
    """Triton builds its library functions (``tl.sum`` ...) for the mode it was first
    imported in; the interpreter needs them built for interpretation."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.sum, InterpretedFunction)


def check_device(t: torch.Tensor) -> None:
    """CUDA tensors run compiled kernels; CPU tensors need Triton's interpreter."""
    if t.device.type != "cpu":
        return
    if not INTERPRET:
        raise ValueError("backend: triton runs on CUDA tensors, or on CPU tensors with TRITON_INTERPRET=1 set "
                         "before triton is first imported")
    if not _interpreter_ready():
        raise ValueError("backend: triton was imported before TRITON_INTERPRET=1 was set (transformers imports "
                         "it, for one); set the variable before the first import of triton")


def empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every buffer a kernel fills is allocated here (tests swap in a NaN-filled version to
    prove each output element is written)."""
    return torch.empty(shape, dtype=dtype, device=device)


def cache_layer(batch, layer_idx: int) -> tuple[torch.Tensor, int]:
    """One layer's storage and its row stride; physical row ``r`` starts at ``r * stride``."""
    layer = batch.blocks[layer_idx]  # [num_pages, page_size, L+R]
    if layer.stride(2) != 1 or layer.stride(0) != layer.shape[1] * layer.stride(1):
        raise ValueError("kv_collection.blocks: each layer's pages must be stored contiguously (row-major)")
    return layer, layer.stride(1)


def as_index(t: torch.Tensor) -> torch.Tensor:
    """Index tensors reach the kernels as contiguous int32 (a no-op when they already are)."""
    return t.to(torch.int32).contiguous()


def dot_dtype(*dtypes: torch.dtype) -> tl.dtype:
    """Operand type of ``tl.dot``: the inputs' half type when they all share one, else float32.

    The interpreter stores bfloat16 as raw uint16 and cannot do arithmetic on it, so there
    bfloat16 operands are widened to float32 (accumulation is float32 either way).
    """
    if len(set(dtypes)) == 1 and dtypes[0] == torch.float16:
        return tl.float16
    if len(set(dtypes)) == 1 and dtypes[0] == torch.bfloat16 and not INTERPRET:
        return tl.bfloat16
    return tl.float32


def dot_precision(dt: tl.dtype) -> str:
    """float32 dots run in full precision (not TF32): float32 callers expect ~1e-6 errors."""
    return "ieee" if dt == tl.float32 else "tf32"


def search_steps(batch_size: int) -> int:
    """Iterations of ``find_sequence``'s binary search for ``batch_size`` sequences."""
    return max(1, int(batch_size).bit_length())


def next_pow2(n: int, floor: int = 16) -> int:
    """Block size covering ``n`` (``tl.dot`` needs every dim >= 16)."""
    return max(floor, triton.next_power_of_2(int(n)))


@triton.jit
def find_sequence(offsets_ptr, row, num_seqs, STEPS: tl.constexpr):
    """The sequence ``b`` whose rows ``offsets[b] <= row < offsets[b+1]`` hold ``row``.

    Binary search for the first ``b`` with ``offsets[b+1] > row`` (empty sequences are
    skipped because their end equals the next one's start). ``STEPS`` >= log2(B) + 1.
    """
    lo = row * 0
    hi = lo + num_seqs - 1
    for _ in tl.static_range(STEPS):
        mid = (lo + hi) // 2
        right = tl.load(offsets_ptr + mid + 1) <= row
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(right, hi, mid)
    return lo


@triton.jit
def physical_row(block_table_ptr, pos, page_size, valid):
    """int64 physical row ``table[pos // page_size] * page_size + pos % page_size``.

    ``block_table_ptr`` points at the sequence's row of the page table; invalid lanes read
    page 0 (their row is never used).
    """
    page = tl.load(block_table_ptr + pos // page_size, mask=valid, other=0)
    return page.to(tl.int64) * page_size + (pos % page_size)


@triton.jit
def key_range(q_pos, kv_len, MASK: tl.constexpr, window, chunk):
    """Half-open range ``[lo, hi)`` of key positions visible to a query at ``q_pos``.

    MASK codes: 0 causal, 1 null, 2 sliding-window causal, 3 sliding-window non-causal,
    4 chunked causal (``MASK_CODES``). ``hi <= lo`` means nothing is visible.
    """
    lo = q_pos * 0
    hi = lo + kv_len
    if MASK == 0 or MASK == 2 or MASK == 4:
        hi = tl.minimum(hi, q_pos + 1)
    if MASK == 2 or MASK == 3:
        lo = tl.maximum(lo, q_pos - window + 1)
    if MASK == 4:
        lo = (q_pos // chunk) * chunk
    return lo, hi


@triton.jit
def cast_to(x, dtype: tl.constexpr):
    """float32 ``x`` -> ``dtype``, rounding to nearest even as the GPU does.

    The interpreter truncates float32 -> bfloat16, so there the rounding is done on the bits:
    adding ``0x7FFF`` plus the lowest kept bit, then truncating, is round-half-to-even.
    """
    if _ROUND_BF16_BY_HAND and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def natural_lse(m2, denom):
    """Natural-log LSE from a base-2 running max ``m2`` and its sum ``denom`` (``-inf`` when 0)."""
    has_key = denom > 0
    return tl.where(has_key, (m2 + tl.log2(tl.where(has_key, denom, 1.0))) * 0.6931471805599453, float("-inf"))
