"""The ``torch`` backend: pure PyTorch tensor ops (the CPU default; runs on any torch device).

- ``cache_write``: RMSNorm + RoPE + paged scatter of a ragged batch, q rope.
- ``decode``: absorbed (MQA) attention over the paged latent cache, split-KV, sparse, sinks.
- ``prefill``: up-projected (MHA) attention, chunked through ``mla_prefill_plan`` buffers.
- ``fp8_view``: FP8 caches are read through a bfloat16 copy of the pages a call touches.
"""

from .cache_write import write_cache
from .decode import absorb, unabsorb
from .decode import decode as _decode_native
from .fp8_view import CACHE_FORMATS, dequantised_view
from .prefill import flare_mla_prefill as _flare_native
from .prefill import prefill as _prefill_native

__all__ = ["CACHE_FORMATS", "write_cache", "absorb", "unabsorb", "decode", "prefill", "flare_mla_prefill"]


def decode(q_abs, batch, layer_idx, *, sparse_indices=None, physical_indices=True, **kwargs):
    """See ``decode.decode``; an fp8 cache is read through a dequantised view."""
    if not batch.is_native:
        batch, layer_idx, sparse_indices = dequantised_view(batch, layer_idx, sparse_indices, physical_indices, q_abs.dtype)
    return _decode_native(q_abs, batch, layer_idx, sparse_indices=sparse_indices, physical_indices=physical_indices, **kwargs)


def prefill(q_rot, batch, layer_idx, w_k, w_uv, *, sparse_indices=None, physical_indices=True, **kwargs):
    """See ``prefill.prefill``; an fp8 cache is read through a dequantised view."""
    if not batch.is_native:
        batch, layer_idx, sparse_indices = dequantised_view(batch, layer_idx, sparse_indices, physical_indices, q_rot.dtype)
    return _prefill_native(q_rot, batch, layer_idx, w_k, w_uv, sparse_indices=sparse_indices,
                           physical_indices=physical_indices, **kwargs)


def flare_mla_prefill(q, k, v, buffer_row_offsets, cache_offsets, batch, layer_idx, **kwargs):
    """See ``prefill.flare_mla_prefill``; an fp8 cache's k_rope is read through a dequantised view."""
    if not batch.is_native:
        batch, layer_idx, _ = dequantised_view(batch, layer_idx, None, True, q.dtype)
    return _flare_native(q, k, v, buffer_row_offsets, cache_offsets, batch, layer_idx, **kwargs)
