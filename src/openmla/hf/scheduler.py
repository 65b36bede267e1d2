"""Continuous batching over the paged latent cache: which tokens of which sequences run each step.

Every step packs, within ``Limits.max_batch_tokens``: one token for each decoding sequence,
then the next chunk of each sequence still prefilling, then the first chunk of waiting
requests, admitted while ``Limits.max_running`` allows and the free pages can hold their whole
prompts. When the running sequences need more pages than are free (``PagedLatentCache.prepare``
raises ``CacheFullError`` and changes nothing), the newest running sequence is preempted: its
pages are released and it waits at the head of the queue, to be prefilled again from its prompt
and the tokens it has generated so far. The oldest running sequence always makes progress, so
every request finishes.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Hashable

import torch

from ..cache import CacheBatch, CacheFullError, PagedLatentCache


@dataclass(frozen=True)
class Limits:
    """Per-step limits of the scheduler."""

    max_batch_tokens: int = 2048  # new tokens per step: bounds activation memory (MoE, lm_head input) per forward
    max_running: int = 64  # sequences holding cache pages at once

    def __post_init__(self) -> None:
        for name in ("max_batch_tokens", "max_running"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")


@dataclass(eq=False)
class Sequence:
    """One request: its prompt and generated tokens, and how many of them the cache holds."""

    index: int  # position in the caller's prompt list
    key: Hashable  # its id in the cache
    tokens: list[int]  # prompt, then generated tokens
    prompt_len: int
    computed: int = 0  # tokens whose cache entries are committed
    registered: bool = False  # known to the cache (holds pages)

    @property
    def pending(self) -> int:
        """Tokens not yet in the cache (1 for a decoding sequence: its last generated token)."""
        return len(self.tokens) - self.computed

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len


@dataclass
class ScheduledStep:
    """The sequences of one step, in packed row order, with their new-token counts and cache view."""

    seqs: list[Sequence]
    counts: list[int]
    batch: CacheBatch
    decode_tokens: int  # rows that feed back a generated token (the rest are prompt / re-prefill)

    def input_ids(self) -> torch.Tensor:
        """int64 ``[T]``: each sequence's next ``count`` tokens, packed."""
        ids: list[int] = []
        for s, n in zip(self.seqs, self.counts):
            ids.extend(s.tokens[s.computed: s.computed + n])
        return torch.tensor(ids, dtype=torch.long)

    def sampled(self) -> tuple[list[Sequence], list[int]]:
        """The sequences whose last token this step reaches (they get a next token) and their rows."""
        seqs, rows = [], []
        for s, n, end in zip(self.seqs, self.counts, self.batch.offsets_list[1:]):
            if s.computed + n == len(s.tokens):
                seqs.append(s)
                rows.append(end - 1)
        return seqs, rows

    @property
    def num_tokens(self) -> int:
        return sum(self.counts)


@dataclass
class Scheduler:
    cache: PagedLatentCache
    limits: Limits
    waiting: deque = field(default_factory=deque)
    running: list = field(default_factory=list)  # admission order, oldest first
    preemptions: int = 0
    on_release: Callable[[Hashable], None] | None = None  # told each id whose pages go back (finished or preempted)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def done(self) -> bool:
        return not self.waiting and not self.running

    def _pages_needed(self, seq: Sequence, n: int) -> int:
        ps = self.cache.page_size
        if not seq.registered:
            return math.ceil(n / ps)
        return max(0, math.ceil((seq.computed + n) / ps) - len(self.cache.pages(seq.key)))

    def _pages_to_hold_all(self, seq: Sequence) -> int:
        """Pages ``seq`` still needs to hold every token it has now (its whole prompt, say)."""
        return self._pages_needed(seq, seq.pending)

    def _pick(self) -> list[tuple[Sequence, int]]:
        budget = self.limits.max_batch_tokens
        picks: list[tuple[Sequence, int]] = []
        for decoding in (True, False):  # decodes first: a long prefill never stalls them
            for s in self.running:
                if budget and (s.pending == 1) == decoding:
                    n = min(s.pending, budget)
                    picks.append((s, n))
                    budget -= n
        # Admission: the running sequences and the admitted one must be able to hold all their
        # tokens (a whole prompt, so a request is not admitted to be preempted half way through its
        # prefill); decodes that outgrow the pages later preempt the newest sequence.
        free = self.cache.num_free_pages - sum(self._pages_to_hold_all(s) for s in self.running)
        # Each admission takes budget left after every running sequence got its tokens, so at most
        # max_batch_tokens sequences run and no decode is ever skipped.
        while self.waiting and budget and len(self.running) < self.limits.max_running:
            s = self.waiting[0]
            need = self._pages_to_hold_all(s)
            if need > free:
                break
            free -= need
            n = min(s.pending, budget)
            budget -= n
            self.running.append(self.waiting.popleft())
            picks.append((s, n))
        return picks

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        if seq.registered:
            self._release(seq)
        seq.computed = 0
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def schedule(self) -> ScheduledStep:
        """The next step; its pages are reserved (``cache.prepare``). Call ``complete`` after the forward."""
        while True:
            picks = self._pick()
            if not picks:
                head = self.waiting[0]
                raise CacheFullError(f"request {head.index} needs {self._pages_to_hold_all(head)} pages to start and only "
                                     f"{self.cache.num_free_pages} are free: other sequences hold the cache")
            seqs, counts = [s for s, _ in picks], [n for _, n in picks]
            try:
                batch = self.cache.prepare([s.key for s in seqs], counts)
            except CacheFullError:  # nothing was reserved: give back the newest sequence's pages, plan again
                self._preempt(self.running[-1])
                continue
            for s in seqs:
                s.registered = True
            decode = sum(1 for s, n in picks if n == 1 and s.computed == len(s.tokens) - 1 and s.generated > 0)
            return ScheduledStep(seqs, counts, batch, decode)

    def complete(self, step: ScheduledStep) -> None:
        """Commit the step's cache writes (after every layer ran)."""
        self.cache.commit(step.batch)
        for s, n in zip(step.seqs, step.counts):
            s.computed += n

    def finish(self, seq: Sequence) -> None:
        """``seq`` is done: its pages go back to the pool."""
        self.running.remove(seq)
        if seq.registered:
            self._release(seq)

    def _release(self, seq: Sequence) -> None:
        self.cache.release(seq.key)
        seq.registered = False
        if self.on_release is not None:
            self.on_release(seq.key)

    def release_all(self) -> None:
        """Free every page this scheduler holds (end of a run, an error, or an abandoned stream)."""
        for s in list(self.running) + list(self.waiting):
            if s.registered:
                self._release(s)
        self.running.clear()
        self.waiting.clear()
