"""The ``cpu`` backend behind the interface of ``openmla.backends`` (arguments arrive validated).

A thin adapter: it reads what the flat kernels need off the ``CacheBatch`` (one layer's pages,
page table, host lengths, the prefill chunk plan) and calls ``kernels``.

| primitive | work |
|---|---|
| ``write_cache`` | one native pass: RMSNorm, RoPE, paged store (fp8 quantised), q's rope |
| ``absorb`` / ``unabsorb`` | the torch backend's (one ``bmm`` per head) |
| ``decode`` | one native call (dense or sparse, split-KV, sinks, fp8 dequantised in the kernel) |
| ``prefill`` | dense: per chunk, a native gather, two torch matmuls (K/V up-projection) and native |
| | flash attention; sparse: the absorbed decode path (the same math) |
| ``flare_mla_prefill`` | a native gather of the rope rows and native flash attention |

Inputs the kernels do not take run the torch backend instead: float64, tensors off the CPU, odd
widths, a float64 cache.
"""

from __future__ import annotations

import torch

from .. import torch_cpu
from ...cache import CacheBatch
from ...masks import MaskVariant
from ..torch_cpu.prefill import default_buffer_size
from . import kernels

__all__ = ["write_cache", "absorb", "unabsorb", "decode", "prefill", "flare_mla_prefill"]

CACHE_FORMATS = ("native", "fp8_e4m3", "fp8_ds_mla")

absorb = torch_cpu.absorb
unabsorb = torch_cpu.unabsorb


def _layer(batch: CacheBatch, layer_idx: int) -> kernels.PagedLayer | None:
    """The kernels' view of one cache layer, or None when they cannot read it."""
    pages = batch.blocks[layer_idx]
    fmt = kernels.FORMAT_CODES.get(pages.dtype if batch.is_native else batch.cache_format)
    if fmt is None or pages.device.type != "cpu" or pages.stride(-1) != 1:
        return None
    kv_scale = float(batch.kv_scale[layer_idx]) if batch.cache_format == "fp8_e4m3" else 1.0
    return kernels.PagedLayer(pages, batch.block_table, batch.cache_lengths, batch.input_row_offsets, fmt, kv_scale)


def _native(batch: CacheBatch, layer_idx: int, q: torch.Tensor, *others: torch.Tensor) -> tuple[kernels.PagedLayer, torch.dtype] | None:
    """(cache view, compute dtype) when the kernels take these inputs (CPU, all widths even).
    The compute dtype follows q and the cache, as the torch backend's (weights are cast)."""
    if not all(t.device.type == "cpu" and t.shape[-1] % 2 == 0 and t.dtype != torch.float64 for t in (q, *others)):
        return None
    dtype = kernels.compute_dtype(q.dtype, batch.compute_dtype)
    layer = _layer(batch, layer_idx) if dtype is not None else None
    return None if layer is None else (layer, dtype)


def write_cache(q, kv, freqs_cis, kv_norm_gamma, batch: CacheBatch, layer_idx: int, epsilon: float, interleaved: bool = True):
    layer = _layer(batch, layer_idx)
    takes = (layer is not None and q.dtype in kernels.FORMAT_CODES and kv.dtype in kernels.FORMAT_CODES
             and kv_norm_gamma.dtype != torch.float64 and q.device.type == "cpu"
             and freqs_cis.dtype in (torch.float32, torch.float64))
    if not takes:
        return torch_cpu.write_cache(q, kv, freqs_cis, kv_norm_gamma, batch, layer_idx, epsilon, interleaved)
    return kernels.write_cache(q, kv, freqs_cis, kv_norm_gamma, layer, epsilon=epsilon, interleaved=interleaved)


def decode(q_abs, batch: CacheBatch, layer_idx: int, *, scale: float, kv_lora_rank: int, mask: MaskVariant,
           sparse_indices, topk_lengths, physical_indices: bool, attn_sink, num_partitions):
    """Absorbed attention: ``q_abs [T, H, L+R]`` -> ``out_lat [T, H, L]``, ``lse [T, H]``."""
    native = _native(batch, layer_idx, q_abs)
    if native is None:
        return torch_cpu.decode(q_abs, batch, layer_idx, scale=scale, kv_lora_rank=kv_lora_rank, mask=mask,
                                sparse_indices=sparse_indices, topk_lengths=topk_lengths, physical_indices=physical_indices,
                                attn_sink=attn_sink, num_partitions=num_partitions)
    layer, dtype = native
    return kernels.decode(q_abs, layer, kv_lora_rank=kv_lora_rank, scale=scale, mask=mask, sparse_indices=sparse_indices,
                          topk_lengths=topk_lengths, physical=physical_indices, attn_sink=attn_sink,
                          num_partitions=num_partitions, dtype=dtype)


