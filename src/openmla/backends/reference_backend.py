"""The ``reference`` backend: ``openmla.reference`` (float64, per token) behind ``base.Backend``.

Chunking (``buffer_size``) and split-KV (``num_partitions``) change only how a fast path
schedules the work, never the result, so the oracle ignores them. Absorption and the output
projection are its own float64 versions too, so a reference run is float64 end to end.
"""

from __future__ import annotations

import torch

from .. import reference as ref
from .base import ALL_FORMATS, Backend

F64 = torch.float64


class ReferenceBackend(Backend):
    name = "reference"
    cache_formats = ALL_FORMATS  # every format: the oracle reads what the cache stores through CacheBatch

    def result_dtypes(self, dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
        return F64, F64

    def write_cache(self, plan, layer_idx, q, kv, freqs_cis, kv_norm_gamma, epsilon, interleaved):
        batch = plan.batch
        ref.write_cache(kv, freqs_cis, kv_norm_gamma, batch, layer_idx, epsilon, interleaved)
        R = kv.shape[1] - kv_norm_gamma.shape[0]
        qf = q.cpu().to(F64)
        Dn = q.shape[2] - R
        return torch.cat([qf[..., :Dn], ref.rope(qf[..., Dn:], freqs_cis, ref.token_positions(batch), interleaved)], dim=-1)

    def absorb(self, q_rot, w_uk):
        Dn = w_uk.shape[2]
        qf = q_rot.cpu().to(F64)
        q_lat = torch.einsum("thd,hld->thl", qf[..., :Dn], w_uk.cpu().to(F64))
        return torch.cat([q_lat, qf[..., Dn:]], dim=-1)

    def unabsorb(self, out_lat, w_uv):
        return torch.einsum("thl,hvl->thv", out_lat.cpu().to(F64), w_uv.cpu().to(F64))

    def decode(self, plan, layer_idx, q_abs, spec, kv_lora_rank):
        return ref.decode(q_abs, plan.batch, layer_idx, spec, kv_lora_rank=kv_lora_rank)

    def prefill(self, plan, layer_idx, q_rot, w_k, w_uv, spec):
        return ref.prefill(q_rot, plan.batch, layer_idx, w_k, w_uv, spec)

    def flare_mla_prefill(self, plan, layer_idx, q, k, v, chunk, spec, tile=None):
        return ref.flare_mla_prefill(q, k, v, chunk.buffer_row_offsets, chunk.cache_offsets, plan.batch, layer_idx,
                                     scale=spec.scale, mask=spec.mask)

    def supports_shared_kv(self, plan):
        return True

    def shared_kv_attention(self, plan, q):
        return ref.shared_kv_attention(q, plan.q_offsets, plan.raw, plan.spec, plan.compressed)
