"""What this CPU computes at full speed, asked at run time (never assumed from the machine we tested on).

PyTorch runs bfloat16 and float16 CPU matmuls through oneDNN only where the CPU has the dot
products for them (AVX512-BF16 / AMX / AVX512-FP16); elsewhere (an AVX2-only CPU, say) it
emulates them about 100x slower than float32 (bench/RESULTS.md). Programs that choose a model
dtype for the user (the demos, the benchmarks) ask here.
"""

from __future__ import annotations

import torch


def fast_matmul(dtype: torch.dtype) -> bool:
    """Whether torch's CPU matmul runs ``dtype`` on hardware dot products (float32 always does)."""
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return True


def model_dtype(wanted: torch.dtype | None = None) -> torch.dtype:
    """``wanted`` when given; else bfloat16 where this CPU multiplies it at full speed, float32 otherwise."""
    if wanted is not None:
        return wanted
    return torch.bfloat16 if fast_matmul(torch.bfloat16) else torch.float32


def describe() -> str:
    """One line: the CPU's vector extensions as torch sees them, and what its matmuls run fast in."""
    caps = [name for name, ok in (("AVX2", torch.cpu._is_avx2_supported()), ("AVX-512", torch.cpu._is_avx512_supported()),
                                  ("AVX512-BF16", torch.cpu._is_avx512_bf16_supported()),
                                  ("AMX", torch.cpu._is_amx_tile_supported())) if ok]
    fast = [str(d).removeprefix("torch.") for d in (torch.bfloat16, torch.float16) if fast_matmul(d)]
    return f"{', '.join(caps) or 'no AVX2'}; full-speed matmuls: float32{''.join(', ' + f for f in fast)}"
