"""The backend interface: kernels only.

A backend receives a validated ``MLAPlan`` (the step's metadata, token positions, physical
write rows, chunk plan) and an ``AttentionSpec``; it never validates, never imports ``ops`` or
``plan`` logic or another backend. Outputs may be in any float dtype (the plan casts them).
Rows without a visible key give zeros and LSE = -inf; the LSE is natural-log and leaves the
attention sink out, while ``out`` has the sink applied.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from ..planning import ChunkRows, MLAPlan, MlaConfigV2
    from ..spec import AttentionSpec


class Backend(Protocol):
    """What ``openmla.plan`` drives. A module with these names is a backend.

    Optional: ``absorb(q_rot, w_uk)`` and ``unabsorb(out_lat, w_uv)`` with the contract of
    ``openmla.combine``'s functions of those names (the decode form's query absorption and output
    projection); a plan uses combine's where a backend has none (the native ``cpu`` one has its own).
    """

    name: str
    cache_formats: tuple[str, ...]  # CacheBatch.cache_format values it reads and writes

    def write_cache(self, plan: "MLAPlan", layer_idx: int, q: torch.Tensor, kv: torch.Tensor, freqs_cis: torch.Tensor,
                    kv_norm_gamma: torch.Tensor, epsilon: float, interleaved: bool) -> torch.Tensor:
        """Store RMSNorm(kv[:, :L]) * gamma and RoPE(kv[:, L:]) at ``plan.write_rows`` of layer
        ``layer_idx``; return q ``[T, H, Dn+R]`` with its rope part rotated at ``plan.token_pos``."""
        ...

    def decode(self, plan: "MLAPlan", layer_idx: int, q_abs: torch.Tensor, spec: "AttentionSpec",
               kv_lora_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Absorbed attention ``q_abs [T, H, L+R]`` over the cache -> ``out [T, H, L]``, ``lse [T, H]``
        (dense or ``spec.sparse``; split-KV by ``plan.num_partitions``)."""
        ...

    def prefill(self, plan: "MLAPlan", layer_idx: int, q_rot: torch.Tensor, w_k: torch.Tensor, w_uv: torch.Tensor,
                spec: "AttentionSpec") -> tuple[torch.Tensor, torch.Tensor]:
        """Dense up-projected attention ``q_rot [T, H, Dn+R]`` -> ``out [T, H, Dv]``, ``lse [T, H]``,
        chunked by ``plan.chunks(buffer_size)`` (``spec.sparse`` is always None here: the plan
        routes sparse prefill through ``decode``)."""
        ...

    def flare_mla_prefill(self, plan: "MLAPlan", layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          chunk: "ChunkRows", spec: "AttentionSpec", tile: "MlaConfigV2 | None") -> tuple[torch.Tensor, torch.Tensor]:
        """One chunk with given up-projected ``k [S, H, Dn]``, ``v [S, H, Dv]``; LSE over its keys."""
        ...
