"""The ``cpu`` backend behind ``openmla.backends.base.Backend`` (a validated plan comes in).

A thin adapter: it reads what the flat kernels need off the ``CacheBatch`` (one layer's pages,
page table, host lengths, the prefill chunk plan) and calls ``kernels``.

| primitive | work |
|---|---|
| ``write_cache`` | one native pass: RMSNorm, RoPE, paged store (fp8 quantised), q's rope |
| ``decode`` | one native call (dense or sparse, split-KV, sinks, fp8 dequantised in the kernel) |
| ``prefill`` | dense: per chunk of the plan, a native gather, two torch matmuls (K/V up-projection) |
| | and native flash attention (sparse prefill reaches ``decode`` through the plan) |
| ``flare_mla_prefill`` | a native gather of the rope rows and native flash attention |
| ``absorb`` / ``unabsorb`` | one native call each (per-head brgemm; the weight packed once and cached) |

Inputs the kernels do not take run the torch backend instead: float64, tensors off the CPU, odd
widths, a float64 cache; ``absorb``/``unabsorb`` run ``openmla.combine``'s for mixed, float16 or
float64 dtypes, autograd and ``torch.compile``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ... import combine
from .. import torch_cpu
from ...cache import CacheBatch
from ..torch_cpu.prefill import default_buffer_size
from . import kernels, packed

if TYPE_CHECKING:
    from ...planning import ChunkRows, MLAPlan
    from ...spec import AttentionSpec

__all__ = ["name", "cache_formats", "write_cache", "decode", "prefill", "flare_mla_prefill", "absorb", "unabsorb"]

name = "cpu"
cache_formats = ("native", "fp8_e4m3", "fp8_ds_mla")


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


def write_cache(plan: "MLAPlan", layer_idx: int, q, kv, freqs_cis, kv_norm_gamma, epsilon: float, interleaved: bool = True):
    layer = _layer(plan.batch, layer_idx)
    takes = (layer is not None and q.dtype in kernels.FORMAT_CODES and kv.dtype in kernels.FORMAT_CODES
             and kv_norm_gamma.dtype != torch.float64 and q.device.type == "cpu"
             and freqs_cis.dtype in (torch.float32, torch.float64))
    if not takes:
        return torch_cpu.write_cache(plan, layer_idx, q, kv, freqs_cis, kv_norm_gamma, epsilon, interleaved)
    return kernels.write_cache(q, kv, freqs_cis, kv_norm_gamma, layer, epsilon=epsilon, interleaved=interleaved)


def _heads_native(x: torch.Tensor, w: torch.Tensor, k: int) -> bool:
    """Whether the per-head kernel takes ``x [T, H, k+c]`` and ``w [H, M, k]``: CPU tensors of one
    dtype that is its own compute dtype (bf16 where bf16 brgemm runs, float32), an even ``k`` for
    bf16, no autograd graph to keep, and not under ``torch.compile`` (the packed-weight cache
    reads addresses; compiled graphs get combine's matmuls)."""
    return (x.device.type == "cpu" and w.device.type == "cpu" and x.dtype == w.dtype
            and kernels.compute_dtype(x.dtype) == x.dtype and (k % 2 == 0 or x.dtype == torch.float32)
            and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))
            and not torch.compiler.is_compiling())


