"""Validate a shared-KV (V4) attention call once, choose its backend once, run it.

``plan_shared_kv`` reads the call's metadata to the host once (offsets, lengths, the pages any
query may read, top-k indices), checks every field (``ValueError`` naming the argument, before
any kernel runs), derives each query row's sequence and position, and asks the backend whether
it runs the step (the ``SharedKVKernels`` protocol's ``supports_shared_kv``, through
``openmla.backends.choose_backend``: a backend that declines falls back to its ``fallback`` or the
call is refused). The backend then reads only the validated ``SharedKVPlan``, through
``openmla.dispatch.shared_kv`` (under ``torch.compile``: the ``openmla::shared_kv_attention`` op).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from .. import dispatch
from ..backends import choose_backend, resolve_backend_name
from ..backends.base import Backend, SharedKVKernels
from ..basics import FLOAT_DTYPES, fail as _fail
from ..basics import SIGNED_INDEX_DTYPES as INDEX_DTYPES  # read in place, -1 allowed: no uint32 (see openmla.basics)
from ..shared_kv_spec import CompressedKeys, EntryLayout, PagedEntries, SharedKVSpec



@dataclass
class SharedKVPlan:
    """One validated V4 attention call (what a backend reads)."""

    spec: SharedKVSpec
    raw: PagedEntries
    compressed: PagedEntries | None
    q_offsets: torch.Tensor  # int64 [B+1]
    token_seq: torch.Tensor  # int64 [T]: each query row's sequence
    token_pos: torch.Tensor  # int64 [T]: its absolute position
    num_tokens: int
    num_heads: int
    device: torch.device
    window_keys: int  # raw keys gathered per query: min(window, longest sequence)
    compressed_keys: int  # compressed keys gathered per query (rule: most entries any query sees; indices: K)
    kv_lengths: list[int]
    backend: Backend | None = None
    backend_name: str = ""
    fallback_reason: str | None = None

    def __post_init__(self) -> None:
        self.handle = dispatch.PlanHandle(self)  # how the custom op carries this plan (each copy its own)

    def for_layer(self, raw: PagedEntries, spec: SharedKVSpec, compressed: PagedEntries | None = None) -> "SharedKVPlan":
        """The same step over another layer of the same stores: ``raw`` / ``compressed`` with the
        same tables and lengths and blocks of the same shape, dtype and device; ``spec`` with the
        same window, scale, entry and rate (its own sinks and, per query, picks of any width).
        O(1) checks, no host read: the step was validated once."""
        def same(name: str, new: PagedEntries | None, old: PagedEntries | None) -> None:
            if (new is None) != (old is None):
                _fail(name, "given for one layer and not the other; every layer of a plan reads the same streams")
            if new is None:
                return
            if new.block_table is not old.block_table or new.lengths is not old.lengths:
                _fail(name, "must share the planned step's block_table and lengths (the same store tables)")
            b, o = new.blocks, old.blocks
            if b.shape != o.shape or b.dtype != o.dtype or b.device != o.device:
                _fail(f"{name}.blocks", f"expected {tuple(o.shape)} {o.dtype} on {o.device}, got {tuple(b.shape)} {b.dtype} on {b.device}")

        same("raw", raw, self.raw)
        same("compressed", compressed, self.compressed)
        old = self.spec
        if not isinstance(spec, SharedKVSpec) or (spec.window, spec.scale, spec.entry) != (old.window, old.scale, old.entry):
            _fail("spec", "another layer of a planned step needs the same window, scale and entry layout")
        ck, keys = spec.compressed, self.compressed_keys
        if (ck is None) != (old.compressed is None) or (ck is not None and (ck.rate != old.compressed.rate
                                                                             or (ck.indices is None) != (old.compressed.indices is None))):
            _fail("spec.compressed", "another layer of a planned step needs the same compressed stream (rate, rule or indices)")
        if ck is not None and ck.indices is not None:
            idx = ck.indices
            if not isinstance(idx, torch.Tensor) or idx.dim() != 2 or idx.dtype not in INDEX_DTYPES or idx.shape[0] != self.num_tokens \
                    or idx.device != self.device:
                _fail("spec.compressed.indices", f"expected int32/int64 [{self.num_tokens}, K] on {self.device}")
            keys = int(idx.shape[1])  # values need no host check: the kernel keeps only entries w < (t+1)//rate <= lengths
        sink = spec.attn_sink
        if sink is not None and (not isinstance(sink, torch.Tensor) or sink.dtype != torch.float32
                                 or tuple(sink.shape) != (self.num_heads,) or sink.device != self.device):
            _fail("spec.attn_sink", f"expected a float32 [{self.num_heads}] tensor on {self.device}")
        return dataclasses.replace(self, spec=spec, raw=raw, compressed=compressed, compressed_keys=keys)

    def run(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``q [T, H, D]`` (normed and roped) -> ``out [T, H, D]`` in q's dtype, ``lse [T, H]`` float32."""
        if q.shape != (self.num_tokens, self.num_heads, self.spec.entry.width) or q.device != self.device:
            raise ValueError(f"q: this plan was made for [{self.num_tokens}, {self.num_heads}, {self.spec.entry.width}] on "
                             f"{self.device}, got {tuple(q.shape)} on {q.device}")
        return dispatch.shared_kv(self, q)


