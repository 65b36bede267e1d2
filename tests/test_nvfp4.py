"""NVFP4 latent caches (``nvfp4_ds_mla``, 432 bytes; ``nvfp4_fp8rope``, 352 bytes; ``openmla.nvfp4``).

- The cache's write/read round trip against a quantiser written here, independently, from the
  documented layout (its own e2m1/e4m3 rounding by nearest-value search, its own byte assembly).
- The byte layout pinned on hand-made values: nibbles, scales (and their permutation), padding
  and rope bytes at known offsets.
- Every backend that reads the formats (torch, reference, cpu's native kernels) against
  the float64 oracle reading the bytes the backend wrote; decode and prefill, ragged lengths with
  0 and 1, pages of 1, 16 and 64; NaN bytes in free pages never reach an output.
- The dispatch seam: cpu runs them natively (tests/test_cpu_nvfp4.py), triton declines (no
  fallback: ValueError); shape validation names the argument.
"""

from __future__ import annotations

import math
import struct

import pytest
import torch

import openmla
from openmla import PagedLatentCache
from openmla import reference as ref
from openmla.cache import CacheBatch
from openmla_tools.cli_options import CACHE_DTYPES
from openmla.formats import QUANTIZED_FORMATS, RECORDS
from openmla.spec import AttentionSpec

from cases import make_case, rel_err, small_config
from cpu_backends import use_backend

FORMATS = ["nvfp4_ds_mla", "nvfp4_fp8rope"]
WIDTH = {"nvfp4_ds_mla": 432, "nvfp4_fp8rope": 352}
L, R = 512, 64


pytestmark = pytest.mark.usefixtures("one_thread")  # small per-token ops


# An independent quantiser, from the documented layout ------------------------------------------
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def e4m3_value(b: int) -> float:
    """The value of an e4m3fn byte, from its bit fields."""
    sign, e, m = -1.0 if b & 0x80 else 1.0, (b >> 3) & 0xF, b & 7
    if b & 0x7F == 0x7F:
        return math.nan
    return sign * (m * 2.0**-9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))


E4M3 = torch.tensor([e4m3_value(b) for b in range(0x7F)], dtype=torch.float64)  # bytes 0x00..0x7E, ascending


