"""openmla.compat.flashmla against float64 references written from FlashMLA's documented semantics.

FlashMLA's conventions, as its interface documents them (flash_mla/flash_mla_interface.py):
q ``[b, s_q, h_q, d_qk]``; paged cache ``[num_blocks, page_block_size, 1, d_qk]``; ``cache_seqlens``
counts every key; causal = the queries are the last ``s_q`` positions; default scale
``d_qk ** -0.5``; sparse indices are physical rows ``block * page_block_size + offset``, an index
``< 0`` or past the valid rows is skipped; ``topk_length`` keeps the leftmost entries (per sequence
in decode, per token in the sparse prefill); LSE natural-log, +inf for a query without keys (output
0), ``[b, h_q, s_q]`` in decode; the sink scales the output by ``e^lse / (e^lse + e^sink)`` and stays
out of the LSE; FP8 records of 656 bytes = 512 float8_e4m3 latent values, 4 float32 scales (one per
128 values), 64 bfloat16 rope values.

Caches are poisoned with NaN wherever the attention must not read (untouched blocks, the tail of a
sequence's last block, blocks past its pages in the table, records of skipped indices).
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from openmla import combine
from openmla.compat.flashmla import flash_mla_sparse_fwd, flash_mla_with_kvcache, get_mla_metadata
from openmla.fp8 import pack_ds_mla, unpack_ds_mla

from cases import TOL, assert_close

CUDA = torch.cuda.is_available()
BACKENDS = ["torch", "triton"]
INF = math.inf
INVALID = [-1, -2147483648, -123456, 2147483647, 2147480000]  # plus "one past the rows", added per case


def _device(backend: str) -> str:
    return "cuda" if backend == "triton" and CUDA else "cpu"


# float64 references ----------------------------------------------------------------------------
def attend(q: torch.Tensor, keys: torch.Tensor, dv: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One query ``q [h, d]`` over ``keys [m, d]`` (values = first dv entries), float64: ``(out [h, dv],
    lse [h])``, natural log; no key -> zeros and -inf."""
    if keys.shape[0] == 0:
        return torch.zeros(q.shape[0], dv, dtype=torch.float64), torch.full((q.shape[0],), -INF, dtype=torch.float64)
    s = (q @ keys.T) * scale
    lse = torch.logsumexp(s, -1)
    return torch.exp(s - lse[:, None]) @ keys[:, :dv], lse


def with_sink(out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor | None) -> torch.Tensor:
    """FlashMLA's sink: ``out * e^lse / (e^lse + e^sink)``; a row without keys stays 0."""
    if sink is None:
        return out
    factor = 1.0 / (1.0 + torch.exp(sink.double() - lse))
    return torch.where(torch.isinf(lse)[:, None] & (lse < 0)[:, None], 0.0, out * factor[:, None])


def flashmla_lse(lse: torch.Tensor) -> torch.Tensor:
    return lse.masked_fill(lse == -INF, INF)


# FP8 records, written from FlashMLA's documented byte layout (not openmla's code) ------------------
def pack_records(entries: torch.Tensor) -> torch.Tensor:
    """``entries [n, 576]`` -> uint8 ``[n, 656]``: 512 float8_e4m3 bytes (latent / its tile's scale),
    4 float32 scales, 64 bfloat16 rope values. Scales are powers of two (as FlashMLA's own
    quantiser makes them), so dequantised values are exact in bfloat16."""
    n = entries.shape[0]
    lat = entries[:, :512].float().view(n, 4, 128)
    scales = torch.exp2(torch.ceil(torch.log2((lat.abs().amax(-1) / 448.0).clamp_min(1e-4))))
    fp8 = (lat / scales[..., None]).to(torch.float8_e4m3fn).view(n, 512)
    parts = [fp8.view(torch.uint8), scales.contiguous().view(torch.uint8).view(n, 16),
             entries[:, 512:].to(torch.bfloat16).contiguous().view(torch.uint8).view(n, 128)]
    return torch.cat(parts, dim=1)


