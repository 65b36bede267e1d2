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


RUN_HINT = "run it through openmla.hf.generate (or openmla.hf.forward_step), or call openmla.hf.detach(model) first"


def packed_step(hidden_states: Any, kwargs: dict, key: str, kind: type | None = None, hint: str = RUN_HINT) -> Any:
    """What an attached layer gets from transformers: the step context under ``kwargs[key]`` (an
    instance of ``kind``; any value but None when ``kind`` is None), returned, and ``hidden_states``
    checked to be one packed step ``[1, T, hidden]``; a ``ValueError`` naming the argument otherwise."""
    step = kwargs.get(key)
    if step is None or (kind is not None and not isinstance(step, kind)):
        raise ValueError(f"{key}: this model is attached to openmla; {hint}")
    if hidden_states.dim() != 3 or hidden_states.shape[0] != 1:
        raise ValueError(f"hidden_states: expected one packed step [1, T, hidden], got {tuple(hidden_states.shape)}")
    return step
