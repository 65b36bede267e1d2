"""The plan/run contract: one plan per step, O(1) host work per layer, custom ops, torch.compile.

- ``plan.run`` equals MAX's named ops (``openmla.compat.max``) (every backend, both forms, sparse, sinks);
- the per-layer path reads no tensor value on the host (methods patched to raise);
- metadata edited after planning cannot reach the kernels (the plan holds validated copies);
- ``refill`` loads a new step in place (same tensors) and equals a fresh plan;
- ``torch.library.opcheck`` passes for every ``openmla::`` op;
- a two-layer stack compiles with ``fullgraph=True``, equals eager, and does not recompile when
  only the metadata values change between steps of the same shapes.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import openmla
from openmla.cache import HostLists
from openmla import LatentAttention, LayerWeights, PagedLatentCache, combine
from openmla.backends import Backend
from openmla import kept_plans
from openmla.config import MLAConfig

from cases import MASK_CASES, TOL, assert_close, assert_lse, make_case, small_config

BACKENDS = ["torch", "reference"]


def _run_both(case, backend, **opts):
    """The fused op through a plan and through MAX's named op, on separate cache copies."""
    a, b = case.clone_cache(), case.clone_cache()
    step = openmla.plan(a.batch, scale=case.scale, backend=backend, **opts)
    got = step.run(*a.run_args(), return_lse=True)
    want = openmla.mla_prefill_decode_graph(*b.fused_args(), scale=case.scale, backend=backend, return_lse=True, **opts)
    return got, want, (a, b)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("new", [[1, 2, 1], [9, 1, 0]], ids=["decode", "prefill"])
@pytest.mark.parametrize("mask,kw", MASK_CASES[:3], ids=[m for m, _ in MASK_CASES[:3]])
def test_run_equals_max_op(backend, new, mask, kw):
    case = make_case([5, 0, 17], new, page_size=4)
    (out, lse), (w_out, w_lse), (a, b) = _run_both(case, backend, mask=mask, **kw)
    assert_close(out, w_out, TOL[torch.float32], "out", case.seed)
    assert_lse(lse, w_lse, TOL[torch.float32], case.seed)
    assert torch.equal(a.batch.blocks, b.batch.blocks)


def test_run_sparse_and_sink_against_reference():
    case = make_case([20, 3], [1, 7], page_size=16)
    T = case.q.shape[0]
    g = torch.Generator().manual_seed(case.seed)
    idx = torch.randint(0, 10, (T, 6), generator=g, dtype=torch.int32)  # sequence 1 holds 10 keys
    idx[:, -1] = -1
    sink = torch.randn(case.config.num_heads, generator=g)
    opts = dict(sparse_indices=idx, physical_indices=False, attn_sink=sink, topk_lengths=torch.tensor([5, 6], dtype=torch.int32))
    outs = []
    for backend in ("torch", "reference"):
        c = case.clone_cache()
        step = openmla.plan(c.batch, scale=case.scale, backend=backend, **opts)
        outs.append(step.run(*c.run_args(), return_lse=True))
    assert_close(outs[0][0], outs[1][0], TOL[torch.float32], "sparse+sink out", case.seed)
    assert_lse(outs[0][1], outs[1][1], TOL[torch.float32], case.seed)


# No host reads in the per-layer path ------------------------------------------------------
class _SpyBackend(Backend):
    """Kernel stand-ins made of pure tensor ops (no host reads), recording what they were given."""

    name = "torch"
    cache_formats = ("native",)

    def __init__(self):
        self.calls = []

    def write_cache(self, plan, layer_idx, q, kv, freqs_cis, kv_norm_gamma, epsilon, interleaved):
        self.calls.append(("write", layer_idx))
        return q * 1

    def decode(self, plan, layer_idx, q_abs, spec, kv_lora_rank):
        self.calls.append(("decode", layer_idx))
        T, H, _ = q_abs.shape
        return q_abs[..., :kv_lora_rank] * 1, q_abs.new_zeros(T, H)

    def prefill(self, plan, layer_idx, q_rot, w_k, w_uv, spec):
        self.calls.append(("prefill", layer_idx))
        T, H, _ = q_rot.shape
        return q_rot.new_zeros(T, H, w_uv.shape[1]), q_rot.new_zeros(T, H)


