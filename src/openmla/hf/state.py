"""What ``attach`` changed on a model: its ``Attachment``, and the one test of whether a model is attached.

``is_attached`` / ``detach`` (``openmla.hf.attach``) are one pair for every attached model: the MLA
families' ``Attachment`` and DeepSeek-V4's ``V4Attachment`` (``openmla.hf.v4``) alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..cache import PagedLatentCache
from ..config import MLAConfig
from .attention import AttachedAttention
from .families import Family
from .hybrid import HybridLayers
from .rope import RopeTable
from .stats import AttentionClock
from .text_only import TextOnlyGuard, check_prompts
from .v4 import _ATTR as V4_ATTR

ATTR = "_openmla_attachment"


@dataclass
class Attachment:
    """What ``attach`` changed on a model, and the cache its layers share."""

    cache: PagedLatentCache
    config: MLAConfig
    layers: list[AttachedAttention]
    originals: list[nn.Module]
    previous_attn_implementation: str | None
    backend: str | None = None  # the openmla backend asked for (None: automatic per device)
    index_keys: torch.Tensor | None = None  # [indexer layers, pages * page_size, index_head_dim], rows as the cache's
    index_topk: int = 0
    family: Family | None = None
    vocab_size: int = 0
    rope: RopeTable | None = None
    clock: AttentionClock | None = None  # time in the attention layers, while generate/stream record stats
    hybrid: HybridLayers | None = None  # a hybrid model's linear-attention layers and their per-sequence states
    text_only: TextOnlyGuard | None = None  # a multimodal model run on text: refuses media inputs (Family.text_only)
    media_tokens: dict | None = None  # {placeholder token id: config attribute}: refused in prompts
    # Cache storage per latent width (caches[0] is ``cache``, whose page tables serve all), and the plans each
    # step makes: (storage, softmax scale, sliding window or None); a layer runs plan_keys[layer.plan_index]
    caches: list = field(default_factory=list)
    plan_keys: list = field(default_factory=list)

    def check_prompts(self, prompts: list[list[int]]) -> None:
        """``ValueError`` for a prompt the attached model does not run (a media placeholder of a text-only model)."""
        if self.media_tokens:
            check_prompts(prompts, self.media_tokens, self.family.model_classes[0])


def attachment(model: nn.Module) -> Attachment:
    """The ``Attachment`` of an attached model; ``ValueError`` when it is not attached."""
    found = getattr(model, ATTR, None)
    if found is None and getattr(model, V4_ATTR, None) is not None:
        raise ValueError("model: a DeepSeek-V4 model attached to openmla runs through openmla.hf.v4 (generate_v4, "
                         "forward_step_v4), not this API yet (docs/v4.md)")
    if found is None:
        raise ValueError("model: not attached to openmla; call openmla.hf.attach(model, num_pages=...) first")
    return found


def is_attached(model: nn.Module) -> bool:
    """Whether ``model`` is attached to openmla (any family, DeepSeek-V4 included)."""
    return getattr(model, ATTR, None) is not None or getattr(model, V4_ATTR, None) is not None
