"""Every mask variant against a brute-force double loop, and key_range against visibility."""

import random

import pytest
import torch

from openmla import MaskVariant


def brute(kind: str, p: int, k: int, W: int | None, C: int | None) -> bool:
    if kind == "causal":
        return k <= p
    if kind == "null":
        return True
    if kind == "sliding_window_causal":
        return p - W < k <= p
    if kind == "sliding_window_noncausal":
        return k > p - W
    if kind == "chunked_causal":
        return k <= p and k // C == p // C
    raise AssertionError(kind)


VARIANTS = [("causal", None, None), ("null", None, None), ("sliding_window_causal", 1, None),
            ("sliding_window_causal", 7, None), ("sliding_window_noncausal", 5, None), ("chunked_causal", None, 1),
            ("chunked_causal", None, 6)]


@pytest.mark.parametrize("kind,W,C", VARIANTS)
def test_visible_matches_double_loop(kind, W, C):
    m = MaskVariant.parse(kind, W, C)
    n = 40
    q = torch.arange(n)[:, None]
    k = torch.arange(n)[None, :]
    got = m.visible(q, k)
    want = torch.tensor([[brute(kind, p, kk, W, C) for kk in range(n)] for p in range(n)])
    assert torch.equal(got, want)


@pytest.mark.parametrize("kind,W,C", VARIANTS)
def test_key_range_holds_every_visible_key(kind, W, C):
    m = MaskVariant.parse(kind, W, C)
    rng = random.Random()
    for _ in range(200):
        kv_len = rng.randint(1, 60)
        q_lo = rng.randint(0, kv_len - 1)
        q_hi = rng.randint(q_lo, kv_len - 1)
        lo, hi = m.key_range(q_lo, q_hi, kv_len)
        assert 0 <= lo <= hi <= kv_len
        vis = m.visible(torch.arange(q_lo, q_hi + 1)[:, None], torch.arange(kv_len)[None, :]).any(0)
        inside = torch.zeros(kv_len, dtype=torch.bool)
        inside[lo:hi] = True
        assert not bool((vis & ~inside).any()), (kind, q_lo, q_hi, kv_len, lo, hi)


@pytest.mark.parametrize("args,name", [
    (("bogus", None, None), "mask"),
    (("sliding_window_causal", None, None), "window_size"),
    (("sliding_window_causal", 0, None), "window_size"),
    (("causal", 4, None), "window_size"),
    (("chunked_causal", None, 0), "chunk_size"),
    (("null", None, 3), "chunk_size"),
])
def test_parse_rejects(args, name):
    with pytest.raises(ValueError, match=name):
        MaskVariant.parse(*args)
