"""DeepSeek-V4 shared-KV attention (openmla.v4) against the float64 oracle.

Every case draws a fresh seed (printed on failure): ragged sequences (0 and 1 new tokens
included, decode and prefill), pages handed out shuffled, pages wholly outside every window
freed (-1 in the table, NaN in the page), NaN in every unused page and row, windows smaller and
larger than the context, the compressed stream by rule (HCA) and by per-query indices with -1
slots and entries the rule hides (CSA), sinks, page sizes 1/16/64, several head counts. The
same scenario list runs over the torch backend, the native cpu backend (every output and
scratch buffer starting as NaN; the plan must not fall back) and the triton backend (CUDA, or
Triton's interpreter on the CPU; every buffer it allocates starts as NaN).
"""

from __future__ import annotations

import importlib
import math
import random

import pytest
import torch

from openmla import reference as ref
from openmla.backends import load_backend
from openmla.v4 import CompressedKeys, EntryLayout, PagedEntries, SharedKVSpec, plan_shared_kv, shared_kv_attention

from cases import assert_close, assert_lse
from cpu_backends import use_backend
from triton_support import CUDA, require_triton

pytestmark = pytest.mark.usefixtures("one_thread")  # small ops: one thread, no stall when another process takes a core
tkv = importlib.import_module("openmla.backends.torch_cpu.shared_kv")
SEEDS = random.Random()


def _triton():
    """The triton backend's ``_common`` when it can run here (CUDA, or the interpreter), else skip."""
    return require_triton()


@pytest.fixture
def triton_poisoned(nan_buffers):
    """The triton backend, every buffer it allocates starting as NaN (an unwritten element fails)."""
    return _triton()


def _to(dev: torch.device, q, offsets, raw, spec, comp):
    """The case's tensors on ``dev`` (the oracle reads the CPU copies)."""
    moved = lambda e: None if e is None else PagedEntries(e.blocks.to(dev), e.block_table.to(dev), e.lengths.to(dev))  # noqa: E731
    ck = spec.compressed
    if ck is not None and ck.indices is not None:
        ck = CompressedKeys(ck.rate, ck.indices.to(dev))
    sink = spec.attn_sink.to(dev) if spec.attn_sink is not None else None
    return q.to(dev), offsets.to(dev), moved(raw), SharedKVSpec(spec.scale, spec.window, spec.entry, ck, sink), moved(comp)


@pytest.fixture(autouse=True)
def poison_outputs(nan_buffers):
    """Output buffers start as NaN, so a row left unwritten shows."""


