"""Compile every kernel of this backend for a GPU architecture on a machine without a GPU.

    python -m openmla.backends.triton.aot [--arch 90] [--dtypes bfloat16,float32,float16]

The launch paths (cache write, decode with each sparse mode, prefill, merge; on a native
cache of each dtype, and on fp8_e4m3 / fp8_ds_mla caches with queries of each dtype) run on
tiny CPU tensors at DeepSeek dims with the GPU tile configs, but every ``kernel[grid](...)``
call is recorded instead of launched. Each recorded specialisation is then compiled with
``triton.compile`` for ``cuda:<arch>`` (ptxas ships with the triton wheel), and its
registers, spill stack and shared memory are printed. This catches what the interpreter
cannot: type errors in compiled Triton, shapes ``tl.dot`` rejects, register spills.
Exit status 1 if any kernel fails to compile. TRITON_INTERPRET must be unset.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import sys
import tempfile
from typing import Iterator

import torch

from . import _common

if _common.INTERPRET:
    raise ImportError("openmla.backends.triton.aot compiles real kernels: unset TRITON_INTERPRET")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from ...cache import CacheBatch  # noqa: E402
from ...fp8 import FP8, ds_mla_record_bytes  # noqa: E402
from ...masks import MaskVariant  # noqa: E402
from . import cache_write, decode, prefill  # noqa: E402

TYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64",
              torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8", torch.float8_e4m3fn: "fp8e4nv"}
FP8_FORMATS = ("fp8_e4m3", "fp8_ds_mla")
CUDA = torch.device("cuda")


@contextlib.contextmanager
def recorded_launches() -> Iterator[list]:
    """Within the block, kernel launches append ``(kernel, args, kwargs)`` instead of running."""
    calls: list = []
    saved_run, saved_check = JITFunction.run, _common.check_device

    def record(self, *args, grid, warmup, **kwargs):
        calls.append((self, args, kwargs))

    JITFunction.run = record
    _common.check_device = lambda t: None
    try:
        yield calls
    finally:
        JITFunction.run, _common.check_device = saved_run, saved_check


def signature_of(kernel: JITFunction, args: tuple, kwargs: dict) -> tuple[dict, dict, dict]:
    """``(signature, constexprs, options)`` of one recorded launch."""
    bound = dict(zip(kernel.arg_names, args))
    bound.update(kwargs)
    options = {k: bound.pop(k) for k in ("num_warps", "num_stages") if k in bound}
    sig, consts = {}, {}
    for i, name in enumerate(kernel.arg_names):
        value = bound[name]
        if kernel.params[i].is_constexpr:
            sig[name], consts[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            sig[name] = "*" + TYPE_NAMES[value.dtype]
        elif isinstance(value, bool):
            sig[name] = "i1"
        elif isinstance(value, int):
            sig[name] = "i64" if abs(value) >= 2**31 else "i32"
        elif isinstance(value, float):
            sig[name] = "fp32"
        else:
            raise TypeError(f"{kernel.__name__}.{name}: cannot type {type(value).__name__}")
    return sig, consts, options


def resource_usage(cubin: bytes) -> dict:
    """Registers / stack / shared bytes from ``cuobjdump -res-usage`` (empty if unavailable)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+).*?STACK:(\d+)", text)
    return {"regs": int(m.group(1)), "stack": int(m.group(2))} if m else {}


