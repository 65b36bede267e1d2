"""Backend registry: ``cpu`` (native C++ kernels), ``torch`` (eager PyTorch, any device), ``triton``
(GPU kernels; the CPU through Triton's interpreter) and ``reference`` (the float64 oracle).

Each is a ``base.Backend`` subclass, imported on first use from the line that names it here.
``openmla.plan`` resolves a name (``resolve_backend_name``) and then ``choose_backend``: the
named backend, or its declared fallback when it declines the step, recorded on the plan.
"""

from __future__ import annotations

import importlib
import os
import torch

from .base import Backend, ChunkPrefillKernels, PlanView, SharedKVKernels

# name -> "module:class"; a new backend is one more line.
REGISTRY: dict[str, str] = {
    "torch": "openmla.backends.torch_cpu:TorchBackend",
    "triton": "openmla.backends.triton.backend:TritonBackend",
    "reference": "openmla.backends.reference_backend:ReferenceBackend",
    "cpu": "openmla.backends.cpu.backend:CpuBackend",
}
BACKENDS = tuple(REGISTRY)
# The backends that implement the shared-KV (DeepSeek-V4) protocol, ``base.SharedKVKernels``
# (load_backend registers each one's class with it).
SHARED_KV: frozenset[str] = frozenset({"torch", "triton", "reference", "cpu"})
# The backends that implement MAX's one-chunk prefill with given keys, ``base.ChunkPrefillKernels``
# (registered the same way).
CHUNK_PREFILL: frozenset[str] = frozenset({"torch", "triton", "reference", "cpu"})

_LOADED: dict[str, Backend] = {}


_CPU_DEFAULT: list[str] = []  # "cpu" or "torch", found once per process (every plan asks)


def _cpu_default(device: torch.device) -> str:
    if device.type != "cpu":
        return "torch"
    if not _CPU_DEFAULT:
        from .cpu import available  # native kernels, built on first use; warns once and falls back

        _CPU_DEFAULT.append("cpu" if available() else "torch")
    return _CPU_DEFAULT[0]


def resolve_backend_name(backend: str | None, device: torch.device) -> str:
    """Explicit argument, else ``OPENMLA_BACKEND``, else ``triton`` on CUDA, ``cpu`` (the native
    kernels) on the CPU when they build here, and ``torch`` elsewhere."""
    name = backend or os.environ.get("OPENMLA_BACKEND") or ("triton" if device.type == "cuda" else _cpu_default(device))
    if name not in REGISTRY:
        raise ValueError(f"backend: unknown backend {name!r}; choose one of {BACKENDS}")
    return name


def load_backend(name: str) -> Backend:
    """The backend ``name`` (one instance per process); ``ValueError`` when it cannot run here."""
    loaded = _LOADED.get(name)
    if loaded is not None:  # every plan asks: once loaded, it stays
        return loaded
    module, _, cls_name = REGISTRY[name].partition(":")
    try:
        cls = getattr(importlib.import_module(module), cls_name)
    except ImportError as exc:  # triton missing, say
        raise ValueError(f"backend: the {name} backend is unavailable here ({exc})") from exc
    why = cls.unavailable()
    if why is not None:
        raise ValueError(f"backend: the {name} backend is unavailable here ({why})")
    if name in SHARED_KV and not issubclass(cls, SharedKVKernels):
        SharedKVKernels.register(cls)
    if name in CHUNK_PREFILL and not issubclass(cls, ChunkPrefillKernels):
        ChunkPrefillKernels.register(cls)
    if name not in _LOADED:
        _LOADED[name] = cls()
    return _LOADED[name]


def _supports(backend: Backend, plan, protocol: type | None):
    """``supports`` (the MLA kernels), or the protocol's question (``SharedKVKernels``: ``supports_shared_kv``)."""
    if protocol is None:
        return backend.supports(plan)
    if not isinstance(backend, protocol):
        return f"it does not implement {protocol.__name__} (openmla.backends.SHARED_KV)"
    return backend.supports_shared_kv(plan)


def choose_backend(name: str, plan: PlanView, protocol: type | None = None) -> tuple[Backend, str | None]:
    """The backend that runs ``plan``: ``name``'s, or its fallback when it declines the step, with
    the reason (None when ``name``'s runs). ``protocol``: None for an MLA plan, ``SharedKVKernels``
    for a V4 plan (the backend must be registered for it). ``ValueError`` when neither runs it."""
    if protocol not in (None, SharedKVKernels):
        raise ValueError(f"protocol: expected None or SharedKVKernels, got {protocol!r}")
    backend = load_backend(name)
    why = _supports(backend, plan, protocol)
    if why is True:
        return backend, None
    if backend.fallback is None:
        raise ValueError(f"backend: the {name} backend cannot run this step: {why}")
    fallback = load_backend(backend.fallback)
    why_not = _supports(fallback, plan, protocol)
    if why_not is not True:
        raise ValueError(f"backend: the {name} backend cannot run this step ({why}), nor its fallback {fallback.name} ({why_not})")
    return fallback, f"{name} declined: {why}"


__all__ = ["BACKENDS", "CHUNK_PREFILL", "REGISTRY", "SHARED_KV", "Backend", "ChunkPrefillKernels", "SharedKVKernels",
           "choose_backend", "load_backend", "resolve_backend_name"]
