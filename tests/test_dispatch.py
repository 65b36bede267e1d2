"""One door: every kernel call goes through ``openmla.dispatch``, eager and compiled alike.

- under ``torch.compile(fullgraph=True)`` the decode form's absorption and output projection, V4's
  shared-KV attention and MAX's one-chunk prefill run as ``openmla::`` custom ops (no graph break,
  the op in the graph) and equal eager;
- ``torch.library.opcheck`` passes for the new ops;
- ``MLAPlan.attend`` (``run`` after the write) applies the form rule ``MLAPlan.absorbed`` and equals
  ``run``;
- nothing outside ``dispatch.py`` and ``backends/`` calls a backend's kernels;
- V4's kernel is a registered protocol (``SharedKVKernels``), not a flag on the plan.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re

import pytest
import torch

import openmla
from openmla import dispatch
from openmla.backends import SHARED_KV, Backend, SharedKVKernels, choose_backend, load_backend
from openmla.chunks import chunk_plan
from openmla.v4 import CompressedKeys, EntryLayout, PagedEntries, SharedKVSpec, plan_shared_kv

from cases import assert_close, make_case

pytestmark = pytest.mark.usefixtures("one_thread")
SRC = pathlib.Path(openmla.__file__).parent


class _Recorder:
    """A ``torch.compile`` backend that keeps each graph's ``openmla::`` ops and runs it as traced."""

    def __init__(self) -> None:
        self.ops: list[str] = []
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        self.graphs += 1
        for node in gm.graph.nodes:
            if node.op == "call_function" and str(node.target).startswith("openmla."):
                self.ops.append(str(node.target).split(".")[1])
        return gm.forward


def _compiled(fn, *args):
    """``fn(*args)`` compiled with ``fullgraph=True``: (result, the openmla ops of its graph)."""
    torch._dynamo.reset()
    rec = _Recorder()
    out = torch.compile(fn, backend=rec, fullgraph=True)(*args)
    assert rec.graphs == 1
    return out, rec.ops


# The MLA plan: absorb / unabsorb ----------------------------------------------------------
@pytest.mark.parametrize("backend", ["torch", "reference", "cpu"])
def test_compiled_decode_step_runs_absorb_and_unabsorb_as_ops(backend):
    if backend == "cpu":
        from openmla.backends.cpu import available

        if not available():
            pytest.skip("the native cpu backend did not build here")
    case = make_case([5, 0, 17], [1, 2, 1], page_size=4, seed=3)
    a, b = case.clone_cache(), case.clone_cache()
    eager_plan = openmla.plan(a.batch, scale=case.scale, backend=backend)
    comp_plan = openmla.plan(b.batch, scale=case.scale, backend=backend)
    assert eager_plan.absorbed() and eager_plan.form == "decode"
    w = case.weights

    def step(q, kv, freqs, plan):
        return plan.run(q, kv, case.layer_idx, w, freqs, return_lse=True)

    want = step(case.q, case.kv, case.freqs_cis, eager_plan)
    with torch.no_grad():
        got, ops = _compiled(step, case.q, case.kv, case.freqs_cis, comp_plan)
    assert ops == ["write_cache", "absorb", "attention", "unabsorb"]
    assert_close(got[0], want[0], 0.0 if backend != "torch" else 1e-6, "compiled out", case.seed)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-6)
    assert torch.equal(a.batch.blocks, b.batch.blocks)