def nearest(a: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Index of the entry of the ascending ``table`` nearest to each ``a >= 0`` (ties: the even
    index; past the end: the last entry, i.e. saturation)."""
    d = (a.double()[..., None] - table).abs()
    best = d == d.min(-1, keepdim=True).values
    idx = torch.arange(len(table))
    even = torch.where(best & (idx % 2 == 0), idx, 999).min(-1).values
    return torch.where(even < 999, even, torch.where(best, idx, 999).min(-1).values)


def signed_code(x: torch.Tensor, table: torch.Tensor, sign_bit: int) -> torch.Tensor:
    return nearest(x.abs(), table) | (torch.signbit(x).long() << sign_bit)


def my_quantise(entries: torch.Tensor, fmt: str) -> torch.Tensor:
    """uint8 records from float32 entries: the layout and recipe as docs/fp8.md and openmla.nvfp4 state them."""
    out = torch.zeros(entries.shape[0], WIDTH[fmt], dtype=torch.uint8)
    for t, x in enumerate(entries.float()):
        lat = x[:L].reshape(32, 16)
        amax = lat.abs().amax(-1)
        if fmt == "nvfp4_ds_mla":
            sf = nearest(amax * torch.tensor(1 / 6, dtype=torch.float32), E4M3)
        else:
            target = torch.clamp_min(amax / 6, 2.0**-9)
            sf = nearest(target, E4M3)
            sf = torch.where((E4M3[sf] < target.double()) & (sf < 0x7E), sf + 1, sf)
        dec = E4M3[sf].float()
        inv = torch.where(dec > 0, 1 / dec, 0)
        codes = signed_code((lat * inv[:, None]).flatten(), E2M1, 3)
        for i in range(256):
            out[t, i] = int(codes[2 * i]) | int(codes[2 * i + 1]) << 4
        for g in range(32):
            out[t, (256 + g) if fmt == "nvfp4_ds_mla" else (320 + 8 * (g % 4) + g // 4)] = int(sf[g])
        for j, v in enumerate(x[L:]):
            if fmt == "nvfp4_ds_mla":
                bits = int(v.to(torch.bfloat16).view(torch.int16)) & 0xFFFF
                out[t, 304 + 2 * j], out[t, 305 + 2 * j] = bits & 0xFF, bits >> 8
            else:
                out[t, 256 + j] = int(signed_code(v, E4M3, 7))
    return out


def my_dequantise(rec: torch.Tensor, fmt: str) -> torch.Tensor:
    """float64 entries from uint8 records, through the bit-field decoders above."""
    out = torch.zeros(rec.shape[0], L + R, dtype=torch.float64)
    for t, r in enumerate(rec.tolist()):
        for i in range(L):
            code = (r[i // 2] >> (4 * (i % 2))) & 0xF
            g = i // 16
            sf = r[256 + g] if fmt == "nvfp4_ds_mla" else r[320 + 8 * (g % 4) + g // 4]
            out[t, i] = (-1 if code & 8 else 1) * float(E2M1[code & 7]) * e4m3_value(sf)
        for j in range(R):
            if fmt == "nvfp4_ds_mla":
                bits = r[304 + 2 * j] | r[305 + 2 * j] << 8
                out[t, L + j] = struct.unpack("<f", struct.pack("<I", bits << 16))[0]
            else:
                out[t, L + j] = e4m3_value(r[256 + j])
    return out


def awkward_entries() -> torch.Tensor:
    """Realistic rows plus every corner the recipe has: zero, tiny, huge and tied groups, -0, saturation."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, L + R, generator=g) * torch.logspace(-2, 2, 8)[:, None]
    x[:, 7] *= 20  # an outlier channel
    x[1, :16] = 0  # an all-zero group
    x[1, 16:32] = 1e-4 * torch.randn(16, generator=g)  # amax/6 below e4m3's smallest value
    x[1, 32:48] = 1e4  # past 448 * 6: the scale and the values saturate
    x[2, :16] = torch.tensor([6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5, -0.1])  # ties
    x[2, 16:32] = 6.36  # amax/6 = 1.06: rounds down to 1.0 in e4m3 (nvfp4_fp8rope bumps it to 1.125)
    x[3, L:L + 4] = torch.tensor([1000.0, -0.3, 3e-3, -0.0])  # rope: past e4m3's range, in between, subnormal, -0
    return x


@pytest.mark.parametrize("fmt", FORMATS)
def test_cache_write_read_round_trip_matches_an_independent_quantiser(fmt):
    x = awkward_entries()
    cache = PagedLatentCache(1, 2, 4, L + R, dtype=fmt)
    batch = cache.prepare([], [])
    rows = torch.tensor([5, 0, 7, 2, 1, 3, 6, 4])  # scattered over both pages
    batch.write_rows(0, rows, x)
    stored = cache.blocks[0].reshape(-1, WIDTH[fmt])[rows]
    want = my_quantise(x, fmt)
    assert torch.equal(stored, want), f"{int((stored != want).sum())} bytes differ"
    back = batch.read_rows(0, rows, torch.float64)
    assert torch.equal(back, my_dequantise(stored, fmt))
    assert torch.equal(batch.read_pages(0, torch.tensor([1, 0]), torch.float64).reshape(-1, L + R),
                       batch.read_rows(0, torch.tensor([4, 5, 6, 7, 0, 1, 2, 3]), torch.float64))
    # 4-bit accuracy relative to each group's amax, where nothing saturates.
    lat, blat = x[:, :L].reshape(-1, 16).double(), back[:, :L].reshape(-1, 16)
    amax = lat.abs().amax(-1, keepdim=True)
    ok = (amax > 0.1) & (amax < 2000)  # normal e4m3 scales (a subnormal one rounds by up to 50%)
    assert float(((lat - blat).abs() / amax)[ok.expand_as(lat)].max()) <= 0.25
    assert back.dtype == torch.float64 and batch.read_rows(0, rows).dtype == torch.bfloat16


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_nan_poisons_only_its_own_group(fmt):
    x = awkward_entries()[:2]
    x[0, 20] = math.nan
    batch = PagedLatentCache(1, 1, 4, L + R, dtype=fmt).prepare([], [])
    batch.write_rows(0, torch.arange(2), x)
    back = batch.read_rows(0, torch.arange(2), torch.float32)
    assert torch.isnan(back[0, 16:32]).all() and not torch.isnan(back[0, :16]).any() and not torch.isnan(back[0, 32:]).any()
    assert not torch.isnan(back[1]).any()


def handmade_entry() -> torch.Tensor:
    x = torch.zeros(L + R)
    x[:8] = torch.tensor([6.0, -6.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0])  # group 0: amax 6 -> scale 1.0
    x[32:34] = torch.tensor([12.0, -3.0])  # group 2: amax 12 -> scale 2.0; codes 6/2 -> 7, -3/2 -> 0xB
    x[80] = 3.0  # group 5: amax 3 -> scale 0.5, code 6.0 -> 7
    x[511] = -6.36  # group 31: amax 6.36 -> 1.06: nearest e4m3 1.0, rounded up 1.125
    x[L], x[L + 1], x[L + 63] = 1.0, 0.3, -2.0
    return x


@pytest.mark.parametrize("fmt", FORMATS)
def test_byte_layout_on_handmade_values(fmt):
    batch = PagedLatentCache(1, 1, 1, L + R, dtype=fmt).prepare([], [])
    batch.write_rows(0, torch.tensor([0]), handmade_entry()[None])
    b = batch.blocks[0, 0, 0].tolist()
    assert len(b) == WIDTH[fmt] == batch.blocks.shape[-1]
    # The latent: value 2i in the low nibble of byte i (e2m1: 7 = 6.0, 0xF = -6.0, 1 = 0.5, 2 = 1.0, ...).
    assert b[:4] == [0xF7, 0x21, 0x43, 0x65]
    assert b[16] == 0xB7 and b[40] == 0x07 and b[255] == 0xF0
    assert all(v == 0 for i, v in enumerate(b[:256]) if i not in (0, 1, 2, 3, 16, 40, 255))
    if fmt == "nvfp4_ds_mla":
        scales = b[256:288]  # group order; e4m3: 0x38 = 1.0, 0x40 = 2.0, 0x30 = 0.5, 0 for an all-zero group
        assert scales[0] == 0x38 and scales[2] == 0x40 and scales[5] == 0x30 and scales[31] == 0x38
        assert all(s == 0 for g, s in enumerate(scales) if g not in (0, 2, 5, 31))
        assert b[288:304] == [0] * 16  # padding
        assert b[304:308] == [0x80, 0x3F, 0x9A, 0x3E] and b[430:432] == [0x00, 0xC0]  # bf16 1.0, 0.3, -2.0 (little-endian)
        assert all(v == 0 for v in b[308:430])
    else:
        # Scales permuted: group s at byte 320 + 8*(s & 3) + (s >> 2); all-zero groups hold the floor 2^-9 (0x01),
        # group 31's 1.06 is rounded UP to 1.125 (0x39).
        sf = b[320:352]
        assert sf[0] == 0x38 and sf[16] == 0x40 and sf[9] == 0x30 and sf[31] == 0x39
        assert all(s == 0x01 for p, s in enumerate(sf) if p not in (0, 16, 9, 31))
        assert b[256:258] == [0x38, 0x2A] and b[319] == 0xC0  # e4m3 rope: 1.0, 0.3 -> 0.3125, -2.0
        assert all(v == 0 for v in b[258:319])
    back = batch.read_rows(0, torch.tensor([0]), torch.float32)[0]
    assert back[:8].tolist() == [6.0, -6.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0] and back[32:34].tolist() == [12.0, -3.0]
    assert float(back[511]) == (-6.0 if fmt == "nvfp4_ds_mla" else -6.75)  # saturated at 6 x 1.0, or 6 x 1.125


# Backends against the float64 oracle reading what they stored ------------------------------------
def oracle(case, batch):
    """float64 attention over ``batch``'s cache as stored (no write): out, lse."""
    Dn = case.w_uk.shape[2]
    q = case.q.double()
    q_rot = torch.cat([q[..., :Dn], ref.rope(q[..., Dn:], case.freqs_cis, ref.token_positions(batch))], dim=-1)
    return ref.prefill(q_rot, batch, case.layer_idx, case.w_k, case.w_uv, AttentionSpec.build(scale=case.scale))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("backend", ["torch", "cpu", "reference"])
@pytest.mark.parametrize("new_lens", [[1, 1, 0, 1], [7, 1, 0, 19]], ids=["decode", "prefill"])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_backend_against_the_oracle_on_the_stored_bytes(fmt, backend, new_lens, page_size, monkeypatch):
    use_backend(backend, monkeypatch)  # cpu: skipped where the kernels do not build; scratch memory starts as NaN
    case = make_case([0, 1, 37, 70], new_lens, config=small_config(4, L, R, 32, 32), dtype=torch.float32, cache_dtype=fmt,
                     page_size=page_size)
    mine, theirs = case.clone_cache(), case.clone_cache()
    plan = openmla.plan(mine.batch, scale=case.scale, backend=backend)
    assert plan.backend_name == backend
    got, lse = plan.run(*mine.run_args(), return_lse=True)
    want, want_lse = oracle(case, mine.batch)
    assert rel_err(got, want) < 1e-5 and rel_err(lse, want_lse) < 1e-5, f"seed {case.seed}"
    # The write stores what the oracle's own write stores (float32 vs float64 entries may flip a rare nibble).
    ref.write_cache(theirs.kv, theirs.freqs_cis, theirs.gamma, theirs.batch, theirs.layer_idx, 1e-6)
    diff = int((mine.batch.blocks != theirs.batch.blocks).sum())
    assert diff <= sum(new_lens), f"{diff} bytes differ, seed {case.seed}"


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_oracle_reads_the_dequantised_cache(fmt):
    """The oracle on the quantised cache equals the oracle on a float64 cache holding its dequantised entries."""
    case = make_case([3, 0, 25], [2, 1, 4], config=small_config(2, L, R, 16, 16), dtype=torch.float32, cache_dtype=fmt, page_size=8)
    openmla.plan(case.batch, scale=case.scale, backend="torch").write_cache(case.q, case.kv, case.freqs_cis, case.gamma,
                                                                            case.layer_idx)
    b = case.batch
    dense = torch.stack([b.read_pages(i, torch.arange(b.num_pages), torch.float64) for i in range(b.num_layers)])
    native = CacheBatch(dense, b.block_table, b.cache_lengths, b.input_row_offsets, b.page_size)
    for x, y in zip(oracle(case, b), oracle(case, native)):
        assert torch.equal(x, y)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("backend", ["torch", "cpu", "reference"])
def test_nan_in_free_pages_and_unused_rows_does_not_leak(fmt, backend, monkeypatch):
    use_backend(backend, monkeypatch)
    case = make_case([5, 0, 30], [1, 1, 3], config=small_config(2, L, R, 16, 16), dtype=torch.float32, cache_dtype=fmt,
                     page_size=16, spare_pages=4)
    clean = case.clone_cache()
    b = case.batch
    used = torch.cat([ref.physical_rows(b, i, torch.arange(n)) for i, n in enumerate(b.seq_lens_list)])
    free = torch.ones(b.num_pages * b.page_size, dtype=torch.bool)
    free[used] = False
    b.blocks.view(b.num_layers, -1, b.blocks.shape[-1])[:, free] = 0xFF  # e4m3 and bf16 NaN bytes everywhere else
    g = torch.Generator().manual_seed(case.seed)
    idx = torch.stack([torch.randint(0, n, (6,), generator=g) for n in [6] + [1] + [33] * 3]).int()
    idx[:, -2:] = -1  # unused slots read row 0 of page 0, which may be a poisoned one
    for kwargs in ({}, {"sparse_indices": idx, "physical_indices": False}):
        outs = []
        for c in (case, clean):
            plan = openmla.plan(c.batch, scale=c.scale, backend=backend, **kwargs)
            outs.append(plan.run(*c.run_args()))
        assert not torch.isnan(outs[0]).any() and torch.equal(outs[0], outs[1]), kwargs


# The dispatch seam and validation ----------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_cpu_runs_them_and_triton_refuses(fmt):
    from openmla.backends.cpu import available

    case = make_case([4], [1], config=small_config(2, L, R, 16, 16), cache_dtype=fmt)
    if available():  # where the native kernels build (else plan(backend="cpu") says they are unavailable)
        plan = openmla.plan(case.batch, scale=case.scale, backend="cpu")
        assert plan.backend_name == "cpu" and plan.fallback_reason is None
    pytest.importorskip("triton")
    with pytest.raises(ValueError, match=f"^backend: the triton backend cannot run this step: it cannot read a {fmt} cache"):
        openmla.plan(case.batch, scale=case.scale, backend="triton")


@pytest.mark.parametrize("fmt", FORMATS)
def test_sizes_and_shape_checks(fmt):
    cache = PagedLatentCache(2, 3, 16, dtype=fmt)
    assert cache.bytes_per_token == WIDTH[fmt] and cache.blocks.dtype == torch.uint8 and cache.prepare(["a"], [1]).head_dim == L + R
    with pytest.raises(ValueError, match="^head_dim: .*512"):
        PagedLatentCache(1, 2, 4, head_dim=320, dtype=fmt)  # DeepSeek-V2-Lite's 256 + 64 is not the record
    with pytest.raises(ValueError, match="^rope_dim: .*64"):
        PagedLatentCache(1, 2, 4, head_dim=544, rope_dim=32, dtype=fmt)
    b = cache.prepare(["a"], [2])
    with pytest.raises(ValueError, match="^kv_collection.rope_dim"):
        CacheBatch(b.blocks, b.block_table, b.cache_lengths, b.input_row_offsets, 16, cache_format=fmt, rope_dim=32)
    with pytest.raises(ValueError, match="^kv_collection.blocks"):
        CacheBatch(b.blocks.view(torch.int8), b.block_table, b.cache_lengths, b.input_row_offsets, 16, cache_format=fmt, rope_dim=R)
    assert fmt in RECORDS and fmt in QUANTIZED_FORMATS and fmt in CACHE_DTYPES


def test_hf_attach_takes_the_formats_and_refuses_other_shapes():
    transformers = pytest.importorskip("transformers")
    from openmla.hf import attach, detach, forward_step, is_attached

    def model(kv_lora_rank, rope):
        cfg = transformers.DeepseekV3Config(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                            num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=kv_lora_rank,
                                            q_lora_rank=None, qk_rope_head_dim=rope, qk_nope_head_dim=16, v_head_dim=16,
                                            first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2)
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(cfg).eval()

    small = model(256, R)
    with pytest.raises(ValueError, match="^cache_dtype: nvfp4_ds_mla holds a 512-value latent"):
        attach(small, num_pages=4, cache_dtype="nvfp4_ds_mla")
    assert not is_attached(small)
    m = model(L, R)
    ids = torch.tensor([[1, 5, 9, 2]])
    with torch.no_grad():
        want = m(ids).logits
    for fmt in FORMATS:
        cache = attach(m, num_pages=4, page_size=4, cache_dtype=fmt)
        assert cache.cache_format == fmt and cache.bytes_per_token == WIDTH[fmt]
        batch = cache.prepare(["a"], [4])
        got = forward_step(m, batch, ids[0], torch.arange(4))
        detach(m)
        assert rel_err(got, want[0]) < 0.3, fmt  # 4-bit keys and values against exact ones (~0.1 seen)