@pytest.mark.parametrize("new", [[1, 1, 1], [9, 1, 0]], ids=["decode", "mixed-prefill-decode"])
def test_run_reads_no_tensor_values_on_the_host(monkeypatch, new):
    case = make_case([5, 0, 17], new, page_size=4)
    step = openmla.plan(case.batch, scale=case.scale)
    spy = _SpyBackend()
    step.backend = spy
    weights = case.weights

    def refuse(*_a, **_k):
        raise AssertionError("host read of tensor data in the per-layer path")

    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    for layer in range(2):
        out = step.run(case.q, case.kv, layer, weights, case.freqs_cis)
        assert out.shape == (case.q.shape[0], case.config.num_heads, case.config.v_head_dim)
    monkeypatch.undo()
    form = "decode" if max(new) <= openmla.DECODE_MAX_Q_LEN else "prefill"
    assert spy.calls == [("write", 0), (form, 0), ("write", 1), (form, 1)]


def test_metadata_edited_after_planning_never_reaches_kernels():
    case = make_case([6, 2], [1, 1], page_size=4)
    a, b = case.clone_cache(), case.clone_cache()
    want = openmla.mla_prefill_decode_graph(*b.fused_args(), scale=case.scale, backend="torch")
    step = openmla.plan(a.batch, scale=case.scale, backend="torch")
    a.batch.cache_lengths.fill_(1000)  # edited in place after validation
    a.batch.block_table.fill_(10**6)
    got = step.run(*a.run_args())
    assert_close(got, want, 0.0, "out", case.seed)
    with pytest.raises(ValueError, match="kv_collection.block_table"):  # a new plan validates the edit
        openmla.plan(a.batch, scale=case.scale)


# The one-shot ops keep their plan on the batch (checks once per metadata object) ------------


def _one_shot(case, q_abs, batch=None, backend="torch", **kw):
    return openmla.flare_mla_decode(q_abs, case.batch if batch is None else batch, case.layer_idx, scale=case.scale,
                                    kv_lora_rank=case.config.kv_lora_rank, backend=backend, **kw)


def _fresh(batch):
    """The same view as a new object with its own metadata copies (nothing kept on it)."""
    return dataclasses.replace(batch, block_table=batch.block_table.clone(), cache_lengths=batch.cache_lengths.clone(),
                               input_row_offsets=batch.input_row_offsets.clone(), _host=HostLists())


def _q_abs(case):
    g = torch.Generator().manual_seed(case.seed + 1)
    cfg = case.config
    return torch.randn(case.q.shape[0], cfg.num_heads, cfg.kv_lora_rank + cfg.qk_rope_head_dim, generator=g)


def test_one_shot_ops_plan_once_per_batch_and_options(monkeypatch):
    case = make_case([5, 0, 17], [1, 2, 1], page_size=4)
    made = []
    real = kept_plans.plan
    monkeypatch.setattr(kept_plans, "plan", lambda *a, **k: made.append(k) or real(*a, **k))
    q = _q_abs(case)
    outs = [_one_shot(case, q) for _ in range(3)]  # three layers of one step
    assert len(made) == 1
    assert all(torch.equal(o, outs[0]) for o in outs)
    _one_shot(case, q, num_partitions=2)  # other options: another plan, the first one kept too
    _one_shot(case, q)
    assert len(made) == 2
    sink = torch.zeros(case.config.num_heads)
    _one_shot(case, q, attn_sink=sink)
    _one_shot(case, q, attn_sink=sink)  # tensor options: planned on every call
    assert len(made) == 4
    want = _one_shot(case, q, batch=_fresh(case.batch), backend="reference")
    assert_close(outs[0], want, TOL[torch.float32], "out", case.seed)


