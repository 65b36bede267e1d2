"""The ``triton`` backend: ``TritonBackend`` (a validated plan comes in).

| primitive | work |
|---|---|
| ``write_cache`` | one kernel launch (``cache_write``) |
| ``decode`` | split-KV kernel + merge kernel (``decode``, ``merge``) |
| ``prefill`` | dense: per chunk of the plan, gather + torch up-projection + flash kernel + merge |
| ``flare_mla_prefill`` | the flash kernel on given K/V (``prefill``) |
| ``shared_kv_attention`` | DeepSeek-V4: split-KV kernel over window + compressed entries + merge with the sink (``shared_kv``) |

Absorption and the output projection are ``openmla.combine``'s ``torch.bmm`` (cuBLAS on GPU);
sparse prefill reaches ``decode`` through the plan (the absorbed form, the same math).

Float64 inputs are computed in float32 (the kernels' accumulation type); a float64 DeepSeek-V4
step is declined (``supports_shared_kv``: ``ValueError``, no fallback), never computed in float32.

FP8 caches (``cache_formats``): the cache-write kernel quantises (fp8_e4m3: one float32 scale
per layer; fp8_ds_mla: DeepSeek-V3.2's 656-byte record), decode and the prefill kernel's rope
read dequantise in registers, and the prefill's latent gather dequantises with
``CacheBatch.read_rows``. Outputs keep the query's dtype (ops gives bfloat16 for a float8 q).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..base import FP8_FORMATS, Backend
from . import _common
from .cache_write import write_cache as _write_cache
from .decode import decode_config, decode_into, default_num_splits
from .prefill import default_buffer_size
from .prefill import flare_mla_prefill as _flare_mla_prefill
from .prefill import prefill as _dense_prefill
from .shared_kv import shared_kv_into

if TYPE_CHECKING:
    from ..base import PlanView


class TritonBackend(Backend):
    name = "triton"
    cache_formats = FP8_FORMATS  # what its kernels read; NVFP4 records are declined (no fallback: plan() raises)

    def supports(self, plan: "PlanView"):
        if plan.device.type == "cpu" and not _common.INTERPRET:
            return "it runs on CUDA tensors, or on CPU tensors with TRITON_INTERPRET=1 set before triton is first imported"
        return super().supports(plan)

    def write_cache(self, plan, layer_idx, q, kv, freqs_cis, kv_norm_gamma, epsilon, interleaved):
        """One kernel launch: RMSNorm + RoPE + paged scatter of the new tokens, and q's RoPE."""
        return _write_cache(q, kv, freqs_cis, kv_norm_gamma, plan.batch, layer_idx, epsilon, interleaved)

    def decode(self, plan, layer_idx, q_abs, spec, kv_lora_rank):
        """Absorbed attention: ``q_abs [T, H, L+R]`` -> ``out_lat [T, H, L]``, ``lse [T, H]``.

        ``plan.num_partitions=None`` picks the split count from the plan's host lengths.
        """
        _common.check_device(q_abs)
        batch, sparse = plan.batch, spec.sparse
        num_partitions = plan.num_partitions
        if num_partitions is None:
            max_keys = sparse.stride if sparse is not None else plan.max_position
            key_dtype = _common.batch_views(batch, layer_idx, kv_lora_rank).compute_dtype(q_abs.dtype)
            block_h = decode_config(key_dtype, q_abs.device, q_abs.shape[1], batch.cache_format)["BLOCK_H"]
            num_partitions = default_num_splits(q_abs.shape[0], q_abs.shape[1], max_keys, q_abs.device, block_h)
        layer, _ = _common.cache_layer(batch, layer_idx)
        kv_scale = batch.kv_scale[layer_idx: layer_idx + 1] if batch.cache_format == "fp8_e4m3" else None
        return decode_into(
            q_abs, layer, batch.block_table, batch.cache_lengths, batch.input_row_offsets, batch.page_size, scale=spec.scale,
            kv_lora_rank=kv_lora_rank, mask=spec.mask,
            sparse_indices=None if sparse is None else sparse.indices,
            topk_lengths=None if sparse is None else sparse.topk_lengths,
            physical_indices=True if sparse is None else sparse.physical, attn_sink=spec.attn_sink, num_splits=num_partitions,
            cache_format=batch.cache_format, kv_scale=kv_scale,
        )

    def prefill(self, plan, layer_idx, q_rot, w_k, w_uv, spec):
        """Dense prefill form: ``q_rot [T, H, Dn+R]`` -> ``out [T, H, Dv]``, ``lse [T, H]``."""
        H = q_rot.shape[1]
        buffer_size = plan.buffer_size or default_buffer_size(H, w_k.shape[0] // H, w_uv.shape[1], q_rot.dtype)
        return _dense_prefill(q_rot, plan.batch, layer_idx, w_k, w_uv, scale=spec.scale, mask=spec.mask,
                              attn_sink=spec.attn_sink, chunks=plan.chunks(buffer_size))

    def flare_mla_prefill(self, plan, layer_idx, q, k, v, chunk, spec, tile=None):
        """The flash kernel on one chunk of given K/V."""
        return _flare_mla_prefill(q, k, v, chunk.buffer_row_offsets, chunk.cache_offsets, plan.batch, layer_idx,
                                  scale=spec.scale, mask=spec.mask, tile=tile)

    def supports_shared_kv(self, plan):
        if plan.device.type == "cpu" and not _common.INTERPRET:
            return "it runs on CUDA tensors, or on CPU tensors with TRITON_INTERPRET=1 set before triton is first imported"
        if plan.raw.blocks.dtype == torch.float64:  # never float64 computed in float32 (docs/v4.md)
            return "q and raw.blocks are float64 and its V4 kernel computes in float32; plan with backend='torch' or 'reference'"
        return True

    def shared_kv_attention(self, plan, q):
        """DeepSeek-V4 attention (``openmla.v4.SharedKVPlan``): ``q [T, H, D]`` -> ``out``, ``lse``."""
        _common.check_device(q)
        return shared_kv_into(q, plan)
