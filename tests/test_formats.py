"""The cache-format table (``openmla.formats``): each format's write then read against its codec
(``openmla.fp8`` / ``openmla.nvfp4``, or a cast), byte for byte and NaN for NaN; its bytes per token;
``CacheBatch``'s reads and writes are the format object's."""

from __future__ import annotations

import pytest
import torch

import openmla
from openmla import fp8, nvfp4
from openmla.formats import CACHE_FORMATS, FORMATS, RECORDS, STORAGE_DTYPES, cache_format

L, R, PAGES, PAGE = 512, 64, 5, 8

# (format, storage dtype) -> (the codec's encode, its decode): what the format must equal
CODECS = {
    ("native", torch.bfloat16): (lambda e, s: e.to(torch.bfloat16), lambda r, s, d: r.to(d)),
    ("native", torch.float16): (lambda e, s: e.to(torch.float16), lambda r, s, d: r.to(d)),
    ("native", torch.float32): (lambda e, s: e.to(torch.float32), lambda r, s, d: r.to(d)),
    ("native", torch.float64): (lambda e, s: e.to(torch.float64), lambda r, s, d: r.to(d)),
    ("fp8_e4m3", fp8.FP8): (lambda e, s: fp8.quantize_e4m3(e, s), lambda r, s, d: (r.float() * s).to(d)),
    ("fp8_ds_mla", torch.uint8): (lambda e, s: fp8.pack_ds_mla(e, L), lambda r, s, d: fp8.unpack_ds_mla(r, L, d)),
    ("nvfp4_ds_mla", torch.uint8): (lambda e, s: nvfp4.pack_ds_mla(e), lambda r, s, d: nvfp4.unpack_ds_mla(r, d)),
    ("nvfp4_fp8rope", torch.uint8): (lambda e, s: nvfp4.pack_fp8rope(e), lambda r, s, d: nvfp4.unpack_fp8rope(r, d)),
}


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _entries(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    e = torch.randn(n, L + R, generator=g) * 3
    e[1, 7] = float("nan")  # a NaN in the latent and one in the rope part
    e[2, L + 3] = float("nan")
    e[3, :128] = 0  # a zero group
    return e


def test_the_table_covers_every_format_and_codec():
    assert set(CACHE_FORMATS) == set(FORMATS) == {f for f, _ in CODECS}
    assert {(f, d) for f in FORMATS for d in STORAGE_DTYPES[f]} == set(CODECS)
    assert set(RECORDS) == {"fp8_ds_mla", "nvfp4_ds_mla", "nvfp4_fp8rope"}
    with pytest.raises(ValueError, match="cache_format"):
        cache_format("fp4")


@pytest.mark.parametrize("name,storage", list(CODECS), ids=[f"{f}-{d}".replace("torch.", "") for f, d in CODECS])
def test_write_then_read_is_the_codec(name, storage):
    fmt = FORMATS[name]
    W = fmt.row_width(L, R)
    assert fmt.fits(W, R) and fmt.entry_width(W, R) == L + R and fmt.latent_rank(W, R) == L
    layer = torch.zeros(PAGES, PAGE, W, dtype=storage)
    entries = _entries(11, seed=3)
    rows = torch.randperm(PAGES * PAGE, generator=torch.Generator().manual_seed(4))[:11]
    scale = torch.tensor(0.37) if fmt.scaled else None
    encode, decode = CODECS[name, storage]
    fmt.write(layer, rows, entries, L, scale)
    flat = layer.view(-1, W)
    assert torch.equal(_bytes(flat[rows]), _bytes(encode(entries, scale))), "stored bytes differ from the codec's"
    others = torch.ones(PAGES * PAGE, dtype=torch.bool)
    others[rows] = False
    assert not _bytes(flat[others]).any(), "a row outside rows was written"
    for dtype in (torch.float32, torch.bfloat16):
        got = fmt.read(layer, rows, L, dtype, scale)
        assert got.dtype == dtype and got.shape == (11, L + R)
        assert torch.equal(got.isnan(), decode(flat[rows], scale, dtype).isnan())
        torch.testing.assert_close(got, decode(flat[rows], scale, dtype), rtol=0, atol=0, equal_nan=True)
    pages = torch.tensor([3, 0])
    torch.testing.assert_close(fmt.read_pages(layer, pages, L, torch.float32, scale),
                               decode(layer[pages], scale, torch.float32), rtol=0, atol=0, equal_nan=True)


def test_bytes_per_token():
    want = {"native": 1152, "fp8_e4m3": 576, "fp8_ds_mla": 656, "nvfp4_ds_mla": 432, "nvfp4_fp8rope": 352}
    assert {n: f.bytes_per_token(L, R, torch.bfloat16 if f.is_native else None) for n, f in FORMATS.items()} == want
    assert FORMATS["native"].bytes_per_token(L, R, torch.float32) == 2304
    for name, nbytes in want.items():
        cache = openmla.PagedLatentCache(1, 2, 4, dtype=torch.bfloat16 if name == "native" else name)
        assert cache.bytes_per_token == nbytes


def test_shapes_the_records_refuse():
    assert FORMATS["fp8_ds_mla"].shape_error(100, 64)[0] == "head_dim"
    assert FORMATS["fp8_ds_mla"].shape_error(256, 3)[0] == "rope_dim"
    assert FORMATS["fp8_ds_mla"].shape_error(256, 32) is None and FORMATS["fp8_ds_mla"].row_width(256, 32) == 328
    assert FORMATS["nvfp4_ds_mla"].shape_error(256, 64) is not None
    assert not FORMATS["nvfp4_fp8rope"].fits(432, 64) and FORMATS["nvfp4_fp8rope"].fits(352, 64)


@pytest.mark.parametrize("dtype", [torch.float32, "fp8_e4m3", "fp8_ds_mla", "nvfp4_ds_mla", "nvfp4_fp8rope"])
def test_cache_batch_reads_and_writes_through_its_format(dtype):
    cache = openmla.PagedLatentCache(2, PAGES, PAGE, dtype=dtype, kv_scale=0.5)
    batch = cache.prepare(["a"], [3])
    fmt = batch.format
    assert fmt is FORMATS[batch.cache_format] and batch.kv_lora_rank == L and batch.head_dim == L + R
    entries, rows = _entries(4, seed=5), torch.tensor([9, 0, 17, 30])
    batch.write_rows(1, rows, entries)
    twin = torch.zeros_like(cache.blocks[1])
    fmt.write(twin, rows, entries, L, cache.kv_scale[1] if fmt.scaled else None)
    assert torch.equal(_bytes(cache.blocks[1]), _bytes(twin)) and not _bytes(cache.blocks[0]).any()
    torch.testing.assert_close(batch.read_rows(1, rows, torch.float32),
                               fmt.read(twin, rows, L, torch.float32, cache.kv_scale[1] if fmt.scaled else None),
                               rtol=0, atol=0, equal_nan=True)
    assert batch.read_rows(1, rows).dtype == batch.compute_dtype == (torch.float32 if dtype is torch.float32 else torch.bfloat16)


def test_kernel_codes():
    want = {("native", torch.bfloat16): 0, ("native", torch.float16): 1, ("native", torch.float32): 2,
            ("native", torch.float64): None, ("fp8_e4m3", fp8.FP8): 3, ("fp8_ds_mla", torch.uint8): 4,
            ("nvfp4_ds_mla", torch.uint8): 5, ("nvfp4_fp8rope", torch.uint8): 6}
    assert {(n, d): FORMATS[n].kernel_code(d) for n, d in want} == want
