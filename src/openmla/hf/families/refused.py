"""MLA families in transformers that ``attach`` refuses, each with what openmla lacks to run it exactly.

Keyed by the top-level model class; ``attach`` raises ``ValueError`` naming the class, the family
and the gap before the model is changed. Kernel and cache gaps are for the backends to fill;
none of these is approximated. Every MLA family of transformers 5.24 runs now (Mistral Large 4, the
last one listed here, attaches since its layers reading an earlier layer's latent, its hidden-state
indexer and its per-head query scale have adapters): the table is empty until a release adds one.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Refused:
    family: str
    gap: str


REFUSED: dict[str, Refused] = {}
