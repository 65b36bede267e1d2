"""``V4Cache``: the stores one DeepSeek-V4 model needs, and bytes per sequence.

- ``raw``: every layer's raw entries (width D), with the model's sliding window: pages out of
  every window go back to the pool (``EntryStore.trim``).
- one compressed store per compressed layer kind (``heavily_compressed_attention``: one entry
  per ``rate`` tokens, all kept; ``compressed_sparse_attention``: the same, plus its indexer's
  compressed keys of width ``index_width`` in a store beside it).
- ``state``: each (sequence, layer)'s compressor running state (open window buffer, CSA overlap
  slice), small tensors kept by whoever runs the compressor and counted here.

Entries per sequence: raw = tokens seen; compressed = tokens seen // rate (the same in every
layer of a kind), so one ``extend`` per store and step serves all its layers.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from ..cache import CacheFullError
from .stores import EntryStore

KINDS = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")


@dataclass(frozen=True)
class V4Layout:
    """What the stores hold: each layer's kind, entry width D and rope width, the sliding window,
    the compression rate per compressed kind and the indexer's key width (CSA)."""

    layer_types: tuple[str, ...]
    width: int
    rope_dim: int
    window: int
    rates: tuple[tuple[str, int], ...]  # (kind, rate) for the compressed kinds present
    index_width: int | None = None

    def rate(self, kind: str) -> int:
        return dict(self.rates)[kind]


class V4Cache:
    """The stores of a V4 model (see the module docstring)."""

    def __init__(self, layout: V4Layout, num_pages: int, page_size: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", compressed_pages: int | None = None) -> None:
        bad = [t for t in layout.layer_types if t not in KINDS]
        if bad:
            raise ValueError(f"layout.layer_types: unknown kinds {bad}; expected {KINDS}")
        self.layout = layout
        self.raw = EntryStore(len(layout.layer_types), num_pages, page_size, layout.width, dtype, device, window=layout.window)
        self.compressed: dict[str, EntryStore] = {}
        self.index: EntryStore | None = None
        self.slot: list[int | None] = []  # layer -> its index in its kind's compressed store
        counts: dict[str, int] = {}
        for kind in layout.layer_types:
            if kind == "sliding_attention":
                self.slot.append(None)
            else:
                self.slot.append(counts.get(kind, 0))
                counts[kind] = counts.get(kind, 0) + 1
        for kind, n in counts.items():
            self.compressed[kind] = EntryStore(n, compressed_pages or num_pages, page_size, layout.width, dtype, device)
        if "compressed_sparse_attention" in counts:
            if layout.index_width is None:
                raise ValueError("layout.index_width: compressed sparse layers need their indexer's key width")
            self.index = EntryStore(counts["compressed_sparse_attention"], compressed_pages or num_pages, page_size,
                                    layout.index_width, dtype, device)
        self.state: dict[tuple[Hashable, int], dict] = {}  # (sequence, layer) -> tensors, or dicts of them

    def stores(self) -> list[EntryStore]:
        return [self.raw, *self.compressed.values()] + ([self.index] if self.index is not None else [])

    def has(self, seq_id: Hashable) -> bool:
        return seq_id in self.raw._lengths

    def length(self, seq_id: Hashable) -> int:
        return self.raw.length(seq_id) if self.has(seq_id) else 0

    def extend(self, seq_ids: Sequence[Hashable], counts: Sequence[int]) -> list[int]:
        """Reserve ``counts`` new tokens per sequence in every store, all or none
        (``CacheFullError``, nothing changed); returns each sequence's cached length before."""
        before = [self.length(s) for s in seq_ids]
        plans = [(self.raw, list(counts))]
        for kind, store in self.compressed.items():
            rate = self.layout.rate(kind)
            new = [(c + n) // rate - c // rate for c, n in zip(before, counts)]
            plans.append((store, new))
            if kind == "compressed_sparse_attention" and self.index is not None:
                plans.append((self.index, new))
        done = []
        try:
            for store, new in plans:
                store.extend(seq_ids, new)
                done.append((store, new))
        except CacheFullError:
            for store, new in done:  # undo: shrink back (pages reserved now are returned)
                for s, n, c in zip(seq_ids, new, before):
                    _shrink(store, s, n, c == 0)
            raise
        return before

    def trim(self, seq_ids: Sequence[Hashable] | None = None) -> None:
        self.raw.trim(seq_ids)

    def release(self, seq_id: Hashable) -> None:
        for store in self.stores():
            if seq_id in store._lengths:
                store.release(seq_id)
        for key in [k for k in self.state if k[0] == seq_id]:
            del self.state[key]

    def bytes_per_sequence(self, seq_id: Hashable) -> dict[str, int]:
        """Bytes the sequence holds: ``raw``, ``compressed``, ``index``, compressor ``state``, ``total``."""
        out = {"raw": self.raw.bytes_of(seq_id),
               "compressed": sum(s.bytes_of(seq_id) for s in self.compressed.values()),
               "index": self.index.bytes_of(seq_id) if self.index is not None else 0,
               "state": sum(_nbytes(d) for (s, _), d in self.state.items() if s == seq_id)}
        out["total"] = sum(out.values())
        return out


def _nbytes(x: object) -> int:
    """Bytes of the tensors in a (nested) dict of states."""
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    return sum(_nbytes(v) for v in x.values()) if isinstance(x, dict) else 0


def _shrink(store: EntryStore, seq_id: Hashable, n: int, was_new: bool) -> None:
    """Undo ``store.extend`` of ``n`` entries for one sequence (used when a later store is full)."""
    if was_new:
        store.release(seq_id)
        return
    length = store._lengths[seq_id] - n
    keep = -(-length // store.page_size)
    pages = store._pages[seq_id]
    store.allocator.free([p for p in pages[keep:] if p != -1])
    del pages[keep:]
    store._lengths[seq_id] = length