def unpack_records(records: torch.Tensor) -> torch.Tensor:
    """uint8 ``[n, 656]`` -> float64 entries ``[n, 576]`` by the documented layout."""
    n = records.shape[0]
    raw = records.reshape(n, 656).contiguous()
    lat = raw[:, :512].view(torch.float8_e4m3fn).double().view(n, 4, 128)
    scales = raw[:, 512:528].contiguous().view(torch.float32).double()
    rope = raw[:, 528:].contiguous().view(torch.bfloat16).double()
    return torch.cat([(lat * scales[..., None]).view(n, 512), rope], dim=1)


def test_fp8_record_layout_is_flashmla_s():
    """openmla's fp8_ds_mla record is FlashMLA's 656-byte record, byte for byte: each decodes the other."""
    g = torch.Generator().manual_seed(7)
    entries = torch.randn(40, 576, generator=g) * torch.rand(40, 1, generator=g) * 3
    entries[3, :128] = 0.0  # an all-zero tile
    theirs = pack_records(entries)
    assert theirs.shape == (40, 656)
    torch.testing.assert_close(unpack_ds_mla(theirs, 512, torch.float64), unpack_records(theirs), rtol=0, atol=0)
    ours = pack_ds_mla(entries, 512)
    assert ours.shape == (40, 656) and ours.dtype == torch.uint8
    torch.testing.assert_close(unpack_records(ours), unpack_ds_mla(ours, 512, torch.float64), rtol=0, atol=0)
    # the fields sit where FlashMLA says: the rope part is plain bfloat16 at byte 528
    torch.testing.assert_close(ours[:, 528:].contiguous().view(torch.bfloat16), entries[:, 512:].to(torch.bfloat16))


