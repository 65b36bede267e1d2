"""The backend interface: kernels, and what they can run.

A backend receives a validated ``MLAPlan`` (the step's metadata, token positions, physical
write rows, chunk plan) and an ``AttentionSpec``; it never validates user input, never imports
``ops``, the plan's logic or another backend. ``openmla.plan`` picks the backend once per step
(``supports``; a backend that declines names its ``fallback``) and records it on the plan.

Results: rows without a visible key give zeros and LSE = -inf; the LSE is natural-log and leaves
the attention sink out, while ``out`` has the sink applied. Outputs are in ``result_dtypes``;
the plan casts them to the caller's dtype (one rule for eager and compiled calls).

A new backend is one subclass in one folder and one line in ``openmla.backends.REGISTRY``
(docs/backends.md walks through it). ``Backend`` is the MLA kernels (cache write, decode, prefill,
absorb / unabsorb, the write of given entries at given rows). Two protocols beside it, each a
backend may implement and is registered for by name: V4's shared-KV attention
(``SharedKVKernels``) and MAX's one-chunk prefill with given keys (``ChunkPrefillKernels``, which
only ``openmla.compat.max.flare_mla_prefill`` / ``mla_prefill_v2_ragged`` reach).
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, ClassVar, Literal, Protocol

import torch

from .. import combine
from ..formats import CACHE_FORMATS

if TYPE_CHECKING:
    from ..cache import CacheBatch
    from ..formats import CacheFormat
    from ..chunks import ChunkPlan, ChunkRows, MlaConfigV2
    from ..spec import AttentionSpec

# Every cache format: what a backend that reads and writes the cache only through the format
# objects (openmla.formats; CacheBatch.read_rows / read_pages / write_rows, which (de)quantise) declares.
ALL_FORMATS = CACHE_FORMATS
# What a backend reads unless it declares otherwise: the formats every kernel in the tree reads
# natively. A backend with kernels of its own lists what they read; the NVFP4 record formats
# (openmla.nvfp4) are opted into, never inherited, so no kernel meets a record it does not know.
FP8_FORMATS = ("native", "fp8_e4m3", "fp8_ds_mla")


class PlanView(Protocol):
    """What a backend reads of a plan (``openmla.MLAPlan`` is one); all read-only."""

    batch: "CacheBatch"  # the step over private, validated int32 metadata; host lists filled
    spec: "AttentionSpec"  # scale, mask, sparse top-k, sink
    device: torch.device
    num_tokens: int
    token_seq: torch.Tensor  # int64 [T]: each new token's sequence
    token_pos: torch.Tensor  # int64 [T]: its position
    write_rows: torch.Tensor  # int64 [T]: its physical cache row
    num_partitions: int | None  # split-KV of the decode form (None: the backend picks)
    buffer_size: int | None  # key rows per prefill chunk (None: the backend picks)
    max_position: int  # the longest sequence of the step (cached + new)

    def chunks(self, buffer_size: int) -> "ChunkPlan":
        """The prefill chunk plan for ``buffer_size`` rows per chunk (made once per plan)."""
        ...


class Backend:
    """Subclass, set ``name``, and implement the four kernels; override the rest as needed."""

    name: ClassVar[str]
    cache_formats: ClassVar[tuple[str, ...]] = FP8_FORMATS  # CacheBatch.cache_format values it reads and writes
    fallback: ClassVar[str | None] = None  # the backend plan() runs instead when supports() declines

    @classmethod
    def unavailable(cls) -> str | None:
        """Why this backend cannot run in this process (None: it can); asked at every load."""
        return None

    def supports(self, plan: "PlanView") -> Literal[True] | str:
        """True when this backend runs ``plan``'s step, else the reason it does not (checked once, in ``plan()``)."""
        if plan.batch.cache_format not in self.cache_formats:
            return f"it cannot read a {plan.batch.cache_format} cache"
        return True

    def result_dtypes(self, dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
        """(output dtype, LSE dtype) of the kernels for inputs of ``dtype``."""
        return dtype, torch.float32

    # The kernels ----------------------------------------------------------------------------
    def write_cache(self, plan: "PlanView", layer_idx: int, q: torch.Tensor, kv: torch.Tensor, freqs_cis: torch.Tensor,
                    kv_norm_gamma: torch.Tensor, epsilon: float, interleaved: bool) -> torch.Tensor:
        """Store RMSNorm(kv[:, :L]) * gamma and RoPE(kv[:, L:]) at ``plan.write_rows`` of layer
        ``layer_idx``; return q ``[T, H, Dn+R]`` with its rope part rotated at ``plan.token_pos``."""
        raise NotImplementedError(f"the {self.name} backend does not implement the write_cache kernel")

    def decode(self, plan: "PlanView", layer_idx: int, q_abs: torch.Tensor, spec: "AttentionSpec",
               kv_lora_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Absorbed attention ``q_abs [T, H, L+R]`` over the cache -> ``out [T, H, L]``, ``lse [T, H]``
        (dense or ``spec.sparse``; split-KV by ``plan.num_partitions``)."""
        raise NotImplementedError(f"the {self.name} backend does not implement the decode kernel")

    def prefill(self, plan: "PlanView", layer_idx: int, q_rot: torch.Tensor, w_k: torch.Tensor, w_uv: torch.Tensor,
                spec: "AttentionSpec") -> tuple[torch.Tensor, torch.Tensor]:
        """Dense up-projected attention ``q_rot [T, H, Dn+R]`` -> ``out [T, H, Dv]``, ``lse [T, H]``,
        chunked by ``plan.chunks(buffer_size)`` (``spec.sparse`` is always None here: the plan
        routes sparse prefill through ``decode``)."""
        raise NotImplementedError(f"the {self.name} backend does not implement the prefill kernel")

    def write_rows(self, fmt: "CacheFormat", layer: torch.Tensor, rows: torch.Tensor, entries: torch.Tensor,
                   kv_lora_rank: int, scale: torch.Tensor | None) -> None:
        """Store given ``entries [n, L+R]`` at physical ``rows`` (a negative row is skipped) of one
        layer's storage ``layer [num_pages, page_size, W]`` in format ``fmt`` (``scale``: the layer's,
        for a scaled format). Default: the format object's write (torch ops; a negative row costs
        one host read of the rows)."""
        keep = rows >= 0
        if not bool(keep.all()):
            rows, entries = rows[keep], entries[keep]
        fmt.write(layer, rows, entries, kv_lora_rank, scale)

    # Around the decode form (defaults: openmla.combine's unfused definitions) ---------------
    def absorb(self, q_rot: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
        """``q_rot [T, H, Dn+R]``, ``w_uk [H, L, Dn]`` -> ``q_abs [T, H, L+R]``."""
        return combine.absorb(q_rot, w_uk)

    def unabsorb(self, out_lat: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
        """``out_lat [T, H, L]``, ``w_uv [H, Dv, L]`` -> ``[T, H, Dv]``."""
        return combine.unabsorb(out_lat, w_uv)

    def __repr__(self) -> str:
        return f"<openmla backend {self.name!r}>"


class ChunkPrefillKernels(abc.ABC):
    """MAX's one-chunk prefill with given up-projected keys, beside ``Backend``'s MLA kernels (only
    ``openmla.compat.max``'s ``flare_mla_prefill`` / ``mla_prefill_v2_ragged`` run it): a backend
    that has the kernel implements ``flare_mla_prefill`` and is registered for it
    (``openmla.backends.CHUNK_PREFILL``: ``load_backend`` registers each listed backend's class, so
    ``isinstance(backend, ChunkPrefillKernels)`` says whether it has it). ``openmla.dispatch.chunk_prefill``
    runs it, and raises ``NotImplementedError`` for a plan whose backend has not."""

    @abc.abstractmethod
    def flare_mla_prefill(self, plan: "PlanView", layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          chunk: "ChunkRows", spec: "AttentionSpec", tile: "MlaConfigV2 | None") -> tuple[torch.Tensor, torch.Tensor]:
        """One chunk with given up-projected ``k [S, H, Dn]``, ``v [S, H, Dv]`` (their rope part read
        from the cache) -> ``out [T, H, Dv]``, ``lse [T, H]`` over its keys (no sink)."""


class SharedKVKernels(abc.ABC):
    """The shared-KV (DeepSeek-V4) protocol, beside ``Backend``'s MLA kernels: a backend that runs
    V4 attention (entry = key = value, sliding window + compressed keys, sinks) implements these
    two methods and is registered for it (``openmla.backends.SHARED_KV``: ``load_backend``
    registers each listed backend's class, so ``isinstance(backend, SharedKVKernels)`` says
    whether it has the kernel). ``openmla.v4.plan_shared_kv`` asks ``supports_shared_kv`` once;
    the step runs through ``openmla.dispatch.shared_kv``."""

    @abc.abstractmethod
    def supports_shared_kv(self, plan) -> Literal[True] | str:
        """True when this backend runs a V4 attention step (``openmla.v4.SharedKVPlan``), else why not."""

    @abc.abstractmethod
    def shared_kv_attention(self, plan, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``q [T, H, D]`` over ``plan``'s raw window and compressed entries -> ``out [T, H, D]``, ``lse [T, H]``."""
