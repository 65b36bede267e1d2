"""Paged latent KV cache: storage, page allocator and the per-call batch view (the step's metadata).

One cache entry per token and layer holds ``L + R`` values: the RMS-normalised
latent then the RoPE'd key rope part. Storage is ``blocks[num_layers, num_pages,
page_size, W]`` (W = L+R values, or a record format's bytes); all layers share one page
allocator, so logical page ``j`` of a sequence is the same physical page in every layer.
How entries are stored (quantised) and read back is the format object's
(``CacheBatch.format``, ``openmla.formats``); ``CacheBatch.read_rows`` / ``write_rows`` hand
the batch's layer storage, latent width and scale to it.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import numbers
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from .basics import FLOAT_DTYPES, INDEX_DTYPES, fail
from .formats import CACHE_FORMATS, FORMATS, QUANTIZED_FORMATS, RECORDS, STORAGE_DTYPES, CacheFormat  # noqa: F401 (STORAGE_DTYPES: re-exported)
from .fp8 import FP8

# Storage dtypes of a native cache (what every backend computes in); metadata: basics.INDEX_DTYPES.
NATIVE_DTYPES = FLOAT_DTYPES
INT32_MAX = 2**31 - 1  # metadata, positions and physical rows are int32 in the kernels


class CacheFullError(RuntimeError):
    """The page pool cannot hold the requested tokens. Nothing was changed."""


class PageAllocator:
    """A free list of physical page ids ``0 .. num_pages-1``."""

    def __init__(self, num_pages: int) -> None:
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 1:
            raise ValueError(f"num_pages: must be an int >= 1, got {num_pages!r}")
        self.num_pages = num_pages
        # A stack popping the lowest ids first keeps small runs compact and easy to read.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._taken = bytearray(num_pages)  # 1 where a page is allocated: double frees are caught

    @property
    def num_free(self) -> int:
        return len(self._free)

    def peek(self, n: int) -> list[int]:
        """The ``n`` pages ``allocate(n)`` would take, without taking them; ``CacheFullError`` if
        fewer are free."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n: must be an int >= 0, got {n!r}")
        if n > len(self._free):
            raise CacheFullError(f"need {n} free pages, {len(self._free)} of {self.num_pages} are free")
        return self._free[len(self._free) - n:][::-1]

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` pages; raises ``CacheFullError`` (and takes none) if fewer are free."""
        pages = self.peek(n)
        del self._free[len(self._free) - n:]
        for p in pages:
            self._taken[p] = 1
        return pages

    def free(self, pages: Sequence[int]) -> None:
        """Return ``pages``; all or none: a page that is out of range, listed twice or already
        free raises ``ValueError`` and nothing is returned."""
        pages = list(pages)
        if any(isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < self.num_pages for p in pages):
            raise ValueError(f"pages: every page must be an int in [0, {self.num_pages}), got {pages}")
        if len(set(pages)) != len(pages) or not all(self._taken[p] for p in pages):
            raise ValueError(f"pages: a page is listed twice or already free in {pages}")
        for p in pages:
            self._taken[p] = 0
        self._free.extend(sorted(pages, reverse=True))


def _describe(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)} on {x.device}"
    return type(x).__name__


def index_tensors_ok(device: torch.device, *fields: tuple[object, int]) -> bool:
    """Every ``(tensor, rank)``: a plain tensor of that rank, an index dtype, on ``device`` (one
    expression each: checked per step, the usual answer is yes)."""
    return all(type(t) is torch.Tensor and t.dim() == rank and t.dtype in INDEX_DTYPES and t.device == device
               for t, rank in fields)


@dataclass(frozen=True)
class Ticket:
    """What ``PagedLatentCache.prepare`` reserved for one batch: the cache that handed it out,
    each sequence's generation at that moment (it changes on every commit and release), and
    the token counts ``commit`` will apply. A batch commits only while every generation holds."""

    cache_token: object
    seq_ids: tuple
    generations: tuple[int, ...]
    cache_lengths: tuple[int, ...]
    new_tokens: tuple[int, ...]


@dataclass(eq=False)  # hashed by identity: openmla.kept_plans keys the plans it keeps by this object
class HostLists:
    """Host copies of a batch's metadata, read from the device once (planning must not sync per
    sequence). ``refills`` counts ``refill`` calls: what is kept per lists object (the MAX-named
    ops' plans, ``openmla.kept_plans``) is dropped when it changes."""

    cache_lengths: list[int] | None = None
    offsets: list[int] | None = None
    max_position: int | None = None
    refills: int = 0

    def copy(self) -> "HostLists":
        """The same lists in a new object (for a batch over the same metadata; nothing kept for this one comes along)."""
        return HostLists(self.cache_lengths, self.offsets, self.max_position)

    def refill(self, other: "HostLists") -> None:
        """Take ``other``'s lists (a plan refilled in place for the next step)."""
        self.cache_lengths, self.offsets, self.max_position = other.cache_lengths, other.offsets, other.max_position
        self.refills += 1


@dataclass
class CacheBatch:
    """The view of the cache one forward call works on (MAX's ``kv_collection``): the step's
    metadata over the cache storage. Entries are stored and read back by the format object
    (``format``, ``openmla.formats``); ``read_rows`` / ``read_pages`` / ``write_rows`` hand it this
    batch's layer storage, latent width and scale.

    - ``blocks``: ``[num_layers, num_pages, page_size, L+R]`` storage (shared, written in place).
    - ``block_table``: int32 ``[B, max_pages]``; entry ``[b, j]`` is the physical page of logical
      page ``j`` of sequence ``b``. Entries past a sequence's last page are 0 and never read.
    - ``cache_lengths``: int32 ``[B]``, tokens already cached before this call.
    - ``input_row_offsets``: int32 ``[B+1]``, rows of the ragged query batch per sequence.
    - ``cache_format``: ``native`` (entries in ``blocks.dtype``: bfloat16, float16, float32 or
      float64), ``fp8_e4m3`` (float8 entries times ``kv_scale[layer]``) or a record format:
      ``fp8_ds_mla``, ``nvfp4_ds_mla``, ``nvfp4_fp8rope`` (uint8 token records, see
      ``openmla.formats``).
    - ``ticket``: what ``PagedLatentCache.prepare`` reserved (``commit`` reads it); None for a
      batch built by hand, which no cache commits.

    Index tensors may be int32, int64 or uint32, in any layout, all on the blocks' device. The
    constructor checks every field's type, dtype, rank, device and size (``ValueError`` naming
    ``kv_collection.<field>``); values are checked by the ops that read them.
    """

    blocks: torch.Tensor
    block_table: torch.Tensor
    cache_lengths: torch.Tensor
    input_row_offsets: torch.Tensor
    page_size: int
    seq_ids: tuple = ()
    cache_format: str = "native"
    kv_scale: torch.Tensor | None = None  # float32 [num_layers], fp8_e4m3 only
    rope_dim: int | None = None  # R, needed to decode token records (fp8_ds_mla, nvfp4_*)
    ticket: "Ticket | None" = field(default=None, repr=False, compare=False)  # set by PagedLatentCache.prepare
    _host: "HostLists" = field(default_factory=lambda: HostLists(), repr=False, compare=False)

    def __post_init__(self) -> None:
        """Field checks (host facts only: no device read, no sync)."""
        if not isinstance(self.cache_format, str) or self.cache_format not in CACHE_FORMATS:
            fail("kv_collection.cache_format", f"expected one of {CACHE_FORMATS}, got {self.cache_format!r}")
        fmt = FORMATS[self.cache_format]
        blocks = self.blocks
        if not isinstance(blocks, torch.Tensor) or blocks.dim() != 4:
            fail("kv_collection.blocks", f"expected a 4-D tensor [num_layers, num_pages, page_size, width], got {_describe(blocks)}")
        if blocks.dtype not in fmt.storage:
            fail("kv_collection.blocks", f"a {self.cache_format} cache is stored as one of {[str(d) for d in fmt.storage]}, "
                 f"got {blocks.dtype}")
        dev = blocks.device
        if not index_tensors_ok(dev, (self.block_table, 2), (self.cache_lengths, 1), (self.input_row_offsets, 1)):
            self._fail_index_fields(dev)
        B = self.cache_lengths.shape[0]
        if self.block_table.shape[0] != B:
            fail("kv_collection.block_table", f"{self.block_table.shape[0]} rows for {B} sequences (cache_lengths)")
        if self.input_row_offsets.shape[0] != B + 1:
            fail("kv_collection.input_row_offsets", f"{self.input_row_offsets.shape[0]} entries for {B} sequences (expected B+1)")
        if isinstance(self.page_size, bool) or not isinstance(self.page_size, int) or self.page_size != blocks.shape[2]:
            fail("kv_collection.page_size", f"must be the int blocks.shape[2] = {blocks.shape[2]}, got {self.page_size!r}")
        if not isinstance(self.seq_ids, tuple) or len(self.seq_ids) not in (0, B):
            fail("kv_collection.seq_ids", f"expected a tuple of 0 or {B} ids, got {self.seq_ids!r}")
        if self.kv_scale is not None or fmt.scaled:
            k = self.kv_scale
            if not isinstance(k, torch.Tensor) or k.dtype != torch.float32 or tuple(k.shape) != (blocks.shape[0],) or k.device != dev:
                fail("kv_collection.kv_scale", f"expected a float32 [{blocks.shape[0]}] tensor on {dev} (one scale per layer), got {_describe(k)}")
        if self.rope_dim is not None or fmt.is_record:
            R = self.rope_dim
            if isinstance(R, bool) or not isinstance(R, int) or R < 0:
                fail("kv_collection.rope_dim", f"expected an int >= 0 (the rope width R), got {R!r}")
            if fmt.is_record and not fmt.fits(int(blocks.shape[3]), R):
                why = fmt.shape_error(fmt.latent_rank(int(blocks.shape[3]), R), R)
                fail("kv_collection.rope_dim", f"{R} does not split {blocks.shape[3]}-byte {self.cache_format} records into a latent and "
                     f"a rope part the format holds{f' ({why[1]})' if why else ''}")
        if self.ticket is not None and not isinstance(self.ticket, Ticket):
            fail("kv_collection.ticket", f"expected a Ticket from PagedLatentCache.prepare or None, got {type(self.ticket).__name__}")
        if not isinstance(self._host, HostLists):
            fail("kv_collection._host", f"expected a HostLists, got {type(self._host).__name__}")

    def _fail_index_fields(self, dev: torch.device) -> None:
        """The ValueError naming the first index field that is not an index tensor of its rank on ``dev``."""
        for name, rank in (("block_table", 2), ("cache_lengths", 1), ("input_row_offsets", 1)):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dim() != rank:
                fail(f"kv_collection.{name}", f"expected a {rank}-D index tensor, got {_describe(t)}")
            if t.dtype not in INDEX_DTYPES:
                fail(f"kv_collection.{name}", f"dtype {t.dtype} is not an index dtype {[str(d) for d in INDEX_DTYPES]}")
            if t.device != dev:
                fail(f"kv_collection.{name}", f"on {t.device}, the blocks are on {dev}")

    # Host-side copies, computed once: planning code must not sync per sequence.
    @property
    def cache_lengths_list(self) -> list[int]:
        host = self._host
        if host.cache_lengths is None:
            host.cache_lengths = [int(x) for x in self.cache_lengths.tolist()]
        return host.cache_lengths

    @property
    def offsets_list(self) -> list[int]:
        host = self._host
        if host.offsets is None:
            host.offsets = [int(x) for x in self.input_row_offsets.tolist()]
        return host.offsets

    @property
    def max_position(self) -> int:
        """The longest sequence of the step (cached + new): rows of ``freqs_cis`` it needs."""
        host = self._host
        if host.max_position is None:
            host.max_position = max(self.seq_lens_list, default=0)
        return host.max_position

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
    def format(self) -> CacheFormat:
        """The cache format's object (``openmla.formats``): bytes, write, read, kernel code."""
        return FORMATS[self.cache_format]

    @property
    def head_dim(self) -> int:
        """Logical entry width L+R (the stored record may be wider or narrower in bytes)."""
        return self.format.entry_width(int(self.blocks.shape[3]), self.rope_dim)

    @property
    def kv_lora_rank(self) -> int:
        """L, the latent width of an entry."""
        return self.head_dim - (self.rope_dim or 0)

    @property
    def is_native(self) -> bool:
        return self.cache_format == "native"

    @property
    def compute_dtype(self) -> torch.dtype:
        """dtype entries are read in: the storage dtype, or bfloat16 for the quantised formats."""
        return self.format.compute_dtype(self.blocks.dtype)

    def layer_scale(self, layer_idx: int) -> torch.Tensor | None:
        """The float32 scale of layer ``layer_idx`` (a scaled format's, else None)."""
        return self.kv_scale[layer_idx] if self.format.scaled else None

    # Format-aware access (the format object's, on this batch's layer): every backend may use these;
    # native caches can also be indexed directly.
    def read_rows(self, layer_idx: int, rows: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Entries ``[n, L+R]`` at physical rows, dequantised, in ``dtype`` (default ``compute_dtype``)."""
        return self.format.read(self.blocks[layer_idx], rows, self.kv_lora_rank, dtype or self.compute_dtype,
                                self.layer_scale(layer_idx))

    def read_pages(self, layer_idx: int, pages: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Entries ``[n_pages, page_size, L+R]`` of whole physical pages, dequantised."""
        return self.format.read_pages(self.blocks[layer_idx], pages, self.kv_lora_rank, dtype or self.compute_dtype,
                                      self.layer_scale(layer_idx))

    def write_rows(self, layer_idx: int, rows: torch.Tensor, entries: torch.Tensor) -> None:
        """Store float ``entries [n, L+R]`` at physical rows, quantising for the quantised formats."""
        self.format.write(self.blocks[layer_idx], rows, entries, self.kv_lora_rank, self.layer_scale(layer_idx))

    # Addressing (the one definition of a token's position and physical row) -----------------
    def token_positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(seq, pos)``: sequence index and absolute position of each new token, int64 ``[T]`` on
        the metadata's device. Token ``i`` of sequence ``b`` sits at ``cache_lengths[b] + i``."""
        # Built from the host lists with numpy: torch.repeat_interleave runs a parallel region even
        # for a handful of sequences, which stalls for milliseconds when another process holds a core.
        offsets = np.array(self.offsets_list, dtype=np.int64)
        starts = offsets[:-1]
        seq = np.repeat(np.arange(len(starts)), offsets[1:] - starts)
        pos = np.arange(len(seq)) + (np.array(self.cache_lengths_list, dtype=np.int64) - starts)[seq]  # position - row, per sequence
        device = self.input_row_offsets.device
        return torch.from_numpy(seq).to(device), torch.from_numpy(pos).to(device)

    def physical_rows(self, seq: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Physical rows ``block_table[seq, pos // page_size] * page_size + pos % page_size`` (int64)."""
        ps = self.page_size
        return self.block_table[seq, pos // ps].to(torch.int64) * ps + pos % ps

    def token_rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``token_positions()`` and their ``physical_rows``: host work, once per step (a plan's). For a
        CPU cache the rows come from numpy indexing of the table (a third of torch's dispatch cost
        on a step's few rows), the same formula."""
        seq, pos = self.token_positions()
        table, ps = self.block_table, self.page_size
        if table.device.type != "cpu" or table.dtype not in (torch.int32, torch.int64):
            return seq, pos, self.physical_rows(seq, pos)
        s, p = seq.numpy(), pos.numpy()
        return seq, pos, torch.from_numpy(table.numpy()[s, p // ps].astype(np.int64) * ps + p % ps)

    @property
    def max_new_tokens(self) -> int:
        return max(self.new_tokens_list, default=0)

    def with_blocks(self, blocks: torch.Tensor) -> "CacheBatch":
        """The same view over other storage of the same shape (a copy of the cache, say)."""
        return dataclasses.replace(self, blocks=blocks)

    def checked_copy(self, **fields: object) -> "CacheBatch":
        """A shallow copy with ``fields`` replaced, without the constructor's checks: only for a caller
        that has checked the new values itself (a plan's private metadata, same-shape storage)."""
        new = object.__new__(CacheBatch)
        new.__dict__.update(self.__dict__, **fields)
        return new


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: must be a positive int, got {value!r}")
    return value


def _storage_device(device: object) -> torch.device:
    """``device`` as a ``torch.device`` that can hold the cache (``ValueError`` naming it otherwise)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"device: not a torch device, got {device!r}") from None
    if dev.type == "meta":
        raise ValueError("device: the cache needs real storage, got meta")
    if dev.type == "cuda" and not (torch.cuda.is_available() and (dev.index or 0) < torch.cuda.device_count()):
        raise ValueError(f"device: {dev} is not available on this machine")
    return dev


def _check_seq_ids(seq_ids: object) -> list:
    if isinstance(seq_ids, (str, bytes)) or not isinstance(seq_ids, Sequence):
        raise ValueError(f"seq_ids: expected a sequence (list or tuple) of ids, got {type(seq_ids).__name__}")
    ids = list(seq_ids)
    for s in ids:
        if isinstance(s, torch.Tensor) or not isinstance(s, Hashable):
            raise ValueError(f"seq_ids: every id must be hashable and not a tensor (tensors hash by identity), got {type(s).__name__}")
    try:
        distinct = len(set(ids))
    except TypeError:  # a tuple holding something unhashable
        raise ValueError(f"seq_ids: every id must be hashable, got {ids!r}") from None
    if distinct != len(ids):
        raise ValueError("seq_ids: an id appears twice in one batch")
    return ids


def _check_counts(num_new_tokens: object, n: int) -> list[int]:
    if isinstance(num_new_tokens, (str, bytes)) or not isinstance(num_new_tokens, Sequence):
        raise ValueError(f"num_new_tokens: expected a sequence (list or tuple) of ints, got {type(num_new_tokens).__name__}")
    counts = list(num_new_tokens)
    if len(counts) != n:
        raise ValueError(f"num_new_tokens: {len(counts)} counts for {n} seq_ids")
    if any(isinstance(c, bool) or not isinstance(c, numbers.Integral) or c < 0 for c in counts):
        raise ValueError(f"num_new_tokens: every count must be an int >= 0, got {counts!r}")
    counts = [int(c) for c in counts]
    if sum(counts) > INT32_MAX:
        raise ValueError(f"num_new_tokens: {sum(counts)} tokens in one batch exceed the int32 row offsets")
    return counts


class PagedLatentCache:
    """Owns the latent storage and the page allocator; hands out ``CacheBatch`` views.

    Typical step: ``batch = cache.prepare(ids, new_counts)``; every layer runs with
    ``batch`` (writing its entries); ``cache.commit(batch)``; ``cache.release(id)`` when a
    sequence finishes. ``prepare``, ``commit`` and ``release`` are all-or-nothing: a call that
    raises leaves the allocator, page lists and lengths as they were. A batch commits once,
    and only while none of its sequences was committed or released since its ``prepare``.
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
        """``dtype``: bfloat16, float16, float32 or float64 (entries stored as is),
        ``torch.float8_e4m3fn`` or ``"fp8_e4m3"`` (entries / ``kv_scale``, one float32 scale per
        layer), or a token-record format: ``"fp8_ds_mla"`` (DeepSeek-V3.2's 656-byte record for L=512,
        R=64; any L a multiple of 128), ``"nvfp4_ds_mla"`` (432 bytes: FP4 e2m1 latent, an e4m3 scale
        per 16 values, bf16 rope) or ``"nvfp4_fp8rope"`` (352 bytes: the same latent, e4m3 rope), the
        NVFP4 ones for L=512, R=64 only (``openmla.nvfp4``). ``rope_dim`` is R (read by the record
        formats). Every argument is checked: ``ValueError`` naming it."""
        for name, value in (("num_layers", num_layers), ("num_pages", num_pages), ("page_size", page_size),
                            ("head_dim", head_dim)):
            _positive_int(name, value)
        if isinstance(rope_dim, bool) or not isinstance(rope_dim, int) or rope_dim < 0:
            raise ValueError(f"rope_dim: expected an int >= 0 (R; 0: entries without a rope part), got {rope_dim!r}")
        if num_pages * page_size > INT32_MAX:
            raise ValueError(f"num_pages: {num_pages} pages of {page_size} rows exceed the int32 row index")
        if rope_dim % 2:
            raise ValueError(f"rope_dim: must be even (RoPE rotates pairs), got {rope_dim}")
        self.page_size = page_size
        self.rope_dim = rope_dim
        if isinstance(dtype, str) and dtype in RECORDS:
            record, L = RECORDS[dtype], head_dim - rope_dim
            why = record.shape_error(L, rope_dim)
            if why is not None:
                raise ValueError(f"{why[0]}: {why[1]}")
            self.cache_format, width, storage = dtype, record.row_width(L, rope_dim), torch.uint8
        elif (isinstance(dtype, str) and dtype == "fp8_e4m3") or dtype is FP8:
            self.cache_format, width, storage = "fp8_e4m3", head_dim, FP8
        elif isinstance(dtype, torch.dtype) and dtype in NATIVE_DTYPES:
            self.cache_format, width, storage = "native", head_dim, dtype
        else:
            raise ValueError(f"dtype: expected one of {[str(d) for d in NATIVE_DTYPES]}, torch.float8_e4m3fn or one of "
                             f"{list(QUANTIZED_FORMATS)}, got {dtype!r}")
        if isinstance(kv_scale, bool) or not isinstance(kv_scale, numbers.Real) or not (
                0 < float(torch.tensor(float(kv_scale), dtype=torch.float32)) < math.inf):
            raise ValueError(f"kv_scale: expected a finite float > 0 (in float32), got {kv_scale!r}")
        dev = _storage_device(device)
        try:
            self.blocks = torch.zeros(num_layers, num_pages, page_size, width, dtype=storage, device=dev)
        except RuntimeError as e:  # out of memory, or a device torch cannot allocate on
            nbytes = num_layers * num_pages * page_size * width * torch.empty((), dtype=storage).element_size()
            raise ValueError(f"num_pages: cannot allocate {nbytes} bytes of cache on {dev}: {e}") from None
        self.kv_scale = torch.full((num_layers,), float(kv_scale), dtype=torch.float32, device=dev)
        self.allocator = PageAllocator(num_pages)
        self._pages: dict[Hashable, list[int]] = {}
        self._lengths: dict[Hashable, int] = {}
        # Generations: each sequence gets a fresh number from the clock when it is registered and
        # on every commit; a batch records them at prepare and commits only while they hold.
        self._generations: dict[Hashable, int] = {}
        self._clock = itertools.count(1)
        self._token = object()  # identifies batches prepared by this cache

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
        (plus one 4-byte scale per layer), 656 for fp8_ds_mla, 432 for nvfp4_ds_mla, 352 for
        nvfp4_fp8rope."""
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

        ``seq_ids``: a list or tuple of distinct hashable ids; ``num_new_tokens``: ints >= 0, one per
        id. Unseen ids are registered. Raises ``ValueError`` (bad arguments) or ``CacheFullError``
        (the pool cannot hold the new tokens), leaving every structure as it was.
        """
        ids = _check_seq_ids(seq_ids)
        counts = _check_counts(num_new_tokens, len(ids))
        ps = self.page_size
        lengths = [self._lengths.get(s, 0) for s in ids]
        for s, c, n in zip(ids, lengths, counts):
            if c + n > INT32_MAX:
                raise ValueError(f"num_new_tokens: sequence {s!r} would hold {c + n} tokens, past the int32 positions")
        owned = [self._pages.get(s, []) for s in ids]
        need = [max(0, -(-(c + n) // ps) - len(p)) for c, n, p in zip(lengths, counts, owned)]
        fresh = self.allocator.peek(sum(need))  # raises CacheFullError before anything changed
        pages, k = [], 0
        for p, m in zip(owned, need):
            pages.append(p + fresh[k: k + m])
            k += m
        generations = tuple(self._generations[s] if s in self._generations else next(self._clock) for s in ids)
        batch = self._make_batch(ids, pages, lengths, counts, generations)  # may raise: still nothing changed
        # Nothing below can fail: apply the reservation.
        self.allocator.allocate(len(fresh))
        for s, p, g in zip(ids, pages, generations):
            self._pages[s] = p
            self._lengths.setdefault(s, 0)
            self._generations[s] = g
        return batch

    def _make_batch(self, ids: list, pages: list[list[int]], lengths: list[int], counts: list[int],
                    generations: tuple[int, ...]) -> CacheBatch:
        max_pages = max([len(p) for p in pages] + [1])
        table = torch.tensor([p + [0] * (max_pages - len(p)) for p in pages] or [[0] * max_pages], dtype=torch.int32)
        offsets = [0]
        for n in counts:
            offsets.append(offsets[-1] + n)
        device = self.blocks.device
        batch = CacheBatch(
            blocks=self.blocks,
            block_table=table[: len(ids)].to(device),
            cache_lengths=torch.tensor(lengths, dtype=torch.int32).to(device),
            input_row_offsets=torch.tensor(offsets, dtype=torch.int32).to(device),
            page_size=self.page_size,
            seq_ids=tuple(ids),
            cache_format=self.cache_format,
            kv_scale=None if self.cache_format == "native" else self.kv_scale,
            rope_dim=self.rope_dim,
            ticket=Ticket(self._token, tuple(ids), generations, tuple(lengths), tuple(counts)),
        )
        batch._host = HostLists(list(lengths), offsets)
        return batch

    def commit(self, batch: CacheBatch) -> None:
        """Advance each sequence's length by the new tokens ``prepare`` reserved (call once all
        layers ran). ``ValueError`` naming ``batch``, and nothing changes, when the batch was not
        prepared by this cache or is stale: committed already, or one of its sequences was
        committed by another batch or released since its ``prepare``."""
        if not isinstance(batch, CacheBatch):
            raise ValueError(f"batch: expected a CacheBatch, got {type(batch).__name__}")
        t = batch.ticket
        if t is None or t.cache_token is not self._token:
            raise ValueError("batch: was not prepared by this cache (only batches from its prepare() commit)")
        for s, g in zip(t.seq_ids, t.generations):
            if s not in self._lengths:
                raise ValueError(f"batch: sequence {s!r} was released after this batch was prepared (stale batch)")
            if self._generations[s] != g:
                raise ValueError(f"batch: sequence {s!r} was committed after this batch was prepared "
                                 "(committed twice, or a stale batch: prepare a new one)")
        g = next(self._clock)
        for s, n in zip(t.seq_ids, t.new_tokens):
            self._lengths[s] += n
            self._generations[s] = g

    def release(self, seq_id: Hashable) -> None:
        """Free the pages of ``seq_id`` and forget it (``ValueError`` for an unknown id; then
        nothing changes). Batches prepared before the release can no longer be committed."""
        if isinstance(seq_id, torch.Tensor) or not isinstance(seq_id, Hashable):
            raise ValueError(f"seq_id: expected a hashable id, got {type(seq_id).__name__}")
        try:
            known = seq_id in self._lengths
        except TypeError:
            raise ValueError(f"seq_id: expected a hashable id, got {seq_id!r}") from None
        if not known:
            raise ValueError(f"seq_id: unknown sequence {seq_id!r}")
        self.allocator.free(self._pages[seq_id])  # checks every page before returning any
        del self._pages[seq_id], self._lengths[seq_id], self._generations[seq_id]

    def batch_for(self, seq_ids: Sequence[Hashable]) -> CacheBatch:
        """A read-only view of already-registered sequences (no new tokens, no reservation);
        ``ValueError`` for an unknown id."""
        ids = _check_seq_ids(seq_ids)
        unknown = [s for s in ids if s not in self._lengths]
        if unknown:
            raise ValueError(f"seq_ids: unknown sequences {unknown!r} (batch_for registers nothing)")
        return self.prepare(ids, [0] * len(ids))
