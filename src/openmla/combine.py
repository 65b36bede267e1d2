"""The small pieces of MLA math that sit around the attention kernels, written once.

- ``absorb`` / ``unabsorb``: the decode form's query absorption and output projection.
- ``merge_states``: the LSE merge of two partial attentions over disjoint key sets.
- ``apply_sink``: the attention sink's share of the softmax denominator.

A backend may fuse any of these into a kernel; this is the unfused definition.
"""

from __future__ import annotations

import math

import torch


def _heads_bmm(x: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per-head product ``x [T, H, a] @ w [H, a, b] -> [T, H, b]`` in ``dtype`` (heads are the bmm batch)."""
    return torch.bmm(x.transpose(0, 1).to(dtype), w.to(dtype)).transpose(0, 1)


def absorb(q_rot: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """``q_rot [T, H, Dn+R]``, ``w_uk [H, L, Dn]`` -> ``q_abs [T, H, L+R]`` in q_rot's dtype:
    ``q_lat[t, h] = w_uk[h] @ q_nope[t, h]``, then the rope part unchanged."""
    T, H, _ = q_rot.shape
    L, Dn = w_uk.shape[1], w_uk.shape[2]
    out = torch.empty(T, H, L + q_rot.shape[2] - Dn, dtype=q_rot.dtype, device=q_rot.device)
    out[..., :L] = _heads_bmm(q_rot[..., :Dn], w_uk.transpose(1, 2), torch.promote_types(q_rot.dtype, w_uk.dtype))
    out[..., L:] = q_rot[..., Dn:]
    return out


def unabsorb(out_lat: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """``out_lat [T, H, L]``, ``w_uv [H, Dv, L]`` -> ``[T, H, Dv]`` in out_lat's dtype:
    ``out[t, h] = w_uv[h] @ out_lat[t, h]``."""
    dtype = torch.promote_types(out_lat.dtype, w_uv.dtype)
    return _heads_bmm(out_lat, w_uv.transpose(1, 2), dtype).to(out_lat.dtype)


def empty_lse(lse: torch.Tensor) -> torch.Tensor:
    """True where ``lse`` marks a part without keys: -inf (openmla) or +inf (FlashMLA). NaN is not
    empty: it is a NaN row (docs/api.md's NaN rule)."""
    return torch.isinf(lse)


def merge_states(
    o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attentions over disjoint key sets.

    ``o_* [..., D]`` are each part's normalised output, ``lse_* [...]`` its natural-log
    log-sum-exp. A part without keys may say so with -inf (openmla's convention) or +inf
    (FlashMLA's); its output is ignored whatever it holds (NaN included). A NaN LSE is a NaN row
    (docs/api.md's NaN rule) and makes the merged row NaN. Returns ``(o, lse)`` as if computed
    over both key sets, in float32 (float64 when an input is float64); a row empty in both gives 0
    and -inf.
    """
    wide = torch.float64 if torch.float64 in (o_a.dtype, o_b.dtype, lse_a.dtype, lse_b.dtype) else torch.float32
    la, lb = lse_a.to(wide), lse_b.to(wide)
    ea, eb = empty_lse(la), empty_lse(lb)
    la = la.masked_fill(ea, -math.inf)
    lb = lb.masked_fill(eb, -math.inf)
    m = torch.maximum(la, lb)  # NaN from either part propagates
    empty = ea & eb
    m_safe = m.masked_fill(empty, 0.0)
    wa, wb = torch.exp(la - m_safe), torch.exp(lb - m_safe)
    denom = wa + wb
    lse = torch.where(empty, -math.inf, m_safe + torch.log(denom))
    denom = torch.where(empty, 1.0, denom)
    part_a = torch.where(ea[..., None], 0.0, o_a.to(wide) * (wa / denom)[..., None])
    part_b = torch.where(eb[..., None], 0.0, o_b.to(wide) * (wb / denom)[..., None])
    return part_a + part_b, lse


def apply_sink(out: torch.Tensor, lse: torch.Tensor, attn_sink: torch.Tensor, token_seq: torch.Tensor | None) -> None:
    """``out [T, H, D] *= e^lse / (e^lse + e^sink)`` in place; ``lse [T, H]`` excludes the sink.

    ``attn_sink`` is ``[H]`` or ``[B, H]`` (then ``token_seq [T]`` gives each row's sequence). A
    row without keys stays 0, with or without a sink.
    """
    sink = attn_sink.to(device=lse.device, dtype=lse.dtype)
    if sink.dim() == 2:
        sink = sink[token_seq]
    factor = torch.sigmoid(lse - sink).nan_to_num_(nan=0.0)  # -inf - (-inf): no key and no sink weight
    out.mul_(factor.unsqueeze(-1).to(out.dtype))
