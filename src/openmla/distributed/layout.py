"""Which CP rank holds which token: the interleaved layout of a sequence over a CP group.

Token ``t`` of every sequence lives on CP rank ``(t // interleave) % cp``. Each rank keeps its
tokens in a cache of its own, densely: its ``j``-th token of a sequence (local position ``j``)
is global position ``global_position(j)``. ``count(x)``, the number of global positions below
``x`` a rank holds, maps a global key interval ``[lo, hi)`` to the local interval
``[count(lo), count(hi))`` of exactly the keys the rank holds there, in closed form.

Every function takes Python ints or integer tensors (elementwise).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def _clamp(x, lo: int, hi: int):
    return x.clamp(lo, hi) if isinstance(x, torch.Tensor) else min(max(x, lo), hi)


@dataclass(frozen=True)
class TokenLayout:
    """Rank ``rank`` of ``cp`` ranks, runs of ``interleave`` consecutive tokens per rank."""

    cp: int
    rank: int
    interleave: int

    def __post_init__(self) -> None:
        if not (0 <= self.rank < self.cp) or self.interleave < 1:
            raise ValueError(f"layout: rank {self.rank} of cp {self.cp} with interleave {self.interleave}")

    @property
    def period(self) -> int:
        """Global positions per round over every rank."""
        return self.cp * self.interleave

    def owner(self, pos):
        """CP rank holding global position ``pos``."""
        return (pos // self.interleave) % self.cp

    def count(self, x):
        """Global positions in ``[0, x)`` this rank holds (= the local position of the first one at or past ``x``)."""
        run = self.interleave
        return (x // self.period) * run + _clamp(x % self.period - self.rank * run, 0, run)

    def global_position(self, j):
        """Global position of this rank's local position ``j``."""
        run = self.interleave
        return (j // run) * self.period + self.rank * run + j % run
