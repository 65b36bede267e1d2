"""DeepSeek-V4 attention: shared-KV entries (the value is the whole entry), a sliding window over
raw entries plus a compressed key stream in the same softmax, per-head sinks (docs/v4.md).

- ``spec``: ``EntryLayout``, ``CompressedKeys``, ``SharedKVSpec``, ``PagedEntries``.
- ``plan``: ``plan_shared_kv`` (validate once, choose the backend) and ``shared_kv_attention``.
- ``fp8_v4`` (``openmla.fp8_v4``): FlashMLA's FP8 pages of V4 entries (``MODEL1_FP8Sparse``, 584 bytes
  a token), to exchange a store's pages with FlashMLA: ``pack_pages(store.blocks[layer])`` gives
  its pages under the same block table, ``unpack_pages`` reads them back. The kernels read the
  stores' float entries, not these pages (docs/v4.md says why).
"""

from .. import fp8_v4
from .plan import SharedKVPlan, plan_shared_kv, shared_kv_attention
from ..shared_kv_spec import CompressedKeys, EntryLayout, PagedEntries, SharedKVSpec, physical_rows

__all__ = ["CompressedKeys", "EntryLayout", "PagedEntries", "SharedKVPlan", "SharedKVSpec", "fp8_v4", "physical_rows",
           "plan_shared_kv", "shared_kv_attention"]
