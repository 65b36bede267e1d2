"""The ``torch`` backend: pure PyTorch tensor ops (the CPU default; runs on any torch device).

- ``cache_write``: RMSNorm + RoPE + paged scatter of a ragged batch, q rope.
- ``decode``: absorbed (MQA) attention over the paged latent cache, split-KV, sparse, sinks.
- ``prefill``: up-projected (MHA) attention, chunked by the plan's chunk plan.

FP8 caches (``fp8_e4m3``, ``fp8_ds_mla``): the cache write quantises through
``CacheBatch.write_rows``; decode dequantises each key block as it gathers it and prefill each
chunk's rows, so extra memory stays bounded by a block or a chunk.
"""

from .cache_write import write_cache
from .decode import decode
from .prefill import flare_mla_prefill, prefill

name = "torch"
cache_formats = ("native", "fp8_e4m3", "fp8_ds_mla")

__all__ = ["name", "cache_formats", "write_cache", "decode", "prefill", "flare_mla_prefill"]