def prefill(q_rot, batch: CacheBatch, layer_idx: int, w_k, w_uv, *, scale: float, mask: MaskVariant, sparse_indices,
            topk_lengths, physical_indices: bool, attn_sink, buffer_size: int | None):
    """Prefill form: ``q_rot [T, H, Dn+R]`` -> ``out [T, H, Dv]``, ``lse [T, H]``."""
    if sparse_indices is not None:  # at most ``stride`` keys per token: the absorbed form
        H, L = w_uv.shape[0], w_uv.shape[2]
        w_uk = w_k.reshape(H, -1, L).transpose(1, 2)
        out_lat, lse = decode(absorb(q_rot, w_uk), batch, layer_idx, scale=scale, kv_lora_rank=L, mask=mask,
                              sparse_indices=sparse_indices, topk_lengths=topk_lengths, physical_indices=physical_indices,
                              attn_sink=attn_sink, num_partitions=None)
        return unabsorb(out_lat, w_uv), lse
    native = _native(batch, layer_idx, q_rot, w_k, w_uv)
    if native is None:
        return torch_cpu.prefill(q_rot, batch, layer_idx, w_k, w_uv, scale=scale, mask=mask, sparse_indices=None,
                                 topk_lengths=None, physical_indices=physical_indices, attn_sink=attn_sink,
                                 buffer_size=buffer_size)
    from ...ops import mla_prefill_plan

    layer, dtype = native
    T, H, Dq = q_rot.shape
    Dv, L = w_uv.shape[1], w_uv.shape[2]
    total = sum(batch.seq_lens_list)
    size = buffer_size or default_buffer_size(H, Dq, Dv, L, dtype)
    num_chunks = max(1, -(-total // size))
    bro, co, _ = mla_prefill_plan(batch.input_row_offsets, batch, size, num_chunks)
    B = batch.batch_size
    chunks = [(r, c[:B]) for r, c in zip(bro.tolist(), co.tolist())]
    return kernels.prefill(q_rot, layer, w_k, w_uv, chunks=chunks, offsets=batch.offsets_list,
                           cache_lens=batch.cache_lengths_list, scale=scale, mask=mask, attn_sink=attn_sink, dtype=dtype)


def flare_mla_prefill(q, k, v, buffer_row_offsets, cache_offsets, batch: CacheBatch, layer_idx: int, *, scale: float,
                      mask: MaskVariant, tile=None):
    """One chunk with up-projected keys ``k [S, H, Dn]``, ``v [S, H, Dv]`` (rope from the cache).
    ``tile`` only schedules work; the native kernel keeps its own tiles."""
    native = _native(batch, layer_idx, q, k, v)
    if native is None:
        return torch_cpu.flare_mla_prefill(q, k, v, buffer_row_offsets, cache_offsets, batch, layer_idx, scale=scale,
                                           mask=mask, tile=tile)
    layer, dtype = native
    S, H, Dn = k.shape
    R = q.shape[2] - Dn
    L = batch.head_dim - R
    B = batch.batch_size
    bro, co = buffer_row_offsets.tolist(), cache_offsets.tolist()[:B]
    counts = [bro[b + 1] - bro[b] for b in range(B)]
    spans = [(b, co[b], n) for b, n in enumerate(counts) if n]
    rope = kernels.gather(layer, spans, kv_lora_rank=L, rope_dim=R, cols=(L, L + R), dtype=dtype)
    table = torch.tensor([bro[:B], co, counts], dtype=torch.int64).reshape(3, B)
    return kernels.prefill_chunk(q.to(dtype).contiguous(), k.to(dtype).reshape(S, H * Dn).contiguous(),
                                 v.to(dtype).reshape(S, -1).contiguous(), rope, offsets=batch.input_row_offsets,
                                 cache_lengths=batch.cache_lengths, spans=table, scale=scale, mask=mask, attn_sink=None)
