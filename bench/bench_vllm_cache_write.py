"""The vLLM plugin's cache write per layer for a prefill-sized batch, with that layer's prefill
attention beside it (issue 33 item 2's measure).

Run with the vLLM venv: ``.venv-vllm/bin/python bench/bench_vllm_cache_write.py [--src DIR]``.
``--src`` points at another checkout's ``src`` (say, ``git archive <commit>`` of the commit before
the plugin's write moved to ``openmla.dispatch.write_rows``) so the same script times the old write
path; without it, this tree's. Per format (``fp8``: openmla's fp8_e4m3; ``fp8_ds_mla``; ``auto``:
bf16) it calls ``OpenMLAImpl.do_kv_cache_update`` on vLLM's own tensor layout (uint8 for the fp8
ones) for T new tokens (default 2048; two padding slots), DeepSeek's L=512, R=64, and times one
layer's ``forward_mha``-equivalent attention (``plan.attend`` of the same prefill, H=16, Dn=Dv=128,
bf16) on the same cache. Median and min of ``--reps`` calls, milliseconds; JSON to stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import types

p = argparse.ArgumentParser()
p.add_argument("--src", default=None)
p.add_argument("--tokens", type=int, default=2048)
p.add_argument("--reps", type=int, default=30)
p.add_argument("--formats", default="fp8,fp8_ds_mla,auto")
p.add_argument("--backend", default=None, help="OPENMLA_BACKEND for the write (default: the device's)")
p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
args = p.parse_args()
if args.src:
    sys.path.insert(0, args.src)

import os  # noqa: E402

if args.backend:
    os.environ["OPENMLA_BACKEND"] = args.backend

import torch  # noqa: E402

import openmla  # noqa: E402
from openmla.integrations.vllm.impl import OpenMLAImpl  # noqa: E402
from openmla.integrations.vllm.metadata import cache_format, layer_blocks  # noqa: E402

L, R, H, DN, DV, BLOCK = 512, 64, 16, 128, 128, 16
T = args.tokens
WIDTH = {"auto": L + R, "fp8": L + R, "fp8_e4m3": L + R, "fp8_ds_mla": 656}


def timed(fn, reps: int) -> dict:
    fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return {"median_ms": statistics.median(out), "min_ms": min(out)}


def impl_for(fmt: str):
    """What do_kv_cache_update reads of an impl (and the old code's write view)."""
    ns = types.SimpleNamespace(cache_format=fmt, kv_lora_rank=L, qk_rope_head_dim=R, _write_view=None)
    if hasattr(OpenMLAImpl, "_view"):  # the write path before dispatch.write_rows
        ns._view = types.MethodType(OpenMLAImpl._view, ns)
    return ns


def main() -> None:
    g = torch.Generator().manual_seed(0)
    blocks = 2 * T // BLOCK + 8
    results = {"openmla": openmla.__file__, "tokens": T, "threads": torch.get_num_threads(), "formats": {}}
    for kv_dtype in args.formats.split(","):
        fmt = cache_format(kv_dtype)
        dtype = torch.bfloat16 if fmt == "native" else torch.uint8
        kv_cache = torch.zeros(blocks, BLOCK, WIDTH[kv_dtype], dtype=dtype)
        kv_c = torch.randn(T, L, generator=g).to(torch.bfloat16)
        k_pe = torch.randn(T, 1, R, generator=g).to(torch.bfloat16)
        slots = torch.arange(T + 2, dtype=torch.long) + 3 * BLOCK
        slots[-2:] = -1  # vLLM pads the slot mapping
        k_scale = torch.tensor(0.05)
        impl = impl_for(fmt)
        write = timed(lambda: OpenMLAImpl.do_kv_cache_update(impl, kv_c, k_pe, kv_cache, slots, kv_dtype, k_scale), args.reps)
        # The same prefill's attention over this layer's cache (forward_mha: plan.attend, the up-projected form).
        batch = openmla.CacheBatch(layer_blocks(kv_cache, fmt), torch.tensor([[3 + i for i in range(blocks - 3)]], dtype=torch.int32),
                                   torch.tensor([0], dtype=torch.int32), torch.tensor([0, T], dtype=torch.int32), page_size=BLOCK,
                                   cache_format=fmt, kv_scale=torch.tensor([0.05]) if fmt == "fp8_e4m3" else None,
                                   rope_dim=R if fmt == "fp8_ds_mla" else None)
        plan = openmla.plan(batch, scale=(DN + R) ** -0.5)
        w = torch.randn(H, DN + DV, L, generator=g).to(torch.bfloat16) * L**-0.5
        w_k = w[:, :DN].reshape(H * DN, L).contiguous()
        weights = openmla.LayerWeights(torch.ones(L, dtype=torch.bfloat16), w_k, w_k.view(H, DN, L).transpose(1, 2),
                                       w[:, DN:].contiguous())
        q = torch.randn(T, H, DN + R, generator=g).to(torch.bfloat16)
        attn = timed(lambda: plan.attend(q, 0, weights), max(3, args.reps // 6))
        results["formats"][kv_dtype] = {"write": write, "attention": attn, "backend": plan.backend_name,
                                        "write_share_pct": 100 * write["median_ms"] / (write["median_ms"] + attn["median_ms"])}
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    if args.threads:
        torch.set_num_threads(args.threads)
    with torch.inference_mode():
        main()
