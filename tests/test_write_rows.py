"""``openmla.dispatch.write_rows`` (given entries at given physical rows of one layer: the vLLM
plugin's cache write) stores the bytes the library's write stores (``CacheBatch.write_rows``, the
format object's torch write) for every format and entry dtype, NaN entries included, padding rows
(-1) skipped; on the cpu backend it is the native kernel. The kernels' codes are one table:
``openmla.kernel_codes``, compiled into the C++ enums through the generated ``codes.h``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import openmla
from openmla import dispatch, kernel_codes
from openmla.formats import FORMATS

L, R, PAGES, PAGE = 512, 64, 6, 16
CSRC = Path(openmla.__file__).parent / "backends" / "cpu" / "csrc"

# (cache dtype for PagedLatentCache, entry dtype)
CASES = [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float16, torch.float16),
         (torch.float32, torch.float32), (torch.float32, torch.bfloat16)]
CASES += [(fmt, et) for fmt in ("fp8_e4m3", "fp8_ds_mla", "nvfp4_ds_mla", "nvfp4_fp8rope") for et in (torch.bfloat16, torch.float32)]


def _entries(n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(11)
    e = torch.randn(n, L + R, generator=g) * 4
    e[0, 5] = e[3, L + 1] = float("nan")  # NaN in the latent and in the rope part
    e[2, :] = float("nan")
    e[4, 200:] = 900.0  # saturates fp8
    e[5, :128] = 0.0
    e = e.to(dtype)
    e[6, 9] = e[6, L + 2] = float("nan")  # set in the entry dtype (a bf16 NaN of other bits than a cast's)
    return e


def _cpu_available() -> bool:
    from openmla.backends.cpu import available

    return available()


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("cache_dtype,entry_dtype", CASES, ids=[f"{c}-{e}".replace("torch.", "") for c, e in CASES])
def test_write_rows_equals_the_librarys_write(cache_dtype, entry_dtype, backend, monkeypatch):
    if backend == "cpu" and not _cpu_available():
        pytest.skip("the native CPU kernels do not build here")
    from openmla.backends.cpu import kernels

    native = []
    real = kernels.write_rows
    monkeypatch.setattr(kernels, "write_rows", lambda *a, **k: native.append(1) or real(*a, **k))
    ours = openmla.PagedLatentCache(2, PAGES, PAGE, dtype=cache_dtype, kv_scale=0.75)
    lib = openmla.PagedLatentCache(2, PAGES, PAGE, dtype=cache_dtype, kv_scale=0.75)
    fmt = lib.cache_format
    entries = _entries(40, entry_dtype)
    rows = torch.randperm(PAGES * PAGE, generator=torch.Generator().manual_seed(2))[:40]
    rows[[7, 30]] = -1  # padding tokens: skipped
    scale = ours.kv_scale[1:2] if FORMATS[fmt].scaled else None
    dispatch.write_rows(ours.blocks[1], rows, entries, cache_format=fmt, kv_lora_rank=L, scale=scale, backend=backend)
    keep = rows >= 0
    lib.prepare([], []).write_rows(1, rows[keep], entries[keep])
    assert torch.equal(ours.blocks.view(torch.uint8), lib.blocks.view(torch.uint8)), "stored bytes differ from the library's write"
    assert native == ([1] if backend == "cpu" else []), "the cpu backend did not run its native write"


def test_write_rows_refuses_rows_past_the_layer():
    if not _cpu_available():
        pytest.skip("the native CPU kernels do not build here")
    cache = openmla.PagedLatentCache(1, 2, 4, dtype="fp8_ds_mla")
    with pytest.raises(RuntimeError, match="past the 8 rows"):
        dispatch.write_rows(cache.blocks[0], torch.tensor([8]), torch.zeros(1, L + R), cache_format="fp8_ds_mla",
                            kv_lora_rank=L, backend="cpu")


def test_codes_are_one_table():
    from openmla.backends.cpu import build, kernels

    assert kernels.FORMAT_CODES is kernel_codes.FORMAT_CODES and kernels.MASK_CODES is kernel_codes.MASK_CODES
    for name, fmt in FORMATS.items():
        for dtype in fmt.storage:
            code = fmt.kernel_code(dtype)
            assert kernel_codes.FORMAT_CODES.get(dtype if fmt.is_native else name) == code
    header = kernel_codes.header()
    enums = dict(re.findall(r"enum (\w+) : int64_t \{([^}]*)\}", header))
    parse = lambda body: {n.strip(): int(v) for n, v in (item.split("=") for item in body.split(","))}  # noqa: E731
    assert sorted(parse(enums["CacheFormat"]).values()) == sorted(kernel_codes.FORMAT_CODES.values())
    assert parse(enums["MaskKind"]) == {cpp: code for cpp, code in kernel_codes.MASKS.values()}
    for kind, code in kernel_codes.MASK_CODES.items():
        assert kernel_codes.MASKS[kind][1] == code
    # No hand-written copy left in the C++ sources; the build writes the header and keys on it.
    for path in CSRC.glob("*.h"):
        assert not re.search(r"enum (CacheFormat|MaskKind)\b", path.read_text()), f"{path.name} defines a code enum by hand"
    assert '#include "codes.h"' in (CSRC / "common.h").read_text()
    assert build.write_codes_header(Path(build.build_dir())).read_text() == header if build.build_dir().exists() else True


def test_triton_reads_the_same_mask_codes():
    _common = pytest.importorskip("openmla.backends.triton._common")
    assert _common.MASK_CODES is kernel_codes.MASK_CODES


def test_the_build_key_follows_the_header(monkeypatch, tmp_path):
    from openmla.backends.cpu import build

    key = build.build_key()
    monkeypatch.setattr(kernel_codes, "header", lambda: "// another table\n")
    assert build.build_key() != key
    path = build.write_codes_header(tmp_path)
    assert path.read_text() == "// another table\n"


def test_write_rows_custom_op_under_compile():
    """Under ``torch.compile(fullgraph=True)`` the write is the ``openmla::write_rows`` op (same bytes);
    ``torch.library.opcheck`` passes for it."""
    eager = openmla.PagedLatentCache(1, PAGES, PAGE, dtype="fp8_e4m3", kv_scale=0.5)
    comp = openmla.PagedLatentCache(1, PAGES, PAGE, dtype="fp8_e4m3", kv_scale=0.5)
    entries, rows = _entries(8, torch.bfloat16), torch.tensor([3, 40, -1, 7, 0, 95, 12, 13])
    kw = dict(cache_format="fp8_e4m3", kv_lora_rank=L)
    dispatch.write_rows(eager.blocks[0], rows, entries, scale=eager.kv_scale[:1], **kw)
    torch._dynamo.reset()
    fn = torch.compile(lambda layer, r, e, s: dispatch.write_rows(layer, r, e, scale=s, **kw), fullgraph=True, backend="eager")
    fn(comp.blocks[0], rows, entries, comp.kv_scale[:1])
    assert torch.equal(eager.blocks.view(torch.uint8), comp.blocks.view(torch.uint8))
    layer = torch.zeros(PAGES, PAGE, L + R, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.openmla.write_rows.default, (layer, rows.abs(), entries, None, "native", L, None))
