"""Drop-in interfaces for code written against other MLA kernel libraries, computed by openmla.

- ``openmla.compat.flashmla``: DeepSeek FlashMLA's ``get_mla_metadata``, ``flash_mla_with_kvcache``
  and ``flash_mla_sparse_fwd``;
- ``openmla.compat.flashinfer``: FlashInfer's ``BatchMLAPagedAttentionWrapper``.

Each keeps its library's argument names, shapes, defaults and conventions (LSE base and the value
for a query without keys, invalid sparse indices, causal alignment), and runs wherever openmla
runs: CPU tensors on the torch backend, CUDA tensors on the Triton backend.
"""

from . import flashinfer, flashmla

__all__ = ["flashmla", "flashinfer"]
