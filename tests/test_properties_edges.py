"""Property suite for the edges issue 34 found (hypothesis; the ``ci`` profile of conftest.py:
derandomized, fixed example counts; about 40 s on the shared 2-core box, triton's interpreter
included):

1. Every cache format (native float32 / bf16, fp8_e4m3, fp8_ds_mla, nvfp4_ds_mla, nvfp4_fp8rope)
   with a NaN, infinite, all-zero (epsilon 0 and default) or outlier latent, on every backend
   present, against the float64 reference on the same stored bytes: the stored entries and every
   output row agree, NaN exactly where the reference has it (docs/api.md's NaN rule).
   The decode form with several query tokens of a sequence and a poisoned key of the step; MAX's
   chunk prefill with an infinite or NaN value whose key's score is -inf or finite.
2. Reduced-precision queries (bf16, fp8 with ``q_scale``) over bf16 and fp8 caches against float64,
   tolerances derived from the dtypes: the LSE to float32 rounding (scores are float32; every
   product of stored values is exact there), the output to two bf16 epsilons.
3. V4 plans with one malformed spec field: a ``ValueError`` naming the field, the stores untouched.
4. Random sequences of V4 store operations (``V4Cache``: extend all or none, raw entries in every
   layer, compressed and indexer entries, sliding-window trim and page release, sequence release)
   against a model of what must be stored, the raw layer mirrored into 584-byte ``fp8_v4`` pages.
"""

from __future__ import annotations

import dataclasses
import importlib
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import openmla
from openmla import CacheFullError, fp8_v4
from openmla import reference as ref
from openmla.v4 import CompressedKeys, EntryLayout, PagedEntries, SharedKVSpec, plan_shared_kv
from openmla.v4.cache import V4Cache, V4Layout

from cases import assert_close, assert_close_nan, assert_lse, make_case, small_config
from cpu_backends import use_backend
from test_properties import FAST_FAIL, scaled, triton_ready

pytestmark = pytest.mark.usefixtures("one_thread")
BACKENDS = ["torch", "cpu"] + (["triton"] if triton_ready() else [])
FORMATS = {  # format -> (cache dtype argument, heads, L, R, Dn)
    "float32": (torch.float32, 3, 64, 16, 32),
    "bfloat16": (torch.bfloat16, 3, 64, 16, 32),
    "fp8_e4m3": ("fp8_e4m3", 3, 128, 16, 32),
    "fp8_ds_mla": ("fp8_ds_mla", 3, 128, 16, 32),
    "nvfp4_ds_mla": ("nvfp4_ds_mla", 2, 512, 64, 16),
    "nvfp4_fp8rope": ("nvfp4_fp8rope", 2, 512, 64, 16),
}
LATENTS = ["nan", "inf", "zero-eps0", "zero", "outlier"]


def _ready(name: str, monkeypatch) -> str:
    return use_backend(name, monkeypatch) if name == "cpu" else name


def _entries(batch, layer_idx: int) -> torch.Tensor:
    return batch.read_rows(layer_idx, torch.arange(batch.blocks.shape[1] * batch.page_size), torch.float32)


# 1. Every cache format x NaN / inf / zero / outlier latents x every backend -------------------------
@settings(max_examples=scaled(14), **FAST_FAIL)
@given(fmt=st.sampled_from(sorted(FORMATS)), latent=st.sampled_from(LATENTS), backend=st.sampled_from(BACKENDS),
       prefill=st.booleans(), token=st.integers(0, 2), coord=st.integers(0, 511), seed=st.integers(0, 2**31 - 1))
