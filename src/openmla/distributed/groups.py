"""The ``tp x cp`` grid of process groups, its collectives, and error agreement.

A grid of ``tp * cp`` ranks (all ranks of the default group, or a subset of them) is laid out
with the TP index fastest: grid position ``i = cp_rank * tp + tp_rank``. Ranks with the same
``cp_rank`` form a TP group (they hold different heads of the same tokens); ranks with the
same ``tp_rank`` form a CP group (the same heads, different tokens).

Bounded time, never a hang:

- every group is made with a collective ``timeout``: a rank that stops taking part makes the
  others raise after at most that long (and at once with gloo's "connection closed" error when
  its process exited);
- ``agree`` runs after each rank validated a step's inputs and before any data is exchanged: an
  ``all_reduce`` of one error flag and one fingerprint per rank, so a bad input on one rank makes
  every rank raise the same clear error, and ranks whose schedulers diverged are caught.

A clean exit: when ``init_grid`` starts a gloo default group it also ends it at interpreter exit
(``_end_at_exit``), so a script need not call ``destroy_process_group`` itself.
"""

from __future__ import annotations

import atexit
import datetime
import os
import time
import zlib
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist

from ..cache import CacheFullError

# Longer than any sane step, short enough that a lost rank is reported within minutes.
DEFAULT_TIMEOUT = datetime.timedelta(seconds=120)

# How long the exit hook lets gloo's worker threads take the GIL to drop their last tensors.
_EXIT_GRACE_S = 0.02

# Exception classes a failing rank's error is re-raised as on the other ranks (by name).
_KNOWN_ERRORS = {"ValueError": ValueError, "CacheFullError": CacheFullError}


@dataclass
class CommStats:
    """Bytes this rank sent, counted as the ring algorithms NCCL uses send them: an all-reduce of
    ``n`` bytes over ``p`` ranks sends ``2 (p-1)/p n``, an all-gather of ``n`` bytes per rank
    ``(p-1) n``. Collectives over one rank send nothing and are not made."""

    bytes_sent: int = 0
    collectives: int = 0

    def add(self, nbytes: float) -> None:
        self.bytes_sent += int(round(nbytes))
        self.collectives += 1


@dataclass(eq=False)
class Grid:
    """This rank's place in a ``tp x cp`` grid and the grid's process groups.

    ``ranks``: global ranks of the grid in grid order; ``index``: this rank's position in it;
    ``group``: every rank of the grid (used by ``agree``); ``tp_group`` / ``cp_group``: this
    rank's TP and CP groups (None when that size is 1); ``device``: where collective tensors
    live (``cuda`` for NCCL, ``cpu`` for gloo).
    """

    tp: int
    cp: int
    ranks: tuple[int, ...]
    index: int
    group: object
    tp_group: object | None
    cp_group: object | None
    device: torch.device
    timeout: datetime.timedelta
    stats: CommStats = field(default_factory=CommStats)

    @property
    def rank(self) -> int:
        """Global rank of this process."""
        return self.ranks[self.index]

    @property
    def tp_rank(self) -> int:
        return self.index % self.tp

    @property
    def cp_rank(self) -> int:
        return self.index // self.tp

    @property
    def size(self) -> int:
        return self.tp * self.cp

    def __repr__(self) -> str:
        return f"Grid(tp={self.tp}, cp={self.cp}, rank={self.rank}, tp_rank={self.tp_rank}, cp_rank={self.cp_rank})"

    # Collectives (no-ops over one rank) ------------------------------------------------------
    def tp_all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the TP group, in place; returns ``t``."""
        return self._all_reduce(t, self.tp_group, self.tp)

    def cp_all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the CP group, in place; returns ``t``."""
        return self._all_reduce(t, self.cp_group, self.cp)

    def cp_all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """``[cp, *t.shape]``: every CP rank's ``t``, in CP-rank order."""
        if self.cp == 1:
            return t.unsqueeze(0)
        shape = t.shape
        t = t.contiguous().view(-1)
        out = torch.empty(self.cp * t.numel(), dtype=t.dtype, device=t.device)
        dist.all_gather_single(out, t, group=self.cp_group)
        self.stats.add((self.cp - 1) * t.numel() * t.element_size())
        return out.view(self.cp, *shape)

    def _all_reduce(self, t: torch.Tensor, group: object, p: int) -> torch.Tensor:
        if p == 1:
            return t
        dist.all_reduce(t, group=group)
        self.stats.add(2 * (p - 1) / p * t.numel() * t.element_size())
        return t


def _default_backend() -> str:
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def _end_at_exit() -> None:
    """Destroy the gloo default group and give its worker threads the GIL once more, before finalizing.

    A gloo worker thread drops a finished collective's tensors after the caller has returned, and
    that drop takes the GIL; if the interpreter is already finalizing, the thread is killed inside
    a destructor and the process aborts ("terminate called without an active exception", torch
    issue 190489). Sleeping here releases the GIL while threads may still take it.
    """
    if dist.is_initialized():
        dist.destroy_process_group()
    time.sleep(_EXIT_GRACE_S)


