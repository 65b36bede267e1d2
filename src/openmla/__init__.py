"""openmla: Multi-head Latent Attention kernels (DeepSeek-V2/V3/V3.2, Kimi K2) for PyTorch.

Paged latent KV cache, ragged prefill and decode, sparse top-k, attention sinks; native CPU
kernels (the CPU default), a plain PyTorch backend, a Triton backend (CUDA) and a float64 reference.
"""

from .cache import CacheBatch, CacheFullError, PageAllocator, PagedLatentCache
from .config import PRESETS, MLAConfig, YarnScaling, preset
from .layer import LatentAttention
from .masks import MaskKind, MaskVariant
from .ops import (
    DECODE_MAX_Q_LEN,
    MlaConfigV2,
    flare_mla_decode,
    flare_mla_prefill,
    merge_states,
    mla_prefill,
    mla_prefill_decode_graph,
    mla_prefill_plan,
    mla_prefill_v2_ragged,
    mla_write_cache,
)
from .planning import MLAPlan, Step, plan
from .rope import apply_rope, rope_freqs_cis
from .spec import AttentionSpec, SparseSpec
from .weights import LayerWeights

__version__ = "0.1.0"

__all__ = [
    "CacheBatch", "CacheFullError", "PageAllocator", "PagedLatentCache",
    "MLAConfig", "YarnScaling", "PRESETS", "preset",
    "MaskKind", "MaskVariant",
    "DECODE_MAX_Q_LEN", "MlaConfigV2", "flare_mla_decode", "flare_mla_prefill", "merge_states", "mla_prefill",
    "mla_prefill_decode_graph", "mla_prefill_plan", "mla_prefill_v2_ragged", "mla_write_cache",
    "apply_rope", "rope_freqs_cis",
    "plan", "MLAPlan", "Step", "AttentionSpec", "SparseSpec", "LayerWeights", "LatentAttention",
]