def test_compiled_attend_of_a_prefill_step_is_one_op():
    case = make_case([3, 0], [9, 7], page_size=4, seed=5)
    plan = openmla.plan(case.batch, scale=case.scale, backend="torch")
    plan.write_cache(case.q, case.kv, case.freqs_cis, case.gamma, case.layer_idx)
    q = torch.randn(case.q.shape, generator=torch.Generator().manual_seed(1))
    assert plan.form == "prefill" and not plan.absorbed()
    w = case.weights
    want = plan.attend(q, case.layer_idx, w)
    got, ops = _compiled(lambda q, p: p.attend(q, case.layer_idx, w), q, plan)
    assert ops == ["attention"]
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("new", [[1, 2, 1], [9, 1, 0]], ids=["decode", "prefill"])
@pytest.mark.parametrize("sparse", [False, True])
def test_attend_equals_run_after_the_write(new, sparse):
    """``attend`` is ``run`` without the write: same form (sparse steps absorbed), same result."""
    case = make_case([5, 0, 17], new, page_size=4)
    opts = {}
    if sparse:
        T = case.q.shape[0]
        idx = torch.randint(-1, 1, (T, 4), generator=torch.Generator().manual_seed(case.seed), dtype=torch.int32)
        opts = dict(sparse_indices=idx, physical_indices=False)
    a, b = case.clone_cache(), case.clone_cache()
    run_plan = openmla.plan(a.batch, scale=case.scale, backend="torch", **opts)
    attend_plan = openmla.plan(b.batch, scale=case.scale, backend="torch", **opts)
    assert run_plan.absorbed() == (new == [1, 2, 1] or sparse)
    want = run_plan.run(*a.run_args(), return_lse=True)
    q_rot = attend_plan.write_cache(case.q, case.kv, case.freqs_cis, case.gamma, case.layer_idx)
    got = attend_plan.attend(q_rot, case.layer_idx, case.weights, return_lse=True)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
    with pytest.raises(ValueError, match="^weights:"):
        attend_plan.attend(q_rot, case.layer_idx, "not weights")
    with pytest.raises(ValueError, match="^layer_idx:"):
        attend_plan.attend(q_rot, 7, case.weights)


# MAX's one-chunk prefill ------------------------------------------------------------------
def _chunk_case():
    case = make_case([6, 0], [3, 5], page_size=4, seed=11)
    plan = openmla.plan(case.batch, scale=case.scale, backend="torch")
    plan.write_cache(case.q, case.kv, case.freqs_cis, case.gamma, case.layer_idx)
    H, Dn, Dv = case.config.num_heads, case.config.qk_nope_head_dim, case.config.v_head_dim
    chunks = chunk_plan(case.batch.seq_lens_list, 64)
    bro, co, _ = chunks.tensors(1)
    S = int(bro[0, -1])
    g = torch.Generator().manual_seed(2)
    k, v = torch.randn(S, H, Dn, generator=g), torch.randn(S, H, Dv, generator=g)
    return case, plan, k, v, bro[0], co[0]


def test_compiled_chunk_prefill_is_one_op():
    case, plan, k, v, bro, co = _chunk_case()
    from openmla.chunks import check_chunk

    chunk = check_chunk(case.q, k, v, bro, co, plan.batch)
    want = dispatch.chunk_prefill(plan, case.layer_idx, case.q, k, v, chunk, None)
    got, ops = _compiled(lambda q, p: dispatch.chunk_prefill(p, case.layer_idx, q, k, v, chunk, None), case.q, plan)
    assert ops == ["chunk_prefill"]
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
    eager = openmla.flare_mla_prefill(case.q, k, v, bro, co, case.batch, case.layer_idx, scale=case.scale, backend="torch",
                                      return_lse=True)
    torch.testing.assert_close(eager[0], want[0], rtol=0, atol=0)


