"""Paged cache lifecycle: prepare/commit/release, page accounting, CacheFullError atomicity."""

import random

import pytest
import torch

from openmla import CacheBatch, CacheFullError, PageAllocator, PagedLatentCache


def snapshot(cache):
    return (list(cache.allocator._free), {k: list(v) for k, v in cache._pages.items()}, dict(cache._lengths))


def check_invariants(cache):
    owned = [p for pages in cache._pages.values() for p in pages]
    assert len(owned) == len(set(owned)), "a page is owned twice"
    assert set(owned).isdisjoint(cache.allocator._free), "an owned page is also free"
    assert len(owned) + cache.num_free_pages == cache.num_pages
    for s, n in cache._lengths.items():
        assert len(cache._pages[s]) >= -(-n // cache.page_size)


def test_prepare_commit_release_cycle():
    cache = PagedLatentCache(num_layers=3, num_pages=10, page_size=4, head_dim=8, dtype=torch.float32)
    b = cache.prepare(["a", "b"], [5, 0])
    assert b.block_table.shape == (2, 2) and b.block_table.dtype == torch.int32
    assert b.cache_lengths.tolist() == [0, 0] and b.input_row_offsets.tolist() == [0, 5, 5]
    assert cache.num_free_pages == 8 and cache.length("a") == 0
    cache.commit(b)
    assert cache.length("a") == 5 and cache.length("b") == 0
    b2 = cache.prepare(["a", "b"], [3, 1])  # a: 8 tokens -> 2 pages (has 2); b: 1 page
    assert cache.num_free_pages == 7
    assert b2.cache_lengths.tolist() == [5, 0] and b2.input_row_offsets.tolist() == [0, 3, 4]
    cache.commit(b2)
    with pytest.raises(ValueError, match="batch"):
        cache.commit(b2)  # twice
    cache.release("a")
    assert cache.num_free_pages == 9 and cache.sequences == ["b"]
    with pytest.raises(ValueError, match="seq_id"):
        cache.release("a")
    check_invariants(cache)


def test_cache_full_changes_nothing():
    cache = PagedLatentCache(num_layers=1, num_pages=4, page_size=16, head_dim=8, dtype=torch.float32)
    cache.commit(cache.prepare(["x"], [40]))  # 3 pages
    before = snapshot(cache)
    with pytest.raises(CacheFullError):
        cache.prepare(["y", "x"], [10, 20])  # y needs 1, x needs 1 more -> 2 > 1 free
    assert snapshot(cache) == before
    assert "y" not in cache.sequences
    cache.prepare(["y"], [16])  # exactly one page fits
    assert cache.num_free_pages == 0


@pytest.mark.parametrize("page_size", [1, 3, 16, 64, 256])
def test_random_lifecycle(page_size):
    rng = random.Random()
    seed = rng.randrange(2**31)
    rng = random.Random(seed)
    cache = PagedLatentCache(num_layers=2, num_pages=64, page_size=page_size, head_dim=4, dtype=torch.float32)
    shadow: dict[int, int] = {}
    next_id = 0
    for step in range(300):
        op = rng.random()
        if op < 0.2 and shadow:
            sid = rng.choice(list(shadow))
            cache.release(sid)
            del shadow[sid]
        else:
            ids = rng.sample(list(shadow), k=min(len(shadow), rng.randint(0, 3)))
            if op > 0.6 or not ids:
                ids.append(next_id)
                next_id += 1
            counts = [rng.randint(0, 3 * page_size) for _ in ids]
            before = snapshot(cache)
            try:
                batch = cache.prepare(ids, counts)
            except CacheFullError:
                assert snapshot(cache) == before, f"seed {seed}"
                continue
            table = batch.block_table.tolist()
            for i, s in enumerate(ids):
                n = shadow.get(s, 0) + counts[i]
                assert table[i][: len(cache.pages(s))] == cache.pages(s)
                assert len(cache.pages(s)) == -(-n // page_size), f"seed {seed}"
            cache.commit(batch)
            for s, c in zip(ids, counts):
                shadow[s] = shadow.get(s, 0) + c
        check_invariants(cache)
        assert {s: cache.length(s) for s in cache.sequences} == shadow, f"seed {seed}"


def test_bytes_per_token_and_prepare_errors():
    cache = PagedLatentCache(num_layers=1, num_pages=2, page_size=64)
    assert cache.bytes_per_token == 1152
    with pytest.raises(ValueError, match="num_new_tokens"):
        cache.prepare(["a"], [1, 2])
    with pytest.raises(ValueError, match="seq_ids"):
        cache.prepare(["a", "a"], [1, 2])
    with pytest.raises(ValueError, match="num_new_tokens"):
        cache.prepare(["a"], [-1])
    with pytest.raises(ValueError, match="page_size"):
        PagedLatentCache(num_layers=1, num_pages=2, page_size=0)


# All-or-nothing lifecycle, stale batches, argument checks (issue: hardening) ------------------
def full_snapshot(cache):
    return snapshot(cache) + (bytes(cache.allocator._taken), dict(cache._generations))


def small_cache(num_pages=8, page_size=4):
    return PagedLatentCache(num_layers=2, num_pages=num_pages, page_size=page_size, head_dim=8, dtype=torch.float32, rope_dim=2)


def test_commit_is_all_or_nothing():
    """A batch whose second sequence was released: commit raises and the first keeps its length."""
    cache = small_cache()
    cache.commit(cache.prepare(["a", "b"], [3, 2]))
    batch = cache.prepare(["a", "b"], [1, 1])
    cache.release("b")
    before = full_snapshot(cache)
    with pytest.raises(ValueError, match="^batch: sequence 'b' was released"):
        cache.commit(batch)
    assert full_snapshot(cache) == before and cache.length("a") == 3
    check_invariants(cache)


@pytest.mark.parametrize("how", ["readmitted", "twice", "committed by another batch", "other cache", "hand-built"])
def test_stale_batch_cannot_commit(how):
    cache = small_cache()
    first = cache.prepare(["a"], [5])
    if how == "readmitted":  # the case: the length would exceed the pages reserved
        cache.release("a")
        cache.prepare(["a"], [1])
    elif how == "twice":
        cache.commit(first)
    elif how == "committed by another batch":
        cache.commit(cache.prepare(["a"], [2]))
    elif how == "other cache":
        first = small_cache().prepare(["a"], [5])
    else:
        first = CacheBatch(first.blocks, first.block_table, first.cache_lengths, first.input_row_offsets, first.page_size, ("a",))
    before = full_snapshot(cache)
    with pytest.raises(ValueError, match="^batch"):
        cache.commit(first)
    assert full_snapshot(cache) == before
    check_invariants(cache)


def test_commit_applies_the_reserved_counts_not_edited_metadata():
    cache = small_cache()
    batch = cache.prepare(["a"], [3])
    batch.input_row_offsets.copy_(torch.tensor([0, 100], dtype=torch.int32))  # edited after prepare
    cache.commit(batch)
    assert cache.length("a") == 3
    check_invariants(cache)


@pytest.mark.parametrize("counts", [[1.0], [2.5], [None], [True], ["3"], [-1], [float("nan")], 3, None, "1", [1, 1], []])
def test_prepare_rejects_bad_counts(counts):
    cache = small_cache()
    before = full_snapshot(cache)
    with pytest.raises(ValueError, match="^num_new_tokens"):
        cache.prepare(["a"], counts)
    assert full_snapshot(cache) == before and cache.sequences == []


@pytest.mark.parametrize("ids", [None, "ab", b"ab", 3, [[1]], [torch.tensor(1)], ["a", "a"], {"a"}, [("a", [1])]])
def test_prepare_rejects_bad_ids(ids):
    cache = small_cache()
    with pytest.raises(ValueError, match="^seq_ids"):
        cache.prepare(ids, [1] * (len(ids) if isinstance(ids, (list, set)) else 2))
    assert full_snapshot(cache) == full_snapshot(small_cache())


def test_prepare_accepts_integral_counts_and_any_sequence():
    np = pytest.importorskip("numpy")
    cache = small_cache()
    batch = cache.prepare(("a", 7), (np.int64(3), 0))
    assert batch.seq_ids == ("a", 7) and batch.input_row_offsets.tolist() == [0, 3, 3]


def test_prepare_failing_late_changes_nothing(monkeypatch):
    """Even a failure after the pages were chosen (building the batch) leaves no trace."""
    cache = small_cache()
    cache.commit(cache.prepare(["a"], [5]))
    before = full_snapshot(cache)

    def boom(self):
        raise RuntimeError("device lost")

    monkeypatch.setattr(CacheBatch, "__post_init__", boom)
    with pytest.raises(RuntimeError):
        cache.prepare(["a", "b"], [9, 9])
    assert full_snapshot(cache) == before


def test_release_is_all_or_nothing_and_checks_its_argument():
    cache = small_cache()
    cache.commit(cache.prepare(["a", "b"], [9, 2]))
    for bad in (["a"], {"a": 1}, torch.tensor(0), "nobody"):
        before = full_snapshot(cache)
        with pytest.raises(ValueError, match="^seq_id"):
            cache.release(bad)
        assert full_snapshot(cache) == before
    cache.allocator._taken[cache.pages("a")[1]] = 0  # a corrupted allocator: one of a's pages looks free
    before = full_snapshot(cache)
    with pytest.raises(ValueError, match="^pages"):
        cache.release("a")
    assert full_snapshot(cache) == before


def test_allocator_rejects_double_and_foreign_frees():
    alloc = PageAllocator(4)
    pages = alloc.allocate(2)
    for bad in ([pages[0], pages[0]], [4], [-1], [2.0], [pages[0], 3]):
        free_before = list(alloc._free)
        with pytest.raises(ValueError, match="^pages"):
            alloc.free(bad)
        assert alloc._free == free_before
    alloc.free(pages)
    assert alloc.num_free == 4
    with pytest.raises(ValueError, match="^pages"):
        alloc.free(pages)  # already free


def test_batch_for_registers_nothing():
    cache = small_cache()
    cache.commit(cache.prepare(["a"], [6]))
    view = cache.batch_for(["a"])
    assert view.cache_lengths.tolist() == [6] and view.new_tokens_list == [0]
    with pytest.raises(ValueError, match="^seq_ids"):
        cache.batch_for(["a", "ghost"])
    assert cache.sequences == ["a"]


@pytest.mark.parametrize("bad", [
    dict(num_layers=0), dict(num_layers=True), dict(num_pages=2.0), dict(num_pages=-3), dict(page_size=None),
    dict(head_dim="8"), dict(rope_dim=-2), dict(rope_dim=3), dict(dtype=torch.int16), dict(dtype=torch.float8_e5m2),
    dict(dtype="bf16"), dict(dtype=None), dict(device="nowhere"), dict(device="meta"), dict(device=3.5),
    dict(kv_scale=0.0), dict(kv_scale=-1.0), dict(kv_scale=float("nan")), dict(kv_scale=float("inf")), dict(kv_scale=1e-60),
    dict(kv_scale="1"), dict(kv_scale=True), dict(num_pages=2**27, page_size=64),
    dict(dtype="fp8_ds_mla", head_dim=100, rope_dim=36),
    dict(dtype="fp8_ds_mla", head_dim=128, rope_dim=0), dict(dtype="nvfp4_ds_mla", head_dim=512, rope_dim=0),
    dict(dtype="nvfp4_fp8rope", head_dim=512, rope_dim=0),
])
def test_constructor_checks_every_argument(bad):
    args = dict(num_layers=1, num_pages=2, page_size=4, head_dim=8, dtype=torch.float32, device="cpu", rope_dim=2, kv_scale=1.0)
    args.update(bad)
    name = next(iter(bad)) if len(bad) == 1 else ("num_pages" if "num_pages" in bad else
                                                  "rope_dim" if bad.get("rope_dim") == 0 else "head_dim")
    with pytest.raises(ValueError, match=f"^{name}"):
        PagedLatentCache(**args)


def test_constructor_rejects_an_unavailable_cuda_device():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(ValueError, match="^device"):
        PagedLatentCache(1, 2, 4, 8, dtype=torch.float32, device="cuda")


# CacheBatch field checks ---------------------------------------------------------------------
def good_fields():
    cache = small_cache()
    b = cache.prepare(["a", "b"], [3, 1])
    return dict(blocks=b.blocks, block_table=b.block_table, cache_lengths=b.cache_lengths, input_row_offsets=b.input_row_offsets,
                page_size=b.page_size)


@pytest.mark.parametrize("field,edit", [
    ("blocks", {"blocks": lambda f: f["blocks"].to(torch.int32)}),
    ("blocks", {"blocks": lambda f: f["blocks"].to(torch.bool)}),
    ("blocks", {"blocks": lambda f: f["blocks"].to(torch.int16)}),
    ("blocks", {"blocks": lambda f: f["blocks"][0]}),
    ("blocks", {"blocks": lambda f: None}),
    ("block_table", {"block_table": lambda f: f["block_table"].float()}),
    ("block_table", {"block_table": lambda f: f["block_table"][0]}),
    ("block_table", {"block_table": lambda f: f["block_table"][:1]}),
    ("block_table", {"block_table": lambda f: f["block_table"].tolist()}),
    ("cache_lengths", {"cache_lengths": lambda f: f["cache_lengths"].to(torch.int16)}),
    ("cache_lengths", {"cache_lengths": lambda f: f["cache_lengths"][None]}),
    ("cache_lengths", {"cache_lengths": lambda f: f["cache_lengths"].to("meta")}),
    ("input_row_offsets", {"input_row_offsets": lambda f: f["input_row_offsets"][:-1]}),
    ("input_row_offsets", {"input_row_offsets": lambda f: f["input_row_offsets"].double()}),
    ("page_size", {"page_size": lambda f: 3}),
    ("page_size", {"page_size": lambda f: 4.0}),
    ("page_size", {"page_size": lambda f: True}),
    ("seq_ids", {"seq_ids": lambda f: ["a", "b"]}),
    ("seq_ids", {"seq_ids": lambda f: ("a",)}),
    ("cache_format", {"cache_format": lambda f: "fp8"}),
    ("blocks", {"cache_format": "fp8_e4m3"}),  # float32 blocks are not a fp8_e4m3 cache
    ("kv_scale", {"kv_scale": lambda f: torch.ones(5)}),
    ("kv_scale", {"kv_scale": lambda f: torch.ones(2, dtype=torch.float64)}),
    ("rope_dim", {"rope_dim": lambda f: -2}),
    ("rope_dim", {"rope_dim": lambda f: "64"}),
    ("ticket", {"ticket": lambda f: "mine"}),
])
def test_cache_batch_checks_its_fields(field, edit):
    fields = good_fields()
    fields.update({k: v(fields) if callable(v) else v for k, v in edit.items()})
    with pytest.raises(ValueError, match=f"^kv_collection\\.{field}"):
        CacheBatch(**fields)


def test_cache_batch_accepts_every_index_dtype_and_fp8_formats():
    f = good_fields()
    for dt in (torch.int32, torch.int64, torch.uint32):
        CacheBatch(f["blocks"], f["block_table"].to(dt), f["cache_lengths"].to(dt), f["input_row_offsets"].to(dt), 4)
    e4m3 = PagedLatentCache(2, 4, 4, 8, dtype="fp8_e4m3", rope_dim=2).prepare(["a"], [2])
    ds = PagedLatentCache(1, 4, 4, 128 + 16, dtype="fp8_ds_mla", rope_dim=16).prepare(["a"], [2])
    assert e4m3.blocks.dtype == torch.float8_e4m3fn and ds.blocks.dtype == torch.uint8
    with pytest.raises(ValueError, match="^kv_collection.kv_scale"):
        CacheBatch(e4m3.blocks, e4m3.block_table, e4m3.cache_lengths, e4m3.input_row_offsets, 4, cache_format="fp8_e4m3")
    with pytest.raises(ValueError, match="^kv_collection.rope_dim"):
        CacheBatch(ds.blocks, ds.block_table, ds.cache_lengths, ds.input_row_offsets, 4, cache_format="fp8_ds_mla", rope_dim=10)


def test_kept_plans_live_beside_the_batch_not_on_it():
    """The MAX ops' kept plans (``openmla.kept_plans``) are keyed by the batch's host lists: a shallow
    copy of the batch shares them, ``HostLists.refill`` drops them, a new lists object has none, and
    they go when the lists do (a weak mapping); ``HostLists`` carries no plans itself."""
    import dataclasses
    import gc

    from openmla import kept_plans
    from openmla.cache import HostLists

    assert "kept_plans" not in {f.name for f in dataclasses.fields(HostLists)}
    cache = PagedLatentCache(1, 4, 4, head_dim=16, rope_dim=4, dtype=torch.float32)
    batch = cache.prepare(["a"], [3])
    first = kept_plans.kept_plan(batch, 0.5, {})
    assert kept_plans.kept_plan(batch, 0.5, {}) is first
    assert kept_plans.kept_plan(dataclasses.replace(batch), 0.5, {}) is first  # the copy shares the host lists
    batch._host.refill(HostLists(batch._host.cache_lengths, batch._host.offsets))
    assert kept_plans.kept_plan(batch, 0.5, {}) is not first
    other = dataclasses.replace(batch, _host=batch._host.copy())
    assert kept_plans.kept_plan(other, 0.5, {}) is not first
    n = len(kept_plans._kept)
    del other
    gc.collect()
    assert len(kept_plans._kept) == n - 1