def test_one_shot_ops_follow_the_backend_choice(monkeypatch):
    case = make_case([5, 3], [1, 1], page_size=4)
    made = []
    real = kept_plans.plan
    monkeypatch.setattr(kept_plans, "plan", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    q = _q_abs(case)
    for name in ("torch", "torch", "reference", "reference", "torch"):
        monkeypatch.setenv("OPENMLA_BACKEND", name)
        _one_shot(case, q, backend=None)
    assert [p.backend_name for p in made] == ["torch", "reference"]  # the torch plan was kept


@pytest.mark.parametrize("how", ["numpy view", "torch in place"])
def test_one_shot_ops_follow_metadata_edited_in_place(how):
    """An edit that bumps no version counter (a numpy view) still reaches the next call."""
    case = make_case([5, 9, 17], [1, 1, 1], page_size=4, spare_pages=3)
    b = case.batch
    q = _q_abs(case)
    before = _one_shot(case, q)
    table, lens = (b.block_table.numpy(), b.cache_lengths.numpy()) if how == "numpy view" else (b.block_table, b.cache_lengths)
    first, second = int(table[2, 0]), int(table[2, 1])
    table[2, 0], table[2, 1] = second, first  # sequence 2 reads its first two pages swapped
    lens[1] -= 6  # and sequence 1 sees 6 keys fewer
    got = _one_shot(case, q)
    want = _one_shot(case, q, batch=_fresh(b), backend="reference")
    assert_close(got, want, TOL[torch.float32], "out", case.seed)
    assert not torch.allclose(got[1:], before[1:])
    table[0, 0] = 10**6  # a bad edit is validated again
    with pytest.raises(ValueError, match="kv_collection.block_table"):
        _one_shot(case, q)


def test_one_shot_ops_follow_other_storage():
    """Batches sharing their host cache (``with_blocks``) or storage reassigned: each call reads its own."""
    case = make_case([7, 12], [1, 1], page_size=4)
    b = case.batch
    other = torch.randn_like(b.blocks)
    b2 = b.with_blocks(other)  # shares b's host cache
    q = _q_abs(case)
    for batch in (b, b2, b, b2):
        want = _one_shot(case, q, batch=_fresh(batch), backend="reference")
        assert_close(_one_shot(case, q, batch=batch), want, TOL[torch.float32], "out", case.seed)
    b.blocks = other
    assert_close(_one_shot(case, q), _one_shot(case, q, batch=_fresh(b), backend="reference"), TOL[torch.float32], "out",
                 case.seed)


def test_per_layer_checks_name_the_argument_and_write_nothing():
    case = make_case([3], [2], page_size=4)
    step = openmla.plan(case.batch, scale=case.scale)
    before = case.batch.blocks.clone()
    bad = {
        "q": case.q[:1], "kv": case.kv[:, :-2], "kv_norm_gamma": case.gamma[None], "w_uk": case.w_uk[:1],
        "w_uv": case.w_uv.transpose(1, 2), "w_k": case.w_k[:-1], "layer_idx": 7, "freqs_cis": case.freqs_cis[:2],
    }
    args = dict(q=case.q, kv=case.kv, freqs_cis=case.freqs_cis, kv_norm_gamma=case.gamma, layer_idx=case.layer_idx,
                w_k=case.w_k, w_uk=case.w_uk, w_uv=case.w_uv)

    def call(q, kv, freqs_cis, kv_norm_gamma, layer_idx, w_k, w_uk, w_uv):
        step.run(q, kv, layer_idx, LayerWeights(kv_norm_gamma, w_k, w_uk, w_uv), freqs_cis)

    for name, value in bad.items():
        with pytest.raises(ValueError, match=name):
            call(**{**args, name: value})
        assert torch.equal(case.batch.blocks, before), name


def test_refill_equals_a_fresh_plan():
    case = make_case([9, 30], [1, 1], page_size=8, spare_pages=6)
    width = case.batch.block_table.shape[1] + 2
    step = openmla.plan(case.batch, scale=case.scale, num_partitions=2, max_pages=width)
    tensors = [step.batch.block_table, step.batch.cache_lengths, step.batch.input_row_offsets, step.write_rows]
    ptrs = [t.data_ptr() for t in tensors]
    for _ in range(3):  # decode steps: commit, prepare the next, refill in place
        step.run(case.q, case.kv, 0, case.weights, case.freqs_cis)
        case.cache.commit(case.batch)
        case = dataclasses.replace(case, batch=case.cache.prepare(["s0", "s1"], [1, 1]))
        step.refill(case.batch)
        assert [t.data_ptr() for t in tensors] == ptrs
        fresh = openmla.plan(case.batch, scale=case.scale, num_partitions=2)
        a = step.decode(combine.absorb(case.q, case.w_uk)[:, :, :], 0, kv_lora_rank=case.config.kv_lora_rank, return_lse=True)
        b = fresh.decode(combine.absorb(case.q, case.w_uk), 0, kv_lora_rank=case.config.kv_lora_rank, return_lse=True)
        assert_close(a[0], b[0], 0.0, "refilled out", case.seed)
        assert torch.equal(step.write_rows, fresh.write_rows)
    with pytest.raises(ValueError, match="batch"):
        step.refill(case.cache.prepare(["s0"], [1]))


# Custom ops ------------------------------------------------------------------------------
def _op_cases(backend: str):
    case = make_case([7, 0], [1, 3], page_size=4)
    step = openmla.plan(case.batch, scale=case.scale, backend=backend)
    q_rot = step.write_cache(case.q, case.kv, case.freqs_cis, case.gamma, 0)
    q_abs = combine.absorb(q_rot, case.w_uk)
    L = case.config.kv_lora_rank
    blocks, handle = step.batch.blocks, step.handle
    out, lse = step.backend.result_dtypes(case.q.dtype)
    return step, {
        "write_cache": (case.q, case.kv, case.freqs_cis, case.gamma, blocks, handle, 0, 1e-6, True, out),
        "decode": (q_abs, None, None, blocks, handle, "decode", 0, L, None, None, None, out, lse),
        "prefill": (q_rot, case.w_k, case.w_uv, blocks, handle, "prefill", 0, 0, None, None, None, out, lse),
    }


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("case", ["write_cache", "decode", "prefill"])
def test_opcheck(case, backend):
    if backend == "triton":
        pytest.importorskip("triton")
    step, args = _op_cases(backend)  # noqa: F841  (the plan stays alive: the handle refers to it weakly)
    op = torch.ops.openmla.write_cache if case == "write_cache" else torch.ops.openmla.attention
    torch.library.opcheck(op.default, args[case])


# torch.compile -----------------------------------------------------------------------------
class _Stack(nn.Module):
    def __init__(self, config: MLAConfig, layers: int):
        super().__init__()
        self.layers = nn.ModuleList(LatentAttention(config, i, dtype=torch.float32, max_position=64) for i in range(layers))

    def forward(self, x: torch.Tensor, step: openmla.MLAPlan) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x, step)
        return x


