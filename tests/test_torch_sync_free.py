"""The torch backend reads no tensor value on the host inside a call, so on an accelerator it
never waits for the device: its cache write, decode (dense, every mask, split-KV, sinks, sparse
physical and logical rows with top-k lengths, fp8 caches), prefill (several chunks, every mask,
sinks, fp8 caches) and flare_mla_prefill run with every way of reading a tensor on the host
refused, then match the float64 reference.

On CPU tensors the prefill forms look once per chunk for a NaN or inf value (a host read is free
there, ``prefill.host_reads_free``); the refusal below takes that choice away, as on a device.

The plan's host lists (cache lengths, offsets, chunk plans) are made with the plan, before the
refusal starts: that is the one host read a step makes. On the CPU a plan makes its token
positions and write rows at their first use (``made``, below): the tests make them first, as on
an accelerator the plan does.
"""

from __future__ import annotations

import contextlib
import importlib
import math

import pytest
import torch

import openmla
from openmla import MaskVariant
from openmla import reference as ref
from openmla.chunks import check_chunk

torch_prefill = importlib.import_module("openmla.backends.torch_cpu.prefill")  # the module (the package exports its function)

from cases import MASK_CASES, TOL, assert_close, assert_lse, make_case, small_config

REFUSED = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")


@contextlib.contextmanager
def host_reads_refused():
    def refuse(*_a, **_k):
        raise AssertionError("host read of tensor data inside a torch backend call")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch_prefill, "host_reads_free", lambda _t: False)  # as for a device's tensors
        for name in REFUSED:
            mp.setattr(torch.Tensor, name, refuse)
        yield


def made(step):
    """``step`` with its token positions and write rows made (host work of the plan, once per step)."""
    step.write_rows
    return step


def test_refusal_catches_a_host_read():
    x = torch.ones(2)
    with host_reads_refused(), pytest.raises(AssertionError, match="host read"):
        float(x.sum())
    with host_reads_refused(), pytest.raises(AssertionError, match="host read"):
        if x.any():
            pass


def _q_abs(case):
    g = torch.Generator().manual_seed(case.seed + 1)
    cfg = case.config
    q = torch.randn(case.q.shape[0], cfg.num_heads, cfg.kv_lora_rank + cfg.qk_rope_head_dim, generator=g) * 0.5
    return q.to(case.q.dtype)


def _sparse_indices(case, physical: bool, stride: int = 12):
    b = case.batch
    g = torch.Generator().manual_seed(case.seed + 2)
    seq = torch.repeat_interleave(torch.arange(b.batch_size), torch.tensor(b.new_tokens_list))
    lens = torch.tensor(b.seq_lens_list)[seq]
    pos = (torch.rand(seq.shape[0], stride, generator=g) * lens[:, None]).long()
    idx = b.physical_rows(seq[:, None], pos) if physical else pos
    idx[torch.rand(idx.shape, generator=g) < 0.2] = -1
    topk = torch.randint(0, stride + 1, (b.batch_size,), generator=g, dtype=torch.int32)
    return idx.int(), topk


DECODE_CASES = {
    **{f"dense-{name}": dict(mask=name, **extra) for name, extra in MASK_CASES},
    "split-kv": dict(num_partitions=3, mask="sliding_window_causal", window_size=40),
    "sink": dict(attn_sink="per-sequence", num_partitions=2),
    "sparse-physical": dict(sparse=True, physical_indices=True),
    "sparse-logical": dict(sparse=False, physical_indices=False, mask="chunked_causal", chunk_size=16, num_partitions=2),
    "fp8_e4m3": dict(cache_dtype="fp8_e4m3"),
    "fp8_ds_mla-sparse": dict(cache_dtype="fp8_ds_mla", sparse=False, physical_indices=False),
}