def _int_tensor(name: str, t: object, rank: int, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != rank or t.dtype not in INDEX_DTYPES:
        _fail(name, f"expected a {rank}-D int32/int64 tensor, got {t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}"
              f"{tuple(t.shape) if isinstance(t, torch.Tensor) else ''}")
    if t.device != device:
        _fail(name, f"on {t.device}, q is on {device}")


def _check_store(name: str, store: object, B: int, width: int, dtype: torch.dtype, device: torch.device) -> None:
    if not isinstance(store, PagedEntries):
        _fail(name, f"expected an openmla.v4.PagedEntries, got {type(store).__name__}")
    b = store.blocks
    if not isinstance(b, torch.Tensor) or b.dim() != 3 or b.shape[2] != width or b.shape[1] < 1:
        _fail(f"{name}.blocks", f"expected [num_pages, page_size, {width}], got {tuple(b.shape) if isinstance(b, torch.Tensor) else b}")
    if b.dtype != dtype or b.device != device:
        _fail(f"{name}.blocks", f"expected {dtype} on {device} (q's), got {b.dtype} on {b.device}")
    _int_tensor(f"{name}.block_table", store.block_table, 2, device)
    _int_tensor(f"{name}.lengths", store.lengths, 1, device)
    if store.block_table.shape[0] != B or store.lengths.shape[0] != B:
        _fail(f"{name}.block_table", f"{store.block_table.shape[0]} rows and {store.lengths.shape[0]} lengths for {B} sequences")


def _check_pages(name: str, store: PagedEntries, spans: list[tuple[int, int]]) -> None:
    """Every page holding an entry of ``spans[b] = (lo, hi)`` (half open) must be a real page."""
    ps, num_pages = store.page_size, int(store.blocks.shape[0])
    table = store.block_table.cpu()
    for b, (lo, hi) in enumerate(spans):
        if hi <= lo:
            continue
        last = (hi - 1) // ps
        if last >= table.shape[1]:
            _fail(f"{name}.block_table", f"sequence {b} holds {hi} entries: needs {last + 1} logical pages, the table has {table.shape[1]}")
        pages = table[b, lo // ps: last + 1]
        if bool(((pages < 0) | (pages >= num_pages)).any()):
            _fail(f"{name}.block_table", f"sequence {b}: a page its queries read is outside [0, {num_pages}): {pages.tolist()}")


def plan_shared_kv(q: torch.Tensor, q_offsets: torch.Tensor, raw: PagedEntries, spec: SharedKVSpec,
                   compressed: PagedEntries | None = None, *, backend: str | None = None) -> SharedKVPlan:
    """Check one V4 attention call and choose its backend.

    ``q [T, H, D]`` (normed, roped), ``q_offsets`` int ``[B+1]`` (rows of sequence ``b``:
    ``q_offsets[b]:[b+1]``; its new tokens are the last ``n_b`` of ``raw.lengths[b]``), ``raw``
    the raw entries (new ones already written), ``spec`` what to compute, ``compressed`` the
    compressed entries (iff ``spec.compressed``). ``backend`` as ``openmla.plan``'s.
    """
    if not isinstance(spec, SharedKVSpec):
        _fail("spec", f"expected an openmla.v4.SharedKVSpec, got {type(spec).__name__}")
    if not isinstance(q, torch.Tensor) or q.dim() != 3 or q.dtype not in FLOAT_DTYPES:
        _fail("q", f"expected a float [T, H, D] tensor, got {q.dtype if isinstance(q, torch.Tensor) else type(q).__name__}")
    T, H, D = q.shape
    device = q.device
    entry = spec.entry
    if not isinstance(entry, EntryLayout):
        _fail("spec.entry", f"expected an openmla.v4.EntryLayout, got {type(entry).__name__}")
    if entry.value != "whole":
        _fail("spec.entry.value", f"only 'whole' (the value is the whole entry) is implemented, got {entry.value!r}")
    if not isinstance(entry.width, int) or entry.width < 1 or entry.width != D:
        _fail("spec.entry.width", f"must be q's last dim {D}, got {entry.width!r}")
    if not isinstance(entry.rope_dim, int) or not 0 <= entry.rope_dim <= D or entry.rope_dim % 2:
        _fail("spec.entry.rope_dim", f"expected an even int in [0, {D}], got {entry.rope_dim!r}")
    if not isinstance(spec.scale, (int, float)) or isinstance(spec.scale, bool) or not math.isfinite(spec.scale):
        _fail("spec.scale", f"expected a finite float, got {spec.scale!r}")
    if isinstance(spec.window, bool) or not isinstance(spec.window, int) or spec.window < 1:
        _fail("spec.window", f"expected an int >= 1, got {spec.window!r}")
    if H < 1:
        _fail("q", "needs at least one head")
    _int_tensor("q_offsets", q_offsets, 1, device)
    B = q_offsets.shape[0] - 1
    if B < 0:
        _fail("q_offsets", "needs B+1 >= 1 entries")
    offs = [int(x) for x in q_offsets.tolist()]
    if offs[0] != 0 or offs[-1] != T or any(b < a for a, b in zip(offs, offs[1:])):
        _fail("q_offsets", f"must start at 0, never decrease and end at T={T}, got {offs}")
    _check_store("raw", raw, B, D, q.dtype, device)
    kv_lens = [int(x) for x in raw.lengths.tolist()]
    new = [b - a for a, b in zip(offs, offs[1:])]
    for b in range(B):
        if kv_lens[b] < new[b]:
            _fail("raw.lengths", f"sequence {b} has {new[b]} new tokens but holds only {kv_lens[b]} entries (write them first)")
    W = spec.window
    _check_pages("raw", raw, [(max(0, kv - n - W + 1), kv) if n else (0, 0) for kv, n in zip(kv_lens, new)])
    sink = spec.attn_sink
    if sink is not None and (not isinstance(sink, torch.Tensor) or sink.dtype != torch.float32 or tuple(sink.shape) != (H,)
                             or sink.device != device):
        _fail("spec.attn_sink", f"expected a float32 [{H}] tensor on {device}")
    seq = torch.repeat_interleave(torch.arange(B, dtype=torch.int64), torch.tensor(new, dtype=torch.int64))
    pos = torch.cat([torch.arange(kv - n, kv, dtype=torch.int64) for kv, n in zip(kv_lens, new)] or [torch.zeros(0, dtype=torch.int64)])
    max_kv = max(kv_lens, default=0)
    comp_keys = 0
    ck = spec.compressed
    if ck is None:
        if compressed is not None:
            _fail("compressed", "given, but spec.compressed is None")
    else:
        if not isinstance(ck, CompressedKeys):
            _fail("spec.compressed", f"expected an openmla.v4.CompressedKeys, got {type(ck).__name__}")
        if isinstance(ck.rate, bool) or not isinstance(ck.rate, int) or ck.rate < 1:
            _fail("spec.compressed.rate", f"expected an int >= 1, got {ck.rate!r}")
        if compressed is None:
            _fail("compressed", "spec.compressed asks for a compressed key stream; pass its entries")
        _check_store("compressed", compressed, B, D, q.dtype, device)
        c_lens = [int(x) for x in compressed.lengths.tolist()]
        seen = [kv // ck.rate for kv in kv_lens]  # entries the sequence's last query may see
        for b in range(B):
            if c_lens[b] < seen[b] and new[b] > 0:
                _fail("compressed.lengths", f"sequence {b} reaches position {kv_lens[b] - 1}, so its queries may see "
                      f"{seen[b]} compressed entries, but it holds {c_lens[b]}")
        _check_pages("compressed", compressed, [(0, s if n else 0) for s, n in zip(seen, new)])
        if ck.indices is None:
            comp_keys = max((s for s, n in zip(seen, new) if n), default=0)
        else:
            idx = ck.indices
            _int_tensor("spec.compressed.indices", idx, 2, device)
            if idx.shape[0] != T:
                _fail("spec.compressed.indices", f"expected {T} rows (one per query), got {idx.shape[0]}")
            host = idx.cpu().long()
            limit = torch.tensor(c_lens, dtype=torch.int64)[seq] if T else torch.zeros(0, dtype=torch.int64)
            bad = (host < -1) | (host >= limit[:, None])
            if bool(bad.any()):
                r = int(bad.any(dim=1).nonzero()[0])
                _fail("spec.compressed.indices", f"row {r} (sequence {int(seq[r])}) lists {host[r].tolist()}: entries must be -1 "
                      f"or in [0, {int(limit[r])})")
            comp_keys = int(idx.shape[1])
    plan = SharedKVPlan(spec, raw, compressed, q_offsets.to(torch.int64), seq.to(device), pos.to(device), T, H, device,
                        min(W, max_kv), comp_keys, kv_lens)
    name = resolve_backend_name(backend, device)
    plan.backend, plan.fallback_reason = choose_backend(name, plan, SharedKVKernels)
    plan.backend_name = plan.backend.name
    return plan


def shared_kv_attention(q: torch.Tensor, q_offsets: torch.Tensor, raw: PagedEntries, spec: SharedKVSpec,
                        compressed: PagedEntries | None = None, *, backend: str | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Plan and run one V4 attention call: ``out [T, H, D]`` (q's dtype), ``lse [T, H]`` float32."""
    return plan_shared_kv(q, q_offsets, raw, spec, compressed, backend=backend).run(q)