def test_compiled_stack_equals_eager_without_recompiles():
    torch.manual_seed(0)
    cfg = dataclasses.replace(small_config(num_heads=2), hidden_size=32)
    model = _Stack(cfg, 2).eval()
    for p in model.parameters():
        nn.init.normal_(p, std=0.2)
    for layer in model.layers:
        layer.split_kv_b()
    compiled = torch.compile(model, fullgraph=True)
    caches = [PagedLatentCache(2, 16, page_size=4, head_dim=cfg.cache_head_dim, dtype=torch.float32) for _ in range(2)]
    ids = ["a", "b", "c"]
    steps = [[7, 3, 9]] + [[1, 1, 1]] * 4  # a prefill step, then decode steps (same shapes)
    torch._dynamo.reset()
    with torch.no_grad():
        for i, new in enumerate(steps):
            x = torch.randn(sum(new), cfg.hidden_size)
            outs = []
            for cache, fn in zip(caches, (model, compiled)):
                batch = cache.prepare(ids, new)
                step = openmla.plan(batch, scale=cfg.softmax_scale, max_pages=6)
                if i >= 2 and fn is compiled:  # the decode graph exists: new metadata must not recompile
                    with torch.compiler.set_stance("fail_on_recompile"):
                        outs.append(fn(x, step))
                else:
                    outs.append(fn(x, step))
                cache.commit(batch)
            assert_close(outs[1], outs[0], 1e-5, f"step {i} compiled vs eager", 0)
    assert torch.allclose(caches[0].blocks, caches[1].blocks, atol=1e-6)


