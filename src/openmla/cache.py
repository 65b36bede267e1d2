"""Paged latent KV cache: storage, page allocator and the per-call batch view.

One cache entry per token and layer holds ``L + R`` values: the RMS-normalised
latent then the RoPE'd key rope part. Storage is ``blocks[num_layers, num_pages,
page_size, L+R]``; all layers share one page allocator, so logical page ``j`` of a
sequence is the same physical page in every layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Hashable, Sequence

import torch


class CacheFullError(RuntimeError):
    """The page pool cannot hold the requested tokens. Nothing was changed."""


class PageAllocator:
    """A free list of physical page ids ``0 .. num_pages-1``."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        # A stack popping the lowest ids first keeps small runs compact and easy to read.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` pages; raises ``CacheFullError`` (and takes none) if fewer are free."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        if n > len(self._free):
            raise CacheFullError(f"need {n} free pages, {len(self._free)} of {self.num_pages} are free")
        if n == 0:
            return []
        pages = self._free[-n:][::-1]
        del self._free[-n:]
        return pages

    def free(self, pages: Sequence[int]) -> None:
        self._free.extend(sorted(pages, reverse=True))


@dataclass
class CacheBatch:
    """The view of the cache one forward call works on (the seeds' ``kv_collection``).

    - ``blocks``: ``[num_layers, num_pages, page_size, L+R]`` storage (shared, written in place).
    - ``block_table``: int32 ``[B, max_pages]``; entry ``[b, j]`` is the physical page of logical
      page ``j`` of sequence ``b``. Entries past a sequence's last page are 0 and never read.
    - ``cache_lengths``: int32 ``[B]``, tokens already cached before this call.
    - ``input_row_offsets``: int32 ``[B+1]``, rows of the ragged query batch per sequence.
    """

    blocks: torch.Tensor
    block_table: torch.Tensor
    cache_lengths: torch.Tensor
    input_row_offsets: torch.Tensor
    page_size: int
    seq_ids: tuple = ()
    _host: dict = field(default_factory=dict, repr=False, compare=False)

    # Host-side copies, computed once: planning code must not sync per sequence.
    @property
    def cache_lengths_list(self) -> list[int]:
        if "cache" not in self._host:
            self._host["cache"] = [int(x) for x in self.cache_lengths.tolist()]
        return self._host["cache"]

    @property
    def offsets_list(self) -> list[int]:
        if "offsets" not in self._host:
            self._host["offsets"] = [int(x) for x in self.input_row_offsets.tolist()]
        return self._host["offsets"]

    @property
    def new_tokens_list(self) -> list[int]:
        o = self.offsets_list
        return [o[i + 1] - o[i] for i in range(len(o) - 1)]

    @property
    def seq_lens_list(self) -> list[int]:
        """Total keys per sequence after this call's write: cached + new."""
        return [c + n for c, n in zip(self.cache_lengths_list, self.new_tokens_list)]

    @property
    def batch_size(self) -> int:
        return int(self.cache_lengths.shape[0])

    @property
    def num_layers(self) -> int:
        return int(self.blocks.shape[0])

    @property
    def num_pages(self) -> int:
        return int(self.blocks.shape[1])

    @property
    def head_dim(self) -> int:
        return int(self.blocks.shape[3])

    @property
    def max_new_tokens(self) -> int:
        return max(self.new_tokens_list, default=0)

    def with_offsets(self, input_row_offsets: torch.Tensor) -> "CacheBatch":
        """The same cache view with another ragged query layout (new host cache)."""
        return CacheBatch(self.blocks, self.block_table, self.cache_lengths, input_row_offsets, self.page_size, self.seq_ids)


