"""Tensor parallelism: a ``LatentAttention`` holding ``H / tp`` heads of one checkpoint layer.

TP rank ``r`` holds heads ``[r H/tp, (r+1) H/tp)``: the rows of ``q_b_proj`` (or ``q_proj``)
and ``kv_b_proj`` of those heads (column parallel) and the columns of ``o_proj`` that read them
(row parallel: each rank's ``o_proj`` output is a partial sum, all-reduced over the TP group).
``q_a_proj``, ``q_a_layernorm``, ``kv_a_proj_with_mqa`` and ``kv_a_layernorm`` are replicated,
and so is the latent cache (every TP rank writes the same entries): MLA's one KV head cannot be
split by heads, which is why context parallelism exists. The softmax scale does not depend on H.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Mapping

import torch

from ..cache import CacheBatch
from ..config import MLAConfig
from ..layer import LatentAttention, dequant_block_fp8, read_layer_tensors
from ..planning import Step
from . import cp_plan
from .cp import ContextParallelBatch
from .groups import Grid

_DEFAULT_FP8_BLOCK = (128, 128)  # DeepSeek-V3 / Kimi-K2 ``weight_block_size``
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _shard_dims(config: MLAConfig) -> dict[str, tuple[int, int]]:
    """``{module: (dim, width per head)}`` of the tensors split by head."""
    c = config
    return {"q_proj": (0, c.qk_head_dim), "q_b_proj": (0, c.qk_head_dim), "kv_b_proj": (0, c.qk_nope_head_dim + c.v_head_dim),
            "o_proj": (1, c.v_head_dim)}


def _tp_coords(grid: Grid | None, tp_rank: int | None, tp_size: int | None) -> tuple[int, int]:
    if grid is not None:
        if not isinstance(grid, Grid):
            raise ValueError(f"grid: expected a Grid (openmla.distributed.init_grid), got {type(grid).__name__}")
        if (tp_rank is not None and tp_rank != grid.tp_rank) or (tp_size is not None and tp_size != grid.tp):
            raise ValueError(f"tp_rank, tp_size: ({tp_rank}, {tp_size}) disagree with the grid's ({grid.tp_rank}, {grid.tp})")
        return grid.tp_rank, grid.tp
    tp_rank, tp_size = 0 if tp_rank is None else tp_rank, 1 if tp_size is None else tp_size
    for name, value, least in (("tp_size", tp_size, 1), ("tp_rank", tp_rank, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name}: expected an int >= {least}, got {value!r}")
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank: must lie in [0, {tp_size}), got {tp_rank}")
    return tp_rank, tp_size


class TensorParallelAttention(LatentAttention):
    """Heads ``[tp_rank H/tp, (tp_rank+1) H/tp)`` of one MLA layer of ``config`` (the whole model's
    config, all H heads); ``tp_size`` must divide H. Give ``grid`` (from ``init_grid``) to run
    it; ``tp_rank`` / ``tp_size`` alone build and load a shard without any process group.

    ``forward(hidden [T, hidden], step)`` returns the full ``[T, hidden]`` output on every rank of
    the TP group (all-reduced). ``step``: an ``MLAPlan`` or ``CacheBatch`` of this rank's cache, or
    a ``ContextParallelPlan`` / ``ContextParallelBatch`` of a ``ContextParallelCache`` of the same
    grid. A plan's attention sink may cover all H heads (each rank takes its own) or this rank's.
    The parameters and ``w_k``/``w_uk``/``w_uv`` are this rank's shard; ``load_hf_state_dict`` and
    ``from_pretrained`` take the whole layer's tensors and keep this rank's rows.
    """

    def __init__(
        self,
        config: MLAConfig,
        layer_idx: int,
        *,
        grid: Grid | None = None,
        tp_rank: int | None = None,
        tp_size: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
        backend: str | None = None,
        max_position: int | None = None,
    ) -> None:
        tp_rank, tp_size = _tp_coords(grid, tp_rank, tp_size)
        if config.num_heads % tp_size:
            raise ValueError(f"tp_size: {tp_size} must divide the layer's {config.num_heads} heads")
        super().__init__(config.with_heads(config.num_heads // tp_size), layer_idx, dtype=dtype, device=device,
                         backend=backend, max_position=max_position)
        self.model_config = config
        self.grid = grid
        self.tp_rank, self.tp_size = tp_rank, tp_size

    @property
    def heads(self) -> slice:
        """This rank's heads among the model's H."""
        n = self.config.num_heads
        return slice(self.tp_rank * n, (self.tp_rank + 1) * n)

    def _bounds(self, key: str) -> tuple[int, int, int] | None:
        """``(dim, lo, hi)`` of this rank's part of ``key`` (a weight or its fp8 scale), or None
        when the tensor is replicated or belongs to another layer."""
        m = _LAYER.search(key)
        if m is not None and int(m.group(1)) != self.layer_idx:
            return None
        parts = key.split(".")
        if len(parts) < 2 or parts[-1] not in ("weight", "weight_scale_inv"):
            return None
        rule = _shard_dims(self.model_config).get(parts[-2])
        if rule is None:
            return None
        dim, width = rule
        n = self.config.num_heads * width
        return dim, self.tp_rank * n, (self.tp_rank + 1) * n

    @torch.no_grad()
    def load_hf_state_dict(
        self,
        state_dict: Mapping[str, torch.Tensor],
        strict: bool = True,
        *,
        fp8_block_size: tuple[int, int] = _DEFAULT_FP8_BLOCK,
    ) -> list[str]:
        """``LatentAttention.load_hf_state_dict`` from the whole layer's tensors (all H heads, bare
        or full keys): keeps this rank's rows of the head-split tensors (block-fp8 ones are
        dequantised first)."""
        shard: dict[str, Any] = {}
        for key, t in state_dict.items():
            bounds = self._bounds(key)
            if bounds is None or not isinstance(t, torch.Tensor):
                shard[key] = t
            elif not key.endswith("_scale_inv"):
                scale = state_dict.get(key + "_scale_inv")
                if scale is not None:
                    t = dequant_block_fp8(t, scale, fp8_block_size)
                dim, lo, hi = bounds
                if t.dim() != 2 or t.shape[dim] < hi:
                    raise ValueError(f"state_dict: {key!r} has shape {tuple(t.shape)}; its heads {self.heads} need "
                                     f"{hi} along dim {dim} (the whole layer's tensor)")
                shard[key] = t.narrow(dim, lo, hi - lo)
        return super().load_hf_state_dict(shard, strict, fp8_block_size=fp8_block_size)

    @classmethod
    def from_pretrained(  # type: ignore[override]
        cls,
        folder: str | os.PathLike,
        layer_idx: int,
        *,
        grid: Grid | None = None,
        tp_rank: int | None = None,
        tp_size: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
        backend: str | None = None,
        max_position: int | None = None,
    ) -> "TensorParallelAttention":
        """This rank's shard of layer ``layer_idx`` of a Hugging Face checkpoint folder: reads only
        this rank's rows of the head-split tensors (``safetensors`` slices; block-fp8 ones by
        whole blocks, dequantised, then trimmed) and the replicated tensors whole."""
        folder = os.fspath(folder)
        path = os.path.join(folder, "config.json")
        if not os.path.isfile(path):
            raise ValueError(f"folder: {path!r} not found")
        with open(path, encoding="utf-8") as f:
            hf_cfg = json.load(f)
        block = tuple((hf_cfg.get("quantization_config") or {}).get("weight_block_size") or _DEFAULT_FP8_BLOCK)
        layer = cls(MLAConfig.from_hf(hf_cfg), layer_idx, grid=grid, tp_rank=tp_rank, tp_size=tp_size, dtype=dtype,
                    device=device, backend=backend, max_position=max_position)
        trims: dict[str, tuple[int, int, int]] = {}  # fp8 weight key -> (dim, offset in the read rows, rows kept)

        def read(key: str, handle: Any) -> torch.Tensor:
            bounds = layer._bounds(key)
            if bounds is None:
                return handle.get_tensor(key)
            dim, lo, hi = bounds
            part = handle.get_slice(key)
            b = block[dim]
            if key.endswith("_scale_inv"):
                lo, hi = lo // b, -(-hi // b)
            elif part.get_dtype().startswith("F8"):  # whole fp8 blocks: their scales apply as stored
                full = part.get_shape()[dim]
                trims[key] = (dim, lo - lo // b * b, hi - lo)
                lo, hi = lo // b * b, min(full, -(-hi // b) * b)
            return part[lo:hi] if dim == 0 else part[:, lo:hi]

        tensors = read_layer_tensors(folder, layer_idx, read)
        for key, (dim, offset, n) in trims.items():
            scale = tensors.pop(key + "_scale_inv", None)
            if scale is None:
                raise ValueError(f"folder: {key!r} is float8 without a weight_scale_inv")
            tensors[key] = dequant_block_fp8(tensors[key], scale, block).narrow(dim, offset, n)
        LatentAttention.load_hf_state_dict(layer, tensors, strict=True, fp8_block_size=block)  # already this rank's rows
        return layer

    # Forward ---------------------------------------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor, step: Any, **plan_options: Any) -> torch.Tensor:
        """``hidden_states [T, hidden]`` (the same on every rank of the grid) -> ``[T, hidden]``,
        all-reduced over the TP group. ``step``: see the class doc; a batch plans here with
        ``plan_options`` (every rank of the grid must call this together)."""
        c = self.config
        if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 2 or hidden_states.shape[1] != c.hidden_size:
            shape = tuple(hidden_states.shape) if isinstance(hidden_states, torch.Tensor) else type(hidden_states).__name__
            raise ValueError(f"hidden_states: expected shape (T, {c.hidden_size}), got {shape}")
        if self.tp_size > 1 and self.grid is None:
            raise ValueError("grid: a shard of a tensor-parallel layer needs its grid to all-reduce (TensorParallelAttention(grid=...))")
        if isinstance(step, ContextParallelBatch):
            step = cp_plan.plan(step, scale=c.softmax_scale, **{"backend": self.backend, **plan_options})
        elif isinstance(step, CacheBatch):
            step = self.plan(step, **plan_options)
        elif not isinstance(step, Step):
            raise ValueError(f"step: expected a plan or a batch, got {type(step).__name__}")
        elif plan_options:
            raise ValueError(f"plan_options: {sorted(plan_options)} belong to the plan, not to a layer call")
        elif step.spec.scale != c.softmax_scale:
            raise ValueError(f"step: planned with scale {step.spec.scale}, this layer's config needs {c.softmax_scale}")
        if getattr(step, "grid", self.grid) is not self.grid:
            raise ValueError("step: planned on another grid than this layer's")
        T = hidden_states.shape[0]
        if T != step.num_tokens:
            raise ValueError(f"hidden_states: {T} rows, the step has {step.num_tokens} new tokens")
        q = self.project_q(hidden_states)
        rows = step.kv_rows  # under context parallelism only the rows this rank stores need their kv
        kv = self.kv_a_proj_with_mqa(hidden_states if rows is None else hidden_states.index_select(0, rows.to(hidden_states.device)))
        sink = step.spec.attn_sink
        own_sink = None
        if sink is not None and sink.shape[-1] == self.model_config.num_heads != c.num_heads:
            own_sink = sink[..., self.heads].contiguous()
        out = step.run(q, kv, self.layer_idx, self.weights, self._freqs_for(step, hidden_states.device), attn_sink=own_sink)
        y = self.o_proj(out.reshape(T, c.num_heads * c.v_head_dim).to(self.o_proj.weight.dtype))
        return y if self.grid is None else self.grid.tp_all_reduce(y)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, tp_rank={self.tp_rank}, tp_size={self.tp_size}, of {self.model_config.num_heads} heads"

