"""LSE merge of partial attentions over disjoint key sets, with the attention sink.

Each part ``s`` holds a normalised output ``o_s`` and ``lse_s = log sum exp(scores)`` of its
keys (``-inf`` when it had none). With ``m = max_s lse_s`` and ``w_s = exp(lse_s - m)``:

    out = sum_s w_s o_s / (sum_s w_s + exp(sink - m))      lse = m + log(sum_s w_s)

The sink term only joins the denominator; the returned LSE leaves it out, so merged
results can be merged again. ``m`` is the parts' max, not the sink's: a huge sink makes
the denominator ``inf`` and the output 0, which is the right limit. Grid ``(T, H)``.
Used as stage 2 of decode and to fold prefill chunks together.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _common
from ._common import cast_to, find_sequence, next_pow2, search_steps


@triton.jit
def _merge_kernel(
    o_part_ptr, lse_part_ptr, sink_ptr, offsets_ptr, out_ptr, lse_out_ptr,
    num_parts, num_seqs, D,
    stride_ps, stride_pt, stride_ph, stride_ls, stride_lt, stride_lh,
    stride_ot, stride_oh, stride_sink_b, stride_lo,
    BLOCK_D: tl.constexpr, HAS_SINK: tl.constexpr, SINK_PER_SEQ: tl.constexpr, STEPS: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    lse_base = lse_part_ptr + t.to(tl.int64) * stride_lt + h * stride_lh
    o_base = o_part_ptr + t.to(tl.int64) * stride_pt + h * stride_ph

    # Pass 1: the largest part LSE (the reference point of every weight).
    m = tl.full((), float("-inf"), tl.float32)
    lse_ptr = lse_base
    for _ in range(num_parts):
        m = tl.maximum(m, tl.load(lse_ptr))
        lse_ptr += stride_ls  # pointer steps stay 64-bit however large the parts are
    m_ref = tl.where(m == float("-inf"), 0.0, m)

    # Pass 2: weighted sum of the parts' outputs.
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    acc = tl.zeros((BLOCK_D,), tl.float32)
    denom = tl.zeros((), tl.float32)
    lse_ptr = lse_base
    o_ptr = o_base
    for _ in range(num_parts):
        w = tl.exp(tl.load(lse_ptr) - m_ref)
        o = tl.load(o_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
        acc += tl.where(w > 0, w * o, 0.0)  # an empty part's output never matters
        denom += w
        lse_ptr += stride_ls
        o_ptr += stride_ps
    # A NaN part LSE (a NaN row, docs/api.md) makes its weight and so ``denom`` NaN: NaN out and LSE.
    lse = tl.where(denom == 0, float("-inf"), m_ref + tl.log(tl.where(denom == 0, 1.0, denom)))

    if HAS_SINK:
        if SINK_PER_SEQ:
            seq = find_sequence(offsets_ptr, t, num_seqs, STEPS)
            sink = tl.load(sink_ptr + seq * stride_sink_b + h)
        else:
            sink = tl.load(sink_ptr + h)
        denom += tl.exp(sink - m_ref)
    out = acc / tl.where(denom == 0, 1.0, denom)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + d, cast_to(out, out_ptr.dtype.element_ty), mask=d_ok)
    tl.store(lse_out_ptr + t.to(tl.int64) * stride_lo + h, lse)


def merge_parts(
    o_parts: torch.Tensor,
    lse_parts: torch.Tensor,
    input_row_offsets: torch.Tensor,
    *,
    attn_sink: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    lse_out: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge ``o_parts [S, T, H, D]`` / ``lse_parts [S, T, H]`` (float32) into ``out [T, H, D]``
    and ``lse [T, H]`` float32, applying ``attn_sink`` ([H] or [B, H]) when given.

    ``out``/``lse_out`` may alias part 0 (each program reads its parts before writing).
    ``input_row_offsets [B+1]`` maps rows to sequences for a per-sequence sink.
    """
    S, T, H, D = o_parts.shape
    dev = o_parts.device
    if out is None:
        out = _common.empty_output((T, H, D), out_dtype, dev)
    if lse_out is None:
        lse_out = _common.empty_output((T, H), torch.float32, dev)
    if T == 0 or H == 0:
        return out, lse_out
    if o_parts.stride(3) != 1 or out.stride(2) != 1 or lse_out.stride(1) != 1:
        raise ValueError("o_parts/out/lse_out: the last dimension must be contiguous")
    sink = attn_sink.contiguous() if attn_sink is not None else lse_parts  # any pointer when unused
    offsets = _common.as_index(input_row_offsets)
    B = offsets.shape[0] - 1
    _merge_kernel[(T, H)](
        o_parts, lse_parts, sink, offsets, out, lse_out,
        S, B, D,
        o_parts.stride(0), o_parts.stride(1), o_parts.stride(2),
        lse_parts.stride(0), lse_parts.stride(1), lse_parts.stride(2),
        out.stride(0), out.stride(1), sink.stride(0) if sink.dim() == 2 else 0,
        lse_out.stride(0),
        BLOCK_D=next_pow2(D, 1), HAS_SINK=attn_sink is not None,
        SINK_PER_SEQ=attn_sink is not None and attn_sink.dim() == 2, STEPS=search_steps(B),
    )
    return out, lse_out
