"""MAX's MLA API, by MAX's names: each function is ``openmla.plan(...)`` and one of the plan's methods.

Modular MAX's MLA kernels are called with loose per-layer arguments and a ``CacheBatch``
(``kv_collection``); these functions keep MAX's names, argument order and results:

| MAX's name | openmla |
|---|---|
| ``mla_prefill_decode_graph`` | ``plan(...).run(...)`` (cache write, q rope, attention in the plan's form) |
| ``mla_write_cache`` | ``plan(...).write_cache(...)`` |
| ``flare_mla_decode`` | ``plan(...).decode(...)`` (absorbed q) |
| ``mla_prefill`` | ``plan(...).prefill(...)`` (up-projected, chunked) |
| ``flare_mla_prefill`` / ``mla_prefill_v2_ragged`` | one prefill chunk of given ``k``, ``v`` (``dispatch.chunk_prefill``) |
| ``mla_prefill_plan`` | the chunk plan as MAX's int32 tensors |
| ``MlaConfigV2`` | the tile configuration of ``mla_prefill_v2_ragged`` |

The plan is kept for the ``CacheBatch`` (``openmla.kept_plans``: sanity checks once per metadata
object): the next call with the same batch and options, as every layer of a step makes, reuses
it after checking that the batch still holds the same storage and metadata (compared by value:
anything changed in place is validated and planned again). A model can also make one plan per
step itself and call ``plan.run`` per layer (see ``openmla.planning``).

Step options (``mask``, ``window_size``, ``chunk_size``, ``sparse_indices``, ``topk_lengths``,
``physical_indices``, ``attn_sink``, ``num_partitions``, ``buffer_size``, ``decode_max_q_len``,
``backend``) are the keyword arguments of ``openmla.plan``, documented there once. These names
stay importable from ``openmla`` itself for existing callers.
"""

from __future__ import annotations

from typing import Literal, overload

import torch
from typing_extensions import Unpack

from .. import dispatch
from ..cache import CacheBatch
from ..chunks import MlaConfigV2, check_chunk, chunk_plan
from ..kept_plans import kept_plan
from ..ops import MaskOptions, StepOptions, check_q_scale, loose_weights
from ..planning import DECODE_MAX_Q_LEN
from ..validate import check_int, check_offsets, check_query, check_tensor, snapshot_batch

__all__ = [
    "DECODE_MAX_Q_LEN", "MlaConfigV2", "flare_mla_decode", "flare_mla_prefill", "mla_prefill", "mla_prefill_decode_graph",
    "mla_prefill_plan", "mla_prefill_v2_ragged", "mla_write_cache",
]


