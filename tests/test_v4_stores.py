"""openmla.v4 stores: a sliding store returns pages out of every window and holds about
``window + page_size`` entries per sequence; compressed stores keep every entry; what the
kernel reads through a store's view is what was written; reservations are all or none."""

from __future__ import annotations

import math
import random

import pytest
import torch

from openmla import reference as ref
from openmla.cache import CacheFullError
from openmla.v4 import CompressedKeys, EntryLayout, SharedKVSpec, shared_kv_attention
from openmla.v4.cache import V4Cache, V4Layout
from openmla.v4.stores import EntryStore

SEEDS = random.Random()


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_sliding_store_frees_pages_and_reads_back(page_size):
    seed = SEEDS.randrange(2**31)
    g = torch.Generator().manual_seed(seed)
    W, D, H = 24, 16, 3
    P = 400
    store = EntryStore(2, P, page_size, D, torch.float32, window=W)
    comp = EntryStore(2, P, page_size, D, torch.float32)
    store.blocks.fill_(math.nan)
    comp.blocks.fill_(math.nan)
    ids = ["a", "b", "c"]
    written = {s: torch.zeros(0, D) for s in ids}
    rate = 4
    steps = [[5, 0, 37], [1, 1, 1], [40, 3, 0], [1, 1, 1], [90, 1, 30]]
    for counts in steps:
        before = [store.length(s) if s in store._lengths else 0 for s in ids]
        store.extend(ids, counts)
        c_new = [(b + n) // rate - b // rate for b, n in zip(before, counts)]
        comp.extend(ids, c_new)
        table = store.table(ids)
        rows = store.rows(table, counts)
        entries = torch.randn(sum(counts), D, generator=g)
        store.write(1, rows, entries)
        ctable = comp.table(ids)
        comp.write(1, comp.rows(ctable, c_new), torch.randn(sum(c_new), D, generator=g))
        for s, e in zip(ids, entries.split(counts)):
            written[s] = torch.cat([written[s], e])
        q = torch.randn(sum(counts), H, D, generator=g)
        offsets = torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist())
        spec = SharedKVSpec(D ** -0.5, W, EntryLayout(D, 4), CompressedKeys(rate), torch.randn(H, generator=g))
        got, _ = shared_kv_attention(q, offsets, store.view(1, table), spec, comp.view(1, ctable), backend="torch")
        want, _ = ref.shared_kv_attention(q, offsets, store.view(1, table), spec, comp.view(1, ctable))
        assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5), f"seed {seed}"
        # every entry any future query may read is what was written
        flat = store.blocks[1].view(-1, D)
        for b, s in enumerate(ids):
            n = store.length(s)
            pos = torch.arange(max(0, n - W + 1), n)
            rows_b = table[0][b].long()[pos // page_size] * page_size + pos % page_size
            assert torch.equal(flat[rows_b], written[s][pos])
        store.trim()
        for s in ids:
            assert store.pages_held(s) <= -(-(W - 1) // page_size) + 1, (s, store.pages_held(s), page_size)
    assert comp.length("c") == sum(x[2] for x in steps) // rate  # compressed entries are all kept
    held = sum(store.pages_held(s) for s in ids)
    assert store.allocator.num_free == P - held
    for s in ids:
        store.release(s)
    assert store.allocator.num_free == P


def test_extend_is_all_or_none():
    store = EntryStore(1, 4, 16, 8, torch.float32, window=8)
    store.extend(["a"], [40])
    with pytest.raises(CacheFullError):
        store.extend(["a", "b"], [1, 40])
    assert store.length("a") == 40 and "b" not in store._lengths and store.allocator.num_free == 1
    layout = V4Layout(("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"), 8, 2, 8,
                      (("compressed_sparse_attention", 4), ("heavily_compressed_attention", 8)), index_width=4)
    cache = V4Cache(layout, num_pages=8, page_size=4, dtype=torch.float32, compressed_pages=2)
    cache.extend(["x"], [8])
    with pytest.raises(CacheFullError):
        cache.extend(["x", "y"], [1, 20])  # the raw store has room, the CSA store does not
    assert cache.length("x") == 8 and not cache.has("y")
    assert [s.allocator.num_free for s in cache.stores()] == [6, 1, 1, 1]


def test_bytes_per_sequence():
    layout = V4Layout(("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"), 8, 2, 8,
                      (("compressed_sparse_attention", 4), ("heavily_compressed_attention", 8)), index_width=4)
    cache = V4Cache(layout, num_pages=64, page_size=4, dtype=torch.float32)
    cache.extend(["x"], [100])
    cache.trim()
    cache.state[("x", 1)] = {"buffer": torch.zeros(3, 16)}
    got = cache.bytes_per_sequence("x")
    assert got["raw"] == 3 * 2 * 4 * 8 * 4  # 3 layers x 2 pages (entries 93..99 of window 8) x 4 entries x 8 x 4 bytes
    assert got["compressed"] == (7 * 4 * 8 * 4) + (3 * 4 * 8 * 4)  # 25 CSA entries (7 pages), 12 HCA (3 pages)
    assert got["index"] == 7 * 4 * 4 * 4
    assert got["state"] == 3 * 16 * 4
    assert got["total"] == sum(v for k, v in got.items() if k != "total")
    cache.release("x")
    assert all(s.allocator.num_free == 64 for s in cache.stores()) and not cache.state


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="^window:"):
        EntryStore(1, 4, 16, 8, torch.float32, window=0)
    store = EntryStore(1, 4, 16, 8, torch.float32)
    with pytest.raises(ValueError, match="^counts:"):
        store.extend(["a"], [-1])
    with pytest.raises(ValueError, match="^seq_ids:"):
        store.table(["nope"])
    store.extend(["a"], [2])
    table = store.table(["a"])
    with pytest.raises(ValueError, match="^entries:"):
        store.write(0, store.rows(table, [2]), torch.zeros(2, 7))
