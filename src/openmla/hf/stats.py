"""What a generation run did, step by step (for progress reports and benchmarks)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


class AttentionClock:
    """Wall time spent in an attached model's attention layers, while ``on`` (one per attachment).

    ``layers``: whole attention layers (projections, indexer, openmla's kernels, gates, ``o_proj``);
    ``kernels``: openmla's part of them (``MLAPlan.run``: cache write and attention). On a CUDA
    device each reading synchronises, so turn it on only to measure."""

    def __init__(self, device: torch.device) -> None:
        self.on = False
        self.sync = device.type == "cuda"
        self.layers = 0.0
        self.kernels = 0.0

    def now(self) -> float:
        if self.sync:
            torch.cuda.synchronize()
        return time.perf_counter()

    def take(self) -> tuple[float, float]:
        """``(layers, kernels)`` seconds since the last ``take``."""
        out = (self.layers, self.kernels)
        self.layers = self.kernels = 0.0
        return out


@dataclass(frozen=True)
class StepRecord:
    """One forward of the packed batch."""

    sequences: int  # sequences with new tokens in the step
    prefill_tokens: int  # prompt tokens (and tokens re-prefilled after a preemption)
    decode_tokens: int  # generated tokens fed back, one per decoding sequence
    cached_tokens: int  # tokens already in the cache for those sequences
    pages_in_use: int  # cache pages held after the step's reservation
    seconds: float  # wall time of the step: scheduling, forward, sampling
    attention_seconds: float = 0.0  # of which in the attention layers (projections, indexer, kernels, o_proj)
    kernel_seconds: float = 0.0  # of which in openmla's kernels (cache write and attention)


@dataclass
class GenerationStats:
    """Filled by ``openmla.hf.stream`` / ``generate`` when passed as ``stats=``."""

    steps: list[StepRecord] = field(default_factory=list)
    generated_tokens: int = 0
    preemptions: int = 0

    @property
    def seconds(self) -> float:
        return sum(s.seconds for s in self.steps)

    @property
    def attention_seconds(self) -> float:
        return sum(s.attention_seconds for s in self.steps)

    @property
    def kernel_seconds(self) -> float:
        return sum(s.kernel_seconds for s in self.steps)

    @property
    def peak_pages(self) -> int:
        return max((s.pages_in_use for s in self.steps), default=0)

    @property
    def prefill_tokens(self) -> int:
        return sum(s.prefill_tokens for s in self.steps)

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of stepping."""
        return self.generated_tokens / self.seconds if self.seconds else 0.0

    def decode_only(self) -> list[StepRecord]:
        """The steps that ran decodes only (no prompt tokens)."""
        return [s for s in self.steps if s.prefill_tokens == 0 and s.decode_tokens]
