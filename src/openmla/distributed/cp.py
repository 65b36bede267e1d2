"""Context parallelism: a latent cache whose tokens are spread over the CP ranks of a grid.

Token ``t`` of every sequence lives on CP rank ``(t // interleave) % cp`` (``TokenLayout``).
Each rank owns a ``PagedLatentCache`` of only its own tokens, so per-rank cache memory is about
1/cp of the whole; ``ContextParallelCache`` wraps it and keeps the global view (every
sequence's global length) the same on every rank. Every rank runs the same scheduler: the
same ``prepare`` / ``commit`` / ``release`` calls, in the same order.

    cache = ContextParallelCache(grid, num_layers, num_pages)      # num_pages per rank
    batch = cache.prepare(ids, new_counts)     # reserves pages for this rank's new tokens only
    step = distributed.plan(batch, scale=cfg.softmax_scale)  # once per step (cp_plan)
    y = layer(hidden, step)                    # every layer; hidden is the same on every rank
    cache.commit(batch)

``prepare`` (and ``cp_plan.plan``) end with ``agree``: a bad input or a full page pool on any rank raises
the same error on every rank, with nothing reserved anywhere.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Hashable, Sequence

import torch

from ..cache import CacheBatch, CacheFullError, PagedLatentCache
from .groups import Grid, agree, fingerprint
from .layout import TokenLayout



@dataclass(eq=False)
class ContextParallelBatch:
    """One step over a context-parallel cache: the global ragged batch and this rank's share.

    ``cache_lengths`` / ``new_tokens``: global tokens per sequence before the step and new in it
    (the query rows are all ``sum(new_tokens)`` new tokens, sequence by sequence, on every
    rank); ``local``: the ``CacheBatch`` of this rank's own cache (its tokens only, at local
    positions).
    """

    cache: "ContextParallelCache"
    seq_ids: tuple
    cache_lengths: list[int]
    new_tokens: list[int]
    local: CacheBatch

    @property
    def batch_size(self) -> int:
        return len(self.seq_ids)

    @property
    def num_tokens(self) -> int:
        return sum(self.new_tokens)

    @property
    def seq_lens(self) -> list[int]:
        """Global keys per sequence once the step is written."""
        return [c + n for c, n in zip(self.cache_lengths, self.new_tokens)]

    @property
    def blocks(self) -> torch.Tensor:
        """This rank's cache storage."""
        return self.local.blocks

    def with_blocks(self, blocks: torch.Tensor) -> "ContextParallelBatch":
        """The same step over other local storage of the same shape (a copy of the cache, say)."""
        return dataclasses.replace(self, local=self.local.with_blocks(blocks))


