"""The triton backend on FP8 latent caches (``fp8_e4m3``, ``fp8_ds_mla``) and FP8 queries.

Every attention result is compared with the float64 oracle reading the *same* fp8 cache
(``openmla.reference`` dequantises what is stored), so the comparison isolates the kernels:
float32 inputs within 1e-5 relative (the dequantised values are exact or one float32
rounding away), bfloat16 within 2e-2. The cache write is checked byte for byte against
``CacheBatch.write_rows`` fed the kernel's own float32 entries (the triton write on a float32
cache), and within one fp8 step of the oracle's write (whose entries are float64, so a value
next to a rounding boundary may round the other way).

Runs under Triton's interpreter without a GPU (tiny shapes; ``kv_lora_rank`` a multiple of
128 for fp8_ds_mla), compiled with one. Seeds are fresh per run and printed on failure;
every buffer the backend allocates starts as NaN, and NaN never passes ``rel_err``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from triton_support import CUDA, DEV, poison, require_triton  # noqa: F401  (poison: autouse, backend buffers start as NaN)

_common = require_triton()  # skips the module where the backend cannot run

import openmla  # noqa: E402
from openmla import reference as ref  # noqa: E402
from openmla.backends.triton.decode import decode_into  # noqa: E402
from openmla.fp8 import FP8, ds_mla_views  # noqa: E402
from openmla.masks import MaskVariant  # noqa: E402

from cases import TOL, Case, make_case, rel_err, small_config  # noqa: E402

F32, BF16 = torch.float32, torch.bfloat16
E4M3, DS_MLA = "fp8_e4m3", "fp8_ds_mla"
FORMATS = [E4M3, DS_MLA]


# Helpers ---------------------------------------------------------------------------
def fp8_case(cache_lens, new_lens, fmt, *, L=128, R=16, heads=3, page_size=16, dtype=F32, kv_scale=0.37) -> Case:
    """A random case on an fp8 cache; kv_scale 0.37 is not a power of two (division rounds)."""
    cfg = small_config(num_heads=heads, L=L, R=R)
    return make_case(cache_lens, new_lens, config=cfg, page_size=page_size, dtype=dtype, cache_dtype=fmt,
                     kv_scale=kv_scale)


def on_device(case: Case) -> Case:
    """The case with its own copy of the cache (format, scales and host lists kept) on DEV."""
    b = case.batch
    batch = dataclasses.replace(b, blocks=b.blocks.clone().to(DEV), block_table=b.block_table.to(DEV),
                                cache_lengths=b.cache_lengths.to(DEV), input_row_offsets=b.input_row_offsets.to(DEV),
                                kv_scale=None if b.kv_scale is None else b.kv_scale.clone().to(DEV), _host=b._host.copy())
    mv = {f: getattr(case, f).to(DEV) for f in ("q", "kv", "freqs_cis", "gamma", "w_k", "w_uk", "w_uv")}
    return dataclasses.replace(case, batch=batch, extras=dict(case.extras), **mv)


def written(case: Case) -> Case:
    """Write this call's tokens into the CPU cache with the oracle (for the attention-only ops)."""
    ref.write_cache(case.kv, case.freqs_cis, case.gamma, case.batch, case.layer_idx, 1e-6)
    return case


def check(got, want, dtype, case: Case, what: str) -> float:
    err = rel_err(got, want)
    assert err <= TOL[dtype], f"{what}: relative error {err:.3g} > {TOL[dtype]:g} (seed={case.seed})"
    return err


def check_lse(got, want, dtype, case: Case, what: str) -> None:
    """-inf exactly where the oracle has it, relative error elsewhere."""
    got, want = got.double().cpu(), want.double().cpu()
    assert not torch.isnan(got).any(), f"{what}: NaN in lse (seed={case.seed})"
    empty = torch.isneginf(want)
    assert torch.equal(torch.isneginf(got), empty), f"{what}: -inf pattern differs (seed={case.seed})"
    check(got[~empty], want[~empty], dtype, case, what + " lse")


