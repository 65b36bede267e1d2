"""The ``torch`` backend: pure PyTorch tensor ops (the CPU default; runs on any torch device).

- ``cache_write``: RMSNorm + RoPE + paged scatter of a ragged batch, q rope.
- ``decode``: absorbed (MQA) attention over the paged latent cache, split-KV, sparse, sinks.
- ``prefill``: up-projected (MHA) attention, chunked through ``mla_prefill_plan`` buffers.

FP8 caches (``fp8_e4m3``, ``fp8_ds_mla``): the cache write quantises through
``CacheBatch.write_rows``; decode dequantises each key block as it gathers it and prefill each
chunk's rows, so extra memory stays bounded by a block or a chunk.
"""

from .cache_write import write_cache
from .decode import absorb, decode, unabsorb
from .prefill import flare_mla_prefill, prefill

CACHE_FORMATS = ("native", "fp8_e4m3", "fp8_ds_mla")

__all__ = ["CACHE_FORMATS", "write_cache", "absorb", "unabsorb", "decode", "prefill", "flare_mla_prefill"]
