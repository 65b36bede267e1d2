"""DeepSeek-V4 FP8 pages (openmla.fp8_v4): bytes written from the layout table by hand, round trips
within the format's rounding, rows that touch only their own bytes, errors that name the argument."""

from __future__ import annotations

import math
import struct

import pytest
import torch

from openmla import fp8_v4

# Exactly representable float8_e4m3fn values and their bytes (sign, 4 exponent bits with bias 7, 3
# mantissa bits), written from the format's definition.
E4M3 = {448.0: 0x7E, 1.5: 0x3C, -1.5: 0xBC, 0.25: 0x28, 0.0: 0x00, 3.0: 0x44, 2.0 ** -9: 0x01}
CYCLE = [1.5, -1.5, 0.25, 0.0, 3.0, 2.0 ** -9]


def bf16_bytes(x: float) -> bytes:
    return struct.pack("<f", x)[2:]  # the high half of a float32 that bf16 holds exactly


@pytest.mark.parametrize("page_size,want", [(1, 1152), (2, 1728), (16, 9792), (64, 37440)])
def test_page_bytes_as_flashmla_pads_them(page_size, want):
    assert fp8_v4.page_bytes(page_size) == want  # 584 per token, rounded up to 576s


def test_hand_made_token_bytes():
    """Token 1 of a 2-token page: tile j's amax is 448 * 2^(j-3), so its scale is 2^(j-3) (byte
    124 + j); tile 6 is all zero (scale 2^-13, byte 114, from the 1e-4 floor); rope 1, -2, 0.5, ..."""
    entry = torch.zeros(fp8_v4.ENTRY, dtype=torch.float64)
    want_nope = bytearray(fp8_v4.NOPE)
    for j in range(6):
        scale = 2.0 ** (j - 3)
        values = [448.0] + [CYCLE[k % len(CYCLE)] for k in range(63)]
        entry[64 * j: 64 * (j + 1)] = torch.tensor(values, dtype=torch.float64) * scale
        want_nope[64 * j: 64 * (j + 1)] = bytes(E4M3[v] for v in values)
    rope = [1.0, -2.0, 0.5] * 21 + [0.0]
    entry[fp8_v4.NOPE:] = torch.tensor(rope, dtype=torch.float64)
    pages = fp8_v4.new_pages(1, 2)
    fp8_v4.write_rows(pages, 2, torch.tensor([1]), entry[None].float())
    got = bytes(pages[0].tolist())
    want = bytearray(fp8_v4.page_bytes(2))
    want[576: 576 + 448] = want_nope
    want[576 + 448: 576 + 576] = b"".join(bf16_bytes(v) for v in rope)
    want[2 * 576 + 8: 2 * 576 + 8 + 7] = bytes([124 + j for j in range(6)] + [114])
    assert got == bytes(want)
    assert torch.equal(fp8_v4.read_rows(pages, 2, torch.tensor([1]), torch.float64)[0], entry)


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_round_trip_within_the_format_rounding(page_size):
    g = torch.Generator().manual_seed(page_size)
    n_pages = 5
    x = torch.randn(n_pages * page_size, fp8_v4.ENTRY, generator=g) * torch.logspace(-5, 3, fp8_v4.ENTRY)[torch.randperm(fp8_v4.ENTRY, generator=g)]
    pages = fp8_v4.new_pages(n_pages, page_size)
    rows = torch.randperm(n_pages * page_size, generator=g)
    fp8_v4.write_rows(pages, page_size, rows, x)
    y = fp8_v4.read_rows(pages, page_size, rows, torch.float64)
    tiles = x[:, :fp8_v4.NOPE].double().reshape(-1, fp8_v4.TILES, fp8_v4.TILE)
    scale = torch.exp2(torch.ceil(torch.log2((tiles.abs().amax(-1) / 448).clamp_min(1e-4))))
    # e4m3 keeps 3 mantissa bits: half an ulp is 2^-4 of the value, and the subnormal step 2^-9 of the scale.
    err = (y[:, :fp8_v4.NOPE].reshape_as(tiles) - tiles).abs()
    bound = torch.maximum(tiles.abs() * 2.0 ** -4, scale[..., None] * 2.0 ** -10)
    assert (err <= bound).all()
    assert torch.equal(y[:, fp8_v4.NOPE:], x[:, fp8_v4.NOPE:].to(torch.bfloat16).double())
    in_row_order = torch.empty_like(x)
    in_row_order[rows] = x
    packed = fp8_v4.pack_pages(in_row_order.reshape(n_pages, page_size, -1))
    assert torch.equal(packed, pages)  # the same bytes, written page by page or row by row in any order
    assert torch.equal(fp8_v4.unpack_pages(packed, page_size, torch.float64).reshape_as(y)[rows], y)


