"""Mask variants and the one visibility rule every backend uses.

Positions are absolute token positions within one sequence: a query at position
``p`` (``cache_length + i`` for new token ``i``) and a key at position ``k``
(``0 <= k < kv_len``, ``kv_len`` = cached + new tokens of that sequence).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class MaskKind(str, enum.Enum):
    CAUSAL = "causal"
    NULL = "null"
    SLIDING_WINDOW_CAUSAL = "sliding_window_causal"
    SLIDING_WINDOW_NONCAUSAL = "sliding_window_noncausal"
    CHUNKED_CAUSAL = "chunked_causal"


@dataclass(frozen=True)
class MaskVariant:
    """A mask kind with its window (sliding variants) or chunk (chunked) size.

    | kind | key k visible to query p when |
    |---|---|
    | causal | k <= p |
    | null | always (every key of the sequence) |
    | sliding_window_causal | p - W < k <= p |
    | sliding_window_noncausal | k > p - W |
    | chunked_causal | k <= p and k // C == p // C |
    """

    kind: MaskKind = MaskKind.CAUSAL
    window_size: int | None = None
    chunk_size: int | None = None

    @classmethod
    def parse(
        cls, mask: "str | MaskKind | MaskVariant" = "causal", window_size: int | None = None, chunk_size: int | None = None
    ) -> "MaskVariant":
        """Normalise the public ``mask=..., window_size=..., chunk_size=...`` arguments.

        Raises ``ValueError`` naming the argument that is wrong.
        """
        if isinstance(mask, MaskVariant):
            return mask
        if mask == "causal" and window_size is None and chunk_size is None:
            return _CAUSAL  # every step of a decoder: no parsing
        try:
            kind = MaskKind(mask)
        except ValueError:
            raise ValueError(f"mask: unknown variant {mask!r}; choose one of {[k.value for k in MaskKind]}") from None
        sliding = kind in (MaskKind.SLIDING_WINDOW_CAUSAL, MaskKind.SLIDING_WINDOW_NONCAUSAL)
        if sliding:
            if not isinstance(window_size, int) or isinstance(window_size, bool) or window_size < 1:
                raise ValueError(f"window_size: {kind.value} needs a positive int window_size, got {window_size!r}")
        elif window_size is not None:
            raise ValueError(f"window_size: only sliding-window masks take a window_size (mask={kind.value})")
        if kind == MaskKind.CHUNKED_CAUSAL:
            if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
                raise ValueError(f"chunk_size: chunked_causal needs a positive int chunk_size, got {chunk_size!r}")
        elif chunk_size is not None:
            raise ValueError(f"chunk_size: only chunked_causal takes a chunk_size (mask={kind.value})")
        return cls(kind, window_size if sliding else None, chunk_size if kind == MaskKind.CHUNKED_CAUSAL else None)

    @property
    def is_causal(self) -> bool:
        """True when no key past the query's own position is visible."""
        return self.kind not in (MaskKind.NULL, MaskKind.SLIDING_WINDOW_NONCAUSAL)

    def visible(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """Boolean visibility, broadcasting ``q_pos`` against ``k_pos`` (integer tensors).

        Keys are assumed to belong to the query's sequence (``k_pos < kv_len``).
        """
        kind = self.kind
        if kind == MaskKind.NULL:
            return torch.ones(torch.broadcast_shapes(q_pos.shape, k_pos.shape), dtype=torch.bool, device=k_pos.device)
        if kind == MaskKind.SLIDING_WINDOW_NONCAUSAL:
            return k_pos > q_pos - self.window_size
        vis = k_pos <= q_pos
        if kind == MaskKind.SLIDING_WINDOW_CAUSAL:
            vis = vis & (k_pos > q_pos - self.window_size)
        elif kind == MaskKind.CHUNKED_CAUSAL:
            vis = vis & (torch.div(k_pos, self.chunk_size, rounding_mode="floor") == torch.div(q_pos, self.chunk_size, rounding_mode="floor"))
        return vis

    def key_range(self, q_lo: int, q_hi: int, kv_len: int) -> tuple[int, int]:
        """Half-open key range ``[lo, hi)`` that can hold visible keys for queries at positions
        ``q_lo..q_hi`` (inclusive), clipped to ``[0, kv_len)``. Used to skip key blocks. For one
        query (``q_lo == q_hi``) it is exactly the query's visible interval. Ints, or integer
        tensors (elementwise)."""
        kind = self.kind
        lo, hi = 0, kv_len
        if self.is_causal:
            hi = _minimum(kv_len, q_hi + 1)
        if kind in (MaskKind.SLIDING_WINDOW_CAUSAL, MaskKind.SLIDING_WINDOW_NONCAUSAL):
            lo = _maximum(0, q_lo - self.window_size + 1)
        elif kind == MaskKind.CHUNKED_CAUSAL:
            lo = (q_lo // self.chunk_size) * self.chunk_size
        return lo, _maximum(lo, hi)


def _minimum(a, b):
    """``min`` of ints or integer tensors (elementwise)."""
    if isinstance(a, torch.Tensor):
        return torch.minimum(a, b) if isinstance(b, torch.Tensor) else a.clamp_max(b)
    return b.clamp_max(a) if isinstance(b, torch.Tensor) else min(a, b)


def _maximum(a, b):
    """``max`` of ints or integer tensors (elementwise)."""
    if isinstance(a, torch.Tensor):
        return torch.maximum(a, b) if isinstance(b, torch.Tensor) else a.clamp_min(b)
    return b.clamp_min(a) if isinstance(b, torch.Tensor) else max(a, b)


_CAUSAL = MaskVariant()  # the default, shared (frozen)