def test_latent_edges_every_format(fmt, latent, backend, prefill, token, coord, seed):
    if backend == "triton" and fmt.startswith("nvfp4"):
        backend = "torch"  # triton declines NVFP4
    with pytest.MonkeyPatch.context() as mp:
        name = _ready(backend, mp)
        dtype_arg, H, L, R, Dn = FORMATS[fmt]
        native = isinstance(dtype_arg, torch.dtype)
        case = make_case([5, 0, 9], [4, 2, 3] if prefill else [1, 1, 1], config=small_config(H, L, R, Dn, Dn), page_size=4,
                         dtype=dtype_arg if native else torch.float32, cache_dtype=None if native else dtype_arg,
                         kv_scale=1.0 if native else 0.5, seed=seed)
        t, j = token, coord % L
        if latent == "nan":
            case.kv[t, j] = math.nan
        elif latent == "inf":
            case.kv[t, j] = -math.inf if coord % 2 else math.inf  # RMSNorm: inf * rsqrt(inf) = NaN there, 0 elsewhere
        elif latent.startswith("zero"):
            case.kv[t, :L] = 0
            if latent == "zero-eps0":
                case.extras["epsilon"] = 0.0  # 0/0: a NaN entry
        else:
            case.kv[t, j] = 1e4 * (1 + coord % 7)  # far outside the rest, finite through RMSNorm
        a, b = case.clone_cache(), case.clone_cache()
        plan = openmla.plan(a.batch, scale=case.scale, backend=name)
        assert plan.backend_name == name, plan.fallback_reason
        out, lse = plan.run(*a.run_args(), return_lse=True)
        w_out, w_lse = openmla.plan(b.batch, scale=case.scale, backend="reference").run(*b.run_args(), return_lse=True)
        tol = 2e-2 if fmt == "bfloat16" else 1e-4
        assert_close_nan(_entries(a.batch, case.layer_idx), _entries(b.batch, case.layer_idx), tol, "stored entries", seed)
        if latent in ("nan", "inf", "zero-eps0"):
            assert torch.isnan(w_lse).any(), f"the poisoned token's own query must be NaN (seed {seed})"
        if name == "triton" and not torch.cuda.is_available() and not native and latent in ("nan", "inf", "zero-eps0"):
            return  # the interpreter widens the e4m3 NaN byte to 480 (a GPU's cvt gives NaN): the write is checked
        assert_close_nan(lse, w_lse, tol, f"{name} {fmt} lse", seed)
        assert_close_nan(out, w_out, tol, f"{name} {fmt} out", seed)


# 1b. The decode form with several query tokens of a sequence: a poisoned key of this step -----------
POISONS = [("nan", 7), ("inf", 7), ("-inf", 7), ("nan", "rope")]  # (value, column: a latent one or the rope part's)


@pytest.mark.parametrize("path", ["torch", "cpu", "cpu-brgemm"])
@pytest.mark.parametrize("value,column", POISONS, ids=[f"{v}-{c}" for v, c in POISONS])
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_step_key_unseen_by_earlier_queries(fmt, value, column, path):
    """Decode form (absorbed queries against the cache), 4 new tokens of one sequence: the row of its
    third new token holds NaN / +-inf (one stored value, the format's encoding of it). Its first two
    queries do not see that key: their output and LSE are the reference's (finite); the queries that
    see it follow the NaN rule exactly, a -inf score's zero probability times an infinite value
    included (NaN in those columns, as the reference's P x V).
    ``cpu-brgemm``: the native kernel with its register tiles off."""
    from cpu_backends import hooks

    with pytest.MonkeyPatch.context() as mp:
        name = _ready(path.split("-")[0], mp)
        dtype_arg, H, L, R, Dn = FORMATS[fmt]
        native = isinstance(dtype_arg, torch.dtype)
        case = make_case([37, 5], [4, 3], config=small_config(H, L, R, Dn, Dn), page_size=16,
                         dtype=dtype_arg if native else torch.float32, cache_dtype=None if native else dtype_arg,
                         kv_scale=1.0 if native else 0.5, seed=11)
        b = case.batch
        row = ref.physical_rows(b, 0, torch.tensor([37 + 2]))
        entry = _entries(b, case.layer_idx)[row].clone()
        entry[0, L + 3 if column == "rope" else column] = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}[value]
        b.write_rows(case.layer_idx, row, entry)
        q_abs = torch.randn(sum(b.new_tokens_list), H, L + R, generator=torch.Generator().manual_seed(3)).to(case.q.dtype)
        args = (q_abs, b, case.layer_idx)
        kw = dict(scale=case.scale, kv_lora_rank=L, return_lse=True)
        ops = hooks() if path == "cpu-brgemm" else None
        if ops is not None:
            ops.set_bf16_tiles(False), ops.set_f32_tiles(False)
        try:
            out, lse = openmla.flare_mla_decode(*args, backend=name, **kw)
        finally:
            if ops is not None:
                ops.set_bf16_tiles(True), ops.set_f32_tiles(True)
        w_out, w_lse = openmla.flare_mla_decode(*args, backend="reference", **kw)
        assert not torch.isnan(w_out[:2]).any() and not torch.isnan(w_lse[:2]).any()
        tol = 2e-2 if fmt == "bfloat16" else 1e-4
        assert_close_nan(lse, w_lse, tol, f"{path} {fmt} lse", 11)
        assert_close_nan(out, w_out, tol, f"{path} {fmt} out", 11)