# V4 shared-KV -----------------------------------------------------------------------------
def _v4_case(mode: str, seed: int = 0):
    """Two sequences (a prefill and a decode), pages shuffled, a compressed stream by rule or indices."""
    g = torch.Generator().manual_seed(seed)
    H, D, ps, rate = 3, 32, 4, 4
    kv, new = [9, 14], [4, 1]
    pages = [-(-n // ps) for n in kv]
    order = torch.randperm(sum(pages) + 2, generator=g)
    table = torch.full((2, max(pages)), -1, dtype=torch.int32)
    j = 0
    for b, n in enumerate(pages):
        table[b, :n] = order[j:j + n]
        j += n
    raw = PagedEntries(torch.randn(sum(pages) + 2, ps, D, generator=g), table, torch.tensor(kv, dtype=torch.int32))
    c_lens = [n // rate for n in kv]
    comp = PagedEntries(torch.randn(sum(pages) + 2, ps, D, generator=g), table.clone(), torch.tensor(c_lens, dtype=torch.int32))
    T = sum(new)
    indices = torch.randint(-1, 2, (T, 3), generator=g, dtype=torch.int32) if mode == "indices" else None
    spec = SharedKVSpec(D ** -0.5, 6, EntryLayout(D, 8), CompressedKeys(rate, indices), torch.randn(H, generator=g))
    q = torch.randn(T, H, D, generator=g)
    offsets = torch.tensor([0, new[0], T], dtype=torch.int64)
    return q, offsets, raw, spec, comp


@pytest.mark.parametrize("mode", ["rule", "indices"])
@pytest.mark.parametrize("backend", ["torch", "reference", "cpu"])
def test_compiled_v4_step_runs_shared_kv_as_an_op(backend, mode):
    if backend == "cpu":
        from openmla.backends.cpu import available

        if not available():
            pytest.skip("the native cpu backend did not build here")
    q, offsets, raw, spec, comp = _v4_case(mode)
    plan = plan_shared_kv(q, offsets, raw, spec, comp, backend=backend)
    assert plan.backend_name == backend and plan.fallback_reason is None
    want = plan.run(q)
    got, ops = _compiled(lambda q, p: p.run(q), q, plan)
    assert ops == ["shared_kv_attention"]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert got[0].dtype == q.dtype and got[1].dtype == torch.float32
    # a layer's own tensors (for_layer) travel as the op's arguments
    other = dataclasses.replace(raw, blocks=raw.blocks + 1.0)
    layer = plan.for_layer(other, spec, comp)
    want2 = layer.run(q)
    got2, _ = _compiled(lambda q, p: p.run(q), q, layer)
    torch.testing.assert_close(got2[0], want2[0], rtol=0, atol=0)
    assert not torch.equal(want2[0], want[0])


def test_compiled_v4_under_aot_eager_equals_eager():
    """Through AOT autograd's functionalisation too (the op gets the graph's tensors)."""
    q, offsets, raw, spec, comp = _v4_case("indices", seed=4)
    plan = plan_shared_kv(q, offsets, raw, spec, comp, backend="torch")
    torch._dynamo.reset()
    got = torch.compile(lambda q, p: p.run(q), backend="aot_eager", fullgraph=True)(q, plan)
    want = plan.run(q)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# opcheck ----------------------------------------------------------------------------------
def test_opcheck_new_ops():
    case = make_case([7, 0], [1, 3], page_size=4, seed=1)
    step = openmla.plan(case.batch, scale=case.scale, backend="torch")
    q_rot = step.write_cache(case.q, case.kv, case.freqs_cis, case.gamma, 0)
    out_dtype = step.backend.result_dtypes(case.q.dtype)[0]
    torch.library.opcheck(torch.ops.openmla.absorb.default, (q_rot, case.w_uk, step.handle, out_dtype))
    out_lat = torch.randn(q_rot.shape[0], q_rot.shape[1], case.config.kv_lora_rank)
    torch.library.opcheck(torch.ops.openmla.unabsorb.default, (out_lat, case.w_uv, step.handle, out_dtype))
    q, offsets, raw, spec, comp = _v4_case("indices")
    v4 = plan_shared_kv(q, offsets, raw, spec, comp, backend="torch")
    torch.library.opcheck(torch.ops.openmla.shared_kv_attention.default,
                          (q, raw.blocks, comp.blocks, spec.compressed.indices, spec.attn_sink, v4.handle))
    case, plan, k, v, bro, co = _chunk_case()
    from openmla.chunks import check_chunk

    chunk = check_chunk(case.q, k, v, bro, co, plan.batch)
    torch.library.opcheck(torch.ops.openmla.chunk_prefill.default,
                          (case.q, k, v, chunk.buffer_row_offsets, chunk.cache_offsets, plan.batch.blocks, plan.handle,
                           case.layer_idx, chunk.bro, chunk.co, None, None, torch.float32, torch.float32))


# The door and the protocol ----------------------------------------------------------------
def test_no_kernel_call_outside_dispatch_and_backends():
    pattern = re.compile(r"\.backend\.(absorb|unabsorb|shared_kv|write_cache|decode|prefill|flare_mla_prefill)\b")
    found = []
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC).as_posix()
        if rel == "dispatch.py" or rel.startswith("backends/"):
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                found.append(f"{rel}:{i}: {line.strip()}")
    assert not found, "kernel calls outside openmla.dispatch:\n" + "\n".join(found)


def test_shared_kv_is_a_registered_protocol():
    assert not hasattr(Backend, "shared_kv_attention") and not hasattr(Backend, "supports_shared_kv")
    for name in SHARED_KV:
        try:
            backend = load_backend(name)
        except ValueError:
            continue  # unavailable here (triton without CUDA or the interpreter)
        assert isinstance(backend, SharedKVKernels), name

    class NoV4(Backend):
        name = "no_v4"

    q, offsets, raw, spec, comp = _v4_case("rule")
    plan = plan_shared_kv(q, offsets, raw, spec, comp, backend="torch")
    assert not hasattr(plan, "shared_kv")  # no duck-typed flag: the caller names the protocol
    from openmla import backends

    backends._LOADED["no_v4"] = NoV4()
    try:
        with pytest.raises(ValueError, match="does not implement SharedKVKernels"):
            choose_backend("no_v4", plan, SharedKVKernels)
    finally:
        del backends._LOADED["no_v4"]


# One definition of the dtype sets and the error helper ------------------------------------
def test_dtype_sets_and_fail_are_defined_once():
    from openmla import basics, cache, validate
    from openmla.v4 import plan as v4_plan

    assert validate.FLOAT_DTYPES is basics.FLOAT_DTYPES and cache.NATIVE_DTYPES is basics.FLOAT_DTYPES
    assert v4_plan.FLOAT_DTYPES is basics.FLOAT_DTYPES
    assert validate.INDEX_DTYPES is basics.INDEX_DTYPES and cache.INDEX_DTYPES is basics.INDEX_DTYPES
    assert v4_plan.INDEX_DTYPES is basics.SIGNED_INDEX_DTYPES and torch.uint32 not in basics.SIGNED_INDEX_DTYPES
    assert validate.STORAGE_DTYPES is cache.STORAGE_DTYPES
    assert v4_plan._fail is basics.fail and not hasattr(cache, "_fail")
    for path in SRC.rglob("*.py"):
        text = path.read_text()
        for name in ("FLOAT_DTYPES =", "INDEX_DTYPES =", "def _fail("):
            assert name not in text or path.name == "basics.py", f"{path.relative_to(SRC)} defines {name}"


@pytest.mark.parametrize("field", ["q_offsets", "raw.block_table", "raw.lengths", "spec.compressed.indices"])
def test_v4_refuses_uint32_metadata_by_name(field):
    """V4's kernels read its tables and lists in place and compare them with -1 and 0, which torch
    has no uint32 operators for: the plan refuses uint32 there (MLA metadata, copied to int32 by
    the plan, takes it)."""
    q, offsets, raw, spec, comp = _v4_case("indices")
    u32 = lambda t: t.clamp(min=0).to(torch.uint32)  # noqa: E731
    if field == "q_offsets":
        offsets = u32(offsets)
    elif field == "raw.block_table":
        raw = dataclasses.replace(raw, block_table=u32(raw.block_table))
    elif field == "raw.lengths":
        raw = dataclasses.replace(raw, lengths=u32(raw.lengths))
    else:
        spec = dataclasses.replace(spec, compressed=CompressedKeys(spec.compressed.rate, u32(spec.compressed.indices)))
    with pytest.raises(ValueError, match=f"^{re.escape(field)}: expected .*int32/int64"):
        plan_shared_kv(q, offsets, raw, spec, comp, backend="torch")
