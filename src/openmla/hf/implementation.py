"""The ``"openmla"`` attention implementation, registered with transformers' ``AttentionInterface``.

An attached model runs with ``attn_implementation="openmla"``: transformers then builds no
attention mask (it has no mask function under that name), and the one function registered
under it is only reached by an attention module that was not attached, which is an error.
"""

from __future__ import annotations

from typing import Any

from torch import nn

ATTN_IMPLEMENTATION = "openmla"


def _not_attached(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """transformers calls this only for an attention module attach did not replace."""
    raise RuntimeError(f"{type(module).__name__}: this model runs with attn_implementation='openmla', but this "
                       "attention module is not attached; call openmla.hf.detach(model) and attach again")


def register() -> None:
    """Register the implementation (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, _not_attached)
