"""The MLA families ``openmla.hf`` runs, one declarative ``Family`` each, and the ones it refuses.

``family_of(model)`` is the allow-list: a model whose class no family lists raises ``ValueError``
(naming the class, and the gap when it is a known MLA family openmla cannot run exactly).
"""

from __future__ import annotations

from typing import Any

from .axk import AXK1, AXK2
from .bailing import BAILING_HYBRID
from .dots3 import DOTS3_NOTE, DOTS3_NOTE_MM
from .deepseek import DEEPSEEK_V2, DEEPSEEK_V3, DEEPSEEK_V32, KIMI_K25
from .family import Family, IndexerSpec, TextOnly
from .glm import GLM4_MOE_LITE, GLM_MOE_DSA
from .glm5_next import GLM5_NEXT
from .hunyuan import HY_V4, HY_V4_VL
from .kimi import KIMI_LINEAR
from .longcat import LONGCAT_FLASH
from .minicpm3 import MINICPM3
from .mistral4 import MISTRAL4
from .mistral_large4 import MISTRAL_LARGE4
from .refused import REFUSED, Refused
from .youtu import YOUTU

FAMILIES: tuple[Family, ...] = (
    DEEPSEEK_V2, DEEPSEEK_V3, KIMI_K25, DEEPSEEK_V32, GLM4_MOE_LITE, MINICPM3, MISTRAL4, YOUTU, AXK1, AXK2, GLM_MOE_DSA,
    HY_V4, HY_V4_VL, LONGCAT_FLASH, BAILING_HYBRID, KIMI_LINEAR, DOTS3_NOTE, DOTS3_NOTE_MM, GLM5_NEXT,
    MISTRAL_LARGE4,
)
_BY_CLASS = {cls: f for f in FAMILIES for cls in f.model_classes}

__all__ = ["FAMILIES", "REFUSED", "Family", "IndexerSpec", "Refused", "TextOnly", "family_of"]


def family_of(model: Any) -> Family:
    """The family of ``model`` (a transformers top-level model), or ``ValueError`` saying why not."""
    name = type(model).__name__
    family = _BY_CLASS.get(name)
    if family is not None:
        return family
    refused = REFUSED.get(name)
    if refused is not None:
        raise ValueError(f"model: {name} ({refused.family}) is not supported by openmla.hf: {refused.gap}")
    supported = ", ".join(sorted(_BY_CLASS))
    raise ValueError(f"model: {name} is not a transformers MLA model openmla.hf runs (supported: {supported})")