class ContextParallelCache:
    """This rank's part of a latent cache spread over the CP group of ``grid``.

    ``num_pages`` (and so the memory) is per rank; the other arguments are
    ``PagedLatentCache``'s. ``interleave``: tokens per run on one rank, 1 or a multiple of
    ``page_size`` (default ``page_size``), so that every local page holds one run of consecutive
    global positions (or a fixed stride of them): the layout a kernel that reads key positions
    from a page map needs. With ``cp == 1`` this is a ``PagedLatentCache`` whose ``prepare`` and
    ``plan`` agree over the grid (tensor parallelism alone).
    """

    def __init__(
        self,
        grid: Grid,
        num_layers: int,
        num_pages: int,
        page_size: int = 64,
        head_dim: int = 576,
        dtype: torch.dtype | str = torch.bfloat16,
        device: torch.device | str = "cpu",
        *,
        rope_dim: int = 64,
        kv_scale: float = 1.0,
        interleave: int | None = None,
    ) -> None:
        if not isinstance(grid, Grid):
            raise ValueError(f"grid: expected a Grid (openmla.distributed.init_grid), got {type(grid).__name__}")
        self.local = PagedLatentCache(num_layers, num_pages, page_size, head_dim, dtype, device, rope_dim=rope_dim, kv_scale=kv_scale)
        interleave = page_size if interleave is None else interleave
        if isinstance(interleave, bool) or not isinstance(interleave, int) or interleave < 1 or (interleave > 1 and interleave % page_size):
            raise ValueError(f"interleave: expected 1 or a positive multiple of page_size {page_size}, got {interleave!r}")
        self.grid = grid
        self.layout = TokenLayout(grid.cp, grid.cp_rank, interleave)
        self._lengths: dict[Hashable, int] = {}
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None  # (global table, this rank's table)

    # Queries (local ones describe this rank's storage) -------------------------------------------
    @property
    def interleave(self) -> int:
        return self.layout.interleave

    @property
    def page_size(self) -> int:
        return self.local.page_size

    @property
    def num_layers(self) -> int:
        return self.local.num_layers

    @property
    def num_pages(self) -> int:
        return self.local.num_pages

    @property
    def num_free_pages(self) -> int:
        return self.local.num_free_pages

    @property
    def pages_in_use(self) -> int:
        return self.local.pages_in_use

    @property
    def bytes_per_token(self) -> int:
        return self.local.bytes_per_token

    @property
    def cache_format(self) -> str:
        return self.local.cache_format

    @property
    def blocks(self) -> torch.Tensor:
        return self.local.blocks

    @property
    def storage_bytes(self) -> int:
        """Bytes of this rank's page pool."""
        return self.local.blocks.numel() * self.local.blocks.element_size()

    @property
    def sequences(self) -> list[Hashable]:
        return list(self._lengths)

    def length(self, seq_id: Hashable) -> int:
        """Committed tokens of ``seq_id`` over all ranks (0 for an unknown id)."""
        return self._lengths.get(seq_id, 0)

    def local_length(self, seq_id: Hashable) -> int:
        """Committed tokens of ``seq_id`` held by this rank."""
        return self.local.length(seq_id)

    # Lifecycle -------------------------------------------------------------------------------------
    def prepare(self, seq_ids: Sequence[Hashable], num_new_tokens: Sequence[int]) -> ContextParallelBatch:
        """Reserve, on this rank, pages for the new tokens it will hold; every rank calls it with
        the same arguments. Raises on every rank, with nothing reserved anywhere, when any rank
        finds a bad argument (``ValueError``) or too few free pages (``CacheFullError``).
        Sequence ids must repr the same on every rank (ints, strings, tuples of them)."""
        error, check = None, 0
        try:
            seq_ids, counts, local_counts = self._validate(seq_ids, num_new_tokens)
            check = fingerprint("prepare", seq_ids, counts)
        except Exception as exc:  # every rank must hear of it: raised below by agree
            error = exc
        agree(self.grid, error, check)
        before = [self._lengths.get(s, 0) for s in seq_ids]
        local = self.local.prepare(seq_ids, local_counts)  # cannot fail: checked above
        for s in seq_ids:
            self._lengths.setdefault(s, 0)
        return ContextParallelBatch(self, tuple(seq_ids), before, counts, local)

    def _validate(self, seq_ids: Sequence[Hashable], num_new_tokens: Sequence[int]) -> tuple[list, list[int], list[int]]:
        seq_ids = list(seq_ids)
        counts = list(num_new_tokens)
        if len(seq_ids) != len(counts):
            raise ValueError(f"num_new_tokens: {len(counts)} counts for {len(seq_ids)} seq_ids")
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError("seq_ids: an id appears twice in one batch")
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in counts):
            raise ValueError(f"num_new_tokens: counts must be ints >= 0, got {counts}")
        lay, ps = self.layout, self.page_size
        local_counts, need = [], 0
        for s, n in zip(seq_ids, counts):
            c = self._lengths.get(s, 0)
            k = lay.count(c + n) - lay.count(c)
            local_counts.append(k)
            need += max(0, math.ceil((self.local.length(s) + k) / ps) - len(self.local.pages(s)))
        if need > self.local.num_free_pages:
            raise CacheFullError(f"rank {self.grid.rank} (cp rank {self.grid.cp_rank}) needs {need} free pages, "
                                 f"{self.local.num_free_pages} of {self.num_pages} are free")
        return seq_ids, counts, local_counts

    def commit(self, batch: ContextParallelBatch) -> None:
        """Advance every sequence of ``batch`` by its new tokens (after every layer ran)."""
        if not isinstance(batch, ContextParallelBatch) or batch.cache is not self:
            raise ValueError("batch: not a step of this cache")
        for s, c in zip(batch.seq_ids, batch.cache_lengths):
            if s not in self._lengths:
                raise ValueError(f"batch: sequence {s!r} was released before commit")
            if self._lengths[s] != c:
                raise ValueError(f"batch: sequence {s!r} has length {self._lengths[s]}, the batch expected {c} (committed twice?)")
        self.local.commit(batch.local)
        for s, c, n in zip(batch.seq_ids, batch.cache_lengths, batch.new_tokens):
            self._lengths[s] = c + n

    def release(self, seq_id: Hashable) -> None:
        """Free this rank's pages of ``seq_id`` and forget it."""
        self.local.release(seq_id)
        del self._lengths[seq_id]

    def local_freqs(self, freqs_cis: torch.Tensor) -> torch.Tensor:
        """This rank's rope table: row ``j`` holds ``freqs_cis``'s row of the global position of
        local position ``j`` (so the cache write rotates keys at their global positions). Made
        once per global table and kept while that table is in use."""
        if self._rope is None or self._rope[0] is not freqs_cis:
            n = self.layout.count(freqs_cis.shape[0])
            rows = self.layout.global_position(torch.arange(n, device=freqs_cis.device))
            self._rope = (freqs_cis, freqs_cis.index_select(0, rows))
        return self._rope[1]
