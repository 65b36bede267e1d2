"""``MLAPlan.with_blocks``: one plan per step over engines that keep one cache tensor per layer.

The view runs over its own storage (reads and writes), shares the plan's host state, rejects
storage of another shape or dtype, and the custom ops find the view's storage, not the plan's.
"""

from __future__ import annotations

import pytest
import torch

import openmla

from cases import TOL, assert_close, assert_lse, make_case


def _layers(case, n=2):
    """``n`` one-layer storages ``[1, pages, page_size, L+R]`` of different random contents."""
    return [torch.randn_like(case.cache.blocks[:1]) for _ in range(n)]


@pytest.mark.parametrize("new", [[1, 2, 1], [9, 1, 0]], ids=["decode", "prefill"])
def test_view_equals_a_plan_over_its_storage(new):
    case = make_case([5, 0, 17], new, page_size=4)
    first, other = _layers(case)
    kept = first.clone()
    step = openmla.plan(case.batch.with_blocks(first), scale=case.scale, backend="torch")
    view = step.with_blocks(other)
    fresh = openmla.plan(case.batch.with_blocks(other.clone()), scale=case.scale, backend="torch")
    args = (case.q, case.kv, 0, case.weights, case.freqs_cis)
    out, lse = view.run(*args, return_lse=True)
    w_out, w_lse = fresh.run(*args, return_lse=True)
    assert_close(out, w_out, TOL[torch.float32], "out", case.seed)
    assert_lse(lse, w_lse, TOL[torch.float32], case.seed)
    assert torch.equal(other, fresh.batch.blocks)  # the view wrote its own storage ...
    assert torch.equal(first, kept)  # ... and not the plan's
    assert view.token_pos is step.token_pos and view.write_rows is step.write_rows
    assert view.chunks(8) is step.chunks(8)  # chunk plans are made once for every layer


def test_view_through_the_custom_op_reads_its_own_storage():
    case = make_case([5, 0, 17], [1, 2, 1], page_size=4)
    first, other = _layers(case)
    step = openmla.plan(case.batch.with_blocks(first), scale=case.scale, backend="torch")
    view = step.with_blocks(other)
    L = case.config.kv_lora_rank
    q = torch.randn(case.q.shape[0], case.config.num_heads, first.shape[-1])
    got, got_lse = torch.ops.openmla.attention(q, None, None, view.batch.blocks, view.handle, "decode", 0, L, None, None, None,
                                               torch.float32, torch.float32)
    want, want_lse = view.decode(q, 0, kv_lora_rank=L, return_lse=True)
    assert_close(got, want, TOL[torch.float32], "out", case.seed)
    other_out = step.decode(q, 0, kv_lora_rank=L)
    assert not torch.allclose(other_out, want)  # the two storages differ: the test can fail


@pytest.mark.parametrize("bad,match", [
    (lambda b: b[:, :-1], "blocks: expected shape"),
    (lambda b: b.to(torch.float64), "blocks: dtype"),
    (lambda b: b[0], "blocks: expected rank"),
    (lambda b: "cache", "blocks: expected a torch.Tensor"),
])
def test_view_rejects_other_storage(bad, match):
    case = make_case([3], [1], page_size=4)
    first, = _layers(case, 1)
    step = openmla.plan(case.batch.with_blocks(first), scale=case.scale, backend="torch")
    with pytest.raises(ValueError, match=match):
        step.with_blocks(bad(first))