# 1c. Chunk prefill (up-projected k, v given): a seen key with an infinite value -------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("score", ["-inf", "finite"])
def test_chunk_prefill_seen_infinite_value(score, backend, dtype):
    """MAX's chunk prefill takes any k and v, so a key's value may be infinite where its score is
    -inf (zero probability: 0 x inf, NaN in those columns, as the reference's P x V) or finite
    (+-inf there). A key in the middle of a causal prefill: the queries before it never see it
    (finite rows), the ones after it do; their rows must be the reference's column for column.
    Triton counts such a value as 0 (docs/api.md): there the queries that see it are checked in
    the other columns, and finite in its own."""
    from malformed import flare_args

    with pytest.MonkeyPatch.context() as mp:
        name = _ready(backend, mp)
        case = make_case([3, 0], [21, 6], config=small_config(2, 64, 16, 32, 32), page_size=4, dtype=dtype, seed=5)
        openmla.plan(case.batch, scale=case.scale, backend="reference").run(*case.run_args())  # the step's rope rows
        kw = flare_args(case)
        q, k, v = kw["q"].clone(), kw["k"].to(dtype), kw["v"].to(dtype)
        s = 3 + 11  # sequence 0's key at position 14: its queries 0-10 do not see it, 11-20 do
        if score == "-inf":
            q[:, 0, 0] = q[:, 0, 0].abs() + 0.5
            k[s, 0, 0] = -math.inf
        v[s, 0, 5], v[s, 1, 6], v[s, 1, 7] = math.inf, -math.inf, math.nan
        kw.update(q=q, k=k, v=v)
        got = openmla.flare_mla_prefill(**kw, backend=name, return_lse=True)
        if name == "torch":  # and its path for a device's tensors (no host read)
            mp.setattr(importlib.import_module("openmla.backends.torch_cpu.prefill"), "host_reads_free", lambda _t: False)
            on_device = openmla.flare_mla_prefill(**kw, backend=name, return_lse=True)
            for g, d in zip(got, on_device):
                torch.testing.assert_close(d, g, equal_nan=True)
        want = openmla.flare_mla_prefill(**kw, backend="reference", return_lse=True)
        assert not torch.isnan(want[0][:11]).any() and torch.isnan(want[0][11:21, 1, 7]).all()
        assert torch.isnan(want[0][11:21, 0, 5]).all() if score == "-inf" else torch.isinf(want[0][11:21, 0, 5]).all()
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
        assert_close_nan(got[1], want[1], tol, f"{name} lse", 5)
        if name == "triton":
            odd = torch.zeros_like(want[0], dtype=torch.bool)
            odd[11:21, 0, 5] = odd[11:21, 1, 6] = odd[11:21, 1, 7] = True
            assert torch.isfinite(got[0][odd]).all()
            got, want = (got[0].masked_fill(odd, 0), want[1]), (want[0].masked_fill(odd, 0), want[1])
        assert_close_nan(got[0], want[0], tol, f"{name} out", 5)


# 2. Reduced-precision queries against float64 -----------------------------------------------------
BF16_EPS = torch.finfo(torch.bfloat16).eps  # 2^-7
F32_EPS = torch.finfo(torch.float32).eps