def test_with_blocks_runs_the_plan_over_other_storage():
    """A plan over another layer's storage (engines with one cache tensor per layer) equals a fresh
    plan over that storage, eagerly and through the openmla::attention custom op."""
    case = make_case([5, 0, 17], [1, 2, 1], page_size=4)
    step = openmla.plan(case.batch, scale=case.scale, backend="torch")
    other = torch.randn(case.batch.blocks.shape, generator=torch.Generator().manual_seed(case.seed + 1))
    view = step.with_blocks(other)
    assert view.batch.blocks is other and step.batch.blocks is case.batch.blocks and step.with_blocks(step.batch.blocks) is step
    L = case.config.kv_lora_rank
    q = torch.randn(case.q.shape[0], case.config.num_heads, case.batch.head_dim, generator=torch.Generator().manual_seed(1))
    fresh = openmla.plan(case.batch.with_blocks(other), scale=case.scale, backend="torch")
    want = fresh.decode(q, case.layer_idx, kv_lora_rank=L, return_lse=True)
    got = view.decode(q, case.layer_idx, kv_lora_rank=L, return_lse=True)
    op = torch.ops.openmla.attention(q, None, None, other, view.handle, "decode", case.layer_idx, L, None, None, None,
                                     torch.float32, torch.float32)
    for a, b in ((got, want), (op, want)):
        torch.testing.assert_close(a[0], b[0], rtol=0, atol=0)
        torch.testing.assert_close(a[1], b[1], rtol=0, atol=0)
    assert not torch.equal(got[0], step.decode(q, case.layer_idx, kv_lora_rank=L))
    with pytest.raises(ValueError, match="^blocks:"):
        step.with_blocks(other[:, :-1])
    with pytest.raises(ValueError, match="^blocks:"):
        step.with_blocks(other.double())


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_with_sparse_equals_a_plan_made_with_those_lists(backend):
    """Per-layer top-k lists (DeepSeek-V3.2's indexer): the view equals a fresh sparse plan and
    the float64 reference; the base plan stays dense; bad lists are ValueErrors naming them."""
    if backend == "cpu":
        from openmla.backends.cpu import available

        if not available():
            pytest.skip("the native cpu backend did not build here")
    case = make_case([5, 0, 40], [1, 3, 2], page_size=4)
    g = torch.Generator().manual_seed(case.seed + 3)
    seq = torch.repeat_interleave(torch.arange(3), torch.tensor(case.batch.new_tokens_list))
    lens = torch.tensor(case.batch.seq_lens_list)[seq]
    idx = (torch.rand(seq.shape[0], 6, generator=g) * lens[:, None]).long()
    idx[torch.rand(idx.shape, generator=g) < 0.3] = -1
    step = openmla.plan(case.batch, scale=case.scale, backend=backend)
    view = step.with_sparse(idx, physical_indices=False)
    assert step.spec.sparse is None and view.spec.sparse is not None and view.batch is step.batch
    q = torch.randn(case.q.shape[0], case.config.num_heads, case.batch.head_dim, generator=g)
    L = case.config.kv_lora_rank
    got = view.decode(q, case.layer_idx, kv_lora_rank=L, return_lse=True)
    for other in ("reference", backend):
        fresh = openmla.plan(case.batch, scale=case.scale, sparse_indices=idx, physical_indices=False, backend=other)
        want = fresh.decode(q.double() if other == "reference" else q, case.layer_idx, kv_lora_rank=L, return_lse=True)
        assert_close(got[0], want[0], TOL[torch.float32], f"with_sparse vs {other}", case.seed)
        assert_lse(got[1], want[1], TOL[torch.float32], case.seed)
    assert not torch.allclose(got[0], step.decode(q, case.layer_idx, kv_lora_rank=L))
    bad = idx.clone()
    bad[0, 0] = case.batch.seq_lens_list[0]  # at its sequence's length
    with pytest.raises(ValueError, match="^sparse_indices:"):
        step.with_sparse(bad, physical_indices=False)
    with pytest.raises(ValueError, match="^sparse_indices:"):
        step.with_sparse(idx[:-1], physical_indices=False)
    with pytest.raises(ValueError, match="^physical_indices:"):
        step.with_sparse(idx, physical_indices=0)
