"""The ``reference`` backend: ``openmla.reference`` (float64, per token) behind the backend interface.

Chunking (``buffer_size``) and split-KV (``num_partitions``) change only how a fast
path schedules the work, never the result, so the oracle ignores them.
"""

from __future__ import annotations

import torch

from .. import reference as ref
from ..cache import CacheBatch
from ..masks import MaskVariant

F64 = torch.float64
CACHE_FORMATS = ("native", "fp8_e4m3", "fp8_ds_mla")


def write_cache(q, kv, freqs_cis, kv_norm_gamma, batch: CacheBatch, layer_idx: int, epsilon: float, interleaved: bool):
    ref.write_cache(kv, freqs_cis, kv_norm_gamma, batch, layer_idx, epsilon, interleaved)
    R = kv.shape[1] - kv_norm_gamma.shape[0]
    qf = q.cpu().to(F64)
    Dn = q.shape[2] - R
    return torch.cat([qf[..., :Dn], ref.rope(qf[..., Dn:], freqs_cis, ref.token_positions(batch), interleaved)], dim=-1)


def absorb(q_rot, w_uk):
    Dn = w_uk.shape[2]
    qf = q_rot.cpu().to(F64)
    q_lat = torch.einsum("thd,hld->thl", qf[..., :Dn], w_uk.cpu().to(F64))
    return torch.cat([q_lat, qf[..., Dn:]], dim=-1)


def unabsorb(out_lat, w_uv):
    return torch.einsum("thl,hvl->thv", out_lat.cpu().to(F64), w_uv.cpu().to(F64))


def decode(q_abs, batch, layer_idx, *, scale, kv_lora_rank, mask: MaskVariant, sparse_indices, topk_lengths,
           physical_indices, attn_sink, num_partitions):
    return ref.decode(q_abs, batch, layer_idx, scale=scale, kv_lora_rank=kv_lora_rank, mask=mask,
                      sparse_indices=sparse_indices, topk_lengths=topk_lengths,
                      physical_indices=physical_indices, attn_sink=attn_sink)


def prefill(q_rot, batch, layer_idx, w_k, w_uv, *, scale, mask: MaskVariant, sparse_indices, topk_lengths,
            physical_indices, attn_sink, buffer_size):
    return ref.prefill(q_rot, batch, layer_idx, w_k, w_uv, scale=scale, mask=mask, sparse_indices=sparse_indices,
                       topk_lengths=topk_lengths, physical_indices=physical_indices, attn_sink=attn_sink)


def flare_mla_prefill(q, k, v, buffer_row_offsets, cache_offsets, batch, layer_idx, *, scale, mask: MaskVariant, tile=None):
    return ref.flare_mla_prefill(q, k, v, buffer_row_offsets, cache_offsets, batch, layer_idx, scale=scale, mask=mask)