@settings(max_examples=scaled(12), **FAST_FAIL)
@given(backend=st.sampled_from(BACKENDS), query=st.sampled_from(["bf16", "fp8"]), fp8_cache=st.booleans(),
       gain=st.sampled_from([1.0, 8.0, 24.0]), seed=st.integers(0, 2**31 - 1))
def test_reduced_precision_queries_against_float64(backend, query, fp8_cache, gain, seed):
    with pytest.MonkeyPatch.context() as mp:
        name = _ready(backend, mp)
        L, R = (128, 16) if fp8_cache else (64, 16)
        case = make_case([17, 2, 33], [1, 2, 1], config=small_config(4, L, R), page_size=8, dtype=torch.bfloat16,
                         cache_dtype="fp8_e4m3" if fp8_cache else None, kv_scale=0.5, seed=seed)
        filled = case.clone_cache()
        openmla.plan(filled.batch, scale=case.scale, backend="reference").run(*filled.run_args())
        g = torch.Generator().manual_seed(seed)
        q = torch.randn(case.q.shape[0], 4, L + R, generator=g) * gain
        kw = {}
        if query == "fp8":
            q, kw = (q / 8).clamp(-448, 448).to(torch.float8_e4m3fn), {"q_scale": 8.0}
        else:
            q = q.bfloat16()
        runs = {}
        for b in (name, "reference"):
            p = openmla.plan(filled.batch, scale=case.scale, backend=b)
            assert p.backend_name == b, p.fallback_reason
            runs[b] = p.decode(q, case.layer_idx, kv_lora_rank=L, return_lse=True, **kw)
        (out, lse), (w_out, w_lse) = runs[name], runs["reference"]
        # Products of bf16 / e4m3 values are exact in float32 and the scores stay float32: the LSE
        # carries only float32 sums (~1000 ulps at these widths); the output the bf16 rounding of
        # P (or of P x V per key block) and of the result: two bf16 epsilons.
        assert_lse(lse, w_lse, 1000 * F32_EPS, seed)
        assert_close(out, w_out, 2 * BF16_EPS, f"{name} {query} out", seed)


# 3. V4 plans with a malformed spec ----------------------------------------------------------------
def _v4_case(seed: int):
    g = torch.Generator().manual_seed(seed)
    D, ps, H = 16, 4, 2
    lengths = [6, 3]
    table = torch.tensor([[0, 1], [2, -1]], dtype=torch.int32)
    raw = PagedEntries(torch.randn(4, ps, D, generator=g), table, torch.tensor(lengths, dtype=torch.int32))
    comp = PagedEntries(torch.randn(4, ps, D, generator=g), torch.tensor([[3], [3]], dtype=torch.int32),
                        torch.tensor([3, 1], dtype=torch.int32))
    q = torch.randn(3, H, D, generator=g)
    offsets = torch.tensor([0, 2, 3])
    spec = SharedKVSpec(D ** -0.5, 4, EntryLayout(D, 2), CompressedKeys(2, torch.tensor([[0, -1], [2, 1], [0, 0]])),
                        torch.zeros(H))
    return q, offsets, raw, spec, comp


BAD_FIELDS = {
    "spec.entry": st.sampled_from([None, (16, 2), {"width": 16, "rope_dim": 2}, "whole", 16]),
    "spec.entry.width": st.sampled_from([EntryLayout(8, 2), EntryLayout(0, 0), EntryLayout(16.0, 2), EntryLayout("16", 2)]),
    "spec.entry.rope_dim": st.sampled_from([EntryLayout(16, 3), EntryLayout(16, -2), EntryLayout(16, 18), EntryLayout(16, None)]),
    "spec.entry.value": st.sampled_from([EntryLayout(16, 2, "latent"), EntryLayout(16, 2, None)]),
    "spec.scale": st.sampled_from([math.nan, math.inf, "1", None, True]),
    "spec.window": st.sampled_from([0, -1, 1.5, True, None, "4"]),
    "spec.compressed": st.sampled_from(["x", 2, (2, None)]),
    "spec.compressed.rate": st.sampled_from([CompressedKeys(0), CompressedKeys(True), CompressedKeys(1.5), CompressedKeys(None)]),
    "spec.compressed.indices": st.sampled_from([CompressedKeys(2, torch.zeros(3, 2)), CompressedKeys(2, torch.zeros(2, 2, dtype=torch.int32)),
                                                CompressedKeys(2, torch.full((3, 2), 7)), CompressedKeys(2, torch.full((3, 2), -2))]),
    "spec.attn_sink": st.sampled_from([torch.zeros(3), torch.zeros(2, dtype=torch.float64), [0.0, 0.0], torch.zeros(1, 2)]),
}


