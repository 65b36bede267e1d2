"""openmla's kernels as PyTorch custom ops (``torch.ops.openmla.*``), for ``torch.compile``.

``MLAPlan`` calls these under ``torch.compile`` (eagerly it calls the backend directly, which
is the same code without the dispatcher). Each op takes the step's metadata as tensors plus
plain scalars, so a compiled graph guards only on shapes and static options, never on the
step's lengths: a new plan with the same shapes reuses the graph. Inside, the op finds the live
plan that owns those metadata tensors (its host-side state: positions, chunk plan), or, for a
call from outside a plan (``torch.library.opcheck``, a hand-built call), plans again from the
tensors.

| op | mutates | returns |
|---|---|---|
| ``openmla::write_cache`` | ``blocks`` (the cache) | q with its rope part rotated |
| ``openmla::attention`` (``form="decode"``) | - | ``(out [T, H, L], lse [T, H])`` from absorbed q |
| ``openmla::attention`` (``form="prefill"``) | - | ``(out [T, H, Dv], lse [T, H])`` from roped q, ``w_k``, ``w_uv`` |

Inference only: no autograd formulas are registered.
"""

from __future__ import annotations

from typing import Optional

import torch

from .cache import CacheBatch
from .masks import MaskKind, MaskVariant
from .planning import MLAPlan, plan, write_impl
from .spec import AttentionSpec, SparseSpec

Tensor = torch.Tensor


# The step, flattened to op arguments ------------------------------------------------------
def _cache_args(p: MLAPlan) -> tuple:
    b = p.batch
    return (b.blocks, b.block_table, b.cache_lengths, b.input_row_offsets, b.kv_scale, b.page_size, b.cache_format,
            b.rope_dim or 0, p.backend_name)


def _spec_args(spec: AttentionSpec) -> tuple:
    s, m = spec.sparse, spec.mask
    return (spec.scale, m.kind.value, m.window_size or 0, m.chunk_size or 0,
            None if s is None else s.indices, None if s is None else s.topk_lengths, True if s is None else s.physical,
            spec.attn_sink)


def _spec_of(scale: float, mask: str, window_size: int, chunk_size: int, sparse_indices: Optional[Tensor],
             topk_lengths: Optional[Tensor], physical_indices: bool, attn_sink: Optional[Tensor]) -> AttentionSpec:
    kind = MaskKind(mask)
    variant = MaskVariant(kind, window_size or None, chunk_size or None)
    sparse = None if sparse_indices is None else SparseSpec(sparse_indices, topk_lengths, physical_indices)
    return AttentionSpec(scale, variant, sparse, attn_sink)


def _plan_of(blocks: Tensor, block_table: Tensor, cache_lengths: Tensor, input_row_offsets: Tensor,
             kv_scale: Optional[Tensor], page_size: int, cache_format: str, rope_dim: int, backend: str,
             num_partitions: int = 0, buffer_size: int = 0) -> MLAPlan:
    """The live plan owning these metadata tensors, or a fresh plan made from them."""
    live = MLAPlan.find(input_row_offsets)
    if live is not None and live.batch.block_table is block_table and live.batch.cache_lengths is cache_lengths:
        return live if live.batch.blocks is blocks else live.with_blocks(blocks)  # a with_blocks view's storage
    batch = CacheBatch(blocks, block_table, cache_lengths, input_row_offsets, page_size, cache_format=cache_format,
                       kv_scale=kv_scale, rope_dim=rope_dim or None)
    return plan(batch, scale=1.0, backend=backend, num_partitions=num_partitions or None, buffer_size=buffer_size or None)


