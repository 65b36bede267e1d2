"""Paged cache lifecycle: prepare/commit/release, page accounting, CacheFullError atomicity."""

import random

import pytest
import torch

from openmla import CacheFullError, PagedLatentCache


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
