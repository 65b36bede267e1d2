"""Drop-in interfaces for code written against other MLA kernel libraries, computed by openmla.

- ``openmla.compat.flashmla``: DeepSeek FlashMLA's ``get_mla_metadata``, ``flash_mla_with_kvcache``
  and ``flash_mla_sparse_fwd``;
- ``openmla.compat.flashinfer``: FlashInfer's ``BatchMLAPagedAttentionWrapper``;
- ``openmla.compat.max``: Modular MAX's MLA functions (``mla_prefill_decode_graph``,
  ``flare_mla_decode``, ``flare_mla_prefill``, ``mla_prefill``, ``mla_prefill_v2_ragged``,
  ``mla_prefill_plan``, ``mla_write_cache``) over a ``CacheBatch``.

Each keeps its library's argument names, shapes, defaults and conventions (LSE base and the value
for a query without keys, invalid sparse indices, causal alignment), and runs wherever openmla
runs: CPU tensors on the torch backend, CUDA tensors on the Triton backend.
"""

from . import flashinfer, flashmla, max  # noqa: A004  (the module named after MAX, not the builtin)

__all__ = ["flashmla", "flashinfer", "max"]
