"""Paged latent KV cache: storage, page allocator and the per-call batch view.

One cache entry per token and layer holds ``L + R`` values: the RMS-normalised
latent then the RoPE'd key rope part. Storage is ``blocks[num_layers, num_pages,
page_size, L+R]``; all layers share one page allocator, so logical page ``j`` of a
sequence is the same physical page in every layer.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Hashable, Sequence

import numpy as np
import torch

from .fp8 import FP8, ds_mla_latent_rank, ds_mla_record_bytes, pack_ds_mla, quantize_e4m3, unpack_ds_mla


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


def _select(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``t.index_select(0, index)``, through a byte view for float8 (torch has no fp8 kernel)."""
    index = index.to(t.device).long()
    if t.dtype == FP8:
        return t.view(torch.uint8).index_select(0, index).view(FP8)
    return t.index_select(0, index)


@dataclass
class CacheBatch:
    """The view of the cache one forward call works on (the seeds' ``kv_collection``).

    - ``blocks``: ``[num_layers, num_pages, page_size, L+R]`` storage (shared, written in place).
    - ``block_table``: int32 ``[B, max_pages]``; entry ``[b, j]`` is the physical page of logical
      page ``j`` of sequence ``b``. Entries past a sequence's last page are 0 and never read.
    - ``cache_lengths``: int32 ``[B]``, tokens already cached before this call.
    - ``input_row_offsets``: int32 ``[B+1]``, rows of the ragged query batch per sequence.
    - ``cache_format``: ``native`` (entries in ``blocks.dtype``), ``fp8_e4m3`` (float8 entries times
      ``kv_scale[layer]``) or ``fp8_ds_mla`` (uint8 token records, see ``openmla.fp8``).
    """

    blocks: torch.Tensor
    block_table: torch.Tensor
    cache_lengths: torch.Tensor
    input_row_offsets: torch.Tensor
    page_size: int
    seq_ids: tuple = ()
    cache_format: str = "native"
    kv_scale: torch.Tensor | None = None  # float32 [num_layers], fp8_e4m3 only
    rope_dim: int | None = None  # R, needed to decode fp8_ds_mla records
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
        """Logical entry width L+R (the stored record may be wider or narrower in bytes)."""
        if self.cache_format == "fp8_ds_mla":
            return ds_mla_latent_rank(int(self.blocks.shape[3]), self.rope_dim) + self.rope_dim
        return int(self.blocks.shape[3])

    @property
    def is_native(self) -> bool:
        return self.cache_format == "native"

    @property
    def compute_dtype(self) -> torch.dtype:
        """dtype entries are read in: the storage dtype, or bfloat16 for the fp8 formats."""
        return self.blocks.dtype if self.is_native else torch.bfloat16

    # Format-aware access: every backend may use these; native caches can also be indexed directly.
    def read_rows(self, layer_idx: int, rows: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Entries ``[n, L+R]`` at physical rows, dequantised, in ``dtype`` (default ``compute_dtype``)."""
        flat = self.blocks[layer_idx].reshape(-1, self.blocks.shape[3])
        return self._decode(layer_idx, _select(flat, rows), dtype)

    def read_pages(self, layer_idx: int, pages: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Entries ``[n_pages, page_size, L+R]`` of whole physical pages, dequantised."""
        return self._decode(layer_idx, _select(self.blocks[layer_idx], pages), dtype)

    def _decode(self, layer_idx: int, stored: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
        dtype = dtype or self.compute_dtype
        if self.cache_format == "fp8_e4m3":
            wide = torch.float64 if dtype == torch.float64 else torch.float32  # fp8 * fp32 scale is exact in float64
            return (stored.to(wide) * self.kv_scale[layer_idx].to(wide)).to(dtype)
        if self.cache_format == "fp8_ds_mla":
            return unpack_ds_mla(stored, self.head_dim - self.rope_dim, dtype)
        return stored.to(dtype)

    def write_rows(self, layer_idx: int, rows: torch.Tensor, entries: torch.Tensor) -> None:
        """Store float ``entries [n, L+R]`` at physical rows, quantising for the fp8 formats."""
        flat = self.blocks[layer_idx].view(-1, self.blocks.shape[3])
        if self.cache_format == "fp8_e4m3":
            stored = quantize_e4m3(entries, self.kv_scale[layer_idx])
        elif self.cache_format == "fp8_ds_mla":
            stored = pack_ds_mla(entries, self.head_dim - self.rope_dim)
        else:
            stored = entries.to(flat.dtype)
        rows = rows.to(flat.device).long()
        if flat.dtype == FP8:  # torch has no fp8 index_copy_: move the bytes
            flat.view(torch.uint8).index_copy_(0, rows, stored.to(flat.device).view(torch.uint8))
        else:
            flat.index_copy_(0, rows, stored.to(flat.device))

    # Addressing (the one definition of a token's position and physical row) -----------------
    def token_positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(seq, pos)``: sequence index and absolute position of each new token, int64 ``[T]`` on
        the metadata's device. Token ``i`` of sequence ``b`` sits at ``cache_lengths[b] + i``."""
        # Built from the host lists with numpy: torch.repeat_interleave runs a parallel region even
        # for a handful of sequences, which stalls for milliseconds when another process holds a core.
        offsets = np.asarray(self.offsets_list, dtype=np.int64)
        seq = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))
        start = np.asarray(self.cache_lengths_list, dtype=np.int64) - offsets[:-1]  # position - row, per sequence
        device = self.input_row_offsets.device
        return torch.from_numpy(seq).to(device), torch.from_numpy(np.arange(len(seq)) + start[seq]).to(device)

    def physical_rows(self, seq: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Physical rows ``block_table[seq, pos // page_size] * page_size + pos % page_size`` (int64)."""
        ps = self.page_size
        return self.block_table[seq, pos // ps].to(torch.int64) * ps + pos % ps

    @property
    def max_new_tokens(self) -> int:
        return max(self.new_tokens_list, default=0)

    def with_offsets(self, input_row_offsets: torch.Tensor) -> "CacheBatch":
        """The same cache view with another ragged query layout (new host cache)."""
        return dataclasses.replace(self, input_row_offsets=input_row_offsets, _host={})

    def with_blocks(self, blocks: torch.Tensor) -> "CacheBatch":
        """The same view over other storage of the same shape (a copy of the cache, say)."""
        return dataclasses.replace(self, blocks=blocks)


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
        dtype: torch.dtype | str = torch.bfloat16,
        device: torch.device | str = "cpu",
        *,
        rope_dim: int = 64,
        kv_scale: float = 1.0,
    ) -> None:
        """``dtype``: a float dtype (entries stored as is), ``torch.float8_e4m3fn`` or ``"fp8_e4m3"``
        (entries / ``kv_scale``, one float32 scale per layer), or ``"fp8_ds_mla"`` (DeepSeek-V3.2's
        656-byte record for L=512, R=64; ``rope_dim`` is R)."""
        for name, value in (("num_layers", num_layers), ("num_pages", num_pages), ("page_size", page_size), ("head_dim", head_dim)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.page_size = page_size
        self.rope_dim = rope_dim
        if dtype in ("fp8_e4m3", FP8):
            self.cache_format, width, storage = "fp8_e4m3", head_dim, FP8
        elif dtype == "fp8_ds_mla":
            self.cache_format, width, storage = "fp8_ds_mla", ds_mla_record_bytes(head_dim - rope_dim, rope_dim), torch.uint8
        elif isinstance(dtype, torch.dtype) and dtype.is_floating_point:
            self.cache_format, width, storage = "native", head_dim, dtype
        else:
            raise ValueError(f"dtype: expected a float dtype, 'fp8_e4m3' or 'fp8_ds_mla', got {dtype!r}")
        if not (kv_scale > 0):
            raise ValueError(f"kv_scale: must be > 0, got {kv_scale!r}")
        self.blocks = torch.zeros(num_layers, num_pages, page_size, width, dtype=storage, device=device)
        self.kv_scale = torch.full((num_layers,), float(kv_scale), dtype=torch.float32, device=device)
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
        """Bytes one token occupies in one layer: 1152 for bf16 576-wide entries, 576 for fp8_e4m3
        (plus one 4-byte scale per layer), 656 for fp8_ds_mla."""
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
            cache_format=self.cache_format,
            kv_scale=None if self.cache_format == "native" else self.kv_scale,
            rope_dim=self.rope_dim,
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