def _result_dtypes(backend: str, dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
    """(output dtype, LSE dtype) a backend returns for inputs of ``dtype`` (the oracle: float64)."""
    if backend == "reference":
        return torch.float64, torch.float64
    return dtype, torch.float32


# openmla::write_cache --------------------------------------------------------------------
@torch.library.custom_op("openmla::write_cache", mutates_args=("blocks",))
def _write_cache_op(q: Tensor, kv: Tensor, freqs_cis: Tensor, kv_norm_gamma: Tensor, layer_idx: int, epsilon: float,
                    rope_interleaved: bool, blocks: Tensor, block_table: Tensor, cache_lengths: Tensor,
                    input_row_offsets: Tensor, kv_scale: Optional[Tensor], page_size: int, cache_format: str, rope_dim: int,
                    backend: str) -> Tensor:
    p = _plan_of(blocks, block_table, cache_lengths, input_row_offsets, kv_scale, page_size, cache_format, rope_dim, backend)
    out = write_impl(p, q, kv, freqs_cis, kv_norm_gamma, layer_idx, epsilon, rope_interleaved)
    return out.to(_result_dtypes(backend, q.dtype)[0]).contiguous()


@_write_cache_op.register_fake
def _(q, kv, freqs_cis, kv_norm_gamma, layer_idx, epsilon, rope_interleaved, blocks, block_table, cache_lengths,
      input_row_offsets, kv_scale, page_size, cache_format, rope_dim, backend):
    return q.new_empty(q.shape, dtype=_result_dtypes(backend, q.dtype)[0])


def write_cache(p: MLAPlan, q, kv, freqs_cis, kv_norm_gamma, layer_idx: int, epsilon: float, interleaved: bool) -> Tensor:
    return torch.ops.openmla.write_cache(q, kv, freqs_cis, kv_norm_gamma, layer_idx, epsilon, interleaved, *_cache_args(p))


# openmla::attention (both forms) ---------------------------------------------------------
@torch.library.custom_op("openmla::attention", mutates_args=())
def _attention_op(q: Tensor, w_k: Optional[Tensor], w_uv: Optional[Tensor], form: str, layer_idx: int, kv_lora_rank: int,
                  num_partitions: int, buffer_size: int, scale: float, mask: str, window_size: int, chunk_size: int,
                  sparse_indices: Optional[Tensor], topk_lengths: Optional[Tensor], physical_indices: bool,
                  attn_sink: Optional[Tensor], blocks: Tensor, block_table: Tensor, cache_lengths: Tensor,
                  input_row_offsets: Tensor, kv_scale: Optional[Tensor], page_size: int, cache_format: str, rope_dim: int,
                  backend: str) -> tuple[Tensor, Tensor]:
    p = _plan_of(blocks, block_table, cache_lengths, input_row_offsets, kv_scale, page_size, cache_format, rope_dim, backend,
                 num_partitions=num_partitions, buffer_size=buffer_size)
    spec = _spec_of(scale, mask, window_size, chunk_size, sparse_indices, topk_lengths, physical_indices, attn_sink)
    if form == "decode":
        out, lse = p.backend.decode(p, layer_idx, q, spec, kv_lora_rank)
    else:
        out, lse = p.backend.prefill(p, layer_idx, q, w_k, w_uv, spec)
    out_dtype, lse_dtype = _result_dtypes(backend, q.dtype)
    return out.to(out_dtype).contiguous(), lse.to(lse_dtype).contiguous()


@_attention_op.register_fake
def _(q, w_k, w_uv, form, layer_idx, kv_lora_rank, num_partitions, buffer_size, scale, mask, window_size, chunk_size,
      sparse_indices, topk_lengths, physical_indices, attn_sink, blocks, block_table, cache_lengths, input_row_offsets,
      kv_scale, page_size, cache_format, rope_dim, backend):
    T, H, _ = q.shape
    out_dtype, lse_dtype = _result_dtypes(backend, q.dtype)
    width = kv_lora_rank if form == "decode" else w_uv.shape[1]
    return q.new_empty((T, H, width), dtype=out_dtype), q.new_empty((T, H), dtype=lse_dtype)


def decode(p: MLAPlan, q_abs: Tensor, layer_idx: int, spec: AttentionSpec, kv_lora_rank: int) -> tuple[Tensor, Tensor]:
    return torch.ops.openmla.attention(q_abs, None, None, "decode", layer_idx, kv_lora_rank, p.num_partitions or 0, 0,
                                       *_spec_args(spec), *_cache_args(p))


def prefill(p: MLAPlan, q_rot: Tensor, layer_idx: int, w_k: Tensor, w_uv: Tensor, spec: AttentionSpec) -> tuple[Tensor, Tensor]:
    return torch.ops.openmla.attention(q_rot, w_k, w_uv, "prefill", layer_idx, 0, 0, p.buffer_size or 0, *_spec_args(spec),
                                       *_cache_args(p))
