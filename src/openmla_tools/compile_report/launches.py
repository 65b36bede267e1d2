"""Every kernel launch the backend makes, recorded instead of run, with representative arguments.

The launch paths (cache write, decode in each mask and sparse mode, the prefill kernel, the
merges) run on CPU tensors with the GPU tile configs, and each ``kernel[grid](...)`` is recorded
as a ``Launch``. Only shapes, strides, dtypes, pointer alignment and integer values matter to
how a launch specialises, so the tensors are tiny but laid out as in serving:

- DeepSeek dims (L 512, R 64, Dn = Dv 128), heads 16 (a TP=8 shard) and 128, pages of 64 rows,
  sparse rows 2048 wide (V3.2's top-k), window 4096, chunk 8192: every stride and size a real
  launch sees as a multiple of 16 is one here;
- counts that vary per step (sequences, rows, pages, buffer rows) are odd: a launch gets no
  divisibility hint for them (the common case);
- the paged cache is taken to be over 2 GiB (a serving cache for all layers), so on AMD its
  pointers get no 32-bit buffer range; every other tensor fits in 2 GiB.
- DeepSeek-V4 shared-KV attention (``shared_kv``): entries of 512, 16 and 64 heads, window 128,
  pages of 64, compressed entries by rule or by rows of 512 picks.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator

import torch
from triton.runtime.jit import JITFunction

from openmla.backends.triton import _common, cache_write, decode, merge, prefill, shared_kv
from openmla.cache import CacheBatch
from openmla.fp8 import CACHE_FORMATS, FP8, ds_mla_record_bytes
from openmla.masks import MaskVariant
from openmla.shared_kv_spec import CompressedKeys, EntryLayout, PagedEntries, SharedKVSpec

L, R, DN, DV, PAGE = 512, 64, 128, 128, 64
TOPK = 2048
MASKS = (MaskVariant(), MaskVariant.parse("null"), MaskVariant.parse("sliding_window_causal", window_size=4096),
         MaskVariant.parse("sliding_window_noncausal", window_size=4096), MaskVariant.parse("chunked_causal", chunk_size=8192))


@dataclass(frozen=True)
class Case:
    """Queries of ``dtype`` on a cache in ``cache_format`` (native: a cache of ``dtype``)."""

    dtype: torch.dtype
    cache_format: str

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


@dataclass
class Launch:
    """One recorded ``kernel[grid](*args, **kwargs)`` and the storages taken to be over 2 GiB."""

    kernel: JITFunction
    args: tuple
    kwargs: dict
    case: Case
    large_storages: frozenset = field(default_factory=frozenset)

    @property
    def name(self) -> str:
        return self.kernel.__name__


@contextlib.contextmanager
def _recording(case: Case, gpu: str, large: frozenset) -> Iterator[list]:
    """Within the block, kernel launches append a ``Launch`` instead of running, and the backend
    picks its tile configs as on a ``gpu`` ("nvidia" or "amd") device."""
    calls: list = []
    saved = JITFunction.run, _common.check_device, _common.gpu_kind

    def record(self, *args, grid, warmup, **kwargs):
        calls.append(Launch(self, args, kwargs, case, large))

    JITFunction.run = record
    _common.check_device = lambda t: None
    _common.gpu_kind = lambda device: gpu
    try:
        yield calls
    finally:
        JITFunction.run, _common.check_device, _common.gpu_kind = saved


class _Make:
    """Zero-filled tensors on ``device`` (values never matter: launches are recorded, or compiled
    without running)."""

    def __init__(self, case: Case, device: str) -> None:
        self.dtype, self.device = case.dtype, torch.device(device)

    def __call__(self, *shape: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype or self.dtype, device=self.device)

    def ints(self, values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=self.device)


def _batch(case: Case, make: _Make) -> CacheBatch:
    """3 sequences (40, 3 and 70 cached tokens, one new token each) on 7 pages."""
    pages, kv_scale = 7, None
    if case.cache_format == "native":
        blocks = make(1, pages, PAGE, L + R)
    elif case.cache_format == "fp8_e4m3":
        blocks, kv_scale = make(1, pages, PAGE, L + R, dtype=FP8), make(1, dtype=torch.float32) + 1
    else:
        blocks = make(1, pages, PAGE, ds_mla_record_bytes(L, R), dtype=torch.uint8)
    return CacheBatch(blocks, make.ints([[0, 1], [2, 3], [4, 5]]), make.ints([40, 3, 70]), make.ints([0, 1, 2, 3]), PAGE,
                      cache_format=case.cache_format, kv_scale=kv_scale, rope_dim=R)


def _write(make: _Make, batch: CacheBatch) -> None:
    cache_write.write_cache(make(3, 16, DN + R), make(3, L + R), make(64, R, dtype=torch.float32), make(L), batch, 0, 1e-6)


def _decode(make: _Make, batch: CacheBatch, heads: int, mask: MaskVariant, sparse: str | None, num_splits: int) -> None:
    """One decode launch (split kernel + merge with a per-head sink); ``sparse``: None, "physical"
    (with V3.2's per-sequence top-k lengths) or "logical"."""
    idx = make(3, TOPK, dtype=torch.int32) if sparse else None
    topk = make.ints([TOPK] * 3) if sparse == "physical" else None
    decode.decode_into(make(3, heads, L + R), batch.blocks[0], batch.block_table, batch.cache_lengths, batch.input_row_offsets,
                       PAGE, scale=0.1, kv_lora_rank=L, mask=mask, sparse_indices=idx, topk_lengths=topk,
                       physical_indices=sparse == "physical", attn_sink=make(heads, dtype=torch.float32),
                       num_splits=num_splits, cache_format=batch.cache_format,
                       kv_scale=batch.kv_scale[:1] if batch.cache_format == "fp8_e4m3" else None)


def _prefill(make: _Make, batch: CacheBatch, mask: MaskVariant) -> None:
    """The flash kernel on one chunk: 43 new tokens (41 / 1 / 1) against 43 buffer rows, 16 heads."""
    rows = make.ints([0, 41, 42, 43])
    chunk = CacheBatch(batch.blocks, batch.block_table, make.ints([0, 2, 3]), rows, PAGE, cache_format=batch.cache_format,
                       kv_scale=batch.kv_scale, rope_dim=R)
    prefill.flare_prefill_into(make(43, 16, DN + R), make(43, 16, DN), make(43, 16, DV), rows, make.ints([0] * 4), chunk, 0,
                               make(43, 16, DV), make(43, 16, dtype=torch.float32), scale=0.1, mask=mask, max_new_tokens=41)


def _merges(make: _Make, heads: int = 16) -> None:
    """The merges decode does not make: prefill's chunk fold (float32, in place into part 0) and a
    per-sequence sink."""
    o, lse = make(2, 43, heads, DV, dtype=torch.float32), make(2, 43, heads, dtype=torch.float32)
    offsets = make.ints([0, 41, 42, 43])
    merge.merge_parts(o, lse, offsets, out=o[0], lse_out=lse[0])
    merge.merge_parts(o[:1], lse[:1], offsets, attn_sink=make(3, heads, dtype=torch.float32), out_dtype=torch.bfloat16)


def _shared_kv(make: _Make, heads: int, comp: str | None, num_splits: int) -> None:
    """One V4 attention launch (split kernel + merge with the sink): 3 decode rows of 3 sequences at
    positions 39, 2 and 69; ``comp`` None (sliding), "rule" (HCA, rate 128) or "indices" (CSA,
    rate 4, rows of 512 picks)."""
    D, idx = 512, None
    raw = PagedEntries(make(7, PAGE, D), make.ints([[0, 1], [2, 3], [4, 5]]), make.ints([40, 3, 70]))
    keys, compressed, n = None, None, 0
    if comp is not None:
        rate = 128 if comp == "rule" else 4
        if comp == "indices":
            idx, n = make(3, 512, dtype=torch.int32), 512
        compressed = PagedEntries(make(5, PAGE, D), make.ints([[0], [1], [2]]), make.ints([0, 0, 0]) + 40 // rate)
        keys = CompressedKeys(rate, idx)
    spec = SharedKVSpec(0.04, 128, EntryLayout(D, R), keys, make(heads, dtype=torch.float32))
    ints = lambda v: torch.tensor(v, dtype=torch.int64, device=make.device)  # noqa: E731  (the plan's int64 rows)
    plan = SimpleNamespace(spec=spec, raw=raw, compressed=compressed, window_keys=70, compressed_keys=n,
                           token_seq=ints([0, 1, 2]), token_pos=ints([39, 2, 69]), q_offsets=ints([0, 1, 2, 3]))
    shared_kv.shared_kv_into(make(3, heads, D), plan, num_splits=num_splits)


def record(case: Case, gpu: str, masks: tuple = MASKS, device: str = "cpu") -> list[Launch]:
    """Every launch of ``case`` with the tile configs of a ``gpu`` device ("nvidia", "amd"), on
    tensors on ``device``: the cache write; decode at 16 heads (2 splits) in each mask, dense and
    sparse logical, sparse physical (top-k lengths), and at 128 heads (1 split: the wide head
    block) dense and sparse physical (V3.2 without tensor parallelism); the prefill kernel in
    each mask; the two extra merges (native cases only: their specialisation does not depend on
    the cache). FP8 caches: causal only (a mask changes the same few integer operations whatever
    the cache holds). Native cases also: V4 shared-KV attention at 16 heads (2 splits) without,
    by rule and by indices over compressed entries, and at 64 heads (1 split) by indices."""
    make = _Make(case, device)
    batch = _batch(case, make)
    masks = masks if case.cache_format == "native" else masks[:1]
    with _recording(case, gpu, frozenset({batch.blocks.untyped_storage().data_ptr()})) as calls:
        _write(make, batch)
        for mask in masks:
            for sparse in (None, "logical"):
                _decode(make, batch, 16, mask, sparse, num_splits=2)
        _decode(make, batch, 16, masks[0], "physical", num_splits=2)
        for sparse in (None, "physical"):
            _decode(make, batch, 128, masks[0], sparse, num_splits=1)
        for mask in masks:
            _prefill(make, batch, mask)
        if case.cache_format == "native":
            _merges(make)
            for comp in (None, "rule", "indices"):
                _shared_kv(make, 16, comp, num_splits=2)
            _shared_kv(make, 64, "indices", num_splits=1)
    return calls


def all_cases(dtypes: tuple[torch.dtype, ...], cache_formats: tuple[str, ...] = CACHE_FORMATS) -> list[Case]:
    return [Case(dtype, fmt) for fmt in cache_formats for dtype in dtypes]


def jit_kernels() -> set[str]:
    """Names of every ``@triton.jit`` kernel (``def *_kernel``) in the backend's source files (a file
    added later included; read as text, nothing imported): a report that records none of a name's
    launches misses a kernel."""
    names = set()
    for path in Path(_common.__file__).parent.glob("*.py"):
        names |= set(re.findall(r"^@triton\.jit[^\n]*\ndef (\w+_kernel)\(", path.read_text(), re.MULTILINE))
    return names