# Dense decode ------------------------------------------------------------------------------------
def make_paged(seqlens: list[int], page_size: int, d: int, dtype, fp8: bool, g: torch.Generator, layers: int = 2):
    """Per-layer caches ``[nb, ps, 1, d]`` (or FP8 records) in shuffled blocks, NaN wherever no key
    lives, and the block table (2147480000 past each sequence's blocks, as FlashMLA's tests do).
    Returns (caches, float64 entries per layer [nb, ps, d], block_table)."""
    pages = [-(-n // page_size) for n in seqlens]
    nb = sum(pages) + 2
    perm = torch.randperm(nb, generator=g).tolist()
    width = max(pages) + 1
    table = torch.full((len(seqlens), width), 2147480000, dtype=torch.int32)
    live = torch.zeros(nb, page_size, dtype=torch.bool)
    k = 0
    for b, (n, p) in enumerate(zip(seqlens, pages)):
        for j in range(p):
            table[b, j] = perm[k]
            live[perm[k], : min(page_size, n - j * page_size)] = True
            k += 1
    caches, exact = [], []
    for _ in range(layers):
        entries = torch.randn(nb, page_size, d, generator=g)
        if fp8:
            records = pack_records(entries.view(-1, d)).view(nb, page_size, 656)
            records[~live] = 255  # NaN in every field
            view = random.Random(int(torch.randint(0, 99, (1,), generator=g))).choice([torch.uint8, torch.int8, torch.float8_e4m3fn])
            caches.append(records.view(view).unsqueeze(2))
            exact.append(unpack_records(records.view(-1, 656)).view(nb, page_size, d))
        else:
            entries = entries.to(dtype)
            entries[~live] = math.nan
            caches.append(entries.unsqueeze(2))
            exact.append(entries.double())
    return caches, exact, table


def ref_dense(q, entries, table, seqlens, dv, scale, causal):
    b, s_q, h, d = q.shape
    ps = entries.shape[1]
    out = torch.zeros(b, s_q, h, dv, dtype=torch.float64)
    lse = torch.zeros(b, h, s_q, dtype=torch.float64)
    for i, n in enumerate(seqlens):
        keys = entries[table[i, : -(-n // ps)].long()].reshape(-1, d)[:n]
        for t in range(s_q):
            m = max(0, min(n, n - s_q + t + 1)) if causal else n
            out[i, t], lse[i, :, t] = attend(q[i, t].double(), keys[:m], dv, scale)
    return out, flashmla_lse(lse)


def check(out, lse, want_out, want_lse, dtype, seed):
    tol = TOL[dtype]
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), f"NaN in the result (seed {seed})"
    assert_close(out, want_out, tol, "out", seed)
    assert lse.dtype == torch.float32
    got, want = lse.double().cpu(), want_lse
    assert torch.equal(got == INF, want == INF), f"lse: +inf (no key) rows differ (seed {seed})"
    assert not (got == -INF).any(), f"lse: -inf is not FlashMLA's empty-row value (seed {seed})"
    fin = torch.isfinite(want)
    if fin.any():
        err = float((got[fin] - want[fin]).abs().max() / want[fin].abs().max().clamp_min(1.0))
        assert err <= tol, f"lse: err {err:.3g} > {tol} (seed {seed})"


DENSE_CASES = [  # (seqlens, s_q, h_q, causal): varlen, empty caches, fewer keys than queries
    ([130, 64, 1], 1, 16, False),
    ([70, 0, 129, 3], 2, 8, True),
    ([70, 0, 129, 3], 2, 8, False),
    ([200, 2, 65], 4, 4, True),
    ([1, 3], 4, 2, False),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seqlens,s_q,h_q,causal", DENSE_CASES)
def test_dense_decode(seqlens, s_q, h_q, causal, dtype):
    """Page size 64 (FlashMLA's only one), d_qk 576, default scale; one metadata object serves
    two layers' caches (the plan is made once and reused over the second cache)."""
    seed = random.randrange(1 << 30)
    g = torch.Generator().manual_seed(seed)
    caches, exact, table = make_paged(seqlens, 64, 576, dtype, False, g)
    q = torch.randn(len(seqlens), s_q, h_q, 576, generator=g).to(dtype)
    seq = torch.tensor(seqlens, dtype=torch.int32)
    meta, splits = get_mla_metadata(seq, s_q * h_q, 1)  # old-style arguments are accepted
    for cache, ent in zip(caches, exact):
        out, lse = flash_mla_with_kvcache(q, cache, table, seq, 512, meta, splits, causal=causal, backend="torch")
        assert out.shape == (len(seqlens), s_q, h_q, 512) and out.dtype == dtype and lse.shape == (len(seqlens), h_q, s_q)
        want_out, want_lse = ref_dense(q, ent, table, seqlens, 512, 576 ** -0.5, causal)
        check(out, lse, want_out, want_lse, dtype, seed)


def test_dense_decode_fp8_records_and_scale():
    """Dense decode reads FP8 records too (beyond FlashMLA), with an explicit softmax_scale."""
    seed = random.randrange(1 << 30)
    g = torch.Generator().manual_seed(seed)
    seqlens = [100, 5, 0]
    caches, exact, table = make_paged(seqlens, 64, 576, None, True, g, layers=1)
    q = torch.randn(3, 2, 4, 576, generator=g)
    seq = torch.tensor(seqlens, dtype=torch.int32)
    meta, _ = get_mla_metadata()
    out, lse = flash_mla_with_kvcache(q, caches[0], table, seq, 512, meta, None, softmax_scale=0.07, causal=True,
                                      is_fp8_kvcache=True, backend="torch")
    check(out, lse, *ref_dense(q, exact[0], table, seqlens, 512, 0.07, True), torch.float32, seed)


@pytest.mark.parametrize("causal", [False, True])
def test_dense_decode_triton(causal):
    """The same through the triton backend (small head dims: the interpreter is slow)."""
    seed = random.randrange(1 << 30)
    g = torch.Generator().manual_seed(seed)
    dev = _device("triton")
    seqlens, d, dv = [40, 0, 17, 2], 80, 64
    caches, exact, table = make_paged(seqlens, 16, d, torch.float32, False, g)
    q = torch.randn(4, 3, 2, d, generator=g)
    seq = torch.tensor(seqlens, dtype=torch.int32)
    meta, _ = get_mla_metadata()
    for cache, ent in zip(caches, exact):
        out, lse = flash_mla_with_kvcache(q.to(dev), cache.to(dev), table.to(dev), seq.to(dev), dv, meta, None,
                                          causal=causal, backend="triton")
        check(out.cpu(), lse.cpu(), *ref_dense(q, ent, table, seqlens, dv, d ** -0.5, causal), torch.float32, seed)


def test_metadata_is_checked_and_replanned():
    g = torch.Generator().manual_seed(1)
    caches, exact, table = make_paged([70, 9], 64, 576, torch.float32, False, g)
    q = torch.randn(2, 1, 4, 576, generator=g)
    seq = torch.tensor([70, 9], dtype=torch.int32)
    meta, _ = get_mla_metadata()
    flash_mla_with_kvcache(q, caches[0], table, seq, 512, meta, None, backend="torch")
    with pytest.raises(ValueError, match="tile_scheduler_metadata"):
        flash_mla_with_kvcache(q, caches[0], table, seq, 512, meta, None, causal=True, backend="torch")
    with pytest.raises(ValueError, match="tile_scheduler_metadata"):
        flash_mla_with_kvcache(q[:, :, :2], caches[0], table, seq, 512, meta, None, backend="torch")
    # another block table tensor (same pages, other column order of the unused tail) is re-read
    table2 = table.clone()
    table2[:, -1] = 0
    out, lse = flash_mla_with_kvcache(q, caches[1], table2, seq, 512, meta, None, backend="torch")
    check(out, lse, *ref_dense(q, exact[1], table, [70, 9], 512, 576 ** -0.5, False), torch.float32, 1)


# Sparse decode -------------------------------------------------------------------------------------
def sparse_indices(b, s_q, topk, num_rows, g, all_invalid_rows: bool = False) -> torch.Tensor:
    """Physical rows (distinct per query), with every invalid form FlashMLA skips mixed in."""
    idx = torch.stack([torch.randperm(num_rows, generator=g)[:topk] for _ in range(b * s_q)]).view(b, s_q, topk)
    forms = torch.tensor(INVALID + [num_rows, num_rows + 5], dtype=torch.int64)
    bad = torch.rand(b, s_q, topk, generator=g) < 0.3
    idx = torch.where(bad, forms[torch.randint(0, len(forms), (b, s_q, topk), generator=g)], idx.long())
    if all_invalid_rows:
        idx[0, 0] = -1
    return idx.to(torch.int32)


def ref_sparse_rows(q_row, rows_list, dv, scale, sink):
    """One query over the union of its valid rows: ``rows_list`` = [(entries [R, d], idx [k], keep)]."""
    keys = []
    for entries, idx, keep in rows_list:
        ok = (idx >= 0) & (idx < entries.shape[0]) & keep
        keys.append(entries[idx[ok].long()])
    o, lse = attend(q_row, torch.cat(keys), dv, scale)
    return with_sink(o, lse, sink), lse


def ref_sparse_decode(q, scopes, dv, scale, sink):
    """``scopes`` = [(entries [rows, d], indices [b, s_q, k], topk_length [b] or None)]."""
    b, s_q, h, _ = q.shape
    out = torch.zeros(b, s_q, h, dv, dtype=torch.float64)
    lse = torch.zeros(b, h, s_q, dtype=torch.float64)
    for i in range(b):
        for t in range(s_q):
            rows = []
            for entries, idx, tl in scopes:
                k = idx.shape[-1]
                keep = torch.arange(k) < (k if tl is None else int(tl[i]))
                rows.append((entries, idx[i, t], keep))
            out[i, t], lse[i, :, t] = ref_sparse_rows(q[i, t].double(), rows, dv, scale, sink)
    return out, flashmla_lse(lse)


def poison_unread(records: torch.Tensor, scopes_idx: list[torch.Tensor]) -> None:
    """NaN bytes in every record no index (valid or not, before topk_length) points at."""
    flat = records.view(-1, records.shape[-1])
    read = torch.zeros(flat.shape[0], dtype=torch.bool)
    for idx in scopes_idx:
        i = idx.reshape(-1).long()
        read[i[(i >= 0) & (i < flat.shape[0])]] = True
    flat[~read] = 255


def make_sink(h, g):
    sink = torch.randn(h, generator=g)
    pick = torch.rand(h, generator=g)
    sink[pick < 0.2] = -INF
    sink[pick > 0.85] = INF
    return sink


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page_size", [64, 61])
def test_sparse_decode_fp8(backend, page_size):
    """FlashMLA's sparse decode: FP8 records, invalid indices of every form, topk_length per
    sequence (0 included), a sink with +-inf heads, a query whose indices are all invalid."""
    seed = random.randrange(1 << 30)
    g = torch.Generator().manual_seed(seed)
    dev = _device(backend)
    b, s_q, h, topk, nb = 3, 2, 4 if backend == "triton" else 16, 24, 4
    entries = torch.randn(nb * page_size, 576, generator=g)
    records = pack_records(entries)
    idx = sparse_indices(b, s_q, topk, nb * page_size, g, all_invalid_rows=True)
    poison_unread(records, [idx])
    exact = unpack_records(records)
    tl = torch.tensor([topk, 0, 9], dtype=torch.int32)
    sink = make_sink(h, g)
    q = torch.randn(b, s_q, h, 576, generator=g).to(torch.bfloat16)
    cache = records.view(nb, page_size, 1, 656).view(torch.float8_e4m3fn)
    meta, _ = get_mla_metadata()
    out, lse = flash_mla_with_kvcache(q.to(dev), cache.to(dev), None, None, 512, meta, None, softmax_scale=576 ** -0.55,
                                      is_fp8_kvcache=True, indices=idx.to(dev), attn_sink=sink.to(dev),
                                      topk_length=tl.to(dev), backend=backend)
    want = ref_sparse_decode(q, [(exact, idx, tl)], 512, 576 ** -0.55, sink)
    check(out.cpu(), lse.cpu(), *want, torch.bfloat16, seed)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sparse_decode_float32_with_extra_cache(backend):
    """float32 q and caches at 1e-5 (beyond FlashMLA), and a second cache (``extra_k_cache``,
    another page size) attended to in the same softmax, each with its own topk_length."""
    seed = random.randrange(1 << 30)
    g = torch.Generator().manual_seed(seed)
    dev = _device(backend)
    b, s_q, h, d, dv = 2, 3, 4, 80, 64
    c1, c2 = torch.randn(5, 16, 1, d, generator=g), torch.randn(3, 7, 1, d, generator=g)
    i1, i2 = sparse_indices(b, s_q, 12, 80, g, True), sparse_indices(b, s_q, 5, 21, g)
    t1, t2 = torch.tensor([12, 4], dtype=torch.int32), torch.tensor([0, 5], dtype=torch.int32)
    sink = make_sink(h, g)
    q = torch.randn(b, s_q, h, d, generator=g)
    meta, _ = get_mla_metadata()
    out, lse = flash_mla_with_kvcache(q.to(dev), c1.to(dev), None, None, dv, meta, None, indices=i1.to(dev),
                                      attn_sink=sink.to(dev), extra_k_cache=c2.to(dev), extra_indices_in_kvcache=i2.to(dev),
                                      topk_length=t1.to(dev), extra_topk_length=t2.to(dev), backend=backend)
    want = ref_sparse_decode(q, [(c1.view(-1, d).double(), i1, t1), (c2.view(-1, d).double(), i2, t2)], dv, d ** -0.5, sink)
    check(out.cpu(), lse.cpu(), *want, torch.float32, seed)


# Sparse prefill ------------------------------------------------------------------------------------
def ref_sparse_prefill(q, kv, idx, topk_length, dv, scale, sink):
    s_q, h, d = q.shape
    entries = kv[:, 0].double()
    out = torch.zeros(s_q, h, dv, dtype=torch.float64)
    lse = torch.zeros(s_q, h, dtype=torch.float64)
    mx = torch.full((s_q, h), -INF, dtype=torch.float64)
    for t in range(s_q):
        k = idx.shape[-1]
        keep = torch.arange(k) < (k if topk_length is None else int(topk_length[t]))
        row = idx[t, 0]
        ok = (row >= 0) & (row < entries.shape[0]) & keep
        keys = entries[row[ok].long()]
        out[t], lse[t] = ref_sparse_rows(q[t].double(), [(entries, row, keep)], dv, scale, sink)
        if keys.shape[0]:
            mx[t] = ((q[t].double() @ keys.T) * scale).amax(-1)
    return out, mx, flashmla_lse(lse)


@pytest.mark.parametrize("backend,dtype,dims", [
    ("torch", torch.bfloat16, (576, 512)), ("torch", torch.float32, (576, 512)), ("triton", torch.float32, (80, 64)),
])
def test_sparse_prefill(backend, dtype, dims):
    """``flash_mla_sparse_fwd``: per-token topk_length (0 and past topk included), invalid indices of
    every form, a sink, non-contiguous q and kv, max_logits and the +inf empty-row LSE."""
    seed = random.randrange(1 << 30)
    g = torch.Generator().manual_seed(seed)
    dev = _device(backend)
    d, dv = dims
    s_q, s_kv, h, topk = 9, 30, 8 if backend == "torch" else 2, 16
    kv = torch.randn(s_kv, 1, 2 * d, generator=g).to(dtype)[:, :, :d]  # rows padded: non-contiguous
    q = torch.randn(h, s_q, d, generator=g).to(dtype).transpose(0, 1)  # non-contiguous
    idx = sparse_indices(s_q, 1, topk, s_kv, g, all_invalid_rows=True).view(s_q, 1, topk)
    read = torch.zeros(s_kv, dtype=torch.bool)
    flat = idx.reshape(-1).long()
    read[flat[(flat >= 0) & (flat < s_kv)]] = True
    kv[~read] = math.nan
    tl = torch.randint(0, topk + 4, (s_q,), generator=g, dtype=torch.int32)
    tl[1] = 0
    sink = make_sink(h, g)
    scale = 0.5 if dtype == torch.float32 else d ** -0.5  # bf16 scores are rounded: keep logits O(1)
    out, mx, lse = flash_mla_sparse_fwd(q.to(dev), kv.to(dev), idx.to(dev), scale, dv, attn_sink=sink.to(dev),
                                        topk_length=tl.to(dev), backend=backend)
    want_out, want_mx, want_lse = ref_sparse_prefill(q, kv, idx, tl, dv, scale, sink)
    assert out.shape == (s_q, h, dv) and out.dtype == dtype and mx.dtype == torch.float32
    check(out.cpu(), lse.cpu(), want_out, want_lse, dtype, seed)
    assert torch.equal(mx.cpu() == -INF, want_mx == -INF), f"max_logits: -inf rows differ (seed {seed})"
    fin = torch.isfinite(want_mx)
    assert_close(mx.cpu()[fin], want_mx[fin], TOL[torch.float32], "max_logits", seed)


def test_sparse_prefill_defaults():
    """No sink, no topk_length: every valid index counts."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(4, 2, 576, generator=g).to(torch.bfloat16)
    kv = torch.randn(10, 1, 576, generator=g).to(torch.bfloat16)
    idx = torch.tensor([[[0, 9, -1, 10]], [[3, 3, 5, 2147483647]], [[-7, -1, 10, 11]], [[1, 2, 4, 8]]], dtype=torch.int32)
    out, mx, lse = flash_mla_sparse_fwd(q, kv, idx, 0.1, backend="torch")
    want_out, want_mx, want_lse = ref_sparse_prefill(q, kv, idx, None, 512, 0.1, None)
    check(out, lse, want_out, want_lse, torch.bfloat16, 3)
    assert lse[2].eq(INF).all() and mx[2].eq(-INF).all() and out[2].eq(0).all()


# Bad input ------------------------------------------------------------------------------------------
def _dense_args():
    g = torch.Generator().manual_seed(0)
    caches, _, table = make_paged([70, 9], 64, 576, torch.float32, False, g, layers=1)
    return dict(q=torch.randn(2, 1, 4, 576), k_cache=caches[0], block_table=table,
                cache_seqlens=torch.tensor([70, 9], dtype=torch.int32), head_dim_v=512)


BAD_DENSE = [
    ("q", dict(q=torch.randn(2, 4, 576))),
    ("q", dict(q=torch.randn(2, 1, 4, 576, dtype=torch.float64).int())),
    ("k_cache", dict(k_cache=torch.randn(4, 64, 2, 576))),
    ("k_cache", dict(k_cache=torch.randn(4, 64, 1, 576, dtype=torch.bfloat16))),
    ("k_cache", dict(k_cache=torch.randn(4, 64, 1, 512))),
    ("head_dim_v", dict(head_dim_v=576)),
    ("cache_seqlens", dict(cache_seqlens=torch.tensor([70, -1], dtype=torch.int32))),
    ("cache_seqlens", dict(cache_seqlens=None)),
    ("block_table", dict(cache_seqlens=torch.tensor([70, 200], dtype=torch.int32))),
    ("block_table", dict(block_table=torch.full((2, 3), 99, dtype=torch.int32))),
    ("softmax_scale", dict(softmax_scale=math.nan)),
    ("causal", dict(causal=1)),
    ("num_splits", dict(num_splits=torch.zeros(3))),
    ("tile_scheduler_metadata", dict(tile_scheduler_metadata=object())),
    ("attn_sink", dict(attn_sink=torch.zeros(4))),
    ("k_cache", dict(is_fp8_kvcache=True)),
    ("is_fp8_kvcache", dict(is_fp8_kvcache=None)),
    ("indices", dict(indices=torch.zeros(2, 1, 4), )),
    ("causal", dict(indices=torch.zeros(2, 1, 4, dtype=torch.int32), causal=True)),
    ("topk_length", dict(indices=torch.zeros(2, 1, 4, dtype=torch.int32), topk_length=torch.zeros(3, dtype=torch.int32))),
    ("attn_sink", dict(indices=torch.zeros(2, 1, 4, dtype=torch.int32), attn_sink=torch.zeros(4, dtype=torch.float64))),
    ("extra_indices_in_kvcache", dict(indices=torch.zeros(2, 1, 4, dtype=torch.int32), extra_k_cache=torch.zeros(2, 64, 1, 576))),
    ("extra_topk_length", dict(indices=torch.zeros(2, 1, 4, dtype=torch.int32), extra_topk_length=torch.zeros(2, dtype=torch.int32))),
]


@pytest.mark.parametrize("name,change", BAD_DENSE, ids=[f"{n}-{i}" for i, (n, _) in enumerate(BAD_DENSE)])
def test_bad_input_names_the_argument(name, change):
    args = _dense_args()
    args.update(tile_scheduler_metadata=get_mla_metadata()[0])
    args.update(change)
    with pytest.raises(ValueError, match=f"^{name}:"):
        flash_mla_with_kvcache(**args, backend="torch")


BAD_PREFILL = [
    ("q", dict(q=torch.randn(3, 2, 576).int())),
    ("kv", dict(kv=torch.randn(8, 2, 576))),
    ("kv", dict(kv=torch.randn(8, 1, 576, dtype=torch.bfloat16))),
    ("indices", dict(indices=torch.zeros(3, 1, 4))),
    ("indices", dict(indices=torch.zeros(3, 2, 4, dtype=torch.int32))),
    ("sm_scale", dict(sm_scale=None)),
    ("d_v", dict(d_v=600)),
    ("topk_length", dict(topk_length=torch.zeros(2, dtype=torch.int32))),
    ("attn_sink", dict(attn_sink=torch.zeros(3))),
]


@pytest.mark.parametrize("name,change", BAD_PREFILL, ids=[f"{n}-{i}" for i, (n, _) in enumerate(BAD_PREFILL)])
def test_bad_prefill_input_names_the_argument(name, change):
    args = dict(q=torch.randn(3, 2, 576), kv=torch.randn(8, 1, 576), indices=torch.zeros(3, 1, 4, dtype=torch.int32),
                sm_scale=0.1)
    args.update(change)
    with pytest.raises(ValueError, match=f"^{name}:"):
        flash_mla_sparse_fwd(**args, backend="torch")


def test_merge_states_takes_flashmla_empty_parts():
    """A FlashMLA partial without keys (+inf LSE, any output, NaN included) is ignored by merge_states."""
    g = torch.Generator().manual_seed(5)
    o_a, lse_a = torch.randn(3, 2, 8, generator=g), torch.randn(3, 2, generator=g)
    o_b = torch.full((3, 2, 8), math.nan)
    lse_b = torch.full((3, 2), INF)
    o, lse = combine.merge_states(o_a, lse_a, o_b, lse_b)
    torch.testing.assert_close(o, o_a)
    torch.testing.assert_close(lse, lse_a)
    o, lse = combine.merge_states(o_b, lse_b, o_b, lse_b)
    assert o.eq(0).all() and lse.eq(-INF).all()
