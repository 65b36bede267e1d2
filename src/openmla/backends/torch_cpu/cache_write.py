"""torch backend: the per-token cache write of a ragged batch, in one vectorised pass.

For the ``T`` new tokens (positions and physical rows precomputed once per step by the plan):
RMSNorm of the latent, RoPE of the key rope part, one ``index_copy_`` into
``blocks[layer_idx]``; q's rope part is rotated with the same positions. No Python loop runs
per token or per sequence, and the op count does not grow with T.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ...cache import CacheBatch
from ...workspace import empty_output

if TYPE_CHECKING:
    from ..base import PlanView

__all__ = ["write_cache", "rotate"]


def rotate(x: torch.Tensor, freqs_cis: torch.Tensor, pos: torch.Tensor, interleaved: bool, compute: torch.dtype) -> torch.Tensor:
    """RoPE of ``x [T, ..., R]`` at positions ``pos [T]`` as one complex multiply, in ``compute``
    (float32 or float64); returns a new contiguous tensor of that dtype.

    ``freqs_cis[p]`` holds interleaved (cos, sin) pairs, i.e. the complex factors ``c + i s``;
    a pair ``(a, b)`` of x (interleaved: ``x[2i], x[2i+1]``; half-split: ``x[i], x[i+R/2]``) maps
    to ``(a c - b s, a s + b c)``.
    """
    T, R = x.shape[0], x.shape[-1]
    # view_as_complex needs a unit last stride, even other strides and an even storage offset:
    # both operands are fresh packed tensors (index_select makes one), so any view of x (a slice
    # of a wider projection, say) works.
    fc = freqs_cis.index_select(0, pos).to(compute).view(T, *([1] * (x.dim() - 2)), R // 2, 2)
    rot = torch.view_as_complex(fc)
    if interleaved:
        packed = torch.empty(x.shape, dtype=compute, device=x.device).copy_(x)
        xc = torch.view_as_complex(packed.view(*x.shape[:-1], R // 2, 2))
        return torch.view_as_real(xc * rot).flatten(-2)
    y = torch.complex(x[..., : R // 2].to(compute), x[..., R // 2 :].to(compute)) * rot
    return torch.cat([y.real, y.imag], dim=-1)


def _norm_dtype(cache_dtype: torch.dtype) -> torch.dtype:
    """float32 is exact enough for a 16-bit cache; a float32/64 cache needs float64 to stay
    within one ulp of the float64 reference."""
    return torch.float32 if cache_dtype in (torch.bfloat16, torch.float16) else torch.float64


def cache_entries(
    kv: torch.Tensor, freqs_cis: torch.Tensor, gamma: torch.Tensor, pos: torch.Tensor,
    epsilon: float, interleaved: bool, out_dtype: torch.dtype,
) -> torch.Tensor:
    """Cache entries ``[T, L+R]`` in ``out_dtype``: RMSNorm(kv[:, :L]) * gamma, then RoPE(kv[:, L:], pos)."""
    L = gamma.shape[0]
    nd = _norm_dtype(out_dtype)
    x = kv[:, :L].to(nd)
    latent = x * torch.rsqrt(x.square().mean(-1, keepdim=True).add_(epsilon)) * gamma.to(nd)
    out = empty_output((kv.shape[0], kv.shape[1]), out_dtype, kv.device)
    out[:, :L] = latent
    # The rope part is tiny; float64 keeps cancellation in (a c - b s) from costing ulps.
    out[:, L:] = rotate(kv[:, L:], freqs_cis, pos, interleaved, torch.float64)
    return out


@torch.no_grad()  # the cache never joins an autograd graph
def _scatter(batch: CacheBatch, layer_idx: int, rows: torch.Tensor, entries: torch.Tensor) -> None:
    """Store ``entries [T, D]`` at physical ``rows`` of layer ``layer_idx`` (in place)."""
    layer = batch.blocks[layer_idx]
    if layer.is_contiguous():
        layer.view(-1, layer.shape[-1]).index_copy_(0, rows, entries)
    else:  # a strided storage cannot be flattened without a copy: index (page, offset) directly
        ps = batch.page_size
        layer.index_put_((rows // ps, rows % ps), entries)


def write_cache(
    plan: "PlanView",
    layer_idx: int,
    q: torch.Tensor,
    kv: torch.Tensor,
    freqs_cis: torch.Tensor,
    kv_norm_gamma: torch.Tensor,
    epsilon: float,
    interleaved: bool = True,
) -> torch.Tensor:
    """Write ``kv [T, L+R]`` into the cache and return q ``[T, H, Dn+R]`` with its rope part rotated.

    The latent is ``x * rsqrt(mean(x^2) + eps) * gamma`` (float32; float64 for 32/64-bit caches),
    the key rope part is rotated at each token's position (float64), both stored in the cache
    dtype. The returned q is a new tensor of q's dtype, rotated in float32 (float64 for float64 q).
    """
    batch = plan.batch
    R = kv.shape[1] - kv_norm_gamma.shape[0]
    Dn = q.shape[2] - R
    pos = plan.token_pos
    if kv.shape[0] and not batch.is_native:  # fp8 formats: float32 entries, quantised by the cache
        entries = cache_entries(kv, freqs_cis, kv_norm_gamma, pos, epsilon, interleaved, torch.float32)
        batch.write_rows(layer_idx, plan.write_rows, entries)
    elif kv.shape[0]:
        entries = cache_entries(kv, freqs_cis, kv_norm_gamma, pos, epsilon, interleaved, batch.blocks.dtype)
        _scatter(batch, layer_idx, plan.write_rows.to(batch.blocks.device), entries.to(batch.blocks.device))
    q_rot = torch.empty_like(q, memory_format=torch.contiguous_format)
    q_rot[..., :Dn] = q[..., :Dn]
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    q_rot[..., Dn:] = rotate(q[..., Dn:], freqs_cis, pos, interleaved, compute)
    return q_rot
