"""The main job: one DeepSeek-shaped attention layer serving a stream of requests.

Continuous batching on the paged latent cache: requests arrive with prompts of varied
lengths, are admitted while the page pool and the batch limit allow, prefilled as one
ragged batch, then decoded one token per step together with every running request;
finished requests free their pages for the next ones. There is no model around the
layer, so hidden states are random; the attention work, cache traffic and scheduling
are the real thing.
"""

from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from openmla.cache import CacheBatch, CacheFullError, PagedLatentCache
from openmla.config import MLAConfig
from .flops import fused_op_flops, projection_flops
from openmla.layer import LatentAttention
from openmla.ops import DECODE_MAX_Q_LEN
from .timing import matmul_rate


@dataclass
class Request:
    rid: int
    prompt_len: int
    gen_len: int
    generated: int = 0


@dataclass
class PhaseStats:
    tokens: int = 0
    seconds: float = 0.0
    flops: int = 0
    steps: int = 0
    bytes_sent: int = 0  # by this rank, over torch.distributed (0 in one process)
    bytes_moved: int = 0  # the least memory traffic of its steps: cache rows read and written, the layer's weights

    def add(self, tokens: int, seconds: float, flops: int, bytes_sent: int = 0, bytes_moved: int = 0) -> None:
        self.tokens += tokens
        self.seconds += seconds
        self.flops += flops
        self.steps += 1
        self.bytes_sent += bytes_sent
        self.bytes_moved += bytes_moved

    def roofline(self, flops_per_s: float, bytes_per_s: float) -> tuple[float, str]:
        """(fraction of the roofline, which bound): the roofline time is the larger of the
        phase's FLOPs at the matmul rate and its bytes at the copy bandwidth, both of this run."""
        if not self.seconds or flops_per_s <= 0 or bytes_per_s <= 0:
            return 0.0, "-"
        t_flops, t_bytes = self.flops / flops_per_s, self.bytes_moved / bytes_per_s
        return max(t_flops, t_bytes) / self.seconds, "compute" if t_flops >= t_bytes else "memory"

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def flops_per_s(self) -> float:
        return self.flops / self.seconds if self.seconds else 0.0


@dataclass
class DemoReport:
    config: MLAConfig
    backend: str
    dtype: torch.dtype
    matmul_flops_per_s: float
    copy_bytes_per_s: float = 0.0  # bytes read + written per second by a large copy, this run
    prefill: PhaseStats = field(default_factory=PhaseStats)
    decode: PhaseStats = field(default_factory=PhaseStats)
    requests: int = 0
    peak_pages: int = 0
    pages_in_use_at_end: int = 0
    num_pages: int = 0
    page_size: int = 0
    cache_format: str = "native"
    bytes_per_token: int = 0
    check_error: float | None = None
    check_what: str = ""
    wall_seconds: float = 0.0
    storage_bytes: int = 0  # this process's page pool