class PagedLatentCache:
    """Owns the latent storage and the page allocator; hands out ``CacheBatch`` views.

    Typical step: ``batch = cache.prepare(ids, new_counts)``; every layer runs with
    ``batch`` (writing its entries); ``cache.commit(batch)``; ``cache.release(id)`` when a
    sequence finishes.
    """

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int = 64,
        head_dim: int = 576,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
    ) -> None:
        for name, value in (("num_layers", num_layers), ("num_pages", num_pages), ("page_size", page_size), ("head_dim", head_dim)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.page_size = page_size
        self.blocks = torch.zeros(num_layers, num_pages, page_size, head_dim, dtype=dtype, device=device)
        self.allocator = PageAllocator(num_pages)
        self._pages: dict[Hashable, list[int]] = {}
        self._lengths: dict[Hashable, int] = {}

    # Queries ------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return int(self.blocks.shape[0])

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    @property
    def num_free_pages(self) -> int:
        return self.allocator.num_free

    @property
    def pages_in_use(self) -> int:
        return self.num_pages - self.num_free_pages

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token occupies in one layer (1152 for a bf16 576-wide entry)."""
        return int(self.blocks.shape[3]) * self.blocks.element_size()

    @property
    def sequences(self) -> list[Hashable]:
        return list(self._lengths)

    def length(self, seq_id: Hashable) -> int:
        """Committed tokens of ``seq_id`` (0 for an unknown id)."""
        return self._lengths.get(seq_id, 0)

    def pages(self, seq_id: Hashable) -> list[int]:
        return list(self._pages.get(seq_id, ()))

    # Lifecycle ----------------------------------------------------------------------
    def prepare(self, seq_ids: Sequence[Hashable], num_new_tokens: Sequence[int]) -> CacheBatch:
        """Reserve pages for ``num_new_tokens[i]`` more tokens of ``seq_ids[i]``; returns the batch.

        Unseen ids are registered. Raises ``CacheFullError`` (leaving every structure as it
        was) when the pool cannot hold the new tokens.
        """
        seq_ids = list(seq_ids)
        counts = [int(n) for n in num_new_tokens]
        if len(seq_ids) != len(counts):
            raise ValueError(f"num_new_tokens: {len(counts)} counts for {len(seq_ids)} seq_ids")
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError("seq_ids: an id appears twice in one batch")
        if any(n < 0 for n in counts):
            raise ValueError(f"num_new_tokens: counts must be >= 0, got {counts}")
        ps = self.page_size
        need = [max(0, math.ceil((self.length(s) + n) / ps) - len(self._pages.get(s, ()))) for s, n in zip(seq_ids, counts)]
        fresh = self.allocator.allocate(sum(need))  # raises before anything changed
        for s, k in zip(seq_ids, need):
            self._pages.setdefault(s, []).extend(fresh[:k])
            self._lengths.setdefault(s, 0)
            fresh = fresh[k:]
        max_pages = max([len(self._pages[s]) for s in seq_ids] + [1])
        table = torch.zeros(len(seq_ids), max_pages, dtype=torch.int32)
        for i, s in enumerate(seq_ids):
            pages = self._pages[s]
            if pages:
                table[i, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        cache_lengths = [self._lengths[s] for s in seq_ids]
        offsets = [0]
        for n in counts:
            offsets.append(offsets[-1] + n)
        device = self.blocks.device
        batch = CacheBatch(
            blocks=self.blocks,
            block_table=table.to(device),
            cache_lengths=torch.tensor(cache_lengths, dtype=torch.int32, device=device),
            input_row_offsets=torch.tensor(offsets, dtype=torch.int32, device=device),
            page_size=ps,
            seq_ids=tuple(seq_ids),
        )
        batch._host.update(cache=cache_lengths, offsets=offsets)
        return batch

    def commit(self, batch: CacheBatch) -> None:
        """Advance each sequence's length by its new tokens (call once all layers ran)."""
        for s, c, n in zip(batch.seq_ids, batch.cache_lengths_list, batch.new_tokens_list):
            if s not in self._lengths:
                raise ValueError(f"batch: sequence {s!r} was released before commit")
            if self._lengths[s] != c:
                raise ValueError(f"batch: sequence {s!r} has length {self._lengths[s]}, the batch expected {c} (committed twice?)")
            self._lengths[s] = c + n

    def release(self, seq_id: Hashable) -> None:
        """Free the pages of ``seq_id`` and forget it."""
        if seq_id not in self._lengths:
            raise ValueError(f"seq_id: unknown sequence {seq_id!r}")
        self.allocator.free(self._pages.pop(seq_id))
        del self._lengths[seq_id]

    def batch_for(self, seq_ids: Sequence[Hashable]) -> CacheBatch:
        """A read-only view of already-committed sequences (no new tokens, no reservation)."""
        return self.prepare(seq_ids, [0] * len(seq_ids))
