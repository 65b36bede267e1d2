"""The ops layer: what the public functions share above the plan.

A public function is ``openmla.plan(...)`` followed by one of the plan's methods (see
``openmla.planning``); MAX's names for them live in ``openmla.compat.max``. This module holds
what they share: the step options (the keyword arguments of ``openmla.plan``, documented there
once), loose per-layer weights as one ``LayerWeights``, the host check of a tensor ``q_scale``
the one-off ops afford, and ``merge_states``.
"""

from __future__ import annotations

from typing import TypedDict

import torch

from . import combine
from .masks import MaskVariant
from .planning import DECODE_MAX_Q_LEN
from .validate import FLOAT_DTYPES, check_tensor
from .weights import LayerWeights, explain_mismatch

__all__ = ["DECODE_MAX_Q_LEN", "MaskOptions", "StepOptions", "check_q_scale", "loose_weights", "merge_states"]


class MaskOptions(TypedDict, total=False):
    """The mask of a step (see ``openmla.plan``)."""

    mask: str | MaskVariant
    window_size: int | None
    chunk_size: int | None
    backend: str | None


class StepOptions(MaskOptions, total=False):
    """Every option of ``openmla.plan`` besides ``scale``."""

    sparse_indices: torch.Tensor | None
    topk_lengths: torch.Tensor | None
    physical_indices: bool
    attn_sink: torch.Tensor | None
    num_partitions: int | None
    buffer_size: int | None
    decode_max_q_len: int


# Utilities -------------------------------------------------------------------------
def merge_states(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attentions over disjoint key sets.

    ``o_* [..., D]`` are each part's normalised output, ``lse_* [...]`` its natural-log
    log-sum-exp; a part without keys may be marked -inf (openmla) or +inf (FlashMLA), and its
    output is then ignored (NaN included). Returns ``(o, lse)`` in float32 (float64 for float64
    inputs) as if computed over both key sets; rows empty in both give 0 and -inf.
    """
    check_tensor("o_a", o_a, dtypes=FLOAT_DTYPES)
    if o_a.dim() < 1:
        raise ValueError(f"o_a: expected [..., D], got shape {tuple(o_a.shape)}")
    check_tensor("o_b", o_b, shape=tuple(o_a.shape), dtypes=FLOAT_DTYPES, device=o_a.device)
    check_tensor("lse_a", lse_a, shape=tuple(o_a.shape[:-1]), dtypes=FLOAT_DTYPES, device=o_a.device)
    check_tensor("lse_b", lse_b, shape=tuple(o_a.shape[:-1]), dtypes=FLOAT_DTYPES, device=o_a.device)
    return combine.merge_states(o_a, lse_a, o_b, lse_b)


# Per-layer arguments ---------------------------------------------------------------
def loose_weights(kv_norm_gamma: object, w_k: object, w_uk: object, w_uv: object, epsilon: object,
                  rope_interleaved: object, q: object = None, head_dim: int | None = None) -> LayerWeights:
    """Loose per-layer arguments (MAX's) as one ``LayerWeights``; an error names the loose
    argument (where the weights alone leave it open, ``q`` and the cache's entry width decide)."""
    try:
        return LayerWeights(kv_norm_gamma, w_k, w_uk, w_uv, epsilon, rope_interleaved)
    except ValueError as exc:
        error = exc
    try:
        if isinstance(q, torch.Tensor) and q.dim() == 3 and isinstance(kv_norm_gamma, torch.Tensor) and head_dim is not None:
            explain_mismatch(kv_norm_gamma, w_k, w_uk, w_uv, heads=q.shape[1],
                            nope=q.shape[2] - (head_dim - kv_norm_gamma.shape[-1]))
    except (ValueError, AssertionError) as better:
        if isinstance(better, ValueError):
            error = better
    raise ValueError(str(error).removeprefix("weights.")) from None


def check_q_scale(q_scale: object) -> None:
    """Values of a tensor ``q_scale`` (host read: the one-off ops can afford it, ``plan.run`` does not)."""
    if isinstance(q_scale, torch.Tensor) and q_scale.is_floating_point() and not bool(torch.isfinite(q_scale).all()):
        raise ValueError(f"q_scale: must be finite, got {q_scale!r}")
