"""FP8 cache formats and FP8 queries: layout, round trips, byte counts, and the oracle on them."""

import math

import pytest
import torch

import openmla
from openmla import PagedLatentCache
from openmla import reference as ref
from openmla.fp8 import FP8, FP8_MAX, ds_mla_views, pack_ds_mla, unpack_ds_mla

from cases import make_case, rel_err, small_config


def test_bytes_per_token():
    assert PagedLatentCache(1, 2, 64).bytes_per_token == 1152
    assert PagedLatentCache(1, 2, 64, dtype="fp8_e4m3").bytes_per_token == 576
    assert PagedLatentCache(1, 2, 64, dtype=torch.float8_e4m3fn).bytes_per_token == 576
    assert PagedLatentCache(1, 2, 64, dtype="fp8_ds_mla").bytes_per_token == 656
    with pytest.raises(ValueError, match="dtype"):
        PagedLatentCache(1, 2, 64, dtype="int4")
    with pytest.raises(ValueError, match="kv_lora_rank"):
        PagedLatentCache(1, 2, 64, head_dim=100, rope_dim=36, dtype="fp8_ds_mla")


def test_ds_mla_record_layout_and_round_trip():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 576, generator=g) * torch.logspace(-3, 3, 7)[:, None]  # rows of very different magnitude
    x[3, :128] = 0  # an all-zero group
    rec = pack_ds_mla(x, 512)
    assert rec.shape == (7, 656) and rec.dtype == torch.uint8
    lat, sc, rope = ds_mla_views(rec, 512)
    assert lat.dtype == FP8 and sc.shape == (7, 4) and rope.dtype == torch.bfloat16 and rope.shape == (7, 64)
    torch.testing.assert_close(sc[:, 1], x[:, 128:256].abs().amax(-1) / FP8_MAX)
    torch.testing.assert_close(rope.float(), x[:, 512:].bfloat16().float())  # rope stays bf16, unquantised
    back = unpack_ds_mla(rec, 512, torch.float32)
    err = (back[:, :512] - x[:, :512]).abs() / x[:, :512].abs().reshape(7, 4, 128).amax(-1).repeat_interleave(128, 1).clamp_min(1e-30)
    assert float(err.max()) <= 2**-4  # e4m3: 3 mantissa bits, relative to the group's amax
    assert torch.all(back[3, :128] == 0) and torch.isfinite(back).all()


def test_e4m3_saturates_instead_of_nan():
    cache = PagedLatentCache(1, 1, 4, head_dim=8, rope_dim=2, dtype="fp8_e4m3", kv_scale=0.5)
    batch = cache.prepare([], [])
    batch.write_rows(0, torch.arange(2), torch.tensor([[1e6] * 8, [-3.0] * 8]))
    back = batch.read_rows(0, torch.arange(2), torch.float32)
    assert torch.all(back[0] == FP8_MAX * 0.5) and torch.all(back[1] == -3.0)


@pytest.mark.parametrize("cache_dtype", ["fp8_e4m3", "fp8_ds_mla"])
@pytest.mark.parametrize("decode_form", [False, True])
def test_reference_on_fp8_cache_equals_reference_on_its_dequantised_copy(cache_dtype, decode_form):
    """The oracle reads exactly what the fp8 cache stores: same math on a float64 copy of it."""
    cfg = small_config(num_heads=2, L=128, R=16)
    case = make_case([9, 0], [3, 17], config=cfg, dtype=torch.float32, cache_dtype=cache_dtype, kv_scale=0.25)
    c = case.clone_cache()
    out, lse = ref.mla_prefill_decode_graph(c.q, c.kv, c.freqs_cis, c.gamma, c.batch, c.layer_idx, c.w_k, c.w_uk, c.w_uv,
                                            scale=c.scale, use_decode_form=decode_form)
    rows = torch.arange(c.batch.num_pages * c.batch.page_size)
    dense = c.batch.read_rows(c.layer_idx, rows, torch.float64).reshape(c.batch.num_pages, c.batch.page_size, -1)
    blocks = torch.zeros(c.batch.num_layers, *dense.shape, dtype=torch.float64)
    blocks[c.layer_idx] = dense
    native = openmla.CacheBatch(blocks, c.batch.block_table, c.batch.cache_lengths, c.batch.input_row_offsets, c.batch.page_size)
    Dn = cfg.qk_nope_head_dim
    q = c.q.double().clone()
    q[..., Dn:] = ref.rope(c.q[..., Dn:], c.freqs_cis, ref.token_positions(c.batch))
    want, want_lse = ref.prefill(q, native, c.layer_idx, c.w_k, c.w_uv, scale=c.scale)
    assert rel_err(out, want) < 1e-12
    # And the quantisation error against the unquantised entries stays small.
    exact = case.clone_cache()
    exact_out, _ = ref.mla_prefill_decode_graph(exact.q, exact.kv, exact.freqs_cis, exact.gamma,
                                                exact.batch.with_blocks(exact.cache.blocks.clone()), exact.layer_idx, exact.w_k,
                                                exact.w_uk, exact.w_uv, scale=exact.scale)
    assert math.isfinite(rel_err(exact_out, out))


def test_fp8_query_gives_bf16_output():
    case = make_case([4, 0], [2, 9], dtype=torch.bfloat16, config=small_config(num_heads=2))
    scale = torch.tensor(0.05)
    q8 = (case.q.float() / scale).to(FP8)
    got = openmla.mla_prefill_decode_graph(q8, *case.clone_cache().fused_args()[1:], scale=case.scale, q_scale=scale, backend="reference")
    assert got.dtype == torch.bfloat16
    want = openmla.mla_prefill_decode_graph((q8.float() * scale).bfloat16(), *case.clone_cache().fused_args()[1:],
                                            scale=case.scale, backend="reference")
    assert rel_err(got, want) == 0.0
    per_token = torch.full((11,), 0.05)
    got2 = openmla.mla_prefill_decode_graph(q8, *case.clone_cache().fused_args()[1:], scale=case.scale, q_scale=per_token,
                                            backend="reference")
    assert rel_err(got2, want) == 0.0
    with pytest.raises(ValueError, match="q_scale"):
        openmla.mla_prefill_decode_graph(case.q, *case.clone_cache().fused_args()[1:], scale=case.scale, q_scale=scale,
                                         backend="reference")
    with pytest.raises(ValueError, match="q_scale"):
        openmla.mla_prefill_decode_graph(q8, *case.clone_cache().fused_args()[1:], scale=case.scale,
                                         q_scale=torch.ones(3), backend="reference")
