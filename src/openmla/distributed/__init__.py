"""Scale-out over ``torch.distributed``: tensor-parallel heads and a context-parallel latent cache.

- ``init_grid(tp, cp)``: this rank's ``Grid`` of ``tp x cp`` process groups (starts the default
  group from ``torchrun``'s environment when needed, with a collective timeout).
- ``TensorParallelAttention``: a ``LatentAttention`` holding ``H / tp`` heads of a checkpoint
  layer; its output is all-reduced over the TP group.
- ``ContextParallelCache``: a latent cache whose tokens are spread over the CP group (per-rank
  memory ~1/cp); ``plan(batch, scale=...)`` makes a step's plan, which attends over each rank's
  keys and merges the parts by LSE.
- ``agree``: error agreement, so a bad input on one rank raises on every rank, never a hang.

Only openmla's public API is used underneath (``openmla.plan``, ``PagedLatentCache``,
``LatentAttention``, ``openmla.combine``), so every backend works. Data parallelism needs
nothing from here: one cache and one scheduler per rank.

    grid = init_grid(tp=2, cp=2)                 # under torchrun --nproc-per-node 4
    layer = TensorParallelAttention.from_pretrained(folder, layer_idx=3, grid=grid)
    cache = ContextParallelCache(grid, num_layers=1, num_pages=1024)
    batch = cache.prepare(["a", "b"], [300, 1])  # the same calls on every rank
    step = plan(batch, scale=layer.config.softmax_scale)  # openmla.distributed.plan
    y = layer(hidden, step)                      # hidden: the same [T, hidden] on every rank
    cache.commit(batch)
"""

from .cp import ContextParallelBatch, ContextParallelCache
from .cp_plan import ContextParallelPlan, merge_over_cp, plan
from .groups import DEFAULT_TIMEOUT, CommStats, Grid, agree, init_grid, launched_by_torchrun
from .layout import TokenLayout
from .tp import TensorParallelAttention

__all__ = [
    "ContextParallelBatch", "ContextParallelCache", "ContextParallelPlan", "merge_over_cp", "plan",
    "DEFAULT_TIMEOUT", "CommStats", "Grid", "agree", "init_grid", "launched_by_torchrun",
    "TokenLayout", "TensorParallelAttention",
]
