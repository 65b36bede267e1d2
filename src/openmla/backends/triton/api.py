"""The ``triton`` backend behind the interface of ``openmla.backends`` (arguments arrive validated).

| primitive | work |
|---|---|
| ``write_cache`` | one kernel launch (``cache_write``) |
| ``absorb`` / ``unabsorb`` | ``torch.bmm`` per head (cuBLAS on GPU) |
| ``decode`` | split-KV kernel + merge kernel (``decode``, ``merge``) |
| ``prefill`` | dense: chunked gather + torch up-projection + flash kernel + merge (``prefill``); |
| | sparse: the absorbed decode path (the same math) |
| ``flare_mla_prefill`` | the flash kernel on given K/V (``prefill``) |

Float64 inputs are computed in float32 (the kernels' accumulation type).

FP8 caches (``CACHE_FORMATS``): the cache-write kernel quantises (fp8_e4m3: one float32 scale
per layer; fp8_ds_mla: DeepSeek-V3.2's 656-byte record), decode and the prefill kernel's rope
read dequantise in registers, and the prefill's latent gather dequantises with
``CacheBatch.read_rows``. Outputs keep the query's dtype (ops gives bfloat16 for a float8 q).
"""

from __future__ import annotations

import torch

from ...cache import CacheBatch
from ...masks import MaskVariant
from . import _common
from .cache_write import write_cache
from .decode import decode_config, decode_into, default_num_splits
from .prefill import flare_mla_prefill
from .prefill import prefill as _dense_prefill

__all__ = ["write_cache", "absorb", "unabsorb", "decode", "prefill", "flare_mla_prefill"]

# Cache formats the kernels read and write (see ``openmla.fp8``): quantised in the cache-write
# kernel, dequantised in registers by decode and prefill.
CACHE_FORMATS = ("native", "fp8_e4m3", "fp8_ds_mla")


def absorb(q_rot: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """``q_rot [T, H, Dn+R]`` -> ``[T, H, L+R]``: ``q_lat[t, h] = W_UK[h]^T q_nope[t, h]``, rope part kept."""
    DN = w_uk.shape[2]
    q_lat = torch.bmm(q_rot[..., :DN].transpose(0, 1), w_uk.to(q_rot.dtype).transpose(1, 2))  # [H, T, L]
    return torch.cat([q_lat.transpose(0, 1), q_rot[..., DN:]], dim=-1)


def unabsorb(out_lat: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """``out_lat [T, H, L]`` -> ``[T, H, Dv]``: ``out[t, h] = W_UV[h] out_lat[t, h]``."""
    w = w_uv.to(out_lat.dtype)
    return torch.bmm(out_lat.transpose(0, 1), w.transpose(1, 2)).transpose(0, 1)


def decode(q_abs: torch.Tensor, batch: CacheBatch, layer_idx: int, *, scale: float, kv_lora_rank: int,
           mask: MaskVariant, sparse_indices, topk_lengths, physical_indices: bool, attn_sink,
           num_partitions: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed attention: ``q_abs [T, H, L+R]`` -> ``out_lat [T, H, L]``, ``lse [T, H]``.

    ``num_partitions=None`` picks the split count from the batch's host lengths.
    """
    _common.check_device(q_abs)
    if num_partitions is None:
        if sparse_indices is not None:
            max_keys = int(sparse_indices.shape[1])
        else:
            max_keys = max(batch.seq_lens_list, default=0)
        key_dtype = _common.batch_views(batch, layer_idx, kv_lora_rank).compute_dtype(q_abs.dtype)
        block_h = decode_config(key_dtype, q_abs.device, q_abs.shape[1], batch.cache_format)["BLOCK_H"]
        num_partitions = default_num_splits(q_abs.shape[0], q_abs.shape[1], max_keys, q_abs.device, block_h)
    layer, _ = _common.cache_layer(batch, layer_idx)
    kv_scale = batch.kv_scale[layer_idx: layer_idx + 1] if batch.cache_format == "fp8_e4m3" else None
    return decode_into(
        q_abs, layer, _common.as_index(batch.block_table), _common.as_index(batch.cache_lengths),
        _common.as_index(batch.input_row_offsets), batch.page_size, scale=scale, kv_lora_rank=kv_lora_rank, mask=mask,
        sparse_indices=None if sparse_indices is None else _common.as_index(sparse_indices),
        topk_lengths=None if topk_lengths is None else _common.as_index(topk_lengths),
        physical_indices=physical_indices, attn_sink=attn_sink, num_splits=num_partitions,
        cache_format=batch.cache_format, kv_scale=kv_scale,
    )


def prefill(q_rot: torch.Tensor, batch: CacheBatch, layer_idx: int, w_k: torch.Tensor, w_uv: torch.Tensor, *,
            scale: float, mask: MaskVariant, sparse_indices, topk_lengths, physical_indices: bool, attn_sink,
            buffer_size: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill form: ``q_rot [T, H, Dn+R]`` -> ``out [T, H, Dv]``, ``lse [T, H]``.

    Sparse prefill attends to at most ``stride`` keys per token, so it runs the absorbed
    decode path (absorb, decode, unabsorb): the same math without up-projecting every key.
    """
    _common.check_device(q_rot)
    if sparse_indices is None:
        return _dense_prefill(q_rot, batch, layer_idx, w_k, w_uv, scale=scale, mask=mask, attn_sink=attn_sink,
                              buffer_size=buffer_size)
    H, L = w_uv.shape[0], w_uv.shape[2]
    w_uk = w_k.reshape(H, -1, L).transpose(1, 2)  # [H, L, Dn] view
    out_lat, lse = decode(absorb(q_rot, w_uk), batch, layer_idx, scale=scale, kv_lora_rank=L, mask=mask,
                          sparse_indices=sparse_indices, topk_lengths=topk_lengths, physical_indices=physical_indices,
                          attn_sink=attn_sink, num_partitions=None)
    return unabsorb(out_lat, w_uv), lse