def sample_launches(dtype: torch.dtype, heads: int = 16, cache_format: str = "native") -> list:
    """Record one launch of every kernel specialisation the backend uses for ``dtype`` queries on
    a ``cache_format`` cache (native: a cache of ``dtype``)."""
    L, R, DN, DV, page = 512, 64, 128, 128, 64
    g = torch.Generator().manual_seed(0)
    kv_scale = None
    if cache_format == "native":
        blocks = torch.randn(1, 4, page, L + R, generator=g).to(dtype)
    elif cache_format == "fp8_e4m3":
        blocks = torch.randn(1, 4, page, L + R, generator=g).to(FP8)
        kv_scale = torch.ones(1)
    else:
        blocks = torch.zeros(1, 4, page, ds_mla_record_bytes(L, R), dtype=torch.uint8)
    batch = CacheBatch(blocks, torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), torch.tensor([40, 3], dtype=torch.int32),
                       torch.tensor([0, 2, 3], dtype=torch.int32), page, cache_format=cache_format, kv_scale=kv_scale,
                       rope_dim=R)
    fmt = dict(cache_format=cache_format, kv_scale=kv_scale)
    q = torch.randn(3, heads, DN + R, generator=g).to(dtype)
    q_abs = torch.randn(3, heads, L + R, generator=g).to(dtype)
    idx = torch.zeros(3, 8, dtype=torch.int32)
    key_dtype = _common.cache_views(blocks[0], cache_format, L, kv_scale).compute_dtype(dtype)  # picks the tile config
    with recorded_launches() as calls:
        cache_write.write_cache(q, torch.randn(3, L + R).to(dtype), torch.randn(64, R), torch.ones(L).to(dtype), batch, 0, 1e-6)
        cfg = decode.decode_config(key_dtype, CUDA, heads, cache_format)
        masks = (MaskVariant(), MaskVariant.parse("chunked_causal", chunk_size=8)) if cache_format == "native" else (MaskVariant(),)
        for mask in masks:
            for sparse in (None, True, False):
                decode.decode_into(q_abs, blocks[0], batch.block_table, batch.cache_lengths, batch.input_row_offsets, page,
                                   scale=0.1, kv_lora_rank=L, mask=mask, sparse_indices=None if sparse is None else idx,
                                   physical_indices=bool(sparse), attn_sink=torch.zeros(heads), num_splits=2, config=cfg,
                                   **fmt)
        wide = torch.randn(3, 128, L + R, generator=g).to(dtype)  # many heads: the wider head block
        decode.decode_into(wide, blocks[0], batch.block_table, batch.cache_lengths, batch.input_row_offsets, page,
                           scale=0.1, kv_lora_rank=L, num_splits=1, config=decode.decode_config(key_dtype, CUDA, 128, cache_format), **fmt)
        k, v = torch.randn(43, heads, DN).to(dtype), torch.randn(43, heads, DV).to(dtype)
        out, lse = torch.empty(3, heads, DV, dtype=dtype), torch.empty(3, heads)
        prefill.flare_prefill_into(q, k, v, torch.tensor([0, 40, 43], dtype=torch.int32), torch.zeros(3, dtype=torch.int32),
                                   batch, 0, out, lse, scale=0.1, mask=MaskVariant.parse("sliding_window_causal", window_size=5),
                                   max_new_tokens=2, config=prefill.prefill_config(dtype, CUDA))
    return calls


def compile_all(dtypes: list[torch.dtype], arch: int, cache_formats: tuple[str, ...] = ("native",) + FP8_FORMATS
                ) -> list[dict]:
    """Compile every distinct recorded launch for ``cuda:arch``; one report row each."""
    target = GPUTarget("cuda", arch, 32)
    rows, seen = [], set()
    launches = [(dtype, fmt, launch) for fmt in cache_formats for dtype in dtypes
                if fmt == "native" or dtype != torch.float64 for launch in sample_launches(dtype, cache_format=fmt)]
    for dtype, fmt, (kernel, args, kwargs) in launches:
        sig, consts, options = signature_of(kernel, args, kwargs)
        key = (kernel.__name__, repr(sorted(sig.items())), repr(sorted((k, str(v)) for k, v in consts.items())),
               repr(sorted(options.items())))
        if key in seen:
            continue
        seen.add(key)
        row = {"kernel": kernel.__name__, "dtype": str(dtype)[6:], "cache": fmt, "mask": consts.get("MASK"),
               "sparse": consts.get("SPARSE"), **options}
        try:
            compiled = triton.compile(ASTSource(kernel, sig, consts), target=target, options=options)
        except Exception as exc:  # report every failure, not only the first
            row["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        else:
            row.update(shared=compiled.metadata.shared, **resource_usage(compiled.asm["cubin"]))
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="compile the triton backend's kernels for a GPU without one")
    p.add_argument("--arch", type=int, default=90, help="CUDA compute capability x10 (90 = Hopper)")
    p.add_argument("--dtypes", default="bfloat16,float32,float16", help="query (and native cache) dtypes")
    p.add_argument("--cache-formats", default="native," + ",".join(FP8_FORMATS))
    a = p.parse_args(argv)
    dtypes = [getattr(torch, name) for name in a.dtypes.split(",")]
    rows = compile_all(dtypes, a.arch, tuple(a.cache_formats.split(",")))
    for r in rows:
        status = "FAIL " + r["error"] if "error" in r else (
            f"regs={r.get('regs', '?')} stack={r.get('stack', '?')} smem={r['shared']}")
        print(f"{r['kernel']:28s} {r['dtype']:9s} {r['cache']:10s} mask={r['mask']} sparse={r['sparse']} "
              f"warps={r.get('num_warps', '-')} stages={r.get('num_stages', '-')}  {status}", flush=True)
    failed = sum("error" in r for r in rows)
    print(f"{len(rows)} kernels compiled for sm_{a.arch}, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
