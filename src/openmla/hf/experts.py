"""Pick the fastest MoE experts implementation transformers offers for a model, by measuring it.

transformers runs a MoE block's experts with one of several implementations
(``model.set_experts_implementation``): ``eager`` (a loop over the experts a step routes to),
``batched_mm`` (every token's expert weights gathered, one batched product: fastest for a few
tokens, slow for many) and ``grouped_mm`` (tokens sorted by expert, one grouped product; the
default where it dispatches). Which wins on a CPU depends on the step's token count, so
``pick_experts_implementation`` times the model's first MoE block on the step shapes a run will
see and keeps the implementation with the least total time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

CANDIDATES = ("grouped_mm", "eager", "batched_mm")


@dataclass(frozen=True)
class ExpertsChoice:
    chosen: str | None  # None: the model has no MoE block whose implementation can be switched
    seconds: dict[str, float]  # candidate -> estimated seconds over the given shapes (inf: not available)


def first_moe(model: nn.Module) -> nn.Module | None:
    """The first module holding an ``experts`` submodule (a MoE block), or None."""
    for module in model.modules():
        if isinstance(getattr(module, "experts", None), nn.Module) and module is not model:
            return module
    return None


def _time(block: nn.Module, x: torch.Tensor) -> float:
    with torch.no_grad():
        block(x)  # warm-up (first-call allocations)
        t0 = time.perf_counter()
        block(x)
        return time.perf_counter() - t0


def pick_experts_implementation(model: nn.Module, shapes: list[tuple[int, float]], hidden_size: int) -> ExpertsChoice:
    """Time each candidate on ``shapes`` (``(tokens per step, how many such steps)``), set the fastest.

    Steps of many tokens are timed at 128 tokens and scaled (every candidate is linear in tokens
    past that), so the probe stays short. A candidate slower than the best so far stops early."""
    block = first_moe(model)
    if block is None or not hasattr(model, "set_experts_implementation"):
        return ExpertsChoice(None, {})
    param = next(block.parameters())
    before = model.get_experts_implementation()
    seconds: dict[str, float] = {}
    g = torch.Generator().manual_seed(0)
    for name in CANDIDATES:
        try:
            model.set_experts_implementation(name)
        except (ValueError, ImportError, RuntimeError):
            seconds[name] = float("inf")
            continue
        best = min(seconds.values(), default=float("inf"))
        total = 0.0
        for tokens, count in shapes:
            probe = min(tokens, 128)
            x = torch.randn(1, probe, hidden_size, generator=g).to(device=param.device, dtype=param.dtype)
            total += _time(block, x) * (tokens / probe) * count
            if total > best:
                break
        seconds[name] = total
    chosen = min(seconds, key=seconds.get)
    model.set_experts_implementation(chosen if seconds[chosen] < float("inf") else before)
    return ExpertsChoice(chosen if seconds[chosen] < float("inf") else None, seconds)
