"""The plugin's cache write (``OpenMLAImpl.do_kv_cache_update``) stores the bytes the library's
write stores (``CacheBatch.write_rows``: the format object's torch write) for every cache format the
plugin serves, on vLLM's own cache tensor (uint8 for the fp8 ones, as vLLM allocates them), with
NaN entries and padding slots (-1), on the cpu backend (the native write kernel) and on torch."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

L, R, BLOCKS, BLOCK = 512, 64, 6, 16
# vLLM's kv_cache_dtype -> (the tensor vLLM allocates: dtype, row width)
SERVED = {"auto": (torch.bfloat16, L + R), "fp8": (torch.uint8, L + R), "fp8_e4m3": (torch.uint8, L + R),
          "fp8_ds_mla": (torch.uint8, 656)}


def _inputs(T: int):
    g = torch.Generator().manual_seed(7)
    kv_c = (torch.randn(T, L, generator=g) * 3).to(torch.bfloat16)
    k_pe = (torch.randn(T, 1, R, generator=g) * 3).to(torch.bfloat16)
    kv_c[1, 3] = k_pe[2, 0, 5] = float("nan")
    kv_c[4, :] = float("nan")
    slots = torch.randperm(BLOCKS * BLOCK, generator=g)[: T + 4].long()  # vLLM pads the mapping past T
    slots[[0, 9]] = -1  # padding tokens
    return kv_c, k_pe, slots


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("kv_cache_dtype", list(SERVED))
def test_plugin_write_equals_the_librarys_write(kv_cache_dtype, backend, monkeypatch):
    import openmla
    from openmla.backends.cpu import available, kernels
    from openmla.integrations.vllm.impl import OpenMLAImpl
    from openmla.integrations.vllm.metadata import cache_format

    if backend == "cpu" and not available():
        pytest.skip("the native CPU kernels do not build here")
    monkeypatch.setenv("OPENMLA_BACKEND", backend)
    native = []
    real = kernels.write_rows
    monkeypatch.setattr(kernels, "write_rows", lambda *a, **k: native.append(1) or real(*a, **k))
    fmt = cache_format(kv_cache_dtype)
    dtype, width = SERVED[kv_cache_dtype]
    kv_cache = torch.zeros(BLOCKS, BLOCK, width, dtype=dtype)
    k_scale = torch.tensor(0.625)
    kv_c, k_pe, slots = _inputs(24)
    impl = SimpleNamespace(cache_format=fmt, kv_lora_rank=L, qk_rope_head_dim=R)  # what the method reads of the impl
    OpenMLAImpl.do_kv_cache_update(impl, kv_c, k_pe, kv_cache, slots, kv_cache_dtype, k_scale)

    lib = openmla.PagedLatentCache(1, BLOCKS, BLOCK, dtype=torch.bfloat16 if fmt == "native" else fmt, kv_scale=0.625)
    rows = slots[:24]
    keep = rows >= 0
    entries = torch.cat([kv_c, k_pe.reshape(24, R)], dim=-1)
    lib.prepare([], []).write_rows(0, rows[keep], entries[keep])
    assert torch.equal(kv_cache.view(torch.uint8), lib.blocks[0].view(torch.uint8)), "the plugin stored other bytes"
    assert native == ([1] if backend == "cpu" else []), "the cpu backend did not run the native write"
