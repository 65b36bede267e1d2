"""Backend registry: ``torch`` (eager PyTorch, any device), ``triton`` (GPU kernels; the CPU through
Triton's interpreter) and ``reference`` (the float64 oracle). Each is a module implementing
``base.Backend``; ``openmla.plan`` picks one and drives it.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .base import Backend

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


def load_backend(name: str) -> "Backend":
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
