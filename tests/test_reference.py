"""The float64 oracle against itself: the two forms agree, chunks merge, sinks, empty rows, plan."""

import math

import pytest
import torch

import openmla
from openmla import reference as ref
from openmla.masks import MaskVariant

from cases import make_case, rel_err, small_config

F64 = torch.float64
MASKS = [MaskVariant.parse("causal"), MaskVariant.parse("null"), MaskVariant.parse("sliding_window_causal", 5),
         MaskVariant.parse("sliding_window_noncausal", 4), MaskVariant.parse("chunked_causal", None, 8)]


def both_forms(case, **kw):
    a, b = case.clone_cache(), case.clone_cache()
    outs = []
    for c, decode_form in ((a, False), (b, True)):
        outs.append(ref.mla_prefill_decode_graph(c.q, c.kv, c.freqs_cis, c.gamma, c.batch, c.layer_idx, c.w_k, c.w_uk,
                                                 c.w_uv, scale=c.scale, use_decode_form=decode_form, **kw))
    return outs


@pytest.mark.parametrize("mask", MASKS, ids=lambda m: m.kind.value)
@pytest.mark.parametrize("page_size", [1, 16])
def test_prefill_form_equals_decode_form(mask, page_size):
    case = make_case([0, 9, 20, 3], [7, 1, 0, 12], dtype=F64, page_size=page_size, config=small_config(num_heads=3))
    (o1, l1), (o2, l2) = both_forms(case, mask=mask)
    assert rel_err(o1, o2) < 1e-12, f"seed {case.seed}"
    fin = torch.isfinite(l1)
    assert torch.equal(fin, torch.isfinite(l2))
    assert (l1[fin] - l2[fin]).abs().max() < 1e-12


@pytest.mark.parametrize("physical", [True, False])
def test_sparse_forms_agree_and_respect_topk(physical):
    case = make_case([5, 30], [2, 3], dtype=F64, page_size=4, config=small_config(num_heads=2))
    g = torch.Generator().manual_seed(case.seed)
    stride = 6
    seq_of_row = [0, 0, 1, 1, 1]
    lens = case.batch.seq_lens_list
    idx = torch.stack([torch.randint(0, lens[b], (stride,), generator=g) for b in seq_of_row]).int()
    idx[0, 2] = -1
    if physical:
        idx = torch.stack([ref.physical_rows(case.batch, b, idx[t].clamp_min(0).long()) for t, b in enumerate(seq_of_row)]).int()
        idx[0, 2] = -1
    topk = torch.tensor([4, 6], dtype=torch.int32)
    kw = dict(sparse_indices=idx, topk_lengths=topk, physical_indices=physical)
    (o1, l1), (o2, l2) = both_forms(case, **kw)
    assert rel_err(o1, o2) < 1e-12
    # Entries past topk_lengths are ignored: changing them changes nothing.
    idx2 = idx.clone()
    idx2[0:2, 4:] = idx[0:2, 0:2]
    (o3, _), _ = both_forms(case, **{**kw, "sparse_indices": idx2})
    assert rel_err(o3, o1) < 1e-12


def test_sink_rescales_output_and_leaves_lse():
    case = make_case([4, 0], [3, 5], dtype=F64, config=small_config(num_heads=3))
    sink = torch.tensor([0.5, -1.0, 3.0], dtype=torch.float32)
    (o0, l0), _ = both_forms(case)
    (o1, l1), (o2, _) = both_forms(case, attn_sink=sink)
    torch.testing.assert_close(l1, l0, rtol=0, atol=0)
    want = o0 / (1 + torch.exp(sink.double()[None, :] - l0))[..., None]
    assert rel_err(o1, want) < 1e-12 and rel_err(o2, want) < 1e-12


def test_rows_without_keys_give_zeros_and_minus_inf():
    case = make_case([3], [2], dtype=F64, config=small_config(num_heads=2))
    idx = torch.full((2, 4), -1, dtype=torch.int32)
    idx[1, 0] = 1
    for decode_form in (False, True):
        c = case.clone_cache()
        out, lse = ref.mla_prefill_decode_graph(c.q, c.kv, c.freqs_cis, c.gamma, c.batch, c.layer_idx, c.w_k, c.w_uk, c.w_uv,
                                                scale=c.scale, sparse_indices=idx, physical_indices=False,
                                                use_decode_form=decode_form)
        assert torch.all(out[0] == 0) and torch.all(lse[0] == -math.inf)
        assert torch.isfinite(lse[1]).all() and out[1].abs().sum() > 0