def absorb(q_rot: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """``combine.absorb``: ``q_rot [T, H, Dn+R]``, ``w_uk [H, L, Dn]`` -> ``q_abs [T, H, L+R]`` (one
    native call; ``w_uk`` packed once, see ``packed``)."""
    L, Dn = w_uk.shape[1], w_uk.shape[2]
    if not _heads_native(q_rot, w_uk, Dn):
        return combine.absorb(q_rot, w_uk)
    return kernels.heads_gemm(q_rot, packed.packed(w_uk), L, Dn)


def unabsorb(out_lat: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """``combine.unabsorb``: ``out_lat [T, H, L]``, ``w_uv [H, Dv, L]`` -> ``out [T, H, Dv]`` (one
    native call; ``w_uv`` packed once)."""
    Dv, L = w_uv.shape[1], w_uv.shape[2]
    if out_lat.shape[2] != L or not _heads_native(out_lat, w_uv, L):
        return combine.unabsorb(out_lat, w_uv)
    return kernels.heads_gemm(out_lat, packed.packed(w_uv), Dv, L)


def decode(plan: "MLAPlan", layer_idx: int, q_abs: torch.Tensor, spec: "AttentionSpec",
           kv_lora_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed attention: ``q_abs [T, H, L+R]`` -> ``out_lat [T, H, L]``, ``lse [T, H]``."""
    native = _native(plan.batch, layer_idx, q_abs)
    if native is None:
        return torch_cpu.decode(plan, layer_idx, q_abs, spec, kv_lora_rank)
    layer, dtype = native
    sparse = spec.sparse
    return kernels.decode(q_abs, layer, kv_lora_rank=kv_lora_rank, scale=spec.scale, mask=spec.mask,
                          sparse_indices=None if sparse is None else sparse.indices,
                          topk_lengths=None if sparse is None else sparse.topk_lengths,
                          physical=True if sparse is None else sparse.physical, attn_sink=spec.attn_sink,
                          num_partitions=plan.num_partitions, dtype=dtype)


def prefill(plan: "MLAPlan", layer_idx: int, q_rot: torch.Tensor, w_k: torch.Tensor, w_uv: torch.Tensor,
            spec: "AttentionSpec") -> tuple[torch.Tensor, torch.Tensor]:
    """Dense prefill form: ``q_rot [T, H, Dn+R]`` -> ``out [T, H, Dv]``, ``lse [T, H]``, per chunk of
    the plan's chunk plan (host lists made once per step)."""
    batch = plan.batch
    native = _native(batch, layer_idx, q_rot, w_k, w_uv)
    if native is None:
        return torch_cpu.prefill(plan, layer_idx, q_rot, w_k, w_uv, spec)
    layer, dtype = native
    T, H, Dq = q_rot.shape
    Dv, L = w_uv.shape[1], w_uv.shape[2]
    B = batch.batch_size
    chunks = plan.chunks(plan.buffer_size or default_buffer_size(H, Dq, Dv, L, dtype))
    pairs = [(bro, co[:B]) for bro, co in zip(chunks.buffer_row_offsets, chunks.cache_offsets)]
    return kernels.prefill(q_rot, layer, w_k, w_uv, chunks=pairs, offsets=batch.offsets_list,
                           cache_lens=batch.cache_lengths_list, scale=spec.scale, mask=spec.mask, attn_sink=spec.attn_sink,
                           dtype=dtype)


def flare_mla_prefill(plan: "MLAPlan", layer_idx: int, q, k, v, chunk: "ChunkRows", spec: "AttentionSpec", tile=None):
    """One chunk with up-projected keys ``k [S, H, Dn]``, ``v [S, H, Dv]`` (rope from the cache).
    ``tile`` only schedules work; the native kernel keeps its own tiles."""
    batch = plan.batch
    native = _native(batch, layer_idx, q, k, v)
    if native is None:
        return torch_cpu.flare_mla_prefill(plan, layer_idx, q, k, v, chunk, spec, tile)
    layer, dtype = native
    S, H, Dn = k.shape
    R = q.shape[2] - Dn
    L = batch.head_dim - R
    B = batch.batch_size
    bro, co = chunk.bro, chunk.co[:B]
    counts = [bro[b + 1] - bro[b] for b in range(B)]
    spans = [(b, co[b], n) for b, n in enumerate(counts) if n]
    rope = kernels.gather(layer, spans, kv_lora_rank=L, rope_dim=R, cols=(L, L + R), dtype=dtype)
    table = torch.tensor([bro[:B], co, counts], dtype=torch.int64).reshape(3, B)
    return kernels.prefill_chunk(q.to(dtype).contiguous(), k.to(dtype).reshape(S, H * Dn).contiguous(),
                                 v.to(dtype).reshape(S, -1).contiguous(), rope, offsets=batch.input_row_offsets,
                                 cache_lengths=batch.cache_lengths, spans=table, scale=spec.scale, mask=spec.mask,
                                 attn_sink=None)