@settings(max_examples=scaled(30))
@given(field=st.sampled_from(sorted(BAD_FIELDS)), data=st.data(), backend=st.sampled_from(["torch", "reference"] + BACKENDS[1:]))
def test_v4_malformed_spec_is_a_value_error_naming_it(field, data, backend):
    q, offsets, raw, spec, comp = _v4_case(7)
    bad = data.draw(BAD_FIELDS[field])
    key = field.split(".")[1]
    if field.count(".") == 2:  # a field of a nested object: the whole object is drawn
        key = "entry" if field.startswith("spec.entry") else "compressed"
    spec = dataclasses.replace(spec, **{key: bad})
    before = (raw.blocks.clone(), comp.blocks.clone())
    with pytest.raises(ValueError, match=f"^{field.replace('.', '[.]')}:"):
        plan_shared_kv(q, offsets, raw, spec, comp, backend=backend)
    assert torch.equal(raw.blocks, before[0]) and torch.equal(comp.blocks, before[1])


# 4. V4 stores against a model ----------------------------------------------------------------------
KINDS = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention", "compressed_sparse_attention")
RATES = {"compressed_sparse_attention": 2, "heavily_compressed_attention": 3}
PS, POOL, WINDOW, IDX_W = 3, 14, 5, 8
IDS = ["a", "b", "c"]


def fp8_bound(x: torch.Tensor) -> torch.Tensor:
    """Largest error ``fp8_v4``'s read may show for entries ``x [n, 512]``: half an e4m3 step at the
    tile's power-of-two scale (nothing saturates), half a bf16 step on the rope slice."""
    nope = x[:, :fp8_v4.NOPE].reshape(-1, fp8_v4.TILES, fp8_v4.TILE)
    amax = nope.abs().amax(-1, keepdim=True)
    scale = torch.exp2(torch.ceil(torch.log2(torch.clamp(amax / 448, min=fp8_v4.MIN_SCALE))))
    nope_b = torch.maximum(nope.abs() * 2.0**-4, scale * 2.0**-10).reshape(-1, fp8_v4.NOPE)
    return torch.cat([nope_b, x[:, fp8_v4.NOPE:].abs() * 2.0**-8], dim=1) * (1 + 1e-6)


