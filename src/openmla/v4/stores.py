"""Paged stores for DeepSeek-V4 layers: raw entries with a sliding window, compressed entries.

An ``EntryStore`` holds entries of width ``D`` for ``num_layers`` layers in pages of
``page_size`` entries (``blocks [num_layers, num_pages, page_size, D]``) from one
``cache.PageAllocator``; logical page ``j`` of a sequence is the same physical page in every
layer of the store. A store with a ``window`` frees, after each step, every page that lies
wholly before the window of the sequence's next query (entries ``< length - window + 1``), so
a sliding layer holds about ``window + page_size`` entries per sequence, not its whole context;
a store without one (compressed entries, the CSA indexer's keys) keeps everything.

A step: ``extend`` (reserve the new entries of every sequence, all or none), ``write`` per layer
(rows from ``spec.physical_rows``, the one definition), ``view`` per layer (what the kernel
reads), then ``trim`` (return pages that fell out of every window). ``V4Cache`` puts a model's
stores together and reports bytes per sequence.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from ..cache import CacheFullError, PageAllocator
from ..shared_kv_spec import PagedEntries, physical_rows

FREED = -1  # a logical page returned to the pool (out of every window)


class EntryStore:
    """Paged entries of one width for a group of layers (see the module docstring)."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, width: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", window: int | None = None) -> None:
        for name, value in (("num_layers", num_layers), ("page_size", page_size), ("width", width)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"window: expected None or an int >= 1, got {window!r}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"dtype: expected a floating torch dtype, got {dtype!r}")
        self.allocator = PageAllocator(num_pages)
        self.page_size, self.width, self.window = page_size, width, window
        self.blocks = torch.zeros(num_layers, num_pages, page_size, width, dtype=dtype, device=device)
        self._pages: dict[Hashable, list[int]] = {}
        self._lengths: dict[Hashable, int] = {}

    # Sequences -----------------------------------------------------------------------------
    def length(self, seq_id: Hashable) -> int:
        return self._lengths[self._known(seq_id)]

    def pages_held(self, seq_id: Hashable) -> int:
        return sum(p != FREED for p in self._pages[self._known(seq_id)])

    def bytes_of(self, seq_id: Hashable) -> int:
        """Bytes of storage the sequence holds (its pages, in every layer of the store)."""
        per_page = self.blocks.shape[0] * self.page_size * self.width * self.blocks.element_size()
        return self.pages_held(seq_id) * per_page

    def _known(self, seq_id: Hashable) -> Hashable:
        if seq_id not in self._pages:
            raise ValueError(f"seq_ids: {seq_id!r} is not in this store")
        return seq_id

    def release(self, seq_id: Hashable) -> None:
        """Forget the sequence and return its pages."""
        pages = self._pages.pop(self._known(seq_id))
        del self._lengths[seq_id]
        self.allocator.free([p for p in pages if p != FREED])

    def extend(self, seq_ids: Sequence[Hashable], counts: Sequence[int]) -> None:
        """Reserve ``counts[i]`` more entries for ``seq_ids[i]`` (a new id starts empty), all or
        none: ``CacheFullError`` and nothing changes when the pool cannot hold them."""
        if len(seq_ids) != len(counts) or len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"seq_ids: expected distinct ids, one per count ({len(seq_ids)} ids, {len(counts)} counts)")
        need = []
        for s, n in zip(seq_ids, counts):
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValueError(f"counts: expected ints >= 0, got {n!r}")
            have = len(self._pages.get(s, ()))
            need.append(max(0, -(-(self._lengths.get(s, 0) + n) // self.page_size) - have))
        if sum(need) > self.allocator.num_free:
            raise CacheFullError(f"need {sum(need)} free pages, {self.allocator.num_free} of {self.allocator.num_pages} are free")
        for s, n, k in zip(seq_ids, counts, need):
            self._pages.setdefault(s, []).extend(self.allocator.allocate(k))
            self._lengths[s] = self._lengths.get(s, 0) + n

    def trim(self, seq_ids: Sequence[Hashable] | None = None) -> None:
        """Return every page wholly before the window of each sequence's next query (no-op without a window)."""
        if self.window is None:
            return
        for s in self._pages if seq_ids is None else seq_ids:
            first_needed = max(0, self._lengths[self._known(s)] - self.window + 1)
            pages = self._pages[s]
            dead = [j for j in range(min(len(pages), first_needed // self.page_size)) if pages[j] != FREED]
            self.allocator.free([pages[j] for j in dead])
            for j in dead:
                pages[j] = FREED

    # Per step ------------------------------------------------------------------------------
    def table(self, seq_ids: Sequence[Hashable]) -> tuple[torch.Tensor, torch.Tensor]:
        """int32 ``block_table [B, max_pages]`` (-1: freed) and ``lengths [B]`` of ``seq_ids``, on the store's device."""
        rows = [self._pages[self._known(s)] for s in seq_ids]
        width = max([len(r) for r in rows] + [1])
        table = torch.full((len(rows), width), FREED, dtype=torch.int32)
        for b, r in enumerate(rows):
            table[b, :len(r)] = torch.tensor(r, dtype=torch.int32)
        lengths = torch.tensor([self._lengths[s] for s in seq_ids], dtype=torch.int32)
        dev = self.blocks.device
        return table.to(dev), lengths.to(dev)

    def view(self, layer: int, table: tuple[torch.Tensor, torch.Tensor]) -> PagedEntries:
        """The kernel's view of layer ``layer`` over a ``table(...)``."""
        return PagedEntries(self.blocks[layer], table[0], table[1])

    def rows(self, table: tuple[torch.Tensor, torch.Tensor], counts: Sequence[int]) -> torch.Tensor:
        """int64 physical rows of the last ``counts[b]`` entries of each sequence of ``table``."""
        lengths = table[1].cpu().tolist()
        seq = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(list(counts), dtype=torch.int64))
        pos = torch.cat([torch.arange(n_len - n, n_len) for n_len, n in zip(lengths, counts)] or [torch.zeros(0, dtype=torch.int64)])
        dev = self.blocks.device
        return physical_rows(table[0], seq.to(dev), pos.to(dev), self.page_size)

    def write(self, layer: int, rows: torch.Tensor, entries: torch.Tensor) -> None:
        """Store ``entries [n, D]`` at physical ``rows`` (from ``rows(...)``) of layer ``layer``."""
        if entries.dim() != 2 or entries.shape != (rows.shape[0], self.width):
            raise ValueError(f"entries: expected [{rows.shape[0]}, {self.width}], got {tuple(entries.shape)}")
        flat = self.blocks[layer].view(-1, self.width)
        flat.index_copy_(0, rows, entries.to(self.blocks.dtype))