def init_grid(
    tp: int = 1,
    cp: int = 1,
    *,
    ranks: Sequence[int] | None = None,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    backend: str | None = None,
) -> Grid | None:
    """This rank's ``Grid`` of ``tp x cp`` ranks (``None`` on a rank outside ``ranks``).

    Starts the default process group when none is running (``torchrun`` sets its address in the
    environment; ``backend`` defaults to ``nccl`` with CUDA, ``gloo`` otherwise) with the
    collective ``timeout``. ``ranks`` (default: every rank) are the grid's global ranks in grid
    order; a world may hold several grids side by side (data parallelism across grids). A
    collective call: every rank of the default group calls it with the same arguments. Raises
    ``ValueError`` when ``tp * cp`` does not equal the number of ranks.
    """
    for name, value in (("tp", tp), ("cp", cp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")
    if not isinstance(timeout, datetime.timedelta) or timeout.total_seconds() <= 0:
        raise ValueError(f"timeout: expected a positive datetime.timedelta, got {timeout!r}")
    if not dist.is_initialized():
        backend = backend or _default_backend()
        if backend == "nccl" and "LOCAL_RANK" in os.environ:  # one GPU per process, as torchrun numbers them
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(backend, timeout=timeout)
        if backend == "gloo":
            atexit.register(_end_at_exit)
    world = dist.get_world_size()
    ranks = tuple(range(world)) if ranks is None else tuple(int(r) for r in ranks)
    if len(ranks) != tp * cp:
        raise ValueError(f"tp, cp: tp * cp = {tp * cp}, but the grid has {len(ranks)} ranks (world size {world})")
    if len(set(ranks)) != len(ranks) or any(r < 0 or r >= world for r in ranks):
        raise ValueError(f"ranks: expected distinct ranks in [0, {world}), got {list(ranks)}")
    me = dist.get_rank()
    # Every rank of the default group makes every group, in the same order (torch's rule).
    whole = None if ranks == tuple(range(world)) else dist.new_group(list(ranks), timeout=timeout)
    tp_groups = [dist.new_group([ranks[c * tp + t] for t in range(tp)], timeout=timeout) if tp > 1 else None for c in range(cp)]
    cp_groups = [dist.new_group([ranks[c * tp + t] for c in range(cp)], timeout=timeout) if cp > 1 else None for t in range(tp)]
    if me not in ranks:
        return None
    index = ranks.index(me)
    group = dist.group.WORLD if whole is None else whole
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")
    return Grid(tp, cp, ranks, index, group, tp_groups[index // tp], cp_groups[index % tp], device, timeout)


def launched_by_torchrun() -> bool:
    """True in a process started by ``torchrun`` (it sets ``TORCHELASTIC_RUN_ID`` / ``WORLD_SIZE``)."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


# Error agreement ---------------------------------------------------------------------------
def fingerprint(*parts: object) -> int:
    """A stable 31-bit checksum of ``repr(parts)`` (the same on every rank for equal inputs)."""
    return zlib.crc32(repr(parts).encode()) & 0x7FFFFFFF


def agree(grid: Grid, error: BaseException | None, check: int = 0) -> None:
    """Every rank of the grid learns whether any rank failed, before data is exchanged.

    Each rank passes the error its own validation raised (or None) and a ``check`` fingerprint of
    what it is about to do. One ``all_reduce`` over the grid; then, on every rank: if some rank
    failed, its error is raised everywhere (the failing rank re-raises its own exception; the
    others raise the same class, ``ValueError``, ``CacheFullError`` or ``RuntimeError``, with
    the failing rank and its message); else if the fingerprints differ, ``ValueError`` (the
    ranks are not running the same step).
    """
    n = grid.size
    flags = torch.zeros(n, 2, dtype=torch.int64, device=grid.device)
    flags[grid.index, 0] = int(error is not None)
    flags[grid.index, 1] = int(check)
    if n > 1:
        dist.all_reduce(flags, group=grid.group)
        grid.stats.add(2 * (n - 1) / n * flags.numel() * flags.element_size())
    flags = flags.cpu()
    failed = [i for i in range(n) if int(flags[i, 0])]
    if failed:
        mine = None if error is None else (type(error).__name__, str(error))
        reports: list = [None] * n
        if n > 1:
            dist.all_gather_object(reports, mine, group=grid.group)
        if error is not None:
            raise error
        kind, message = reports[failed[0]] or ("RuntimeError", "no message")
        cls = _KNOWN_ERRORS.get(kind, RuntimeError)
        others = f" (ranks {[grid.ranks[i] for i in failed]} failed)" if len(failed) > 1 else ""
        raise cls(f"rank {grid.ranks[failed[0]]} rejected the step{others}: {kind}: {message}")
    checks = flags[:, 1].tolist()
    if len(set(checks)) > 1:
        odd = [grid.ranks[i] for i, c in enumerate(checks) if c != checks[0]]
        raise ValueError(f"step: ranks {odd} differ from rank {grid.ranks[0]} in the step they run (different seq_ids, "
                         "counts or options): every rank of a grid must make the same scheduling calls")