def _store(g: torch.Generator, lengths: list[int], first_read: list[int], page_size: int, D: int, dtype: torch.dtype,
           scale: float = 1.0) -> PagedEntries:
    """Entries ``0 .. lengths[b]-1`` of each sequence in shuffled pages; pages wholly before
    ``first_read[b]`` are freed (-1, NaN), as are all unused pages and rows."""
    need = [-(-n // page_size) for n in lengths]
    num_pages = sum(need) + 3
    order = torch.randperm(num_pages, generator=g).tolist()
    blocks = torch.full((num_pages, page_size, D), math.nan, dtype=dtype)
    table = torch.full((len(lengths), max(need + [1])), -1, dtype=torch.int32)
    for b, n in enumerate(lengths):
        for j in range(need[b]):
            if (j + 1) * page_size <= first_read[b]:
                continue  # out of every window: returned to the pool
            p = order.pop()
            table[b, j] = p
            k = min(page_size, n - j * page_size)
            blocks[p, :k] = (torch.randn(k, D, generator=g) * scale).to(dtype)
    return PagedEntries(blocks, table, torch.tensor(lengths, dtype=torch.int32))


def make(seed: int, *, B: int, H: int, D: int, page_size: int, window: int, mode: str, rate: int = 4, K: int = 6,
         sinks: bool = True, dtype: torch.dtype = torch.float32, decode: bool = False):
    g = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    new = [1 if decode else rnd.choice([0, 1, 2, 5, 17, 40]) for _ in range(B)]
    cached = [rnd.choice([0, 0, 3, 9, 30, 77]) for _ in range(B)]
    if decode:
        new[0] = 0  # a sequence without a query in a decode batch
    kv = [c + n for c, n in zip(cached, new)]
    first = [max(0, c - window + 1) if n else 10**9 for c, n in zip(cached, new)]
    raw = _store(g, kv, first, page_size, D, dtype)
    T = sum(new)
    q = (torch.randn(T, H, D, generator=g) * 0.7).to(dtype)
    offsets = torch.tensor([0] + list(torch.tensor(new).cumsum(0).tolist()), dtype=torch.int64)
    sink = torch.randn(H, generator=g) if sinks else None
    compressed, ck = None, None
    if mode != "none":
        c_lens = [n_kv // rate + rnd.choice([0, 0, 1]) for n_kv in kv]  # a store may hold entries no query sees yet
        compressed = _store(g, c_lens, [0] * B, page_size, D, dtype)
        indices = None
        if mode == "indices":
            rows = []
            for b, n in enumerate(new):
                for _ in range(n):
                    slots = torch.randint(-1, max(c_lens[b], 1), (K,), generator=g) if c_lens[b] else torch.full((K,), -1)
                    rows.append(slots)
            indices = torch.stack(rows).to(torch.int32) if rows else torch.zeros(0, K, dtype=torch.int32)
        ck = CompressedKeys(rate, indices)
    spec = SharedKVSpec(D ** -0.5 * rnd.choice([1.0, 3.0]), window, EntryLayout(D, min(8, D)), ck, sink)
    return q, offsets, raw, spec, compressed


CASES = [  # (B, H, D, page_size, window, mode, rate)
    (3, 1, 16, 1, 4, "none", 4),
    (4, 4, 32, 16, 8, "rule", 4),
    (4, 3, 32, 64, 200, "rule", 8),
    (5, 8, 16, 16, 6, "indices", 4),
    (3, 2, 64, 1, 3, "indices", 2),
    (4, 16, 32, 64, 33, "indices", 4),
    (2, 5, 512, 16, 16, "rule", 16),
]


@pytest.mark.parametrize("decode", [False, True])
@pytest.mark.parametrize("B,H,D,page_size,window,mode,rate", CASES)
def test_torch_matches_oracle(B, H, D, page_size, window, mode, rate, decode):
    seed = SEEDS.randrange(2**31)
    q, offsets, raw, spec, comp = make(seed, B=B, H=H, D=D, page_size=page_size, window=window, mode=mode, rate=rate,
                                       decode=decode, sinks=seed % 3 != 0)
    want, want_lse = ref.shared_kv_attention(q, offsets, raw, spec, comp)
    got, lse = shared_kv_attention(q, offsets, raw, spec, comp, backend="torch")
    assert got.dtype == q.dtype and lse.dtype == torch.float32
    assert_close(got, want, 1e-5, "out", seed)
    assert_lse(lse, want_lse, 1e-5, seed)


CPU_CASES = CASES + [pytest.param(5, 64, 64, 64, 128, "indices", 4, id="H64"),
                     pytest.param(3, 20, 24, 16, 9, "rule", 2, id="H20-D24")]  # head tiles of 16 + 4, an 8-column tail


@pytest.mark.parametrize("decode", [False, True])
@pytest.mark.parametrize("B,H,D,page_size,window,mode,rate", CPU_CASES)
def test_cpu_matches_oracle(monkeypatch, B, H, D, page_size, window, mode, rate, decode):
    use_backend("cpu", monkeypatch)
    seed = SEEDS.randrange(2**31)
    case = make(seed, B=B, H=H, D=D, page_size=page_size, window=window, mode=mode, rate=rate, decode=decode,
                sinks=seed % 3 != 0)
    want, want_lse = ref.shared_kv_attention(*case)
    plan = plan_shared_kv(*case, backend="cpu")
    assert plan.backend_name == "cpu" and plan.fallback_reason is None
    got, lse = plan.run(case[0])
    assert got.dtype == case[0].dtype and lse.dtype == torch.float32
    assert_close(got, want, 1e-5, "out", seed)
    assert_lse(lse, want_lse, 1e-5, seed)


@pytest.mark.parametrize("mode", ["none", "rule", "indices"])
def test_cpu_v4_shape_threads_and_half(monkeypatch, mode):
    """V4's shape (D = 512, 64 heads, a 128-token window; CSA's top-k by int64 indices) on two
    threads (heads cut into blocks across them), and bf16 / fp16 entries (float32 products)."""
    use_backend("cpu", monkeypatch)
    seed = SEEDS.randrange(2**31)
    case = make(seed, B=2, H=64, D=512, page_size=64, window=128, mode=mode, rate=4, K=24, decode=True)  # one query row: 2 head blocks
    q, offsets, raw, spec, comp = case
    if mode == "indices":
        spec = SharedKVSpec(spec.scale, spec.window, spec.entry, CompressedKeys(4, spec.compressed.indices.long()), spec.attn_sink)
    want, want_lse = ref.shared_kv_attention(q, offsets, raw, spec, comp)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        plan = plan_shared_kv(q, offsets, raw, spec, comp, backend="cpu")
        assert plan.backend_name == "cpu"
        got, lse = plan.run(q)
    finally:
        torch.set_num_threads(before)
    assert_close(got, want, 1e-5, "out (2 threads)", seed)
    assert_lse(lse, want_lse, 1e-5, seed)
    for dtype in (torch.bfloat16, torch.float16):
        qh, offsets, raw, spec, comp = make(seed, B=4, H=6, D=64, page_size=16, window=10, mode=mode, rate=4, dtype=dtype)
        want, want_lse = ref.shared_kv_attention(qh, offsets, raw, spec, comp)
        plan = plan_shared_kv(qh, offsets, raw, spec, comp, backend="cpu")
        assert plan.backend_name == "cpu" and plan.fallback_reason is None
        got, lse = plan.run(qh)
        assert got.dtype == dtype
        assert_close(got, want, 2e-2, f"out {dtype}", seed)
        assert_lse(lse, want_lse, 1e-4, seed)  # float32 products of the stored values: only q's rounding to its dtype differs


def test_cpu_nan_entry_is_not_hidden(monkeypatch):
    """A NaN in an entry a query sees makes that query's output and LSE NaN (as the oracle's and
    the torch kernel's), never zeros; the other queries keep their values."""
    use_backend("cpu", monkeypatch)
    seed = SEEDS.randrange(2**31)
    q, offsets, raw, spec, comp = make(seed, B=3, H=4, D=32, page_size=16, window=5, mode="rule", decode=True)
    b = 2  # decode: every sequence but the first has one query, which reads its own new entry
    last = int(raw.lengths[b]) - 1
    raw.blocks[int(raw.block_table[b, last // 16]), last % 16, 3] = math.nan
    got, lse = shared_kv_attention(q, offsets, raw, spec, comp, backend="cpu")
    want, want_lse = ref.shared_kv_attention(q, offsets, raw, spec, comp)
    row = int(offsets[b + 1]) - 1
    assert torch.isnan(got[row]).all() and torch.isnan(lse[row]).all() and torch.isnan(want[row]).all(), f"seed {seed}"
    keep = torch.ones(q.shape[0], dtype=torch.bool)
    keep[row] = False
    assert_close(got[keep], want[keep], 1e-5, "out (other rows)", seed)


@pytest.mark.parametrize("decode", [False, True])
@pytest.mark.parametrize("B,H,D,page_size,window,mode,rate", CASES + [pytest.param(5, 64, 64, 64, 128, "indices", 4, id="H64")])
def test_triton_matches_oracle(triton_poisoned, B, H, D, page_size, window, mode, rate, decode):
    if H == 64 and not decode and not CUDA:
        pytest.skip("64 heads: decode rows only under the interpreter (time)")
    seed = SEEDS.randrange(2**31)
    if not decode and not CUDA:
        B = min(B, 3)  # the interpreter runs each program in Python: prefill rows of 3 ragged sequences
    case = make(seed, B=B, H=H, D=D, page_size=page_size, window=window, mode=mode, rate=rate, decode=decode,
                sinks=seed % 3 != 0)
    want, want_lse = ref.shared_kv_attention(*case)
    dev = torch.device("cuda" if CUDA else "cpu")
    moved = _to(dev, *case)
    plan = plan_shared_kv(*moved, backend="triton")
    assert plan.backend_name == "triton" and plan.fallback_reason is None
    got, lse = plan.run(moved[0])
    assert got.dtype == moved[0].dtype and lse.dtype == torch.float32
    assert_close(got, want, 1e-5, "out", seed)
    assert_lse(lse.cpu(), want_lse, 1e-5, seed)


@pytest.mark.parametrize("mode", ["rule", "indices"])
def test_triton_splits_and_bf16(triton_poisoned, mode):
    """Any split count (slices cut through the window and the compressed slots; merged with the
    sink) gives the oracle's result; bf16 entries within bf16 tolerance."""
    from openmla.backends.triton.shared_kv import shared_kv_into

    seed = SEEDS.randrange(2**31)
    case = make(seed, B=6, H=3, D=32, page_size=16, window=37, mode=mode, rate=2, K=40, decode=True)
    want, want_lse = ref.shared_kv_attention(*case)
    dev = torch.device("cuda" if CUDA else "cpu")
    moved = _to(dev, *case)
    plan = plan_shared_kv(*moved, backend="triton")
    for splits in (1, 3, 7):
        got, lse = shared_kv_into(moved[0], plan, num_splits=splits)
        assert_close(got, want, 1e-5, f"out ({splits} splits)", seed)
        assert_lse(lse.cpu(), want_lse, 1e-5, seed)
    qb, offsets, raw, spec, comp = make(seed, B=3, H=4, D=64, page_size=16, window=10, mode=mode, rate=4, dtype=torch.bfloat16,
                                        decode=True)
    want, _ = ref.shared_kv_attention(qb, offsets, raw, spec, comp)
    got, _ = shared_kv_attention(*_to(dev, qb, offsets, raw, spec, comp), backend="triton")
    assert got.dtype == torch.bfloat16
    assert_close(got, want, 2e-2, "out bf16", seed)


def test_torch_chunks_and_bf16(monkeypatch):
    """Many small chunks give the result of one; bf16 entries within bf16 tolerance."""
    seed = SEEDS.randrange(2**31)
    q, offsets, raw, spec, comp = make(seed, B=4, H=4, D=32, page_size=16, window=10, mode="indices", rate=4)
    want, _ = ref.shared_kv_attention(q, offsets, raw, spec, comp)
    monkeypatch.setattr(tkv, "CHUNK_ELEMENTS", 1)
    got, _ = shared_kv_attention(q, offsets, raw, spec, comp, backend="torch")
    assert_close(got, want, 1e-5, "out (one row per chunk)", seed)
    qb, offsets, raw, spec, comp = make(seed, B=4, H=4, D=32, page_size=16, window=10, mode="rule", rate=4, dtype=torch.bfloat16)
    want, _ = ref.shared_kv_attention(qb, offsets, raw, spec, comp)
    got, _ = shared_kv_attention(qb, offsets, raw, spec, comp, backend="torch")
    assert got.dtype == torch.bfloat16
    assert_close(got, want, 2e-2, "out bf16", seed)


def test_oracle_by_hand():
    """The oracle against a hand-computed case: window 2, rate 2, one query at position 3 sees raw
    entries 2 and 3 and compressed entries 0 and 1 ((3+1)//2 = 2), plus the sink."""
    D = 4
    raw_entries = torch.eye(4, dtype=torch.float64)
    comp_entries = torch.tensor([[1.0, 1, 0, 0], [0, 0, 1, 1], [9, 9, 9, 9]], dtype=torch.float64)
    raw = PagedEntries(raw_entries[:, None, :], torch.arange(4)[None], torch.tensor([4]))
    comp = PagedEntries(comp_entries[:, None, :], torch.arange(3)[None], torch.tensor([3]))
    q = torch.tensor([[[1.0, 2, 3, 4]]], dtype=torch.float64)
    spec = SharedKVSpec(0.5, 2, EntryLayout(D, 2), CompressedKeys(2), torch.tensor([0.25]))
    out, lse = ref.shared_kv_attention(q, torch.tensor([0, 1]), raw, spec, comp)
    keys = torch.stack([raw_entries[2], raw_entries[3], comp_entries[0], comp_entries[1]])
    s = 0.5 * keys @ q[0, 0]
    e = torch.exp(s)
    assert torch.allclose(out[0, 0], (e @ keys) / (e.sum() + math.exp(0.25)))
    assert torch.allclose(lse[0, 0], torch.log(e.sum()))


def test_rule_hides_future_entries():
    """A compressed entry at logical position (w+1)*rate-1 past the query changes nothing."""
    seed = SEEDS.randrange(2**31)
    q, offsets, raw, spec, comp = make(seed, B=2, H=2, D=16, page_size=16, window=4, mode="rule", rate=4)
    base, _ = shared_kv_attention(q, offsets, raw, spec, comp, backend="torch")
    hidden = 0
    for b, (kv, n) in enumerate(zip(raw.lengths.tolist(), comp.lengths.tolist())):
        for w in range(kv // 4, n):  # held, but past every query of the sequence: (w+1)*4-1 > kv-1
            page = int(comp.block_table[b, w // 16])
            comp.blocks[page, w % 16] = 1e4
            hidden += 1
    comp.blocks[torch.isnan(comp.blocks)] = 1e4  # unused rows too
    got, _ = shared_kv_attention(q, offsets, raw, spec, comp, backend="torch")
    assert torch.equal(got, base), f"seed {seed}"
    want, _ = ref.shared_kv_attention(q, offsets, raw, spec, comp)
    assert_close(got, want, 1e-5, "out", seed)


def test_fallback_and_refusal():
    seed = SEEDS.randrange(2**31)
    q, offsets, raw, spec, comp = make(seed, B=2, H=2, D=16, page_size=16, window=4, mode="rule")
    try:
        load_backend("cpu")
    except ValueError:
        pass
    else:
        assert plan_shared_kv(q, offsets, raw, spec, comp, backend="cpu").backend_name == "cpu"
        case64 = make(seed, B=2, H=2, D=16, page_size=16, window=4, mode="rule", dtype=torch.float64)
        plan = plan_shared_kv(*case64, backend="cpu")  # float64 entries: the native kernel declines
        assert plan.backend_name == "torch" and "shared-KV" in plan.fallback_reason and "float64" in plan.fallback_reason
    assert plan_shared_kv(q, offsets, raw, spec, comp, backend="reference").backend_name == "reference"
    try:
        load_backend("triton")
    except ValueError:
        return
    from openmla.backends.triton import _common

    if CUDA or _common.INTERPRET:
        assert plan_shared_kv(q, offsets, raw, spec, comp, backend="triton").backend_name == "triton"
    else:
        with pytest.raises(ValueError, match="backend: the triton backend cannot run this step: it runs on CUDA"):
            plan_shared_kv(q, offsets, raw, spec, comp, backend="triton")


def _bad(**change):
    q, offsets, raw, spec, comp = make(5, B=3, H=2, D=16, page_size=4, window=4, mode="indices")
    args = dict(q=q, q_offsets=offsets, raw=raw, spec=spec, compressed=comp)
    for k, v in change.items():
        args[k] = v(args) if callable(v) else v
    return args


@pytest.mark.parametrize("name,change", [
    ("q", dict(q=lambda a: a["q"][:, 0])),
    ("spec.entry.width", dict(spec=lambda a: SharedKVSpec(1.0, 4, EntryLayout(8, 2), a["spec"].compressed))),
    ("spec.window", dict(spec=lambda a: SharedKVSpec(1.0, 0, EntryLayout(16, 2), a["spec"].compressed))),
    ("spec.scale", dict(spec=lambda a: SharedKVSpec(math.nan, 4, EntryLayout(16, 2), a["spec"].compressed))),
    ("spec.entry.value", dict(spec=lambda a: SharedKVSpec(1.0, 4, EntryLayout(16, 2, "latent"), a["spec"].compressed))),
    ("spec.entry", dict(spec=lambda a: SharedKVSpec(1.0, 4, None, a["spec"].compressed))),
    ("spec.entry", dict(spec=lambda a: SharedKVSpec(1.0, 4, (16, 2), a["spec"].compressed))),
    ("spec.entry", dict(spec=lambda a: SharedKVSpec(1.0, 4, {"width": 16, "rope_dim": 2}, a["spec"].compressed))),
    ("q_offsets", dict(q_offsets=lambda a: a["q_offsets"].flip(0))),
    ("raw.lengths", dict(raw=lambda a: PagedEntries(a["raw"].blocks, a["raw"].block_table, a["raw"].lengths * 0))),
    ("raw.block_table", dict(raw=lambda a: PagedEntries(a["raw"].blocks, a["raw"].block_table * 0 - 1, a["raw"].lengths))),
    ("raw.blocks", dict(raw=lambda a: PagedEntries(a["raw"].blocks.double(), a["raw"].block_table, a["raw"].lengths))),
    ("compressed", dict(compressed=None)),
    ("compressed.lengths", dict(compressed=lambda a: PagedEntries(a["compressed"].blocks, a["compressed"].block_table,
                                                                   a["compressed"].lengths * 0))),
    ("spec.compressed.indices", dict(spec=lambda a: SharedKVSpec(1.0, 4, EntryLayout(16, 2), CompressedKeys(
        4, a["spec"].compressed.indices + 1000)))),
    ("spec.compressed.rate", dict(spec=lambda a: SharedKVSpec(1.0, 4, EntryLayout(16, 2), CompressedKeys(0)))),
    ("spec.attn_sink", dict(spec=lambda a: SharedKVSpec(1.0, 4, EntryLayout(16, 2), a["spec"].compressed, torch.zeros(3)))),
])
def test_bad_input_names_the_argument(name, change):
    args = _bad(**change)
    with pytest.raises(ValueError, match=f"^{name.replace('.', '[.]')}:"):
        shared_kv_attention(args["q"], args["q_offsets"], args["raw"], args["spec"], args["compressed"], backend="torch")


@pytest.mark.parametrize("mode", ["rule", "indices"])
def test_torch_kernel_is_sync_free(mode):
    """After the plan (the step's one host read), the torch kernel reads no tensor value on the host."""
    from test_torch_sync_free import host_reads_refused

    seed = SEEDS.randrange(2**31)
    q, offsets, raw, spec, comp = make(seed, B=3, H=2, D=16, page_size=16, window=5, mode=mode)
    plan = plan_shared_kv(q, offsets, raw, spec, comp, backend="torch")
    with host_reads_refused():
        got, _ = plan.backend.shared_kv_attention(plan, q)
    assert_close(got, ref.shared_kv_attention(q, offsets, raw, spec, comp)[0], 1e-5, "out", seed)


def test_plan_for_another_layer():
    """A planned step serves another layer of the same stores (other blocks, sinks, picks) with
    the result of a fresh plan; what does not fit the step is refused, naming it."""
    seed = SEEDS.randrange(2**31)
    q, offsets, raw, spec, comp = make(seed, B=3, H=4, D=16, page_size=16, window=5, mode="indices")
    plan = plan_shared_kv(q, offsets, raw, spec, comp, backend="torch")
    g = torch.Generator().manual_seed(seed + 7)
    raw2 = PagedEntries(torch.randn(raw.blocks.shape, generator=g), raw.block_table, raw.lengths)
    comp2 = PagedEntries(torch.randn(comp.blocks.shape, generator=g), comp.block_table, comp.lengths)
    picks = torch.randint(-1, 4, (q.shape[0], 3), generator=g, dtype=torch.int64)
    spec2 = SharedKVSpec(spec.scale, spec.window, spec.entry, CompressedKeys(spec.compressed.rate, picks), torch.randn(4, generator=g))
    got, _ = plan.for_layer(raw2, spec2, comp2).run(q)
    assert_close(got, ref.shared_kv_attention(q, offsets, raw2, spec2, comp2)[0], 1e-5, "out", seed)
    with pytest.raises(ValueError, match="^spec:"):
        plan.for_layer(raw2, SharedKVSpec(spec.scale, spec.window + 1, spec.entry, spec2.compressed), comp2)
    with pytest.raises(ValueError, match="^raw:"):
        plan.for_layer(PagedEntries(raw2.blocks, raw.block_table.clone(), raw.lengths), spec2, comp2)
    with pytest.raises(ValueError, match="^compressed[.]blocks:"):
        plan.for_layer(raw2, spec2, PagedEntries(comp2.blocks[:1], comp.block_table, comp.lengths))


@pytest.mark.parametrize("backend", ["reference", "torch", "cpu", "triton"])
def test_float64_is_float64_or_refused(backend, monkeypatch):
    """float64 q and entries: torch computes in float64 (as its MLA path; cpu declines to it), so the
    result is the oracle's to ~1e-12; triton, whose kernel computes in float32, refuses the step by
    name (never float64 computed in float32)."""
    if backend == "cpu":
        use_backend("cpu", monkeypatch)
    if backend == "triton":
        _triton()
    seed = SEEDS.randrange(2**31)
    case = make(seed, B=3, H=4, D=32, page_size=16, window=6, mode="indices", dtype=torch.float64)
    if backend == "triton":
        dev = torch.device("cuda" if CUDA else "cpu")
        with pytest.raises(ValueError, match="^backend: the triton backend cannot run this step: q and raw.blocks are float64"):
            plan_shared_kv(*_to(dev, *case), backend="triton")
        return
    want, want_lse = ref.shared_kv_attention(*case)
    plan = plan_shared_kv(*case, backend=backend)
    assert plan.backend_name == ("torch" if backend == "cpu" else backend)
    got, lse = plan.run(case[0])
    assert got.dtype == torch.float64 and lse.dtype == torch.float32
    assert_close(got, want, 1e-12, "float64 out", seed)
    assert_lse(lse, want_lse, 1e-6, seed)


@pytest.mark.parametrize("value", [math.nan, math.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("backend", ["reference", "torch", "cpu", "triton"])
def test_nonfinite_entry_gives_a_nan_row(backend, value, monkeypatch):
    """docs/api.md's NaN rule on V4: a NaN or infinite value in an entry a query sees (its score NaN
    or +inf) makes that query's output and LSE NaN on every backend; the other rows keep their values."""
    if backend == "cpu":
        use_backend("cpu", monkeypatch)
    dev = torch.device("cpu")
    if backend == "triton":
        _triton()
        dev = torch.device("cuda" if CUDA else "cpu")
    seed = SEEDS.randrange(2**31)
    q, offsets, raw, spec, comp = make(seed, B=3, H=4, D=32, page_size=16, window=5, mode="rule", decode=True)
    b = 2
    last = int(raw.lengths[b]) - 1
    q[int(offsets[b + 1]) - 1, :, 3] = 1.0  # the poisoned coordinate's score is +-inf * 1 (or NaN)
    raw.blocks[int(raw.block_table[b, last // 16]), last % 16, 3] = value
    want, want_lse = ref.shared_kv_attention(q, offsets, raw, spec, comp)
    got, lse = shared_kv_attention(*_to(dev, q, offsets, raw, spec, comp), backend=backend)
    row = int(offsets[b + 1]) - 1
    assert torch.isnan(want[row]).all() and torch.isnan(want_lse[row]).all(), f"seed {seed}"
    assert torch.isnan(got[row].cpu()).all() and torch.isnan(lse[row].cpu()).all(), f"{backend}: seed {seed}"
    keep = torch.ones(q.shape[0], dtype=torch.bool)
    keep[row] = False
    assert_close(got.cpu()[keep], want[keep], 1e-5, "out (other rows)", seed)
