"""The ``torch`` backend: plain PyTorch tensor ops (runs on any torch device, never syncs with it:
no call reads a tensor value on the host; tests/test_torch_sync_free.py holds it to that).

- ``cache_write``: RMSNorm + RoPE + paged scatter of a ragged batch, q rope.
- ``decode``: absorbed (MQA) attention over the paged latent cache, split-KV, sparse, sinks;
  its ``OnlineSoftmax`` (flash-style running max, sum and output in float32) serves both forms.
- ``prefill``: up-projected (MHA) attention, chunked by the plan's chunk plan.
- ``shared_kv``: DeepSeek-V4 attention (entry = key = value, sliding window + compressed keys, sinks).

FP8 caches (``fp8_e4m3``, ``fp8_ds_mla``): the cache write quantises through
``CacheBatch.write_rows``; decode dequantises each key block as it gathers it and prefill each
chunk's rows, so extra memory stays bounded by a block or a chunk.
"""

from ..base import ALL_FORMATS, Backend
from .cache_write import write_cache
from .decode import decode
from .prefill import flare_mla_prefill, prefill
from .shared_kv import shared_kv_attention


class TorchBackend(Backend):
    name = "torch"
    cache_formats = ALL_FORMATS  # every format: it reads and writes the cache through CacheBatch, which (de)quantises

    def write_cache(self, plan, layer_idx, q, kv, freqs_cis, kv_norm_gamma, epsilon, interleaved):
        return write_cache(plan, layer_idx, q, kv, freqs_cis, kv_norm_gamma, epsilon, interleaved)

    def decode(self, plan, layer_idx, q_abs, spec, kv_lora_rank):
        return decode(plan, layer_idx, q_abs, spec, kv_lora_rank)

    def prefill(self, plan, layer_idx, q_rot, w_k, w_uv, spec):
        return prefill(plan, layer_idx, q_rot, w_k, w_uv, spec)

    def flare_mla_prefill(self, plan, layer_idx, q, k, v, chunk, spec, tile=None):
        return flare_mla_prefill(plan, layer_idx, q, k, v, chunk, spec, tile)

    def supports_shared_kv(self, plan):
        return True

    def shared_kv_attention(self, plan, q):
        return shared_kv_attention(plan, q)


__all__ = ["TorchBackend"]