class V4Stores(RuleBasedStateMachine):
    """``V4Cache`` against a model: the entries written at each (store, layer, sequence, position),
    what the window frees, all-or-none extends; the raw layer 0 mirrored into fp8_v4 pages."""

    def __init__(self) -> None:
        super().__init__()
        layout = V4Layout(KINDS, width=fp8_v4.ENTRY, rope_dim=64, window=WINDOW, rates=tuple(RATES.items()), index_width=IDX_W)
        self.cache = V4Cache(layout, POOL, PS, torch.float32)
        self.fp8 = fp8_v4.new_pages(POOL, PS)
        self.model: dict = {}  # (store name, layer, seq, position) -> entry
        self.length: dict = {}
        self.freed: dict = {}  # seq -> raw logical pages trimmed away
        self.gen = torch.Generator().manual_seed(0)

    def _stores(self):
        return {"raw": self.cache.raw, **{k: s for k, s in self.cache.compressed.items()}, "index": self.cache.index}

    def _snapshot(self):
        return {n: (list(s.allocator._free), {k: list(v) for k, v in s._pages.items()}, dict(s._lengths))
                for n, s in self._stores().items()}

    @rule(ids=st.lists(st.sampled_from(IDS), unique=True, min_size=1, max_size=3), data=st.data())
    def extend(self, ids, data) -> None:
        counts = data.draw(st.lists(st.integers(0, 2 * PS + 2), min_size=len(ids), max_size=len(ids)))
        before_state = self._snapshot()
        try:
            before = self.cache.extend(ids, counts)
        except CacheFullError:
            assert self._snapshot() == before_state, "a full extend changed a store"
            return
        assert before == [self.length.get(s, 0) for s in ids]
        stores = self._stores()
        for name, store in stores.items():
            rate = RATES.get(name if name != "index" else "compressed_sparse_attention")
            new = list(counts) if name == "raw" else [(c + n) // rate - c // rate for c, n in zip(before, counts)]
            table = store.table(ids)
            rows = store.rows(table, new)
            first = [store.length(s) - n for s, n in zip(ids, new)]
            for layer in range(store.blocks.shape[0]):
                entries = torch.randn(rows.shape[0], store.width, generator=self.gen) * (1 + 10 * torch.rand(1, generator=self.gen))
                store.write(layer, rows, entries)
                i = 0
                for s, n, f in zip(ids, new, first):
                    for k in range(n):
                        self.model[(name, layer, s, f + k)] = entries[i]
                        i += 1
                if name == "raw" and layer == 0:
                    fp8_v4.write_rows(self.fp8, PS, rows, entries)
        for s, n in zip(ids, counts):
            self.length[s] = self.length.get(s, 0) + n
            self.freed.setdefault(s, 0)

    @rule()
    def trim(self) -> None:
        self.cache.trim()
        for s, n in self.length.items():
            self.freed[s] = max(self.freed[s], max(0, n - WINDOW + 1) // PS)
            held = self.cache.raw.pages_held(s)
            assert held <= (WINDOW - 1) // PS + 2, f"{s}: {held} raw pages held after trim (window {WINDOW}, page {PS})"

    @precondition(lambda self: self.length)
    @rule(data=st.data())
    def release(self, data) -> None:
        s = data.draw(st.sampled_from(sorted(self.length)))
        self.cache.release(s)
        del self.length[s], self.freed[s]
        self.model = {k: v for k, v in self.model.items() if k[2] != s}
        assert not self.cache.has(s)

    @invariant()
    def stores_hold_the_model(self) -> None:
        for name, store in self._stores().items():
            owned = [p for pages in store._pages.values() for p in pages if p != -1]
            assert len(owned) == len(set(owned)), f"{name}: a page is owned twice"
            assert len(owned) + store.allocator.num_free == store.allocator.num_pages, f"{name}: free + used != total"
            ids = [s for s in self.length if s in store._lengths]
            if not ids:
                continue
            table, lengths = store.table(ids)
            for b, s in enumerate(ids):
                n = int(lengths[b])
                rate = None if name == "raw" else RATES.get(name if name != "index" else "compressed_sparse_attention")
                assert n == (self.length[s] if rate is None else self.length[s] // rate), f"{name} {s}: length {n}"
                freed = self.freed[s] if name == "raw" else 0
                pages = table[b, : -(-n // PS)]
                assert bool((pages[:freed] == -1).all()) and bool((pages[freed:] >= 0).all()), f"{name} {s}: {pages.tolist()}"
                pos = torch.arange(freed * PS, n)
                if pos.numel() == 0:
                    continue
                rows = table[b, pos // PS].long() * PS + pos % PS
                for layer in range(store.blocks.shape[0]):
                    want = torch.stack([self.model[(name, layer, s, int(p))] for p in pos])
                    assert torch.equal(store.blocks[layer].reshape(-1, store.width)[rows], want), f"{name} layer {layer} {s}"
                if name == "raw":
                    want = torch.stack([self.model[("raw", 0, s, int(p))] for p in pos])
                    err = (fp8_v4.read_rows(self.fp8, PS, rows) - want).abs()
                    assert bool((err <= fp8_bound(want)).all()), f"fp8_v4 page of {s}: max err {float(err.max()):.3g}"
            per_page = store.blocks.shape[0] * PS * store.width * 4
            assert all(store.bytes_of(s) == store.pages_held(s) * per_page for s in ids)


TestV4Stores = V4Stores.TestCase
TestV4Stores.settings = settings(max_examples=scaled(12), stateful_step_count=10, deadline=None)
