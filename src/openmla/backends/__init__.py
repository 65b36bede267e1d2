"""Backend registry. A backend is a module-level object with the primitives ``ops`` composes:

- ``write_cache(q, kv, freqs_cis, kv_norm_gamma, batch, layer_idx, epsilon, interleaved) -> q_rot``
- ``absorb(q_rot, w_uk) -> q_abs [T,H,L+R]`` and ``unabsorb(out_lat, w_uv) -> [T,H,Dv]``
- ``decode(q_abs, batch, layer_idx, *, scale, kv_lora_rank, mask, sparse_indices, topk_lengths,
  physical_indices, attn_sink, num_partitions) -> (out_lat, lse)``
- ``prefill(q_rot, batch, layer_idx, w_k, w_uv, *, scale, mask, sparse_indices, topk_lengths,
  physical_indices, attn_sink, buffer_size) -> (out, lse)``
- ``flare_mla_prefill(q, k, v, buffer_row_offsets, cache_offsets, batch, layer_idx, *, scale, mask,
  tile) -> (out, lse)``

Arguments reach a backend already validated. Outputs may be in any float dtype; ``ops``
casts them to the caller's.
"""

from __future__ import annotations

import os
from types import ModuleType

import torch

BACKENDS = ("torch", "triton", "reference", "cpu")


def _cpu_default(device: torch.device) -> str:
    from .cpu import available  # native kernels, built on first use; warns once and falls back

    return "cpu" if device.type == "cpu" and available() else "torch"


def resolve_backend_name(backend: str | None, device: torch.device) -> str:
    """Explicit argument, else ``OPENMLA_BACKEND``, else ``triton`` on CUDA, ``cpu`` (the native
    kernels) on the CPU when they build here, and ``torch`` elsewhere."""
    name = backend or os.environ.get("OPENMLA_BACKEND") or ("triton" if device.type == "cuda" else _cpu_default(device))
    if name not in BACKENDS:
        raise ValueError(f"backend: unknown backend {name!r}; choose one of {BACKENDS}")
    return name


def load_backend(name: str) -> ModuleType:
    if name == "reference":
        from . import reference_backend as mod
    elif name == "torch":
        from . import torch_cpu as mod  # a package: cache_write, decode, prefill
    elif name == "cpu":
        from .cpu import api as mod, available

        if not available():
            raise ValueError("backend: the cpu backend is unavailable here (its native kernels did not build)")
    else:
        try:
            from .triton import api as mod
        except ImportError as exc:  # triton missing, or the backend not built yet
            raise ValueError(f"backend: the triton backend is unavailable here ({exc})") from exc
    return mod
