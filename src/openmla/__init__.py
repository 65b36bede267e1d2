"""openmla: Multi-head Latent Attention kernels (DeepSeek-V2/V3/V3.2, Kimi K2) for PyTorch.

Paged latent KV cache, ragged prefill and decode, sparse top-k, attention sinks; native CPU
kernels (the CPU default), a plain PyTorch backend, a Triton backend (CUDA) and a float64 reference.

The top level is the plan API: the cache (``PagedLatentCache``, ``CacheBatch``), ``plan`` ->
``MLAPlan`` (``run`` per layer), ``LayerWeights``, the specs (``AttentionSpec``, ``SparseSpec``,
masks), the layer (``LatentAttention``), configs and rope. Other libraries' names live in
``openmla.compat``: ``compat.max`` (Modular MAX's ``mla_prefill_decode_graph``, ``flare_mla_*``,
...), ``compat.flashmla``, ``compat.flashinfer``. MAX's names also resolve here, on first use,
for existing callers (``openmla.mla_prefill_decode_graph`` is ``openmla.compat.max``'s).
"""

from .cache import CacheBatch, CacheFullError, PageAllocator, PagedLatentCache
from .config import PRESETS, MLAConfig, YarnScaling, preset
from .layer import LatentAttention
from .masks import MaskKind, MaskVariant
from .ops import merge_states
from .planning import DECODE_MAX_Q_LEN, MLAPlan, Step, plan
from .rope import apply_rope, rope_freqs_cis
from .spec import AttentionSpec, SparseSpec
from .weights import LayerWeights

__version__ = "0.1.0"

__all__ = [
    "CacheBatch", "CacheFullError", "PageAllocator", "PagedLatentCache",
    "MLAConfig", "YarnScaling", "PRESETS", "preset",
    "MaskKind", "MaskVariant",
    "DECODE_MAX_Q_LEN", "merge_states",
    "apply_rope", "rope_freqs_cis",
    "plan", "MLAPlan", "Step", "AttentionSpec", "SparseSpec", "LayerWeights", "LatentAttention",
]

# MAX's names (openmla.compat.max), resolved on first use for callers of the top-level names.
_MAX_NAMES = frozenset({"MlaConfigV2", "flare_mla_decode", "flare_mla_prefill", "mla_prefill", "mla_prefill_decode_graph",
                        "mla_prefill_plan", "mla_prefill_v2_ragged", "mla_write_cache"})


def __getattr__(name: str):
    if name in _MAX_NAMES:
        from .compat import max as max_api

        return getattr(max_api, name)
    raise AttributeError(f"module 'openmla' has no attribute {name!r}")
