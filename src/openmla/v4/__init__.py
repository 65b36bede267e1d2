"""DeepSeek-V4 attention: shared-KV entries (the value is the whole entry), a sliding window over
raw entries plus a compressed key stream in the same softmax, per-head sinks (docs/v4.md).

- ``spec``: ``EntryLayout``, ``CompressedKeys``, ``SharedKVSpec``, ``PagedEntries``.
- ``plan``: ``plan_shared_kv`` (validate once, choose the backend) and ``shared_kv_attention``.
"""

from .plan import SharedKVPlan, plan_shared_kv, shared_kv_attention
from ..shared_kv_spec import CompressedKeys, EntryLayout, PagedEntries, SharedKVSpec, physical_rows

__all__ = ["CompressedKeys", "EntryLayout", "PagedEntries", "SharedKVPlan", "SharedKVSpec", "physical_rows",
           "plan_shared_kv", "shared_kv_attention"]