def mla_prefill_plan(
    input_row_offsets: torch.Tensor, kv_collection: CacheBatch, buffer_size: int, max_chunks: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split the keys every sequence sees (cached + new) into chunks of at most ``buffer_size`` rows.

    The batch's keys are laid end to end (sequence 0's positions 0..n0-1, then sequence 1's,
    ...) and cut every ``buffer_size`` rows. For chunk ``c``: ``buffer_row_offsets[c, b]:[c, b+1]``
    are sequence ``b``'s rows in the buffer, starting at key position ``cache_offsets[c, b]``;
    ``buffer_lengths[c]`` is the chunk's row count, -1 past the last chunk. All int32, on
    ``input_row_offsets``' device.
    """
    check_int("buffer_size", buffer_size, 1)
    check_int("max_chunks", max_chunks, 1)
    snap = snapshot_batch(kv_collection)
    if not isinstance(input_row_offsets, torch.Tensor):
        raise ValueError(f"input_row_offsets: expected a torch.Tensor, got {type(input_row_offsets).__name__}")
    offs = check_offsets("input_row_offsets", input_row_offsets, snap.offsets_list[-1], input_row_offsets.device)
    if offs != snap.offsets_list:
        raise ValueError("input_row_offsets: differs from kv_collection.input_row_offsets")
    chunks = chunk_plan(snap.seq_lens_list, buffer_size)
    if chunks.num_chunks > max_chunks:
        raise ValueError(f"max_chunks: {sum(snap.seq_lens_list)} keys need {chunks.num_chunks} chunks of {buffer_size}, "
                         f"more than max_chunks={max_chunks}")
    return chunks.tensors(max_chunks, input_row_offsets.device)


# Cache write -----------------------------------------------------------------------
def mla_write_cache(
    q: torch.Tensor,
    kv: torch.Tensor,
    freqs_cis: torch.Tensor,
    kv_norm_gamma: torch.Tensor,
    kv_collection: CacheBatch,
    layer_idx: int,
    *,
    epsilon: float = 1e-6,
    rope_interleaved: bool = True,
    backend: str | None = None,
) -> torch.Tensor:
    """Write ``kv [T, L+R]`` into the cache (RMSNorm latent, RoPE'd key rope) and return q
    ``[T, H, Dn+R]`` with its last R dims rotated (a new tensor of q's dtype)."""
    step = kept_plan(kv_collection, 1.0, {"backend": backend})  # the scale is not used by a write
    return step.write_cache(q, kv, freqs_cis, kv_norm_gamma, layer_idx, epsilon=epsilon, rope_interleaved=rope_interleaved)


# The fused op ----------------------------------------------------------------------
@overload
def mla_prefill_decode_graph(q: torch.Tensor, kv: torch.Tensor, input_row_offsets: torch.Tensor, freqs_cis: torch.Tensor,
                             kv_norm_gamma: torch.Tensor, kv_collection: CacheBatch, layer_idx: int, w_k: torch.Tensor,
                             w_uk: torch.Tensor, w_uv: torch.Tensor, *, scale: float, epsilon: float = ...,
                             rope_interleaved: bool = ..., q_scale: torch.Tensor | float | None = ...,
                             return_lse: Literal[False] = ..., **options: Unpack[StepOptions]) -> torch.Tensor: ...


@overload
def mla_prefill_decode_graph(q: torch.Tensor, kv: torch.Tensor, input_row_offsets: torch.Tensor, freqs_cis: torch.Tensor,
                             kv_norm_gamma: torch.Tensor, kv_collection: CacheBatch, layer_idx: int, w_k: torch.Tensor,
                             w_uk: torch.Tensor, w_uv: torch.Tensor, *, scale: float, epsilon: float = ...,
                             rope_interleaved: bool = ..., q_scale: torch.Tensor | float | None = ...,
                             return_lse: Literal[True], **options: Unpack[StepOptions]) -> tuple[torch.Tensor, torch.Tensor]: ...


def mla_prefill_decode_graph(q, kv, input_row_offsets, freqs_cis, kv_norm_gamma, kv_collection, layer_idx, w_k, w_uk, w_uv, *,
                             scale, epsilon=1e-6, rope_interleaved=True, q_scale=None, return_lse=False, **options):
    """MLA for one layer of a ragged batch: cache write, q rope, then attention.

    Shapes: ``q [T, H, Dn+R]``, ``kv [T, L+R]`` (``kv_a_proj_with_mqa`` output, before norm and
    rope), ``input_row_offsets [B+1]``, ``freqs_cis [max_seq_len, R]``, ``kv_norm_gamma [L]``,
    ``w_k [H*Dn, L]``, ``w_uk [H, L, Dn]``, ``w_uv [H, Dv, L]``. Returns ``out [T, H, Dv]`` in q's
    dtype (and float32 ``lse [T, H]`` with ``return_lse``). Runs the decode (absorbed) form when
    no sequence has more than ``decode_max_q_len`` new tokens, the prefill form otherwise.
    Nothing is written to the cache when an argument is rejected. A float8_e4m3fn ``q`` (with
    ``q_scale``: scalar or per token) gives bfloat16 output. ``options``: see ``openmla.plan``.
    """
    step = kept_plan(kv_collection, scale, options)
    if not isinstance(input_row_offsets, torch.Tensor):
        raise ValueError(f"input_row_offsets: expected a torch.Tensor, got {type(input_row_offsets).__name__}")
    offs = check_offsets("input_row_offsets", input_row_offsets, step.num_tokens, step.device)
    if offs != step.batch.offsets_list:
        raise ValueError("input_row_offsets: differs from kv_collection.input_row_offsets")
    check_q_scale(q_scale)
    weights = loose_weights(kv_norm_gamma, w_k, w_uk, w_uv, epsilon, rope_interleaved, q, step.head_dim)
    return step.run(q, kv, layer_idx, weights, freqs_cis, q_scale=q_scale, return_lse=return_lse)


# Kernel-level entry points ---------------------------------------------------------
def flare_mla_decode(q: torch.Tensor, kv_collection: CacheBatch, layer_idx: int, *, scale: float, kv_lora_rank: int = 512,
                     q_scale: torch.Tensor | float | None = None, return_lse: bool = False, **options: Unpack[StepOptions]):
    """Absorbed (MQA) attention over the paged latent cache.

    ``q [T, H, L+R]`` is already absorbed (``W_UK^T q_nope``) and roped; the cache already holds
    this call's tokens (positions ``cache_lengths[b] + i``). Returns ``out [T, H, L]`` in q's dtype
    (and float32 ``lse [T, H]``). ``kv_lora_rank`` is L, the value width. A float8_e4m3fn ``q``
    (with ``q_scale``) gives bfloat16 output. ``options``: see ``openmla.plan``.
    """
    step = kept_plan(kv_collection, scale, options)
    check_q_scale(q_scale)
    return step.decode(q, layer_idx, kv_lora_rank=kv_lora_rank, q_scale=q_scale, return_lse=return_lse)


def mla_prefill(q: torch.Tensor, kv_collection: CacheBatch, layer_idx: int, w_k: torch.Tensor, w_uv: torch.Tensor, *,
                scale: float, q_scale: torch.Tensor | float | None = None, return_lse: bool = False,
                **options: Unpack[StepOptions]):
    """Prefill (up-projected) form over the cache: ``q [T, H, Dn+R]`` (roped), keys = every cached
    position the mask shows (this call's tokens already written). K_nope and V are up-projected
    with ``w_k [H*Dn, L]`` and ``w_uv [H, Dv, L]`` in chunks of at most ``buffer_size`` keys.
    Returns ``out [T, H, Dv]`` (and float32 ``lse``); bfloat16 for a float8_e4m3fn ``q``."""
    step = kept_plan(kv_collection, scale, options)
    check_q_scale(q_scale)
    return step.prefill(q, layer_idx, w_k, w_uv, q_scale=q_scale, return_lse=return_lse)


def flare_mla_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, buffer_row_offsets: torch.Tensor,
                      cache_offsets: torch.Tensor, kv_collection: CacheBatch, layer_idx: int, *, scale: float,
                      q_scale: torch.Tensor | float | None = None, return_lse: bool = False,
                      _tile: MlaConfigV2 | None = None, **options: Unpack[MaskOptions]):
    """One prefill chunk with already up-projected keys.

    ``q [T, H, Dn+R]`` (roped); ``k [S, H, Dn]`` and ``v [S, H, Dv]`` hold, in rows
    ``buffer_row_offsets[b]:[b+1]``, sequence ``b``'s keys at positions ``cache_offsets[b] + j``,
    whose rope part is read from the cache. Queries sit at ``cache_lengths[b] + i``. Returns
    ``out [T, H, Dv]`` (and float32 ``lse`` over this chunk's keys, for ``merge_states``); bfloat16
    for a float8_e4m3fn ``q`` (with ``q_scale``). ``options``: ``mask``, ``window_size``,
    ``chunk_size``, ``backend``.
    """
    extra = set(options) - set(MaskOptions.__annotations__)
    if extra:
        raise TypeError(f"flare_mla_prefill() got unexpected keyword arguments {sorted(extra)}")
    step = kept_plan(kv_collection, scale, options)
    check_q_scale(q_scale)
    q, out_dtype = check_query(q, q_scale, step.num_tokens, step.device)
    layer_idx = check_int("layer_idx", layer_idx, 0, step.num_layers)
    if not isinstance(return_lse, bool):
        raise ValueError(f"return_lse: expected a bool, got {return_lse!r}")
    chunk = check_chunk(q, k, v, buffer_row_offsets, cache_offsets, step.batch)
    if _tile is not None and not isinstance(_tile, MlaConfigV2):
        raise ValueError(f"config: expected an MlaConfigV2, got {type(_tile).__name__}")
    out, lse = dispatch.chunk_prefill(step, layer_idx, q, k, v, chunk, _tile)
    out = out.to(device=step.device, dtype=out_dtype)
    return (out, lse.to(device=step.device, dtype=torch.float32)) if return_lse else out


def mla_prefill_v2_ragged(q: torch.Tensor, k_nope: torch.Tensor, v: torch.Tensor, buffer_row_offsets: torch.Tensor,
                          cache_offsets: torch.Tensor, kv_collection: CacheBatch, layer_idx: int, *, scale: float,
                          config: MlaConfigV2, q_scale: torch.Tensor | float | None = None, return_lse: bool = False,
                          **options: Unpack[MaskOptions]):
    """``flare_mla_prefill`` with an explicit tile config (``MlaConfigV2``); same result for any tiles."""
    if not isinstance(config, MlaConfigV2):
        raise ValueError(f"config: expected an MlaConfigV2, got {type(config).__name__}")
    check_tensor("q", q, rank=3)
    if q.shape[1] != config.num_heads or q.shape[2] != config.q_depth:
        raise ValueError(f"config: num_heads={config.num_heads}, q_depth={config.q_depth} but q is {tuple(q.shape)}")
    check_tensor("v", v, rank=3)
    if v.shape[2] != config.depth:
        raise ValueError(f"config: depth={config.depth} but v is {tuple(v.shape)}")
    if q.dtype != config.dtype:
        raise ValueError(f"config: dtype={config.dtype} but q is {q.dtype}")
    out = flare_mla_prefill(q, k_nope, v, buffer_row_offsets, cache_offsets, kv_collection, layer_idx, scale=scale,
                            q_scale=q_scale, return_lse=return_lse, _tile=config, **options)
    if return_lse:
        return out[0].to(config.output_dtype), out[1]
    return out.to(config.output_dtype)
