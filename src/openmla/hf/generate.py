"""``generate`` and ``stream``: continuous-batching generation with an attached transformers model.

Prompts are token-id lists. Each step runs one packed forward holding a token of every
decoding sequence and the prompt chunks of sequences being prefilled (see ``Scheduler``);
each sequence that reaches its last token gets its next token from that step's logits.
A sequence ends on an ``eos_token_id`` (which is kept, as transformers does) or after
``max_new_tokens``; its pages go back to the pool at once, so a waiting request can start.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Iterator, Sequence as Seq

import torch
from torch import nn

from .state import attachment
from .sampling import Sampling, sample
from .scheduler import Limits, Scheduler, Sequence
from .stats import GenerationStats, StepRecord
from .step import forward_step
from .v4 import generate_v4, is_attached as is_v4_attached

_RUNS = itertools.count()  # keeps the cache ids of two runs on one cache apart


@dataclass(frozen=True)
class TokenEvent:
    """One generated token of request ``request`` (its index in ``prompts``)."""

    request: int
    token: int
    finish_reason: str | None  # None while the request runs; "eos" or "length" on its last token
    logits: torch.Tensor | None = None  # [vocab] float32 logits it was chosen from, with return_logits=True


def _check_prompts(prompts: Seq, vocab_size: int, capacity: int, max_new_tokens: int, rope_limit: int | None = None) -> list[list[int]]:
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Seq):
        raise ValueError(f"prompts: expected a list of token-id lists, got {type(prompts).__name__}")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, torch.Tensor):
            if p.dim() != 1 or p.dtype.is_floating_point:
                raise ValueError(f"prompts[{i}]: expected a 1-D integer tensor, got {p.dtype} {tuple(p.shape)}")
            p = p.tolist()
        if isinstance(p, (str, bytes)) or not isinstance(p, Seq) or not all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            raise ValueError(f"prompts[{i}]: expected a list of token ids (ints)")
        if not p:
            raise ValueError(f"prompts[{i}]: is empty")
        lo, hi = min(p), max(p)
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"prompts[{i}]: token id {lo if lo < 0 else hi} is outside the vocabulary [0, {vocab_size})")
        need = len(p) + max_new_tokens - 1  # the last generated token is never fed back
        if need > capacity:
            raise ValueError(f"prompts[{i}]: {len(p)} tokens + max_new_tokens {max_new_tokens} need {need} cache slots, "
                             f"the cache holds {capacity} (num_pages x page_size)")
        if rope_limit is not None and need > rope_limit:
            raise ValueError(f"prompts[{i}]: {len(p)} tokens + max_new_tokens {max_new_tokens} reach position {need - 1}; this "
                             f"model's rope (longrope) is static only below position {rope_limit}, and transformers changes "
                             "every position's frequencies past it")
        out.append(list(p))
    return out


def _eos_set(eos_token_id: int | Seq[int] | None) -> frozenset[int]:
    if eos_token_id is None:
        return frozenset()
    ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ValueError(f"eos_token_id: expected an int, a list of ints or None, got {eos_token_id!r}")
    return frozenset(ids)


def stream(
    model: nn.Module,
    prompts: Seq[Seq[int]],
    max_new_tokens: int,
    *,
    sampling: Sampling | None = None,
    eos_token_id: int | Seq[int] | None = None,
    limits: Limits | None = None,
    stats: GenerationStats | None = None,
    return_logits: bool = False,
) -> Iterator[TokenEvent]:
    """Generate for every prompt at once, yielding each token as soon as its step ends.

    ``model`` must be attached (``openmla.hf.attach``). ``eos_token_id=None`` never stops early
    (pass ``model.generation_config.eos_token_id`` to stop as transformers does). Arguments are
    checked here, before anything runs; a prompt that cannot fit the cache even alone is a
    ``ValueError``. Closing the iterator early releases every page the run holds.
    """
    state = attachment(model)
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected a positive int, got {max_new_tokens!r}")
    sampling = Sampling() if sampling is None else sampling
    limits = Limits() if limits is None else limits
    if not isinstance(sampling, Sampling):
        raise ValueError(f"sampling: expected an openmla.hf.Sampling, got {type(sampling).__name__}")
    if not isinstance(limits, Limits):
        raise ValueError(f"limits: expected an openmla.hf.Limits, got {type(limits).__name__}")
    cache = state.cache
    checked = _check_prompts(prompts, state.vocab_size, cache.num_pages * cache.page_size, max_new_tokens, state.rope.limit)
    state.check_prompts(checked)  # a text-only multimodal model: no media placeholder tokens
    return _run(model, checked, max_new_tokens, sampling, _eos_set(eos_token_id), limits, stats, return_logits)


def _run(model: nn.Module, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling, eos: frozenset[int],
         limits: Limits, stats: GenerationStats | None, return_logits: bool) -> Iterator[TokenEvent]:
    state = attachment(model)
    cache, clock = state.cache, state.clock
    run = next(_RUNS)
    sched = Scheduler(cache, limits, on_release=state.hybrid.states.drop if state.hybrid is not None else None)
    for i, p in enumerate(prompts):
        sched.add(Sequence(i, ("openmla.hf", run, i), p, len(p)))
    generator = sampling.generator(cache.blocks.device)
    clock.on = stats is not None
    clock.take()
    try:
        while not sched.done:
            t0 = time.perf_counter()
            step = sched.schedule()
            pages = cache.pages_in_use
            seqs, rows = step.sampled()
            logits = forward_step(model, step.batch, step.input_ids(), torch.tensor(rows, dtype=torch.long))
            sched.complete(step)
            tokens = sample(logits, sampling, generator).tolist() if seqs else []
            events = []
            for j, (s, tok) in enumerate(zip(seqs, tokens)):
                s.tokens.append(tok)
                reason = "eos" if tok in eos else "length" if s.generated >= max_new_tokens else None
                if reason is not None:
                    sched.finish(s)
                events.append(TokenEvent(s.index, tok, reason, logits[j].float() if return_logits else None))
            if stats is not None:
                stats.steps.append(StepRecord(len(step.seqs), step.num_tokens - step.decode_tokens, step.decode_tokens,
                                              sum(step.batch.cache_lengths_list), pages, time.perf_counter() - t0,
                                              *clock.take()))
                stats.generated_tokens += len(tokens)
                stats.preemptions = sched.preemptions
            yield from events
    finally:
        clock.on = False
        sched.release_all()


def generate(
    model: nn.Module,
    prompts: Seq[Seq[int]],
    max_new_tokens: int,
    *,
    sampling: Sampling | None = None,
    eos_token_id: int | Seq[int] | None = None,
    limits: Limits | None = None,
    stats: GenerationStats | None = None,
) -> list[list[int]]:
    """The generated tokens of every prompt (not the prompt itself), in prompt order.

    See ``stream`` for the arguments; greedy by default (``Sampling(temperature=...)`` samples).
    An attached DeepSeek-V4 model runs ``openmla.hf.v4.generate_v4``: greedy only (a ``sampling``
    that samples, and ``stats``, are refused by name), ``limits.max_running`` sequences at once
    and prefill chunks of at most ``limits.max_batch_tokens`` tokens per sequence.
    """
    if is_v4_attached(model):
        if sampling is not None and sampling.temperature != 0:
            raise ValueError("sampling: a DeepSeek-V4 model generates greedily for now (openmla.hf.v4.generate_v4)")
        if stats is not None:
            raise ValueError("stats: not recorded for DeepSeek-V4 models yet")
        limits = limits or Limits()
        return generate_v4(model, prompts, max_new_tokens, prefill_chunk=limits.max_batch_tokens,
                           max_running=limits.max_running, eos_token_id=eos_token_id)
    out: list[list[int]] = [[] for _ in range(len(prompts))]
    for event in stream(model, prompts, max_new_tokens, sampling=sampling, eos_token_id=eos_token_id, limits=limits, stats=stats):
        out[event.request].append(event.token)
    return out
