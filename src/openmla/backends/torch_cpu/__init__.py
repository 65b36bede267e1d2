"""The ``torch`` backend: pure PyTorch tensor ops (the CPU default; runs on any torch device).

- ``cache_write``: RMSNorm + RoPE + paged scatter of a ragged batch, q rope.
- ``decode``: absorbed (MQA) attention over the paged latent cache, split-KV, sparse, sinks.
- ``prefill``: up-projected (MHA) attention, chunked through ``mla_prefill_plan`` buffers.
"""

from .cache_write import write_cache
from .decode import absorb, decode, unabsorb
from .prefill import flare_mla_prefill, prefill

__all__ = ["write_cache", "absorb", "unabsorb", "decode", "prefill", "flare_mla_prefill"]
