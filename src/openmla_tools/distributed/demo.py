"""``openmla demo --tp N --cp M`` under ``torchrun``: the demo's layer and cache over a grid.

Every rank runs the same request stream (same seed, same scheduler); the layer holds H/tp
heads, the cache 1/cp of the tokens. Rank 0 prints the usual table, then one row per rank:
its cache memory and the bytes it sent per step.
"""

from __future__ import annotations

import argparse
import datetime

import torch.distributed as dist

from openmla.config import MLAConfig
from openmla.layer import LatentAttention
from openmla.distributed.cp import ContextParallelCache
from openmla.distributed.groups import Grid, init_grid, launched_by_torchrun
from openmla.distributed.tp import TensorParallelAttention


def demo_grid(args: argparse.Namespace, console) -> Grid | None:
    """The demo's grid from ``--tp``/``--cp`` (None for one process). Ranks other than 0 stay quiet."""
    if args.tp * args.cp == 1 and not launched_by_torchrun():
        return None
    if args.heads % args.tp:
        raise ValueError(f"--tp: {args.tp} must divide --heads {args.heads}")
    grid = init_grid(args.tp, args.cp, timeout=datetime.timedelta(seconds=args.timeout))
    if grid.rank != 0:
        console.quiet = True
    return grid


def sharded_layer(config: MLAConfig, grid: Grid, seed: int, **kwargs) -> TensorParallelAttention:
    """This rank's heads of the demo's layer: the one-process demo's weights, split by head."""
    whole = LatentAttention(config, 0, **kwargs)
    whole.randomize_(seed)
    layer = TensorParallelAttention(config, 0, grid=grid, **kwargs)
    layer.load_hf_state_dict(whole.state_dict())
    return layer


def sharded_cache(grid: Grid, config: MLAConfig, num_pages: int, page_size: int, dtype, max_running: int,
                  interleave: int | None) -> ContextParallelCache:
    """This rank's cache for a grid-wide budget of ``num_pages``: its 1/cp share, plus one
    partly filled page per running sequence (a rank's share of a sequence rounds up)."""
    pages = -(-num_pages // grid.cp) + (max_running if grid.cp > 1 else 0)
    return ContextParallelCache(grid, 1, pages, page_size, config.cache_head_dim, dtype, rope_dim=config.qk_rope_head_dim,
                                interleave=interleave)


def print_ranks(grid: Grid, report, console) -> None:
    """Rank 0 prints one row per rank (a collective: every rank calls it)."""
    from rich.table import Table

    page_bytes = report.page_size * report.bytes_per_token
    mine = {"rank": grid.rank, "tp": grid.tp_rank, "cp": grid.cp_rank, "pool": report.storage_bytes,
            "peak": report.peak_pages * page_bytes,
            "prefill": report.prefill.bytes_sent / max(report.prefill.steps, 1),
            "decode": report.decode.bytes_sent / max(report.decode.steps, 1)}
    rows: list = [None] * grid.size
    dist.all_gather_object(rows, mine, group=grid.group)
    table = Table(title=f"per rank — tp={grid.tp} x cp={grid.cp} (gloo/NCCL ring bytes; cache bytes per layer)")
    for col in ("rank", "tp rank", "cp rank", "cache bytes (pool)", "cache bytes (peak use)", "bytes sent per step: prefill", "decode"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["rank"]), str(r["tp"]), str(r["cp"]), f"{r['pool']:,}", f"{r['peak']:,}", f"{r['prefill']:,.0f}",
                      f"{r['decode']:,.0f}")
    console.print(table)