def test_explicit_softmax_on_one_sequence():
    """The fused op against a hand-written dense formula for one sequence with a causal mask."""
    case = make_case([4], [3], dtype=F64, config=small_config(num_heads=2), page_size=2)
    c = case.clone_cache()
    out, _ = ref.mla_prefill_decode_graph(c.q, c.kv, c.freqs_cis, c.gamma, c.batch, 1, c.w_k, c.w_uk, c.w_uv, scale=0.3)
    cfg = case.config
    L, Dn = cfg.kv_lora_rank, cfg.qk_nope_head_dim
    entries = ref.cache_rows(c.batch, 1, ref.physical_rows(c.batch, 0, torch.arange(7)))
    x = c.kv[:, :L]
    torch.testing.assert_close(entries[4:, :L], x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * c.gamma)
    q = c.q.clone()
    q[..., Dn:] = ref.rope(c.q[..., Dn:], c.freqs_cis, torch.arange(4, 7))
    Wk = c.w_k.reshape(2, Dn, L)
    for i in range(3):
        for h in range(2):
            keys = entries[: 4 + i + 1]
            s = 0.3 * (Wk[h] @ keys[:, :L].T).T @ q[i, h, :Dn] + 0.3 * keys[:, L:] @ q[i, h, Dn:]
            p = torch.softmax(s, 0)
            want = c.w_uv[h] @ (p @ keys[:, :L])
            torch.testing.assert_close(out[i, h], want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("buffer_size", [1, 5, 13, 1000])
def test_plan_chunks_merge_to_full_prefill(buffer_size):
    case = make_case([6, 0, 11], [5, 0, 9], dtype=F64, page_size=4, config=small_config(num_heads=2))
    c = case.clone_cache()
    ref.write_cache(c.kv, c.freqs_cis, c.gamma, c.batch, c.layer_idx, 1e-6)
    Dn, L = c.config.qk_nope_head_dim, c.config.kv_lora_rank
    q = c.q.clone()
    q[..., Dn:] = ref.rope(c.q[..., Dn:], c.freqs_cis, ref.token_positions(c.batch))
    want, want_lse = ref.prefill(q, c.batch, c.layer_idx, c.w_k, c.w_uv, scale=c.scale)
    bro, co, blen = openmla.mla_prefill_plan(c.batch.input_row_offsets, c.batch, buffer_size, max_chunks=64)
    n_chunks = int((blen >= 0).sum())
    assert blen[:n_chunks].sum() == sum(c.batch.seq_lens_list) and bool((blen[n_chunks:] == -1).all())
    assert int(blen.max()) <= buffer_size
    o = torch.zeros_like(want, dtype=torch.float32)
    lse = torch.full(want_lse.shape, -math.inf)
    Wk = c.w_k.reshape(2, Dn, L)
    for ch in range(n_chunks):
        rows = []
        for b in range(c.batch.batch_size):
            n = int(bro[ch, b + 1] - bro[ch, b])
            rows.append(ref.physical_rows(c.batch, b, torch.arange(int(co[ch, b]), int(co[ch, b]) + n)))
        latent = ref.cache_rows(c.batch, c.layer_idx, torch.cat(rows))[:, :L]
        k = torch.einsum("hdl,sl->shd", Wk, latent)
        v = torch.einsum("hdl,sl->shd", c.w_uv, latent)
        oc, lc = ref.flare_mla_prefill(q, k, v, bro[ch], co[ch], c.batch, c.layer_idx, scale=c.scale)
        o, lse = openmla.merge_states(o, lse, oc.float(), lc.float())
    assert rel_err(o, want) < 1e-5  # merge_states works in float32


def test_plan_rejects_too_few_chunks():
    case = make_case([10], [10], dtype=F64)
    with pytest.raises(ValueError, match="max_chunks"):
        openmla.mla_prefill_plan(case.batch.input_row_offsets, case.batch, 4, max_chunks=2)


def test_merge_states_with_empty_parts():
    o = torch.randn(3, 2, 4)
    lse = torch.randn(3, 2)
    empty_o, empty_l = torch.zeros(3, 2, 4), torch.full((3, 2), -math.inf)
    mo, ml = openmla.merge_states(o, lse, empty_o, empty_l)
    torch.testing.assert_close(mo, o) and torch.testing.assert_close(ml, lse)
    mo, ml = openmla.merge_states(empty_o, empty_l, empty_o, empty_l)
    assert torch.all(mo == 0) and torch.all(ml == -math.inf) and not torch.isnan(mo).any()


@pytest.mark.parametrize("decode_form", [False, True], ids=["prefill", "decode"])
def test_no_rope_equals_a_zero_rope_part(decode_form):
    """R = 0 (entries of the latent alone) gives what R = 2 gives when q's and kv's rope parts are 0:
    the oracle's R = 0 path is the math without a rope term, not a special case of its own."""
    cfg0, cfg2 = small_config(num_heads=3, R=0), small_config(num_heads=3, R=2)
    no_rope = make_case([5, 0, 9], [3, 1, 6], dtype=F64, config=cfg0, page_size=4)
    L = cfg0.kv_lora_rank
    zero = make_case([5, 0, 9], [3, 1, 6], dtype=F64, config=cfg2, page_size=4, seed=no_rope.seed)
    zero.batch.blocks.view(-1, L + 2)[:, :L] = no_rope.batch.blocks.view(-1, L)  # the same cached latents, rope part 0
    zero.batch.blocks.view(-1, L + 2)[:, L:] = 0
    q2 = torch.cat([no_rope.q, torch.zeros(*no_rope.q.shape[:2], 2, dtype=F64)], dim=-1)
    kv2 = torch.cat([no_rope.kv, torch.zeros(no_rope.kv.shape[0], 2, dtype=F64)], dim=-1)
    scale = 0.2
    got, got_lse = ref.mla_prefill_decode_graph(no_rope.q, no_rope.kv, no_rope.freqs_cis, no_rope.gamma, no_rope.batch, 1,
                                                no_rope.w_k, no_rope.w_uk, no_rope.w_uv, scale=scale, use_decode_form=decode_form)
    want, want_lse = ref.mla_prefill_decode_graph(q2, kv2, zero.freqs_cis, no_rope.gamma, zero.batch, 1, no_rope.w_k,
                                                  no_rope.w_uk, no_rope.w_uv, scale=scale, use_decode_form=decode_form)
    assert no_rope.freqs_cis.shape[1] == 0 and no_rope.batch.head_dim == L
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_lse, want_lse, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(no_rope.batch.blocks.view(-1, L), zero.batch.blocks.view(-1, L + 2)[:, :L], rtol=0, atol=0)
