"""The Triton kernels under metadata corrupted *after* validation (a page table entry, a sparse
index, a length, an offset edited in place): every load and store stays inside the cache, the
page table and the buffers, an out-of-range page or row reads as an invisible key and a write
to one is skipped. Without those bounds these calls read and write far outside the tensors,
so every body runs in a child process (``isolated``): a regression fails its test instead of
crashing the run.

The kernel-level functions are called directly (no validation). The cache storage is a slice
of a larger tensor whose pages on both sides are NaN (all bits set: NaN for every float and
fp8 format), and the output buffers are slices of NaN-guarded buffers too: a load from a guard
page turns the output NaN, a store into one changes its bits. Entries that point just past
either end land in the guard pages; entries far away (``far_corruption``) only show as a crash
or a non-finite output.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import pytest
import torch

from triton_support import require_triton

_common = require_triton()  # skips the module where the backend cannot run

from openmla import reference as ref  # noqa: E402
from openmla.backends.triton.cache_write import write_cache  # noqa: E402
from openmla.backends.triton.decode import decode_into  # noqa: E402
from openmla.backends.triton.prefill import flare_mla_prefill, prefill  # noqa: E402
from openmla.masks import MaskVariant  # noqa: E402
from openmla.planning import chunk_plan  # noqa: E402

from cases import TOL, assert_close, make_case, small_config  # noqa: E402
from isolated import isolated  # noqa: E402,F401  (fixture)

GUARD = 2  # guard pages (and guard rows of outputs) on each side
F32 = torch.float32


def fp8_config(fmt: str):
    """Small shapes; fp8_ds_mla needs a latent of whole 128-value groups."""
    return small_config(num_heads=2, L=128 if fmt == "fp8_ds_mla" else 32, R=8, Dn=16, Dv=16)


def a_case(fmt: str, cache_lens, new_lens, page_size=4, seed=None):
    cache_dtype = None if fmt == "native" else fmt
    return make_case(cache_lens, new_lens, config=fp8_config(fmt), page_size=page_size, cache_dtype=cache_dtype, seed=seed)


def guarded(batch):
    """``batch`` over a copy of its storage in the middle of a tensor with GUARD all-ones-bits pages
    on each side; returns ``(batch, whole)``. Metadata tensors are private copies."""
    nl, P, ps, W = batch.blocks.shape
    whole = torch.empty(nl, P + 2 * GUARD, ps, W, dtype=batch.blocks.dtype)
    whole.view(torch.uint8).fill_(0xFF)
    real = whole[:, GUARD: GUARD + P]
    real.copy_(batch.blocks)
    g = dataclasses.replace(batch, blocks=real, block_table=batch.block_table.clone(), cache_lengths=batch.cache_lengths.clone(),
                            input_row_offsets=batch.input_row_offsets.clone(), _host=batch._host.copy())
    return g, whole


def guards_intact(whole: torch.Tensor) -> bool:
    b = whole.view(torch.uint8)
    return bool((b[:, :GUARD] == 0xFF).all() and (b[:, -GUARD:] == 0xFF).all())


@contextlib.contextmanager
def guarded_outputs():
    """Every buffer the backend allocates is the middle of a NaN tensor with GUARD rows (dim 0)
    on each side; the ``check()`` it yields asserts no guard row was written."""
    made = []

    def empty(shape, dtype, device):
        whole = torch.full((shape[0] + 2 * GUARD, *shape[1:]), float("nan"), dtype=dtype, device=device)
        made.append(whole)
        return whole[GUARD: GUARD + shape[0]]

    def check():
        for w in made:
            assert torch.isnan(w[:GUARD]).all() and torch.isnan(w[-GUARD:]).all(), "a kernel wrote outside its output buffer"

    saved = _common.empty_output
    _common.empty_output = empty
    try:
        yield check
    finally:
        _common.empty_output = saved


def absorbed_q(case) -> torch.Tensor:
    T = case.q.shape[0]
    return torch.randn(T, case.config.num_heads, case.config.cache_head_dim, generator=torch.Generator().manual_seed(case.seed + 1))


def run_decode(q, batch, case, **kw):
    kv_scale = batch.kv_scale[case.layer_idx: case.layer_idx + 1] if batch.cache_format == "fp8_e4m3" else None
    return decode_into(q, batch.blocks[case.layer_idx], batch.block_table, batch.cache_lengths, batch.input_row_offsets,
                       batch.page_size, scale=case.scale, kv_lora_rank=case.config.kv_lora_rank, num_splits=2,
                       cache_format=batch.cache_format, kv_scale=kv_scale, **kw)


def rows_without(batch, b: int, positions: list[int], bad_cols: set[int]) -> list[int]:
    """Physical rows (through the clean table) of ``positions`` of sequence ``b`` not on ``bad_cols``."""
    ps = batch.page_size
    keep = [p for p in positions if p // ps not in bad_cols]
    return ref.physical_rows(batch, b, torch.tensor(keep, dtype=torch.long)).tolist() if keep else []


def padded(rows_per_query: list[list[int]]) -> torch.Tensor:
    width = max([len(r) for r in rows_per_query] + [1])
    return torch.tensor([r + [-1] * (width - len(r)) for r in rows_per_query], dtype=torch.int32)


# Bodies (run in the child) ------------------------------------------------------------------
# Decode ---------------------------------------------------------------------------------------
def decode_table_entries_outside_the_cache_are_invisible(outputs_ok, fmt):
    case = a_case(fmt, [37, 20], [1, 1], page_size=8)
    ref.write_cache(case.kv, case.freqs_cis, case.gamma, case.batch, case.layer_idx, 1e-6)
    clean = case.batch
    batch, whole = guarded(clean)
    P = batch.num_pages
    bad = {0: {1: -1, 3: P + 1}, 1: {0: P}}  # sequence -> {table column: corrupt page}
    for b, cols in bad.items():
        for col, page in cols.items():
            batch.block_table[b, col] = page
    q = absorbed_q(case)
    out, lse = run_decode(q, batch, case)
    assert guards_intact(whole)
    outputs_ok()
    # The same as attending to every key except those on the corrupt pages.
    rows = [rows_without(clean, b, list(range(n)), set(bad[b])) for b, n in enumerate(clean.seq_lens_list)]
    want, want_lse = ref.decode(q, clean, case.layer_idx, scale=case.scale, kv_lora_rank=case.config.kv_lora_rank,
                                sparse_indices=padded(rows), physical_indices=True)
    assert_close(out, want, TOL[F32], f"decode over corrupt pages ({fmt})", case.seed)
    assert_close(lse, want_lse, TOL[F32], "lse", case.seed)


def decode_sparse_rows_outside_the_cache_are_invisible(outputs_ok, fmt):
    case = a_case(fmt, [13, 6], [2, 1], page_size=4)
    ref.write_cache(case.kv, case.freqs_cis, case.gamma, case.batch, case.layer_idx, 1e-6)
    clean = case.batch
    batch, whole = guarded(clean)
    n_rows = batch.num_pages * batch.page_size
    good = [0, 5, 9, n_rows - 1]
    wild = [-2, -batch.page_size, n_rows, n_rows + GUARD * batch.page_size - 1]  # below -1, guard rows before and after
    idx = torch.tensor([good + wild, wild + good, good[:2] + wild + good[2:]], dtype=torch.int32)
    q = absorbed_q(case)
    out, lse = run_decode(q, batch, case, sparse_indices=idx, physical_indices=True)
    assert guards_intact(whole)
    outputs_ok()
    want, want_lse = ref.decode(q, clean, case.layer_idx, scale=case.scale, kv_lora_rank=case.config.kv_lora_rank,
                                sparse_indices=torch.where((idx >= 0) & (idx < n_rows), idx, -1), physical_indices=True)
    assert_close(out, want, TOL[F32], f"sparse decode over wild rows ({fmt})", case.seed)
    assert_close(lse, want_lse, TOL[F32], "lse", case.seed)


def decode_logical_sparse_through_a_corrupt_table(outputs_ok):
    case = a_case("native", [13, 6], [2, 1], page_size=4)
    ref.write_cache(case.kv, case.freqs_cis, case.gamma, case.batch, case.layer_idx, 1e-6)
    clean = case.batch
    batch, whole = guarded(clean)
    batch.block_table[0, 1] = batch.num_pages  # positions 4..7 of sequence 0
    batch.block_table[1, 0] = -1  # positions 0..3 of sequence 1
    idx = torch.tensor([[0, 4, 5, 12, 14], [1, 7, 13, 2, -1], [0, 3, 4, 6, -1]], dtype=torch.int32)
    q = absorbed_q(case)
    out, _ = run_decode(q, batch, case, sparse_indices=idx, physical_indices=False)
    assert guards_intact(whole)
    outputs_ok()
    # Causal: row 0 (position 13) cannot see 14. Pages lost: sequence 0's positions 4..7, sequence 1's 0..3.
    phys = [rows_without(clean, 0, [0, 4, 5, 12], {1}), rows_without(clean, 0, [1, 7, 13, 2], {1}),
            rows_without(clean, 1, [0, 3, 4, 6], {0})]
    want, _ = ref.decode(q, clean, case.layer_idx, scale=case.scale, kv_lora_rank=case.config.kv_lora_rank,
                         sparse_indices=padded(phys), physical_indices=True)
    assert_close(out, want, TOL[F32], "logical sparse over a corrupt table", case.seed)


def decode_lengths_and_offsets_edited(outputs_ok):
    """A length past the table's reach attends to the table's pages only; a negative one sees
    nothing; offsets flipped out of order never move a read or write outside its buffer."""
    case = a_case("native", [9, 5], [1, 1], page_size=4)
    clean = case.batch
    batch, whole = guarded(clean)
    batch.cache_lengths.copy_(torch.tensor([1000, -5], dtype=torch.int32))
    q = absorbed_q(case)
    out, lse = run_decode(q, batch, case)
    assert guards_intact(whole)
    outputs_ok()
    reach = batch.block_table.shape[1] * batch.page_size
    rows = [ref.physical_rows(clean, 0, torch.arange(reach)).tolist(), []]
    want, want_lse = ref.decode(q, clean, case.layer_idx, scale=case.scale, kv_lora_rank=case.config.kv_lora_rank,
                                sparse_indices=padded(rows), physical_indices=True)
    assert_close(out, want, TOL[F32], "decode with edited lengths", case.seed)
    assert torch.equal(torch.isinf(lse[1]), torch.ones_like(lse[1], dtype=torch.bool)) and bool((out[1] == 0).all())

    batch.cache_lengths.copy_(clean.cache_lengths)
    batch.input_row_offsets.copy_(torch.tensor([2, 0, 1], dtype=torch.int32))
    out, lse = run_decode(q, batch, case)
    assert guards_intact(whole)
    outputs_ok()
    assert torch.isfinite(out).all() and not torch.isnan(lse).any()


# Cache write ------------------------------------------------------------------------------------
def write_to_a_page_outside_the_cache_is_skipped(outputs_ok, fmt):
    case = a_case(fmt, [5, 0], [6, 3], page_size=4)  # sequence 0 writes positions 5..10 (columns 1, 2)
    clean = case.batch
    before, whole = guarded(clean)
    original = before.blocks.clone()
    want_batch, _ = guarded(clean)
    want_q = write_cache(case.q, case.kv, case.freqs_cis, case.gamma, want_batch, case.layer_idx, 1e-6)  # clean table
    batch = before
    batch.block_table[0, 2] = batch.num_pages  # positions 8..10 of sequence 0: guard page after
    batch.block_table[1, 0] = -1  # all of sequence 1: guard page before
    q_rot = write_cache(case.q, case.kv, case.freqs_cis, case.gamma, batch, case.layer_idx, 1e-6)
    assert guards_intact(whole), "a write escaped the cache"
    outputs_ok()
    skipped = torch.cat([ref.physical_rows(clean, 0, torch.arange(8, 11)), ref.physical_rows(clean, 1, torch.arange(0, 3))])
    want = want_batch.blocks.clone()
    flat_want, flat_orig = want[case.layer_idx].reshape(-1, want.shape[-1]), original[case.layer_idx].reshape(-1, want.shape[-1])
    flat_want[skipped] = flat_orig[skipped]
    assert torch.equal(batch.blocks.view(torch.uint8), want.view(torch.uint8)), "rows on good pages differ, or a skipped row was written"
    assert torch.equal(q_rot, want_q), "q's rotation depends on the page table"


def write_with_lengths_past_freqs_and_table(outputs_ok):
    """A length edited past the rope table and the page table writes nothing and rotates q by
    zeros (no read outside freqs_cis); a negative one likewise."""
    case = a_case("native", [5, 2], [2, 2], page_size=4)
    batch, whole = guarded(case.batch)
    original = batch.blocks.clone()
    batch.cache_lengths.copy_(torch.tensor([10**6, -7], dtype=torch.int32))
    q_rot = write_cache(case.q, case.kv, case.freqs_cis, case.gamma, batch, case.layer_idx, 1e-6)
    assert guards_intact(whole)
    outputs_ok()
    assert torch.equal(batch.blocks, original), "a write landed although every position is out of range"
    R = case.config.qk_rope_head_dim
    assert torch.equal(q_rot[..., :-R], case.q[..., :-R]) and bool((q_rot[..., -R:] == 0).all())


def write_refuses_q_shallower_than_the_rope_width(outputs_ok):
    case = a_case("native", [5], [2], page_size=4)
    with pytest.raises(ValueError, match="^q"):
        write_cache(case.q[..., :3], case.kv, case.freqs_cis, case.gamma, case.batch, case.layer_idx, 1e-6)


# Prefill ----------------------------------------------------------------------------------------
def dense_prefill_over_a_corrupt_table(outputs_ok):
    """The chunked prefill (latent gather in torch, rope read in the kernel) with two table
    entries outside the cache: those pages' keys are invisible to every query."""
    case = a_case("native", [9, 3], [6, 5], page_size=4)
    ref.write_cache(case.kv, case.freqs_cis, case.gamma, case.batch, case.layer_idx, 1e-6)
    clean = case.batch
    batch, whole = guarded(clean)
    bad = {0: {1: -1}, 1: {1: batch.num_pages}}
    for b, cols in bad.items():
        for col, page in cols.items():
            batch.block_table[b, col] = page
    q = case.q
    out, lse = prefill(q, batch, case.layer_idx, case.w_k, case.w_uv, scale=case.scale, mask=MaskVariant(), attn_sink=None,
                       chunks=chunk_plan(clean.seq_lens_list, 7))
    assert guards_intact(whole)
    outputs_ok()
    # Logical sparse indices: every position not on a bad page (the causal mask still applies).
    logical = []
    for row, b, pos in ref._query_positions(clean):
        logical.append([p for p in range(clean.seq_lens_list[b]) if p // clean.page_size not in bad[b]])
    idx = torch.tensor([r + [-1] * (max(map(len, logical)) - len(r)) for r in logical], dtype=torch.int32)
    want, want_lse = ref.prefill(q, clean, case.layer_idx, case.w_k, case.w_uv, scale=case.scale, sparse_indices=idx,
                                 physical_indices=False)
    assert_close(out, want, TOL[F32], "prefill over corrupt pages", case.seed)
    assert_close(lse, want_lse, TOL[F32], "lse", case.seed)


def flare_prefill_with_wild_offsets(outputs_ok):
    """Buffer offsets past the k/v rows, negative cache offsets and query offsets past q: no
    read or write outside q, k, v, the cache or out."""
    case = a_case("native", [9, 3], [6, 5], page_size=4)
    batch, whole = guarded(case.batch)
    H, Dn, Dv = case.config.num_heads, case.config.qk_nope_head_dim, case.config.v_head_dim
    S = 12
    k, v = torch.randn(S, H, Dn), torch.randn(S, H, Dv)
    bro = torch.tensor([-4, 10, S + 50], dtype=torch.int32)
    co = torch.tensor([-3, 2, 0], dtype=torch.int32)
    batch.input_row_offsets.copy_(torch.tensor([0, 9, 40], dtype=torch.int32))  # sequence 1's rows 9..39, past T = 11
    out, lse = flare_mla_prefill(case.q, k, v, bro, co, batch, case.layer_idx, scale=case.scale, mask=MaskVariant())
    assert guards_intact(whole)
    outputs_ok()
    assert not torch.isnan(lse[torch.isfinite(lse)]).any()


# The tests: each body runs in the child process ---------------------------------------------------
def guarded_call(body, *args) -> None:
    """In the child: ``body(outputs_ok, *args)`` with guarded output buffers."""
    with guarded_outputs() as outputs_ok:
        body(outputs_ok, *args)


FORMATS = ["native", "fp8_e4m3", "fp8_ds_mla"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_table_entries_outside_the_cache_are_invisible(fmt, isolated):  # noqa: F811
    isolated.run(guarded_call, decode_table_entries_outside_the_cache_are_invisible, fmt)


@pytest.mark.parametrize("fmt", ["native", "fp8_ds_mla"])
def test_decode_sparse_rows_outside_the_cache_are_invisible(fmt, isolated):  # noqa: F811
    isolated.run(guarded_call, decode_sparse_rows_outside_the_cache_are_invisible, fmt)


def test_decode_logical_sparse_through_a_corrupt_table(isolated):  # noqa: F811
    isolated.run(guarded_call, decode_logical_sparse_through_a_corrupt_table)


def test_decode_lengths_and_offsets_edited(isolated):  # noqa: F811
    isolated.run(guarded_call, decode_lengths_and_offsets_edited)


@pytest.mark.parametrize("fmt", FORMATS)
def test_write_to_a_page_outside_the_cache_is_skipped(fmt, isolated):  # noqa: F811
    isolated.run(guarded_call, write_to_a_page_outside_the_cache_is_skipped, fmt)


def test_write_with_lengths_past_freqs_and_table(isolated):  # noqa: F811
    isolated.run(guarded_call, write_with_lengths_past_freqs_and_table)


def test_write_refuses_q_shallower_than_the_rope_width(isolated):  # noqa: F811
    isolated.run(guarded_call, write_refuses_q_shallower_than_the_rope_width)


def test_dense_prefill_over_a_corrupt_table(isolated):  # noqa: F811
    isolated.run(guarded_call, dense_prefill_over_a_corrupt_table)


def test_flare_prefill_with_wild_offsets(isolated):  # noqa: F811
    isolated.run(guarded_call, flare_prefill_with_wild_offsets)


# Far away: in a child process ---------------------------------------------------------------------
def far_corruption(fmt: str) -> str:
    """Decode, sparse decode, cache write and prefill with entries around +-2^30 and lengths near
    2^31 (no guard page can catch those): runs in the child; returns a report."""
    case = a_case(fmt, [9, 5], [2, 1], page_size=4, seed=7)
    b = case.batch
    b.block_table[0, 1] = 2**30
    b.block_table[1, 0] = -(2**30)
    q = absorbed_q(case)
    out, _ = run_decode(q, b, case)
    idx = torch.tensor([[2**30, -(2**30), 3], [5, 2**31 - 1, -1], [-(2**31), 0, 1]], dtype=torch.int32)
    out_s, _ = run_decode(q, b, case, sparse_indices=idx, physical_indices=True)
    out_l, _ = run_decode(q, b, case, sparse_indices=idx, physical_indices=False)
    write_cache(case.q, case.kv, case.freqs_cis, case.gamma, b, case.layer_idx, 1e-6)
    b.cache_lengths.copy_(torch.tensor([2**31 - 100, -(2**31) + 100], dtype=torch.int32))
    out_w = run_decode(q, b, case)[0]
    write_cache(case.q, case.kv, case.freqs_cis, case.gamma, b, case.layer_idx, 1e-6)
    pre, _ = prefill(case.q, dataclasses.replace(b, _host=case.batch._host.copy()), case.layer_idx, case.w_k, case.w_uv,
                     scale=case.scale, mask=MaskVariant(), attn_sink=None, chunks=chunk_plan(case.batch.seq_lens_list, 8))
    finite = all(bool(torch.isfinite(t).all()) for t in (out, out_s, out_l, out_w, pre))
    return "ok" if finite else "non-finite output"


@pytest.mark.parametrize("fmt", ["native", "fp8_ds_mla"])
def test_far_out_of_range_metadata_in_a_child(fmt, isolated):  # noqa: F811
    assert isolated.run(far_corruption, fmt) == "ok"


def test_isolated_reports_a_crash(isolated):  # noqa: F811
    """The helper itself: a child that aborts fails the call with ``ChildCrashed`` (and the next
    call gets a fresh child)."""
    import os

    from isolated import ChildCrashed

    with pytest.raises(ChildCrashed):
        isolated.run(os.abort)
    assert isolated.run(math.sqrt, 4.0) == 2.0
