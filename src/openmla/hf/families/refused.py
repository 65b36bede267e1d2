"""MLA families in transformers that ``attach`` refuses, each with what openmla lacks to run it exactly.

Keyed by the top-level model class; ``attach`` raises ``ValueError`` naming the class, the family
and the gap before the model is changed. Kernel and cache gaps are for the backends to fill;
none of these is approximated.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Refused:
    family: str
    gap: str


_MISTRAL_LARGE4 = Refused("mistral_large4", "layers without rope (R=0 keys: no kernel form), layers that reuse an earlier "
                          "layer's latent instead of writing their own (no shared cache layer), a top-k indexer that "
                          "reads hidden states and learned rope frequencies")
_GLM5_NEXT = Refused("glm5_next", "MLA layers with R=0 (qk_rope_head_dim 0: openmla's kernels need a rope part) and a "
                     "top-k indexer over pooled key groups (index_kpool keys pooled by a softmax gate, the picked pools "
                     "expanded to their tokens plus the open tail pool), which openmla's indexer does not have; its "
                     "linear-attention (KDA) layers would run per sequence (openmla.hf.hybrid)")

REFUSED: dict[str, Refused] = {
    "MistralLarge4ForConditionalGeneration": _MISTRAL_LARGE4,
    "Glm5NextForConditionalGeneration": _GLM5_NEXT,
}
