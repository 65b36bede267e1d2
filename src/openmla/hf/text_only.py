"""A multimodal model attached for its text alone (``Family.text_only``): what is not text is refused.

openmla.hf feeds a model token ids and 1-D positions only. For a model whose rope reads several
position streams (M-RoPE), text tokens get the same position in every stream, and the rope table
openmla reads from the model's rotary module (one position per token) is then exactly the model's
rope. Anything else would not be: image or video features in place of placeholder tokens, and
the positions transformers gives them (streams that differ). So:

- ``check_prompts`` refuses a prompt holding one of the config's media placeholder token ids
  (``image_token_id``, ``video_token_id``): its image would be missing (``generate`` / ``stream``
  call it before anything runs);
- ``TextOnlyGuard`` is a forward pre-hook on the top-level model while it is attached: a forward
  given pixel values or another media input, or position ids whose streams differ, is a
  ``ValueError`` naming it, before anything runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn

from .families.family import Family, TextOnly


def media_token_ids(family: Family, model: nn.Module) -> dict[int, str]:
    """The media placeholder token ids of ``model``'s config: ``{id: attribute name}``."""
    spec = family.text_only
    out: dict[int, str] = {}
    for name in spec.media_tokens if spec is not None else ():
        value = getattr(model.config, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            out[value] = name
    return out


def _check_positions(spec: TextOnly, position_ids: Any, owner: str) -> None:
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 3 or spec.position_streams < 2:
        return
    if position_ids.shape[0] not in (spec.position_streams, spec.position_streams + 1):
        raise ValueError(f"position_ids: {owner} takes [{spec.position_streams}, B, T] position streams, got "
                         f"{tuple(position_ids.shape)}")
    if not bool((position_ids == position_ids[:1]).all()):
        raise ValueError(f"position_ids: its {position_ids.shape[0]} position streams differ (M-RoPE positions of image or "
                         f"video tokens); openmla.hf runs {owner} on text only, where every stream holds the token's position")


@dataclass
class TextOnlyGuard:
    """The forward pre-hook ``attach`` puts on a ``Family.text_only`` model (removed by ``detach``)."""

    spec: TextOnly
    owner: str  # the model class
    handle: Any = None

    @classmethod
    def install(cls, family: Family, model: nn.Module) -> "TextOnlyGuard":
        guard = cls(family.text_only, type(model).__name__)
        guard.handle = model.register_forward_pre_hook(guard, with_kwargs=True)
        return guard

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        given = [name for name in self.spec.media_inputs if kwargs.get(name) is not None]
        if given:
            raise ValueError(f"{given[0]}: {self.owner} is attached to openmla for text only (token ids); media inputs "
                             f"({', '.join(given)}) are refused: detach the model to run images or videos")
        _check_positions(self.spec, kwargs.get("position_ids"), self.owner)

    def remove(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


def check_prompts(prompts: Sequence[Sequence[int]], media: dict[int, str], owner: str) -> None:
    """``ValueError`` naming the first prompt that holds a media placeholder token id."""
    if not media:
        return
    for i, p in enumerate(prompts):
        hits = media.keys() & set(p)
        if hits:
            hit = min(hits)
            raise ValueError(f"prompts[{i}]: holds token {hit} ({media[hit]}), a placeholder for an image or video; "
                             f"openmla.hf runs {owner} on text only and takes no pixel values")
