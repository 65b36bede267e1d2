"""Next-token choice for a batch of rows: greedy, or seeded sampling with temperature, top-k, top-p."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    """How the next token is picked. ``temperature == 0`` (the default) is greedy (argmax).

    Otherwise logits are divided by ``temperature``, cut to the ``top_k`` largest (0: no cut)
    and to the smallest set whose probability reaches ``top_p`` (1: no cut), then sampled.
    ``seed`` makes a run reproducible (same prompts, settings and cache size); ``None`` draws
    from torch's global generator.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and self.temperature >= 0):
            raise ValueError(f"temperature: expected a number >= 0, got {self.temperature!r}")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise ValueError(f"top_k: expected an int >= 0, got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p: expected a number in (0, 1], got {self.top_p!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed: expected an int or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self, device: torch.device) -> torch.Generator | None:
        """A generator seeded with ``seed`` on ``device`` (``None`` without a seed or when greedy)."""
        if self.greedy or self.seed is None:
            return None
        return torch.Generator(device=device).manual_seed(self.seed)


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """``logits [B, V]`` float32 with everything outside top-k / top-p set to ``-inf`` (the best always stays)."""
    if top_k and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        before = probs.cumsum(-1) - probs  # probability mass ranked above each token
        drop_sorted = before >= top_p  # the first token has 0 before it, so it is never dropped
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None = None) -> torch.Tensor:
    """``logits [B, V]`` -> int64 ``[B]`` next tokens, all rows at once."""
    if sampling.greedy:
        return logits.argmax(dim=-1)
    x = filter_logits(logits.float() / sampling.temperature, sampling.top_k, sampling.top_p)
    return torch.multinomial(x.softmax(-1), 1, generator=generator)[:, 0]
