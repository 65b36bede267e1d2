"""torch backend: the per-token cache write of a ragged batch, in one vectorised pass.

For the ``T`` new tokens: positions from the batch's offsets and cache lengths, physical
rows through the page table, RMSNorm of the latent, RoPE of the key rope part, one
``index_copy_`` into ``blocks[layer_idx]``; q's rope part is rotated with the same positions.
No Python loop runs per token or per sequence.
"""

from __future__ import annotations

import torch

from ...cache import CacheBatch
from ...rope import apply_rope

__all__ = ["write_cache", "token_positions", "token_rows"]


def token_positions(batch: CacheBatch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(seq, pos)``: sequence index and absolute position of each new token, both int64 ``[T]``.

    Token ``i`` of sequence ``b`` sits at ``cache_lengths[b] + i``.
    """
    offsets = batch.input_row_offsets.to(device=device, dtype=torch.int64)
    counts = offsets[1:] - offsets[:-1]
    T = int(batch.offsets_list[-1])
    seq = torch.repeat_interleave(torch.arange(counts.shape[0], device=device), counts, output_size=T)
    local = torch.arange(T, device=device) - offsets[seq]
    pos = batch.cache_lengths.to(device=device, dtype=torch.int64)[seq] + local
    return seq, pos


def token_rows(batch: CacheBatch, seq: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Physical cache rows (``page * page_size + offset``) of positions ``pos`` of sequences ``seq``."""
    ps = batch.page_size
    table = batch.block_table.to(device=pos.device, dtype=torch.int64)
    return table[seq, pos // ps] * ps + pos % ps


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
    latent = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + epsilon) * gamma.to(nd)
    # The rope part is tiny; float64 keeps cancellation in (a c - b s) from costing ulps.
    k_rope = apply_rope(kv[:, L:].to(torch.float64), freqs_cis, pos, interleaved)
    out = torch.empty(kv.shape[0], kv.shape[1], dtype=out_dtype, device=kv.device)
    out[:, :L] = latent
    out[:, L:] = k_rope
    return out


def _scatter(batch: CacheBatch, layer_idx: int, rows: torch.Tensor, entries: torch.Tensor) -> None:
    """Store ``entries [T, D]`` at physical ``rows`` of layer ``layer_idx`` (in place)."""
    layer = batch.blocks[layer_idx]
    if layer.is_contiguous():
        layer.view(-1, layer.shape[-1]).index_copy_(0, rows, entries)
    else:  # a strided storage cannot be flattened without a copy: index (page, offset) directly
        ps = batch.page_size
        layer.index_put_((rows // ps, rows % ps), entries)


def write_cache(
    q: torch.Tensor,
    kv: torch.Tensor,
    freqs_cis: torch.Tensor,
    kv_norm_gamma: torch.Tensor,
    batch: CacheBatch,
    layer_idx: int,
    epsilon: float,
    interleaved: bool = True,
) -> torch.Tensor:
    """Write ``kv [T, L+R]`` into the cache and return q ``[T, H, Dn+R]`` with its rope part rotated.

    The latent is ``x * rsqrt(mean(x^2) + eps) * gamma`` (float32, float64 for 32/64-bit caches),
    the key rope part is rotated at each token's position, both stored in the cache dtype. The
    returned q is a new tensor of q's dtype.
    """
    device = kv.device
    blocks = batch.blocks
    R = kv.shape[1] - kv_norm_gamma.shape[0]
    Dn = q.shape[2] - R
    seq, pos = token_positions(batch, device)
    if kv.shape[0]:
        rows = token_rows(batch, seq, pos)
        entries = cache_entries(kv, freqs_cis, kv_norm_gamma, pos, epsilon, interleaved, blocks.dtype)
        _scatter(batch, layer_idx, rows.to(blocks.device), entries.to(blocks.device))
    q_rot = torch.empty_like(q, memory_format=torch.contiguous_format)
    q_rot[..., :Dn] = q[..., :Dn]
    q_rot[..., Dn:] = apply_rope(q[..., Dn:], freqs_cis, pos, interleaved)
    return q_rot
