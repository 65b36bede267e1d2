"""A backend in one class (docs/backends.md walks through it): every visible key of a sequence
gathered at once and attended with ``einsum``. Short and exact, not fast: memory grows with the
context. It declines what it does not implement (fp8 caches, sparse top-k), so ``openmla.plan``
runs its fallback (``torch``) for those steps and says why.
"""

from __future__ import annotations

import torch

from openmla import combine
from openmla.backends import Backend
from openmla.rope import apply_rope


class EinsumBackend(Backend):
    name = "einsum"
    cache_formats = ("native",)
    fallback = "torch"

    def supports(self, plan):
        if plan.spec.sparse is not None:
            return "it has no sparse top-k"
        return super().supports(plan)  # the cache format

    def write_cache(self, plan, layer_idx, q, kv, freqs_cis, kv_norm_gamma, epsilon, interleaved):
        L = kv_norm_gamma.shape[0]
        lat = kv[:, :L].float()
        lat = lat * torch.rsqrt(lat.pow(2).mean(-1, keepdim=True) + epsilon) * kv_norm_gamma.float()
        k_rope = apply_rope(kv[:, L:], freqs_cis, plan.token_pos, interleaved)
        plan.batch.write_rows(layer_idx, plan.write_rows, torch.cat([lat, k_rope.float()], dim=-1))
        R = kv.shape[1] - L
        return torch.cat([q[..., :-R], apply_rope(q[..., -R:], freqs_cis, plan.token_pos, interleaved)], dim=-1)

    def _keys(self, plan, layer_idx, b):
        """Sequence ``b``'s entries ``[S, L+R]`` (float32) and their positions."""
        pos = torch.arange(plan.batch.seq_lens_list[b], device=plan.device)
        rows = plan.batch.physical_rows(torch.full_like(pos, b), pos)
        return plan.batch.read_rows(layer_idx, rows, torch.float32), pos

    def _attend(self, plan, layer_idx, q, spec, values_of):
        """Per sequence: scores of ``q [T, H, D]`` against its keys, masked, softmax, times values."""
        T, H, _ = q.shape
        offsets = plan.batch.offsets_list
        out, lse = None, torch.empty(T, H, device=q.device)
        for b in range(plan.batch.batch_size):
            t0, t1 = offsets[b], offsets[b + 1]
            if t0 == t1:
                continue
            keys, k_pos = self._keys(plan, layer_idx, b)
            scores, values = values_of(q[t0:t1].float(), keys)  # [n, H, S], [S, H, Dv]
            seen = spec.mask.visible(plan.token_pos[t0:t1, None], k_pos[None, :])  # [n, S]
            scores = (scores * spec.scale).masked_fill(~seen[:, None, :], float("-inf"))
            lse[t0:t1] = torch.logsumexp(scores, dim=-1)
            p = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows without keys: zeros
            o = torch.einsum("nhs,shv->nhv", p, values)
            out = o.new_zeros(T, H, o.shape[-1]) if out is None else out
            out[t0:t1] = o
        if out is None:
            return q.new_zeros(T, H, 0), lse
        if spec.attn_sink is not None:
            combine.apply_sink(out, lse, spec.attn_sink, plan.token_seq)
        return out.to(q.dtype), lse

    def decode(self, plan, layer_idx, q_abs, spec, kv_lora_rank):
        def latent(q, keys):  # one key head shared by every query head; values are the latent
            return torch.einsum("nhd,sd->nhs", q, keys), keys[:, None, :kv_lora_rank].expand(-1, q.shape[1], -1)

        return self._attend(plan, layer_idx, q_abs, spec, latent)

    def prefill(self, plan, layer_idx, q_rot, w_k, w_uv, spec):
        H, Dv, L = w_uv.shape

        def up_projected(q, keys):  # K_nope and V per head from the latent
            k_nope = torch.einsum("sl,hdl->shd", keys[:, :L], w_k.float().view(H, -1, L))
            k = torch.cat([k_nope, keys[:, None, L:].expand(-1, H, -1)], dim=-1)
            return torch.einsum("nhd,shd->nhs", q, k), torch.einsum("sl,hvl->shv", keys[:, :L], w_uv.float())

        return self._attend(plan, layer_idx, q_rot, spec, up_projected)

    def flare_mla_prefill(self, plan, layer_idx, q, k, v, chunk, spec, tile):
        raise NotImplementedError("einsum: MAX's chunk-level flare_mla_prefill is not implemented")
