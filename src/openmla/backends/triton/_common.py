"""Pieces shared by the Triton kernels: device checks, dtype choices, and three ``@triton.jit``
helpers (which sequence a ragged row belongs to, the physical cache row of a position, and
the contiguous key range a mask leaves visible to one query).

Why a visible key range is enough: for every mask variant the keys one query at position
``p`` sees form one interval ``[lo, hi)`` of positions (see ``key_range``), so a kernel can
both skip whole key tiles and test single keys with two comparisons.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...fp8 import FP8, FP8_MAX, ds_mla_views
from ...kernel_codes import MASK_CODES  # the mask codes of every kernel (openmla.kernel_codes)
from ...masks import MaskVariant
from ...workspace import empty_output  # noqa: F401  (every buffer a kernel fills: the backend calls _common.empty_output)

# Read once, like triton.jit does: TRITON_INTERPRET must be set before this backend is imported.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

_ROUND_BY_HAND = tl.constexpr(INTERPRET)

# Cache formats as the kernels' ``FMT`` constexpr.
FMT_NATIVE, FMT_E4M3, FMT_DS_MLA = 0, 1, 2
FMT_CODES = {"native": FMT_NATIVE, "fp8_e4m3": FMT_E4M3, "fp8_ds_mla": FMT_DS_MLA}
FP8_MAX_C = tl.constexpr(FP8_MAX)


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


def gpu_kind(device: torch.device) -> str | None:
    """``"nvidia"`` or ``"amd"`` for a GPU (ROCm's torch names it ``cuda`` too), ``None`` for the CPU
    (the interpreter): tile configs are chosen per kind."""
    if device.type != "cuda":
        return None
    return "amd" if torch.version.hip else "nvidia"


def cache_layer(batch, layer_idx: int) -> tuple[torch.Tensor, int]:
    """One layer's storage and its row stride; physical row ``r`` starts at ``r * stride``."""
    layer = batch.blocks[layer_idx]  # [num_pages, page_size, L+R]
    if layer.stride(2) != 1 or layer.stride(0) != layer.shape[1] * layer.stride(1):
        raise ValueError("kv_collection.blocks: each layer's pages must be stored contiguously (row-major)")
    return layer, layer.stride(1)


@dataclass
class CacheViews:
    """Typed, no-copy views of one layer's storage, as the kernels read and write it.

    - ``latent [pages, page, L]``: the stored latent (native dtype, or float8_e4m3fn);
    - ``rope [pages, page, R]``: the key rope part (native dtype, float8_e4m3fn, or bfloat16 for
      fp8_ds_mla);
    - ``scales [pages, page, L/128]`` float32: fp8_ds_mla's group scales (else any tensor, unused);
    - ``kv_scale [1]`` float32: fp8_e4m3's layer scale, on the device (else any tensor, unused).
      A pointer, not a host float: launches stay capturable in a CUDA graph.
    - ``key_dtype``: a dtype every stored key value widens to exactly (None: any float type,
      fp8_e4m3's values fit float16, bfloat16 and float32 alike).
    Row strides are in elements of each view's own dtype.
    """

    fmt: int
    latent: torch.Tensor
    rope: torch.Tensor
    scales: torch.Tensor
    kv_scale: torch.Tensor
    key_dtype: torch.dtype | None

    def compute_dtype(self, q_dtype: torch.dtype) -> torch.dtype:
        """dtype that picks tile configs with a query of ``q_dtype``: the native cache's dtype (as
        before fp8 existed), else the ``tl.dot`` operand type (bfloat16/float16 when the query and
        the widened keys share it, float32 otherwise)."""
        if self.fmt == FMT_NATIVE:
            return self.latent.dtype
        key = self.key_dtype or q_dtype
        return key if key == q_dtype and key in (torch.bfloat16, torch.float16) else torch.float32

    def dot_dtype(self, *dtypes: torch.dtype) -> tl.dtype:
        """``tl.dot`` operand type for inputs of ``dtypes`` (the query's first) and these keys."""
        return dot_dtype(*dtypes, self.key_dtype or dtypes[0])


def cache_views(layer: torch.Tensor, cache_format: str, kv_lora_rank: int, kv_scale: torch.Tensor | None = None
                ) -> CacheViews:
    """Views of ``layer [pages, page, width]`` (one layer of ``blocks``) for ``cache_format``.

    ``kv_scale``: fp8_e4m3's float32 scale of this layer, a 1-element device tensor.
    """
    if layer.stride(2) != 1 or layer.stride(0) != layer.shape[1] * layer.stride(1):
        raise ValueError("kv_collection.blocks: each layer's pages must be stored contiguously (row-major)")
    L = kv_lora_rank
    fmt = FMT_CODES[cache_format]
    if fmt == FMT_DS_MLA:
        if layer.dtype != torch.uint8:
            raise ValueError(f"kv_collection.blocks: fp8_ds_mla records are uint8, got {layer.dtype}")
        latent, scales, rope = ds_mla_views(layer, L)
        return CacheViews(fmt, latent, rope, scales, scales, torch.bfloat16)
    if fmt == FMT_E4M3:
        if layer.dtype != FP8:
            raise ValueError(f"kv_collection.blocks: fp8_e4m3 entries are float8_e4m3fn, got {layer.dtype}")
        if kv_scale is None or kv_scale.numel() != 1:
            raise ValueError("kv_collection.kv_scale: fp8_e4m3 needs this layer's float32 scale")
        return CacheViews(fmt, layer[..., :L], layer[..., L:], layer, kv_scale, None)
    return CacheViews(fmt, layer[..., :L], layer[..., L:], layer, layer, layer.dtype)


def batch_views(batch, layer_idx: int, kv_lora_rank: int) -> CacheViews:
    """``cache_views`` of a ``CacheBatch``'s layer (the layer's kv_scale as a device slice)."""
    scale = batch.kv_scale[layer_idx: layer_idx + 1] if batch.cache_format == "fp8_e4m3" else None
    return cache_views(batch.blocks[layer_idx], batch.cache_format, kv_lora_rank, scale)


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
    return tl.minimum(lo, num_seqs - 1)  # offsets ending before ``row`` (corrupt) still name a sequence


@triton.jit
def physical_row(block_table_ptr, pos, page_size, max_pages, num_pages, valid):
    """``(row, ok)``: int64 physical row ``table[pos // page_size] * page_size + pos % page_size``
    and where it may be touched.

    ``block_table_ptr`` points at the sequence's row of the page table (``max_pages`` entries);
    the cache holds ``num_pages`` pages. ``ok`` is ``valid`` and ``0 <= pos``, the page inside
    the table row, the page id inside ``[0, num_pages)``: metadata corrupted after validation
    can never move a load or store outside the table or the cache. Rows where ``ok`` is false
    are 0 (callers mask them: an invisible key, a skipped write).
    """
    col = pos // page_size
    ok = valid & (pos >= 0) & (col < max_pages)
    page = tl.load(block_table_ptr + tl.where(ok, col, 0), mask=ok, other=0).to(tl.int64)
    ok = ok & (page >= 0) & (page < num_pages)
    return tl.where(ok, page * page_size + (pos % page_size), 0), ok


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
def _e4m3_by_hand(x):
    """float32 ``x`` in [-448, 448] -> float8_e4m3fn, round to nearest even, on the bits.

    Normal range (|x| >= 2^-6): keep 3 mantissa bits (add ``0x7FFFF`` plus the lowest kept bit,
    truncate; a carry moves into the exponent), re-bias the exponent from 127 to 7.
    Subnormals (|x| < 2^-6, steps of 2^-9): the code is ``rint(|x| * 512)``, rounded to
    even by the float32 add of 2^23 (8 there is the smallest normal, whose code is 8 too).
    """
    sign = (x.to(tl.uint32, bitcast=True) >> 24) & 0x80
    a = tl.abs(x)
    bits = a.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000
    normal = (((bits >> 23) - 120) << 3) | ((bits >> 20) & 7)
    sub = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.uint32)
    code = tl.where(a < 0.015625, sub, normal)
    code = tl.minimum(code, 0x7E)  # 448 stays 448 (0x7F is NaN)
    code = tl.where(a != a, 0x7F, code)  # NaN stays NaN (as the GPU's cvt)
    return (code | sign).to(tl.uint8).to(tl.float8e4nv, bitcast=True)