def fp8_steps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in fp8 steps between two float8_e4m3fn tensors (codes ordered by value; +-0 equal)."""
    def ordinal(x):
        c = x.view(torch.uint8).cpu().to(torch.int32)
        return torch.where(c >= 128, -(c - 128), c)
    return (ordinal(a) - ordinal(b)).abs()


def written_rows(batch) -> torch.Tensor:
    """Physical rows this call's tokens go to, in token order."""
    spans = zip(batch.cache_lengths_list, batch.new_tokens_list)
    parts = [ref.physical_rows(batch, b, torch.arange(c, c + n)) for b, (c, n) in enumerate(spans)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def check_cache_near(got_batch, want_batch, layer_idx: int, case: Case, what: str) -> int:
    """Stored records within one fp8 step (latent), 1e-6 relative (ds_mla scales) and one
    bfloat16 step (ds_mla rope) of ``want``'s; every other byte equal. Returns the number of
    fp8 values one step apart."""
    got, want = got_batch.blocks.cpu(), want_batch.blocks.cpu()
    other = [i for i in range(got.shape[0]) if i != layer_idx]
    assert torch.equal(got[other].view(torch.uint8), want[other].view(torch.uint8)), f"{what}: another layer changed"
    g, w = got[layer_idx], want[layer_idx]
    if got_batch.cache_format == E4M3:
        steps = fp8_steps(g, w)
    else:
        L = got_batch.head_dim - got_batch.rope_dim
        (gl, gs, gr), (wl, ws, wr) = ds_mla_views(g, L), ds_mla_views(w, L)
        steps = fp8_steps(gl, wl)
        assert rel_err(gs, ws) <= 1e-6, f"{what}: group scales differ by {rel_err(gs, ws):.3g} (seed={case.seed})"
        rope_gap = (gr.float() - wr.float()).abs() - wr.float().abs() * 2.0**-8
        assert float(rope_gap.max()) <= 0, f"{what}: bf16 rope differs by more than one step (seed={case.seed})"
    assert int(steps.max()) <= 1, f"{what}: stored fp8 values {int(steps.max())} steps apart (seed={case.seed})"
    return int((steps > 0).sum())


# Cache write -----------------------------------------------------------------------
WRITE = [
    # format, kv_scale, L, R, page_size, heads, dtype, zero latent group
    (E4M3, 0.37, 128, 16, 1, 1, F32, False),
    (E4M3, 2.0**-9, 256, 64, 16, 3, BF16, False),  # tiny scale: most values saturate at +-448
    (DS_MLA, 1.0, 128, 16, 1, 3, F32, True),  # an all-zero group keeps scale 1
    (DS_MLA, 1.0, 256, 64, 64, 16, BF16, True),
]


@pytest.mark.parametrize("fmt,kv_scale,L,R,page_size,heads,dtype,zero_group", WRITE,
                         ids=[f"{w[0]}-L{w[2]}-p{w[4]}-{str(w[6])[6:]}" for w in WRITE])
def test_cache_write_bytes(fmt, kv_scale, L, R, page_size, heads, dtype, zero_group):
    case = fp8_case([0, 5, 70], [3, 0, 4], fmt, L=L, R=R, heads=heads, page_size=page_size, dtype=dtype,
                    kv_scale=kv_scale)
    if zero_group:
        case.gamma[:128] = 0  # RMSNorm makes the first latent group all zeros
    dev = on_device(case)
    q_rot = openmla.mla_write_cache(dev.q, dev.kv, dev.freqs_cis, dev.gamma, dev.batch, dev.layer_idx, backend="triton")
    want_q = ref.rope(case.q[..., -R:], case.freqs_cis, ref.token_positions(case.batch))
    check(q_rot[..., -R:], want_q, dtype, case, "q_rot")
    assert torch.equal(q_rot[..., :-R].cpu(), case.q[..., :-R]), "q's nope part changed"

    # The kernel's own float32 entries: the same write on a float32 cache.
    b = case.batch
    f32 = dataclasses.replace(b, blocks=torch.zeros(*b.blocks.shape[:3], L + R, device=DEV),
                              block_table=dev.batch.block_table, cache_lengths=dev.batch.cache_lengths,
                              input_row_offsets=dev.batch.input_row_offsets, cache_format="native", kv_scale=None,
                              _host=b._host.copy())
    openmla.mla_write_cache(dev.q, dev.kv, dev.freqs_cis, dev.gamma, f32, dev.layer_idx, backend="triton")
    rows = written_rows(b)
    entries = f32.blocks[dev.layer_idx].reshape(-1, L + R)[rows.to(DEV)].cpu()
    want = b.with_blocks(b.blocks.clone())
    want.write_rows(case.layer_idx, rows, entries)  # openmla.fp8's quantisation of the same float32 values
    got_bytes, want_bytes = dev.batch.blocks.cpu().view(torch.uint8), want.blocks.view(torch.uint8)
    if CUDA:  # the compiled RMSNorm may sum in another order than the float32 write: one fp8 step at most
        check_cache_near(dev.batch, want, case.layer_idx, case, "cache vs write_rows")
    else:
        diff = int((got_bytes != want_bytes).sum())
        assert diff == 0, f"{diff} stored bytes differ from write_rows of the kernel's float32 entries (seed={case.seed})"
    if zero_group and fmt == DS_MLA:
        _, scales, _ = ds_mla_views(dev.batch.blocks[dev.layer_idx].cpu(), L)
        assert torch.all(scales.reshape(-1, L // 128)[rows, 0] == 1.0)
    if fmt == E4M3 and kv_scale < 0.01:
        stored = dev.batch.blocks[dev.layer_idx].cpu().reshape(-1, L + R)[rows].float()
        assert stored.abs().max() == 448.0 and not torch.isnan(stored).any()  # saturated, never NaN

    # The oracle writes float64 entries: within one fp8 step of the kernel's bytes.
    oracle = written(dataclasses.replace(case, batch=b.with_blocks(b.blocks.clone())))
    check_cache_near(dev.batch, oracle.batch, case.layer_idx, case, "cache vs the oracle's write")


# Decode ----------------------------------------------------------------------------
def absorbed_q(case: Case) -> torch.Tensor:
    cfg = case.config
    g = torch.Generator().manual_seed(case.seed + 1)
    return torch.randn(case.q.shape[0], cfg.num_heads, cfg.cache_head_dim, generator=g).to(case.q.dtype)


DECODE = [
    # format, dtype, L, R, mask
    (E4M3, F32, 128, 16, ("sliding_window_causal", {"window_size": 5})),
    (E4M3, BF16, 256, 64, ("causal", {})),
    (DS_MLA, F32, 256, 16, ("chunked_causal", {"chunk_size": 8})),
    (DS_MLA, BF16, 128, 64, ("causal", {})),
]


@pytest.mark.parametrize("fmt,dtype,L,R,mask", DECODE, ids=[f"{d[0]}-{str(d[1])[6:]}-L{d[2]}-{d[4][0]}" for d in DECODE])
def test_decode_multi_token_mask_partitions(fmt, dtype, L, R, mask):
    case = written(fp8_case([9, 4, 20, 0], [1, 3, 0, 2], fmt, L=L, R=R, page_size=4, dtype=dtype))
    dev = on_device(case)
    q = absorbed_q(case)
    name, kw = mask
    out, lse = openmla.flare_mla_decode(q.to(DEV), dev.batch, dev.layer_idx, scale=case.scale, kv_lora_rank=L, mask=name,
                                        num_partitions=2, return_lse=True, backend="triton", **kw)
    assert out.dtype == dtype
    want, want_lse = ref.decode(q, case.batch, case.layer_idx, scale=case.scale, kv_lora_rank=L,
                                mask=MaskVariant.parse(name, **kw))
    check(out, want, dtype, case, f"{fmt} decode {name}")
    check_lse(lse, want_lse, dtype, case, f"{fmt} decode {name}")


@pytest.mark.parametrize("fmt,physical", [(E4M3, True), (DS_MLA, False)], ids=["e4m3-physical", "ds_mla-logical"])
def test_decode_sparse_topk_sink(fmt, physical):
    case = written(fp8_case([30, 12, 0], [2, 1, 3], fmt, L=128, R=16))
    T, H, B = case.q.shape[0], case.config.num_heads, case.batch.batch_size
    g = torch.Generator().manual_seed(case.seed + 2)
    if physical:
        limit = torch.full((T,), case.batch.num_pages * case.batch.page_size)
    else:
        limit = torch.repeat_interleave(torch.tensor(case.batch.seq_lens_list), torch.tensor(case.batch.new_tokens_list))
    idx = (torch.rand(T, 8, generator=g) * limit[:, None]).long()
    idx[torch.rand(T, 8, generator=g) < 0.25] = -1
    idx[:, 1] = idx[:, 0]  # a repeated key counts twice
    idx[0] = -1  # a row with no key: zeros and lse -inf
    idx, topk = idx.int(), torch.tensor([8, 5, 3], dtype=torch.int32)
    sink = torch.randn(H, generator=g) if physical else torch.randn(B, H, generator=g)
    dev = on_device(case)
    q = absorbed_q(case)
    L = case.config.kv_lora_rank
    out, lse = openmla.flare_mla_decode(q.to(DEV), dev.batch, dev.layer_idx, scale=case.scale, kv_lora_rank=L,
                                        sparse_indices=idx.to(DEV), topk_lengths=topk.to(DEV), physical_indices=physical,
                                        attn_sink=sink.to(DEV), num_partitions=2, return_lse=True, backend="triton")
    want, want_lse = ref.decode(q, case.batch, case.layer_idx, scale=case.scale, kv_lora_rank=L, sparse_indices=idx,
                                topk_lengths=topk, physical_indices=physical, attn_sink=sink)
    check(out, want, F32, case, f"{fmt} sparse decode")
    check_lse(lse, want_lse, F32, case, f"{fmt} sparse decode")
    assert torch.equal(out[0].cpu(), torch.zeros_like(out[0].cpu())) and torch.isneginf(lse[0]).all()


def test_decode_into_reads_kv_scale_from_the_device():
    """The capturable entry takes fp8_e4m3's scale as a device tensor: updating it in place
    (a replayed CUDA graph sees the new value) changes the result as the oracle says."""
    case = written(fp8_case([25, 3], [2, 1], E4M3, heads=16, page_size=64, kv_scale=0.5))
    dev = on_device(case)
    q = absorbed_q(case).to(DEV)
    T, H, _ = q.shape
    L = case.config.kv_lora_rank
    b = dev.batch
    out, lse = torch.full((T, H, L), float("nan"), device=DEV), torch.full((T, H), float("nan"), device=DEV)
    ws = (torch.full((3, T, H, L), float("nan"), device=DEV), torch.full((3, T, H), float("nan"), device=DEV))
    scale_slot = b.kv_scale[dev.layer_idx: dev.layer_idx + 1]
    for new_scale in (0.5, 0.125):
        scale_slot.fill_(new_scale)
        decode_into(q, b.blocks[dev.layer_idx], b.block_table, b.cache_lengths, b.input_row_offsets, b.page_size,
                    scale=case.scale, kv_lora_rank=L, num_splits=3, out=out, lse=lse, workspace=ws,
                    cache_format=E4M3, kv_scale=scale_slot)
        view = dataclasses.replace(case.batch, kv_scale=b.kv_scale.cpu().clone())
        want, want_lse = ref.decode(q.cpu(), view, case.layer_idx, scale=case.scale, kv_lora_rank=L)
        check(out, want, F32, case, f"decode_into kv_scale={new_scale}")
        check_lse(lse, want_lse, F32, case, f"decode_into kv_scale={new_scale}")


# Prefill ---------------------------------------------------------------------------
PREFILL = [
    # format, dtype, L, R, mask, sink
    (E4M3, F32, 128, 16, ("causal", {}), True),
    (E4M3, BF16, 128, 64, ("sliding_window_noncausal", {"window_size": 6}), False),
    (DS_MLA, F32, 128, 64, ("causal", {}), False),
    (DS_MLA, BF16, 256, 16, ("chunked_causal", {"chunk_size": 8}), True),
]


@pytest.mark.parametrize("fmt,dtype,L,R,mask,sink", PREFILL,
                         ids=[f"{p[0]}-{str(p[1])[6:]}-L{p[2]}-{p[4][0]}" for p in PREFILL])
def test_prefill_prefix_chunked(fmt, dtype, L, R, mask, sink):
    """Cached prefix + new tokens in chunks of 16 keys: the latent gather dequantises, the
    kernel reads k_rope from the fp8 cache."""
    case = written(fp8_case([7, 0, 19], [9, 12, 5], fmt, L=L, R=R, dtype=dtype))
    dev = on_device(case)
    name, kw = mask
    s = torch.randn(3, generator=torch.Generator().manual_seed(case.seed)) if sink else None
    out, lse = openmla.mla_prefill(dev.q, dev.batch, dev.layer_idx, dev.w_k, dev.w_uv, scale=case.scale, mask=name,
                                   buffer_size=16, attn_sink=None if s is None else s.to(DEV), return_lse=True,
                                   backend="triton", **kw)
    assert out.dtype == dtype
    want, want_lse = ref.prefill(case.q, case.batch, case.layer_idx, case.w_k, case.w_uv, scale=case.scale,
                                 mask=MaskVariant.parse(name, **kw), attn_sink=s)
    check(out, want, dtype, case, f"{fmt} prefill {name}")
    check_lse(lse, want_lse, dtype, case, f"{fmt} prefill {name}")


def test_flare_mla_prefill_reads_fp8_rope():
    """The kernel-level entry: given K/V, only the rope part comes from the (e4m3) cache."""
    case = written(fp8_case([10, 3], [20, 7], E4M3, L=128, R=16))
    dev = on_device(case)
    H, Dn, Dv = case.config.num_heads, case.config.qk_nope_head_dim, case.config.v_head_dim
    bro, co, lengths = openmla.mla_prefill_plan(case.batch.input_row_offsets, case.batch, 24, 4)
    g = torch.Generator().manual_seed(case.seed + 4)
    S = int(lengths[1])
    k, v = torch.randn(S, H, Dn, generator=g), torch.randn(S, H, Dv, generator=g)
    out, lse = openmla.flare_mla_prefill(case.q.to(DEV), k.to(DEV), v.to(DEV), bro[1].to(DEV), co[1].to(DEV), dev.batch,
                                         dev.layer_idx, scale=case.scale, return_lse=True, backend="triton")
    want, want_lse = ref.flare_mla_prefill(case.q, k, v, bro[1], co[1], case.batch, case.layer_idx, scale=case.scale)
    check(out, want, F32, case, "flare prefill")
    check_lse(lse, want_lse, F32, case, "flare prefill")


# The fused op ----------------------------------------------------------------------
FUSED = [
    # format, form, dtype, L, R, heads, page_size
    (E4M3, "decode", BF16, 128, 16, 3, 16),
    (E4M3, "prefill", F32, 256, 16, 1, 64),
    (DS_MLA, "decode", F32, 128, 64, 16, 1),
    (DS_MLA, "prefill", BF16, 128, 16, 3, 16),
]


@pytest.mark.parametrize("fmt,form,dtype,L,R,heads,page_size", FUSED,
                         ids=[f"{f[0]}-{f[1]}-{str(f[2])[6:]}-h{f[5]}-p{f[6]}" for f in FUSED])
def test_fused_op(fmt, form, dtype, L, R, heads, page_size):
    case = fp8_case([6, 0, 30], [3, 9, 1] if form == "prefill" else [2, 1, 3], fmt, L=L, R=R, heads=heads,
                    page_size=page_size, dtype=dtype)
    dev = on_device(case)
    out, lse = openmla.mla_prefill_decode_graph(*dev.fused_args(), scale=case.scale,
                                                decode_max_q_len=64 if form == "decode" else 0, buffer_size=20,
                                                return_lse=True, backend="triton")
    assert out.dtype == dtype
    # The oracle's own write has float64 entries (a value may land one fp8 step away from the
    # kernel's); compare the two writes, then run the oracle's attention on the triton-written
    # cache so that only the attention is compared.
    written(case)
    triton_cache = dataclasses.replace(case.batch, blocks=dev.batch.blocks.cpu())
    check_cache_near(triton_cache, case.batch, case.layer_idx, case, f"{fmt} cache after the fused op")
    want, want_lse = _oracle_attention(case, triton_cache, form)
    check(out, want, dtype, case, f"{fmt} fused {form}")
    check_lse(lse, want_lse, dtype, case, f"{fmt} fused {form}")


def _oracle_attention(case: Case, batch, form: str):
    """The oracle's attention (either form) over an already-written cache, with q roped by the oracle."""
    Dn = case.config.qk_nope_head_dim
    q = case.q.double().clone()
    q[..., Dn:] = ref.rope(case.q[..., Dn:], case.freqs_cis, ref.token_positions(batch))
    if form == "prefill":
        return ref.prefill(q, batch, case.layer_idx, case.w_k, case.w_uv, scale=case.scale)
    q_lat = torch.einsum("thd,hld->thl", q[..., :Dn], case.w_uk.double())
    out_lat, lse = ref.decode(torch.cat([q_lat, q[..., Dn:]], -1), batch, case.layer_idx, scale=case.scale,
                              kv_lora_rank=case.config.kv_lora_rank)
    return torch.einsum("thl,hvl->thv", out_lat, case.w_uv.double()), lse


@pytest.mark.parametrize("fmt,form,per_token", [(E4M3, "decode", False), (DS_MLA, "prefill", True)],
                         ids=["e4m3-decode-per_tensor", "ds_mla-prefill-per_token"])
def test_fp8_query_bf16_output(fmt, form, per_token):
    """float8_e4m3fn q with a per-tensor or per-token q_scale gives bfloat16 output."""
    case = fp8_case([5, 0, 11], [2, 8, 1] if form == "prefill" else [1, 2, 1], fmt, L=128, R=16, dtype=BF16)
    T = case.q.shape[0]
    g = torch.Generator().manual_seed(case.seed + 5)
    q_scale = (0.5 + torch.rand(T, generator=g)) / 64 if per_token else torch.tensor(1 / 48)
    q8 = (case.q.float() / (q_scale[:, None, None] if per_token else q_scale)).to(FP8)
    dev = on_device(case)
    out = openmla.mla_prefill_decode_graph(q8.to(DEV), *dev.fused_args()[1:], scale=case.scale, q_scale=q_scale.to(DEV),
                                           decode_max_q_len=64 if form == "decode" else 0, backend="triton")
    assert out.dtype == BF16
    q_deq = (q8.float() * (q_scale[:, None, None] if per_token else q_scale)).bfloat16()
    triton_cache = dataclasses.replace(case.batch, blocks=dev.batch.blocks.cpu())
    want, _ = _oracle_attention(dataclasses.replace(case, q=q_deq), triton_cache, form)
    check(out, want, BF16, case, f"fp8 q {form}")


# Quantisation error (not a kernel property: how far fp8 storage moves the result) ----
@pytest.mark.parametrize("fmt,form", [(E4M3, "decode"), (DS_MLA, "prefill")])
def test_fp8_cache_close_to_bf16_cache(fmt, form):
    """The same inputs and the same cached entries on an fp8 and a bfloat16 cache, both through
    the triton kernels: the gap is fp8's rounding of the entries (3 mantissa bits), under 10%."""
    case = fp8_case([12, 30], [2, 5], fmt, L=256, R=64, heads=4, dtype=BF16, kv_scale=1 / 16)
    b = case.batch
    entries = torch.randn(b.num_pages * b.page_size, b.head_dim, generator=torch.Generator().manual_seed(case.seed + 6))
    bf16 = dataclasses.replace(b, blocks=torch.zeros(*b.blocks.shape[:3], b.head_dim, dtype=BF16), cache_format="native",
                               kv_scale=None, _host=b._host.copy())
    rows = torch.arange(entries.shape[0])
    for batch in (b, bf16):
        batch.write_rows(case.layer_idx, rows, entries)
    outs = []
    for batch in (b, bf16):
        dev = on_device(dataclasses.replace(case, batch=batch))
        outs.append(openmla.mla_prefill_decode_graph(*dev.fused_args(), scale=case.scale, backend="triton",
                                                     decode_max_q_len=64 if form == "decode" else 0))
    err = rel_err(outs[0], outs[1])
    assert err < 0.1, f"{fmt}: output moved by {err:.3g} against a bfloat16 cache (seed={case.seed})"


def test_interpreter_or_cuda():
    assert CUDA or _common.INTERPRET