def copy_bandwidth(mib: int = 64, repeats: int = 3) -> float:
    """Bytes read plus written per second by a ``mib`` MiB tensor copy (median of ``repeats``):
    the memory side of the roofline, measured in the same run as the matmul rate."""
    src = torch.ones(mib << 18)  # float32: mib MiB
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return 2 * src.numel() * 4 / sorted(times)[len(times) // 2]


@torch.inference_mode()
def _reference_check(layer: LatentAttention, hidden: torch.Tensor, batch: CacheBatch, layer_out: torch.Tensor) -> float:
    """Re-run one step with the float64 reference backend on a copy of the cache; relative error."""
    # The step already wrote its tokens; writing them again from the same input is idempotent.
    copy = batch.with_blocks(batch.blocks.clone())
    saved = layer.backend
    layer.backend = "reference"
    try:
        want = layer(hidden, copy).double()
    finally:
        layer.backend = saved
    got = layer_out.double()
    if torch.isnan(got).any():
        return float("inf")
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def run_demo(
    config: MLAConfig,
    *,
    num_requests: int = 24,
    max_running: int = 8,
    prompt_range: tuple[int, int] = (64, 768),
    gen_range: tuple[int, int] = (8, 48),
    page_size: int = 64,
    num_pages: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    cache_dtype: torch.dtype | str | None = None,
    backend: str | None = None,
    seed: int = 0,
    check: bool = True,
    on_step: Callable[[str, int, int], None] | None = None,
    grid=None,
    interleave: int | None = None,
) -> DemoReport:
    """Serve ``num_requests`` requests; ``on_step(kind, finished, running)`` reports progress.

    With a ``grid`` (``openmla.distributed.init_grid``; every rank runs this with the same
    arguments) the layer's heads are split over its TP ranks and the cache over its CP ranks
    (tokens in runs of ``interleave``); ``num_pages`` is then the whole grid's budget."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    max_position = prompt_range[1] + gen_range[1] + 1
    if grid is None:
        layer = LatentAttention(config, 0, dtype=dtype, backend=backend, max_position=max_position)
        layer.randomize_(seed)
    else:
        from .distributed.demo import sharded_layer

        layer = sharded_layer(config, grid, seed, dtype=dtype, backend=backend, max_position=max_position)
    longest = prompt_range[1] + gen_range[1]
    if num_pages is None:
        # Room for about half the batch limit at full length: admission control has work to do.
        num_pages = max(-(-longest // page_size) * max(2, max_running // 2 + 1), -(-longest // page_size) + 1)
    if grid is None:
        cache = PagedLatentCache(1, num_pages, page_size, config.cache_head_dim, cache_dtype or dtype, rope_dim=config.qk_rope_head_dim)
    else:
        from .distributed.demo import sharded_cache

        cache = sharded_cache(grid, config, num_pages, page_size, cache_dtype or dtype, max_running, interleave)
    waiting = deque(Request(i, rng.randint(*prompt_range), rng.randint(*gen_range)) for i in range(num_requests))
    running: dict[int, Request] = {}
    from openmla.backends import resolve_backend_name

    report = DemoReport(config, resolve_backend_name(backend, torch.device("cpu")), dtype, matmul_rate(dtype=dtype),
                        copy_bytes_per_s=copy_bandwidth(), num_pages=cache.num_pages, page_size=page_size, requests=num_requests,
                        cache_format=cache.cache_format,
                        bytes_per_token=cache.bytes_per_token, storage_bytes=cache.blocks.numel() * cache.blocks.element_size())
    hidden_std = 1.0
    weight_bytes = sum(p.numel() * p.element_size() for p in layer.parameters())

    def bytes_moved(cache_lens: list[int], counts: list[int]) -> int:
        """The step's least memory traffic: every visible cache row read once, the new rows
        written, the weights read once (activations left out)."""
        return (sum(cache_lens) + 2 * sum(counts)) * cache.bytes_per_token + weight_bytes

    t_start = time.perf_counter()
    finished = 0

    def step(ids: list[int], counts: list[int]) -> tuple[CacheBatch, torch.Tensor, torch.Tensor, float, int]:
        batch = cache.prepare(ids, counts)
        hidden = torch.randn(sum(counts), config.hidden_size, dtype=dtype) * hidden_std
        sent = grid.stats.bytes_sent if grid is not None else 0
        t0 = time.perf_counter()
        with torch.inference_mode():
            if grid is None:  # plan here, to report the backend that ran (a declined one falls back)
                plan = layer.plan(batch)
                report.backend = plan.backend_name if plan.fallback_reason is None else f"{plan.backend_name} ({plan.fallback_reason})"
                out = layer(hidden, plan)
            else:
                out = layer(hidden, batch)
        dt = time.perf_counter() - t0
        sent = grid.stats.bytes_sent - sent if grid is not None else 0
        report.peak_pages = max(report.peak_pages, cache.pages_in_use)
        return batch, hidden, out, dt, sent

    while waiting or running:
        # Admit as many waiting requests as the batch limit and the page pool allow.
        admit: list[Request] = []
        while waiting and len(running) + len(admit) < max_running:
            cand = waiting[0]
            need = -(-(cand.prompt_len + cand.gen_len) // page_size)  # reserve for its whole life
            reserved = sum(-(-(r.prompt_len + r.gen_len) // page_size) for r in list(running.values()) + admit)
            if reserved + need > num_pages:
                break
            admit.append(waiting.popleft())
        if admit:
            ids, counts = [r.rid for r in admit], [r.prompt_len for r in admit]
            batch, hidden, out, dt, sent = step(ids, counts)
            decode_form = max(counts) <= DECODE_MAX_Q_LEN
            flops = fused_op_flops(config, [0] * len(ids), counts, decode_form) + projection_flops(config, sum(counts))
            report.prefill.add(sum(counts), dt, flops, sent, bytes_moved([0] * len(ids), counts))
            cache.commit(batch)
            for r in admit:
                r.generated = 1  # the prefill step yields the first token
                running[r.rid] = r
            if on_step:
                on_step("prefill", finished, len(running))
        if not running:
            if waiting:
                raise CacheFullError(f"request {waiting[0].rid} needs more pages than the pool has ({num_pages})")
            break
        ids = list(running)
        cache_lens = [cache.length(i) for i in ids]
        batch, hidden, out, dt, sent = step(ids, [1] * len(ids))
        flops = fused_op_flops(config, cache_lens, [1] * len(ids), True) + projection_flops(config, len(ids))
        report.decode.add(len(ids), dt, flops, sent, bytes_moved(cache_lens, [1] * len(ids)))
        if check and report.check_error is None and len(ids) >= 2:
            report.check_error = _reference_check(layer, hidden, batch, out)
            report.check_what = f"decode step of {len(ids)} sequences ({sum(cache_lens)} cached tokens)"
        cache.commit(batch)
        for rid in ids:
            r = running[rid]
            r.generated += 1
            if r.generated >= r.gen_len:
                cache.release(rid)
                del running[rid]
                finished += 1
        if on_step:
            on_step("decode", finished, len(running))
    report.pages_in_use_at_end = cache.pages_in_use
    report.wall_seconds = time.perf_counter() - t_start
    return report
