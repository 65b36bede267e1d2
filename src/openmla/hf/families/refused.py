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


# R = 0 (layers without rope) is no longer a gap: every backend runs MLA without a rope part (GLM-5-Next,
# ``glm5_next``, runs on it); what stops Mistral Large 4 is the adapter side named in its gap.
_MISTRAL_LARGE4 = Refused("mistral_large4", "layers that reuse an earlier layer's latent instead of writing their own (no "
                          "shared cache layer), a top-k indexer that reads hidden states and learned rope frequencies; its "
                          "layers without rope (R=0) would run on openmla's R = 0 kernels, but no adapter maps them yet")

REFUSED: dict[str, Refused] = {
    "MistralLarge4ForConditionalGeneration": _MISTRAL_LARGE4,
}