def test_a_write_touches_only_its_tokens_bytes():
    page_size = 16
    pages = torch.full((3, fp8_v4.page_bytes(page_size)), 0x7F, dtype=torch.uint8)  # e4m3 NaN everywhere
    before = pages.clone()
    rows = torch.tensor([17, 5, 47])
    fp8_v4.write_rows(pages, page_size, rows, torch.randn(3, fp8_v4.ENTRY))
    changed = (pages != before)
    for r in rows.tolist():  # clear the bytes token r owns: its 576 data bytes and its 7 scale bytes
        p, t = divmod(r, page_size)
        changed[p, 576 * t: 576 * (t + 1)] = False
        changed[p, 576 * page_size + 8 * t: 576 * page_size + 8 * t + 7] = False
    assert not changed.any()
    assert not fp8_v4.read_rows(pages, page_size, rows).isnan().any()


def test_errors_name_the_argument():
    pages = fp8_v4.new_pages(2, 16)
    with pytest.raises(ValueError, match="page_size"):
        fp8_v4.page_bytes(0)
    with pytest.raises(ValueError, match="pages"):
        fp8_v4.write_rows(pages[:, :-1], 16, torch.tensor([0]), torch.randn(1, 512))
    with pytest.raises(ValueError, match="pages"):
        fp8_v4.read_rows(pages.view(torch.int8), 16, torch.tensor([0]))
    with pytest.raises(ValueError, match="entries"):
        fp8_v4.write_rows(pages, 16, torch.tensor([0]), torch.randn(1, 576))
    with pytest.raises(ValueError, match="rows"):
        fp8_v4.write_rows(pages, 16, torch.tensor([0, 1]), torch.randn(1, 512))
    assert not pages.any()  # nothing written by a refused call


def test_a_v4_store_exchanged_through_flashmla_pages_attends_as_its_entries():
    """A V4 raw store's layer packed into FlashMLA's pages and unpacked again keeps its page ids
    (the store's block table indexes both); attention over it equals the float64 reference on the
    dequantised entries, and stays within what the fp8 rounding can move it from the original."""
    from openmla import reference as ref
    from openmla.v4 import EntryLayout, PagedEntries, SharedKVSpec, fp8_v4 as exported, shared_kv_attention
    from openmla.v4.cache import V4Cache, V4Layout

    assert exported is fp8_v4  # openmla.v4's public name for the format
    S, window, lengths = 16, 40, [37, 50, 5]
    layout = V4Layout(("sliding_attention",), width=fp8_v4.ENTRY, rope_dim=fp8_v4.ROPE, window=window, rates=())
    cache = V4Cache(layout, num_pages=12, page_size=S, dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    ids = list(range(len(lengths)))
    cache.extend(ids, lengths)
    table = cache.raw.table(ids)
    cache.raw.write(0, cache.raw.rows(table, lengths), torch.randn(sum(lengths), fp8_v4.ENTRY, generator=g) * 2)
    original = cache.raw.blocks[0].clone()

    pages = fp8_v4.pack_pages(cache.raw.blocks[0])  # what FlashMLA's MODEL1_FP8Sparse cache would hold
    assert pages.shape == (12, fp8_v4.page_bytes(S)) and pages.dtype == torch.uint8
    cache.raw.blocks[0].copy_(fp8_v4.unpack_pages(pages, S))  # and back into the store, page for page

    H, new = 4, [3, 1, 2]  # the last tokens of each sequence are this call's queries
    q = torch.randn(sum(new), H, fp8_v4.ENTRY, generator=g)
    offsets = torch.tensor([0, 3, 4, 6])
    spec = SharedKVSpec(fp8_v4.ENTRY ** -0.5, window, EntryLayout(fp8_v4.ENTRY, fp8_v4.ROPE))
    got, lse = shared_kv_attention(q, offsets, cache.raw.view(0, table), spec, backend="torch")
    want, want_lse = ref.shared_kv_attention(q, offsets, cache.raw.view(0, table), spec)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)

    # Against the original entries: a value moves by at most max|dv|, and each score by at most
    # eps = scale * max |q . dk|, so the softmax weights move by at most e^(2 eps) - 1 in sum.
    before, _ = ref.shared_kv_attention(q, offsets, PagedEntries(original, *table), spec)
    delta = (cache.raw.blocks[0] - original).double()
    eps = spec.scale * float((q.double().reshape(-1, fp8_v4.ENTRY) @ delta.reshape(-1, fp8_v4.ENTRY).T).abs().max())
    bound = float(delta.abs().max()) + (math.exp(2 * eps) - 1) * float(original.abs().max())
    err = float((got.double() - before).abs().max())
    assert 0 < err <= bound, (err, bound)