@pytest.mark.parametrize("name", list(DECODE_CASES))
def test_decode_and_cache_write_read_nothing_on_the_host(name):
    kw = dict(DECODE_CASES[name])
    fmt = kw.pop("cache_dtype", None)
    sparse = kw.pop("sparse", None)
    dims = dict(L=128, R=16) if fmt == "fp8_ds_mla" else {}
    case = make_case([0, 37, 90, 5], [1, 3, 1, 0], config=small_config(num_heads=4, **dims), page_size=16,
                     cache_dtype=fmt, kv_scale=0.5)
    if sparse is not None:
        kw["sparse_indices"], kw["topk_lengths"] = _sparse_indices(case, kw["physical_indices"])
    if kw.get("attn_sink") == "per-sequence":
        kw["attn_sink"] = torch.randn(case.batch.batch_size, 4)
    L = case.config.kv_lora_rank
    q_abs = _q_abs(case)
    step = made(openmla.plan(case.batch, scale=case.scale, backend="torch", **kw))
    assert step.backend_name == "torch"
    with host_reads_refused():
        step.backend.write_cache(step, case.layer_idx, case.q, case.kv, case.freqs_cis, case.gamma, 1e-6, True)
        out, lse = step.backend.decode(step, case.layer_idx, q_abs, step.spec, L)
    kw.pop("num_partitions", None)
    want, want_lse = openmla.flare_mla_decode(q_abs, case.batch, case.layer_idx, scale=case.scale, kv_lora_rank=L,
                                              return_lse=True, backend="reference", **kw)
    assert_close(out, want, TOL[torch.float32], name, case.seed)
    assert_lse(lse, want_lse, TOL[torch.float32], case.seed)


@pytest.mark.parametrize("fmt", [None, "fp8_e4m3"])
@pytest.mark.parametrize("mask,extra", MASK_CASES, ids=[m for m, _ in MASK_CASES])
def test_prefill_reads_nothing_on_the_host(mask, extra, fmt):
    case = make_case([6, 0, 21], [23, 4, 17], config=small_config(num_heads=3), page_size=8, cache_dtype=fmt,
                     kv_scale=0.5)
    ref.write_cache(case.kv, case.freqs_cis, case.gamma, case.batch, case.layer_idx, 1e-6)
    sink = torch.randn(3)
    step = made(openmla.plan(case.batch, scale=case.scale, mask=mask, attn_sink=sink, buffer_size=11, backend="torch", **extra))
    assert step.chunks(11).num_chunks > 3
    with host_reads_refused():
        out, lse = step.backend.prefill(step, case.layer_idx, case.q, case.w_k, case.w_uv, step.spec)
    want, want_lse = ref.prefill(case.q, case.batch, case.layer_idx, case.w_k, case.w_uv, scale=case.scale,
                                 mask=MaskVariant.parse(mask, **extra), attn_sink=sink)
    assert_close(out, want, TOL[torch.float32], "prefill", case.seed)
    assert_lse(lse, want_lse, TOL[torch.float32], case.seed)


def test_flare_mla_prefill_reads_nothing_on_the_host():
    case = make_case([7, 0, 2], [25, 4, 30], config=small_config(num_heads=2), page_size=8)
    ref.write_cache(case.kv, case.freqs_cis, case.gamma, case.batch, case.layer_idx, 1e-6)
    b = case.batch
    bro, co, blen = openmla.mla_prefill_plan(b.input_row_offsets, b, 19, 8)
    L, Dn = case.config.kv_lora_rank, case.config.qk_nope_head_dim
    step = made(openmla.plan(b, scale=case.scale, mask="sliding_window_causal", window_size=9, backend="torch"))
    out = lse = None
    for c in range(int((blen >= 0).sum())):
        rows = torch.cat([ref.physical_rows(b, s, int(co[c, s]) + torch.arange(int(bro[c, s + 1] - bro[c, s])))
                          for s in range(b.batch_size)])
        latent = ref.cache_rows(b, case.layer_idx, rows)[:, :L].float()
        k = torch.einsum("hdl,nl->nhd", case.w_k.reshape(-1, Dn, L), latent)
        v = torch.einsum("hdl,nl->nhd", case.w_uv, latent)
        chunk = check_chunk(case.q, k, v, bro[c], co[c], b)
        with host_reads_refused():
            part = step.backend.flare_mla_prefill(step, case.layer_idx, case.q, k, v, chunk, step.spec, None)
        out, lse = part if out is None else openmla.merge_states(out, lse, *part)
    want, want_lse = ref.prefill(case.q, b, case.layer_idx, case.w_k, case.w_uv, scale=case.scale,
                                 mask=MaskVariant.parse("sliding_window_causal", 9))
    assert_close(out, want, 1e-5, "flare chunks", case.seed)
    assert_lse(lse, want_lse, 1e-5, case.seed)
    assert not math.isnan(float(out.sum()))