@triton.jit
def cast_to(x, dtype: tl.constexpr):
    """float32 ``x`` -> ``dtype``, rounding to nearest even as the GPU does.

    The interpreter truncates float32 -> bfloat16, so there the rounding is done on the bits:
    adding ``0x7FFF`` plus the lowest kept bit, then truncating, is round-half-to-even. Its
    float32 -> float8e4nv rounds half away from zero and loses carries and subnormals, so
    that one is done on the bits too (``_e4m3_by_hand``; callers saturate to +-448 first).
    The GPU converts with ``cvt.rn.satfinite``.
    """
    if _ROUND_BY_HAND and dtype == tl.float8e4nv:
        return _e4m3_by_hand(x)
    if _ROUND_BY_HAND and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def quantize_e4m3(x, scale):
    """float32 ``x / scale`` (IEEE division, as torch divides) saturated to +-448, as float8_e4m3fn:
    the same bytes as ``openmla.fp8.quantize_e4m3`` (a NaN stays NaN: tl.maximum drops it)."""
    y = tl.math.div_rn(x, scale)
    y = tl.where(y != y, y, tl.minimum(tl.maximum(y, -FP8_MAX_C), FP8_MAX_C))
    return cast_to(y, tl.float8e4nv)


@triton.jit
def online_softmax_step(s, m_i, l_i):
    """One key tile of the online softmax on base-2 logits ``s [M, N]``: returns the tile's
    probabilities ``p`` (relative to the new running max), the factor ``alpha`` that rescales the
    old accumulator, the new sum ``l_i`` and the new max ``m_i``."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: avoid -inf - -inf
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    return p, alpha, l_i * alpha + tl.sum(p, axis=1), m_new


@triton.jit
def natural_lse(m2, denom):
    """Natural-log LSE from a base-2 running max ``m2`` and its sum ``denom`` (``-inf`` when 0; NaN
    when a NaN or +inf score made the sum NaN: docs/api.md's NaN rule)."""
    empty = denom == 0
    return tl.where(empty, float("-inf"), (m2 + tl.log2(tl.where(empty, 1.0, denom))) * 0.6931471805599453)
