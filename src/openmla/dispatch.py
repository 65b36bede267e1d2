"""The one route from a plan to its backend's kernels, for eager and compiled calls alike.

Every kernel call goes through here: the cache write, attention (decode or prefill form), the
decode form's absorption and output projection, one prefill chunk with given keys (MAX's
``flare_mla_prefill``), V4's shared-KV attention, and the write of given entries at given
physical rows of one layer (``write_rows``: an engine that norms and ropes the entries itself,
the vLLM plugin; no plan: the backend is the device's default). Each runs the same function either way:
eagerly it is called directly; under ``torch.compile`` through an ``openmla::`` custom op whose
implementation is that function. The op carries the plan as a ``PlanHandle``, an opaque
reference that ``torch.compile`` makes an input of the graph (never baked in), so a new plan
each step reuses the graph; the tensors a kernel reads that the graph may produce or mutate (q,
kv, weights, the cache storage, sparse lists, sinks) travel as arguments so the graph orders
them. Outputs are in the backend's ``result_dtypes`` (one rule); the plan's public methods then
cast to the caller's dtype.

| op | mutates | returns |
|---|---|---|
| ``openmla::write_cache`` | ``blocks`` (the cache) | q with its rope part rotated |
| ``openmla::write_rows`` | ``layer`` (one layer's storage) | - |
| ``openmla::attention`` (``form="decode"``) | - | ``(out [T, H, L], lse [T, H])`` from absorbed q |
| ``openmla::attention`` (``form="prefill"``) | - | ``(out [T, H, Dv], lse [T, H])`` from roped q, ``w_k``, ``w_uv`` |
| ``openmla::absorb`` | - | ``q_abs [T, H, L+R]`` from roped q and ``w_uk`` |
| ``openmla::unabsorb`` | - | ``[T, H, Dv]`` from the latent output and ``w_uv`` |
| ``openmla::chunk_prefill`` | - | ``(out [T, H, Dv], lse [T, H])`` over one chunk of given ``k``, ``v`` |
| ``openmla::shared_kv_attention`` | - | ``(out [T, H, D], lse [T, H])`` of a V4 plan, in q's dtype and float32 |

Inference only: no autograd formulas are registered.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import TYPE_CHECKING, Optional

import torch
from torch._library.opaque_object import register_opaque_type
from torch._opaque_base import OpaqueBase

if TYPE_CHECKING:
    from .backends.base import PlanView
    from .chunks import ChunkRows, MlaConfigV2
    from .spec import AttentionSpec

Tensor = torch.Tensor


class PlanHandle(OpaqueBase):
    """A weak reference to one plan, for the custom ops (``plan.handle``; it never outlives its plan's use)."""

    def __init__(self, plan: "PlanView") -> None:
        self._plan = weakref.ref(plan)

    @property
    def plan(self):
        plan = self._plan()
        if plan is None:
            raise RuntimeError("openmla: a plan handle was used after its plan was freed; keep the plan alive for the step")
        return plan


register_opaque_type(PlanHandle, typ="reference")


def _as(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t`` in ``dtype``, contiguous (itself when it already is: no dispatcher call on the hot path)."""
    return t if t.dtype == dtype and t.is_contiguous() else t.to(dtype).contiguous()


def _over(plan, blocks: Tensor):
    """The plan over ``blocks``: itself, or a view when the graph hands the op another tensor (a
    functionalised copy of the cache, say), which is the one the op must read and write."""
    return plan if blocks is plan.batch.blocks else plan.with_blocks(blocks)


# The cache write ----------------------------------------------------------------------
def _write(plan, layer_idx: int, q: Tensor, kv: Tensor, freqs_cis: Tensor, gamma: Tensor, epsilon: float,
           interleaved: bool) -> Tensor:
    if plan.max_position > freqs_cis.shape[0]:
        raise ValueError(f"freqs_cis: has {freqs_cis.shape[0]} positions, the batch reaches position {plan.max_position - 1}")
    out = plan.backend.write_cache(plan, layer_idx, q, kv, freqs_cis, gamma, epsilon, interleaved)
    return _as(out, plan.backend.result_dtypes(q.dtype)[0])


@torch.library.custom_op("openmla::write_cache", mutates_args=("blocks",))
def _write_op(q: Tensor, kv: Tensor, freqs_cis: Tensor, kv_norm_gamma: Tensor, blocks: Tensor, plan: PlanHandle,
              layer_idx: int, epsilon: float, rope_interleaved: bool, out_dtype: torch.dtype) -> Tensor:
    return _write(_over(plan.plan, blocks), layer_idx, q, kv, freqs_cis, kv_norm_gamma, epsilon, rope_interleaved)


@_write_op.register_fake
def _(q, kv, freqs_cis, kv_norm_gamma, blocks, plan, layer_idx, epsilon, rope_interleaved, out_dtype):
    return q.new_empty(q.shape, dtype=out_dtype)


def write(plan, layer_idx: int, q: Tensor, kv: Tensor, freqs_cis: Tensor, gamma: Tensor, epsilon: float,
          interleaved: bool) -> Tensor:
    """Store this step's entries of ``layer_idx``; returns q with its rope part rotated."""
    if torch.compiler.is_compiling():
        return torch.ops.openmla.write_cache(q, kv, freqs_cis, gamma, plan.batch.blocks, plan.handle, layer_idx, epsilon,
                                             interleaved, plan.backend.result_dtypes(q.dtype)[0])
    return _write(plan, layer_idx, q, kv, freqs_cis, gamma, epsilon, interleaved)


# Given entries at given rows of one layer (no plan) ----------------------------------------
def _write_rows(layer: Tensor, rows: Tensor, entries: Tensor, scale: Optional[Tensor], cache_format: str,
                kv_lora_rank: int, backend: Optional[str]) -> None:
    from .backends import load_backend, resolve_backend_name
    from .formats import cache_format as format_of

    load_backend(resolve_backend_name(backend, layer.device)).write_rows(format_of(cache_format), layer, rows, entries,
                                                                         kv_lora_rank, scale)


@torch.library.custom_op("openmla::write_rows", mutates_args=("layer",))
def _write_rows_op(layer: Tensor, rows: Tensor, entries: Tensor, scale: Optional[Tensor], cache_format: str,
                   kv_lora_rank: int, backend: Optional[str]) -> None:
    _write_rows(layer, rows, entries, scale, cache_format, kv_lora_rank, backend)


def write_rows(layer: Tensor, rows: Tensor, entries: Tensor, *, cache_format: str, kv_lora_rank: int,
               scale: Tensor | None = None, backend: str | None = None) -> None:
    """Store ``entries [n, L+R]`` (already normed and roped) at physical ``rows`` (int ``[n]``; a
    negative row is skipped: a padding token) of one layer's storage ``layer [num_pages, page_size,
    W]`` in ``cache_format`` (an ``openmla.formats`` name), quantised as the format says, with the
    layer's float32 ``scale`` for a scaled format (fp8_e4m3). Runs on ``backend`` (default: the
    device's, as ``openmla.plan`` picks it): the cpu backend's native kernel where it reads the
    format, else the format object's torch write; the bytes are the same."""
    if torch.compiler.is_compiling():
        return torch.ops.openmla.write_rows(layer, rows, entries, scale, cache_format, kv_lora_rank, backend)
    _write_rows(layer, rows, entries, scale, cache_format, kv_lora_rank, backend)


# Attention ------------------------------------------------------------------------------
def _spec(plan, sparse_indices: Optional[Tensor], topk_lengths: Optional[Tensor], attn_sink: Optional[Tensor]) -> "AttentionSpec":
    """The plan's spec with this call's tensors (the same objects eagerly: nothing is rebuilt)."""
    spec = plan.spec
    if attn_sink is not spec.attn_sink:
        spec = spec.with_sink(attn_sink)
    s = spec.sparse
    if s is not None and (sparse_indices is not s.indices or topk_lengths is not s.topk_lengths):
        spec = dataclasses.replace(spec, sparse=dataclasses.replace(s, indices=sparse_indices, topk_lengths=topk_lengths))
    return spec


def _attention(plan, form: str, layer_idx: int, q: Tensor, kv_lora_rank: int, w_k: Optional[Tensor], w_uv: Optional[Tensor],
               sparse_indices: Optional[Tensor], topk_lengths: Optional[Tensor], attn_sink: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    spec = _spec(plan, sparse_indices, topk_lengths, attn_sink)
    backend = plan.backend
    if form == "decode":
        out, lse = backend.decode(plan, layer_idx, q, spec, kv_lora_rank)
    else:
        out, lse = backend.prefill(plan, layer_idx, q, w_k, w_uv, spec)
    out_dtype, lse_dtype = backend.result_dtypes(q.dtype)
    return _as(out, out_dtype), _as(lse, lse_dtype)


@torch.library.custom_op("openmla::attention", mutates_args=())
def _attention_op(q: Tensor, w_k: Optional[Tensor], w_uv: Optional[Tensor], blocks: Tensor, plan: PlanHandle, form: str,
                  layer_idx: int, kv_lora_rank: int, sparse_indices: Optional[Tensor], topk_lengths: Optional[Tensor],
                  attn_sink: Optional[Tensor], out_dtype: torch.dtype, lse_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    return _attention(_over(plan.plan, blocks), form, layer_idx, q, kv_lora_rank, w_k, w_uv, sparse_indices, topk_lengths,
                      attn_sink)


@_attention_op.register_fake
def _(q, w_k, w_uv, blocks, plan, form, layer_idx, kv_lora_rank, sparse_indices, topk_lengths, attn_sink, out_dtype, lse_dtype):
    T, H, _ = q.shape
    width = kv_lora_rank if form == "decode" else w_uv.shape[1]
    return q.new_empty((T, H, width), dtype=out_dtype), q.new_empty((T, H), dtype=lse_dtype)


def attention(plan, form: str, layer_idx: int, q: Tensor, spec: "AttentionSpec", *, kv_lora_rank: int = 0,
              w_k: Tensor | None = None, w_uv: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The ``decode`` form (absorbed ``q [T, H, L+R]`` -> ``[T, H, L]``) or the dense ``prefill`` form
    (roped ``q [T, H, Dn+R]``, ``w_k``, ``w_uv`` -> ``[T, H, Dv]``), with ``spec`` (the plan's, or
    the plan's with this layer's sink)."""
    sparse = spec.sparse
    args = (None if sparse is None else sparse.indices, None if sparse is None else sparse.topk_lengths, spec.attn_sink)
    if torch.compiler.is_compiling():
        out_dtype, lse_dtype = plan.backend.result_dtypes(q.dtype)
        return torch.ops.openmla.attention(q, w_k, w_uv, plan.batch.blocks, plan.handle, form, layer_idx, kv_lora_rank,
                                           *args, out_dtype, lse_dtype)
    return _attention(plan, form, layer_idx, q, kv_lora_rank, w_k, w_uv, *args)


# Around the decode form: absorption and output projection ------------------------------
def _absorb(plan, q_rot: Tensor, w_uk: Tensor) -> Tensor:
    out = plan.backend.absorb(q_rot, w_uk)
    dtype = plan.backend.result_dtypes(q_rot.dtype)[0]
    return out if out.dtype == dtype else out.to(dtype)


def _unabsorb(plan, out_lat: Tensor, w_uv: Tensor) -> Tensor:
    out = plan.backend.unabsorb(out_lat, w_uv)
    dtype = plan.backend.result_dtypes(out_lat.dtype)[0]
    return out if out.dtype == dtype else out.to(dtype)


@torch.library.custom_op("openmla::absorb", mutates_args=())
def _absorb_op(q_rot: Tensor, w_uk: Tensor, plan: PlanHandle, out_dtype: torch.dtype) -> Tensor:
    return _absorb(plan.plan, q_rot, w_uk).contiguous()


@_absorb_op.register_fake
def _(q_rot, w_uk, plan, out_dtype):
    T, H, qd = q_rot.shape
    return q_rot.new_empty((T, H, w_uk.shape[1] + qd - w_uk.shape[2]), dtype=out_dtype)


@torch.library.custom_op("openmla::unabsorb", mutates_args=())
def _unabsorb_op(out_lat: Tensor, w_uv: Tensor, plan: PlanHandle, out_dtype: torch.dtype) -> Tensor:
    return _unabsorb(plan.plan, out_lat, w_uv).contiguous()


@_unabsorb_op.register_fake
def _(out_lat, w_uv, plan, out_dtype):
    T, H, _ = out_lat.shape
    return out_lat.new_empty((T, H, w_uv.shape[1]), dtype=out_dtype)


def absorb(plan, q_rot: Tensor, w_uk: Tensor) -> Tensor:
    """``q_rot [T, H, Dn+R]``, ``w_uk [H, L, Dn]`` -> ``q_abs [T, H, L+R]`` (the backend's absorption;
    eagerly the backend is called directly: its ``absorb`` returns ``result_dtypes``' output dtype)."""
    if torch.compiler.is_compiling():
        return torch.ops.openmla.absorb(q_rot, w_uk, plan.handle, plan.backend.result_dtypes(q_rot.dtype)[0])
    return plan.backend.absorb(q_rot, w_uk)


def unabsorb(plan, out_lat: Tensor, w_uv: Tensor) -> Tensor:
    """``out_lat [T, H, L]``, ``w_uv [H, Dv, L]`` -> ``[T, H, Dv]`` (the backend's output projection;
    eagerly the backend is called directly, as ``absorb``)."""
    if torch.compiler.is_compiling():
        return torch.ops.openmla.unabsorb(out_lat, w_uv, plan.handle, plan.backend.result_dtypes(out_lat.dtype)[0])
    return plan.backend.unabsorb(out_lat, w_uv)


# One prefill chunk with given keys (MAX's flare_mla_prefill) ------------------------------
class _Tile:
    """The blocking a compiled chunk call passes (what the kernels read of an ``MlaConfigV2``)."""

    def __init__(self, block_m: int, block_n: int) -> None:
        self.block_m, self.block_n = block_m, block_n


def _chunk_prefill(plan, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, chunk: "ChunkRows",
                   tile) -> tuple[Tensor, Tensor]:
    from .backends.base import ChunkPrefillKernels

    backend = plan.backend
    if not isinstance(backend, ChunkPrefillKernels):  # a protocol beside the MLA kernels (openmla.backends.CHUNK_PREFILL)
        raise NotImplementedError(f"the {backend.name} backend does not implement the flare_mla_prefill kernel")
    out, lse = backend.flare_mla_prefill(plan, layer_idx, q, k, v, chunk, plan.spec.with_sink(None), tile)
    out_dtype, lse_dtype = backend.result_dtypes(q.dtype)
    return _as(out, out_dtype), _as(lse, lse_dtype)


@torch.library.custom_op("openmla::chunk_prefill", mutates_args=())
def _chunk_prefill_op(q: Tensor, k: Tensor, v: Tensor, buffer_row_offsets: Tensor, cache_offsets: Tensor, blocks: Tensor,
                      plan: PlanHandle, layer_idx: int, bro: list[int], co: list[int], block_m: Optional[int],
                      block_n: Optional[int], out_dtype: torch.dtype, lse_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    from .chunks import ChunkRows

    chunk = ChunkRows(buffer_row_offsets, cache_offsets, list(bro), list(co))
    tile = None if block_m is None else _Tile(block_m, block_n)
    return _chunk_prefill(_over(plan.plan, blocks), layer_idx, q, k, v, chunk, tile)


@_chunk_prefill_op.register_fake
def _(q, k, v, buffer_row_offsets, cache_offsets, blocks, plan, layer_idx, bro, co, block_m, block_n, out_dtype, lse_dtype):
    T, H, _ = q.shape
    return q.new_empty((T, H, v.shape[2]), dtype=out_dtype), q.new_empty((T, H), dtype=lse_dtype)


def chunk_prefill(plan, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, chunk: "ChunkRows",
                  tile: "MlaConfigV2 | None") -> tuple[Tensor, Tensor]:
    """``q [T, H, Dn+R]`` (roped) over one chunk of up-projected ``k [S, H, Dn]``, ``v [S, H, Dv]``
    (their rope part read from the cache); LSE over this chunk's keys, no sink."""
    if torch.compiler.is_compiling():
        out_dtype, lse_dtype = plan.backend.result_dtypes(q.dtype)
        return torch.ops.openmla.chunk_prefill(q, k, v, chunk.buffer_row_offsets, chunk.cache_offsets, plan.batch.blocks,
                                               plan.handle, layer_idx, chunk.bro, chunk.co,
                                               None if tile is None else tile.block_m, None if tile is None else tile.block_n,
                                               out_dtype, lse_dtype)
    return _chunk_prefill(plan, layer_idx, q, k, v, chunk, tile)


# Shared-KV attention (DeepSeek-V4: openmla.v4.SharedKVPlan) --------------------------------
def _shared_kv(plan, q: Tensor) -> tuple[Tensor, Tensor]:
    out, lse = plan.backend.shared_kv_attention(plan, q)
    return _as(out, q.dtype), _as(lse, torch.float32)


def _shared_kv_over(plan, raw_blocks: Tensor, comp_blocks: Optional[Tensor], indices: Optional[Tensor],
                    attn_sink: Optional[Tensor]):
    """The V4 plan over the op's tensors: itself, or a copy when the graph hands the op others."""
    spec, comp = plan.spec, plan.compressed
    ck = spec.compressed
    same = (raw_blocks is plan.raw.blocks and (comp is None or comp_blocks is comp.blocks) and attn_sink is spec.attn_sink
            and (ck is None or indices is ck.indices))
    if same:
        return plan
    if ck is not None and indices is not ck.indices:
        spec = dataclasses.replace(spec, compressed=dataclasses.replace(ck, indices=indices))
    if attn_sink is not spec.attn_sink:
        spec = dataclasses.replace(spec, attn_sink=attn_sink)
    raw = plan.raw if raw_blocks is plan.raw.blocks else dataclasses.replace(plan.raw, blocks=raw_blocks)
    if comp is not None and comp_blocks is not comp.blocks:
        comp = dataclasses.replace(comp, blocks=comp_blocks)
    return dataclasses.replace(plan, spec=spec, raw=raw, compressed=comp)


@torch.library.custom_op("openmla::shared_kv_attention", mutates_args=())
def _shared_kv_op(q: Tensor, raw_blocks: Tensor, comp_blocks: Optional[Tensor], indices: Optional[Tensor],
                  attn_sink: Optional[Tensor], plan: PlanHandle) -> tuple[Tensor, Tensor]:
    return _shared_kv(_shared_kv_over(plan.plan, raw_blocks, comp_blocks, indices, attn_sink), q)


@_shared_kv_op.register_fake
def _(q, raw_blocks, comp_blocks, indices, attn_sink, plan):
    T, H, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((T, H), dtype=torch.float32)


def shared_kv(plan, q: Tensor) -> tuple[Tensor, Tensor]:
    """A V4 step (``openmla.v4.SharedKVPlan``): ``q [T, H, D]`` -> ``out [T, H, D]`` in q's dtype,
    ``lse [T, H]`` float32."""
    if torch.compiler.is_compiling():
        ck, comp = plan.spec.compressed, plan.compressed
        return torch.ops.openmla.shared_kv_attention(q, plan.raw.blocks, None if comp is None else comp.blocks,
                                                     None if ck is None else ck.indices, plan.spec.attn_sink, plan.handle)
    return _shared_kv(plan, q)
