"""The ``cpu`` backend: ``CpuBackend``, native C++ kernels behind ``base.Backend``.

A thin adapter: it reads what the flat kernels need off the plan's ``CacheBatch`` (one layer's
pages, page table, host lengths, the prefill chunk plan) and calls ``kernels``.

| primitive | work |
|---|---|
| ``write_cache`` | one native pass: RMSNorm, RoPE, paged store (fp8 / NVFP4 quantised), q's rope |
| ``write_rows`` | given entries at given physical rows (the vLLM plugin's write): one native pass, the same quantisers |
| ``decode`` | one native call (dense or sparse, split-KV, sinks; fp8 and NVFP4 dequantised in the kernel, |
| | next to the products for dense float32 units on AVX2 CPUs: ``csrc/decode_reg.h``) |
| ``prefill`` | dense: per chunk of the plan, a native gather, two torch matmuls (K/V up-projection) |
| | and native flash attention (sparse prefill reaches ``decode`` through the plan) |
| ``flare_mla_prefill`` | (``ChunkPrefillKernels``, MAX's chunk) a native gather of the rope rows and native flash attention |
| ``absorb`` / ``unabsorb`` | one native call each (per-head brgemm; the weight packed once and cached) |
| ``shared_kv_attention`` | DeepSeek-V4: one native call over window + compressed entries (``csrc/shared_kv.h``; |
| | float32 products, float32 / bf16 / fp16 entries; others declined to torch) |

What it runs is decided once per step (``supports``): a CPU cache whose entries the kernels
read (bfloat16, float16, float32, ``fp8_e4m3``, ``fp8_ds_mla``, ``nvfp4_ds_mla`` or
``nvfp4_fp8rope``; rows contiguous; an even entry width). A float64 cache, or one elsewhere, is
declined and ``openmla.plan`` runs the ``torch`` backend instead (recorded on the plan). Per call, inputs the kernels cannot compute with (float64, an
odd width they reduce over) are a ``ValueError`` naming the argument, never a silent detour.
``absorb``/``unabsorb`` use the base class's (``openmla.combine``) for mixed, float16 or float64
dtypes, autograd and ``torch.compile``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ...cache import CacheBatch
from ...chunks import default_buffer_size
from ..base import FP8_FORMATS, Backend
from . import build, kernels, packed

if TYPE_CHECKING:
    from ...chunks import ChunkRows
    from ...spec import AttentionSpec
    from ..base import PlanView


def _layer(batch: CacheBatch, layer_idx: int) -> kernels.PagedLayer:
    """The kernels' view of one cache layer (``supports`` checked that they read it)."""
    fmt = kernels.FORMAT_CODES[batch.blocks.dtype if batch.is_native else batch.cache_format]
    kv_scale = float(batch.kv_scale[layer_idx]) if batch.cache_format == "fp8_e4m3" else 1.0
    return kernels.PagedLayer(batch.blocks[layer_idx], batch.block_table, batch.cache_lengths, batch.input_row_offsets, fmt,
                              kv_scale)


def _compute_dtype(batch: CacheBatch, **inputs: torch.Tensor) -> torch.dtype:
    """The kernels' compute dtype for these inputs over ``batch``'s cache; ``ValueError`` naming an
    input they cannot take (float64, or an odd width the bf16 products reduce over)."""
    for name, t in inputs.items():
        if t.dtype == torch.float64:
            raise ValueError(f"{name}: the cpu backend computes in bfloat16 or float32, not float64; store the cache in "
                             "float64 or plan with backend='torch' (or 'reference') for float64 inputs")
        if t.shape[-1] % 2:
            raise ValueError(f"{name}: its last dimension {t.shape[-1]} is odd; the cpu backend's kernels take even widths "
                             "(plan with backend='torch' for this shape)")
    return kernels.compute_dtype(*(t.dtype for t in inputs.values()), batch.compute_dtype)


def _heads_native(x: torch.Tensor, w: torch.Tensor, k: int) -> bool:
    """Whether the per-head kernel takes ``x [T, H, k+c]`` and ``w [H, M, k]``: CPU tensors of one
    dtype that is its own compute dtype (bf16 where bf16 brgemm runs, float32), an even ``k`` for
    bf16, no autograd graph to keep, and not under ``torch.compile`` (the packed-weight cache
    reads addresses; compiled graphs get combine's matmuls)."""
    return (x.device.type == "cpu" and w.device.type == "cpu" and x.dtype == w.dtype
            and kernels.compute_dtype(x.dtype) == x.dtype and (k % 2 == 0 or x.dtype == torch.float32)
            and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))
            and not torch.compiler.is_compiling())


class CpuBackend(Backend):
    name = "cpu"
    cache_formats = FP8_FORMATS + ("nvfp4_ds_mla", "nvfp4_fp8rope")  # its kernels' format codes (kernels.FORMAT_CODES)
    fallback = "torch"

    @classmethod
    def unavailable(cls) -> str | None:
        return build.unavailable_reason()

    def supports(self, plan: "PlanView"):
        batch = plan.batch
        if batch.blocks.device.type != "cpu":
            return f"its kernels run on the CPU, the cache is on {batch.blocks.device}"
        if batch.is_native and batch.blocks.dtype not in kernels.FORMAT_CODES:
            return f"its kernels do not read {batch.blocks.dtype} entries"
        if batch.blocks.stride(-1) != 1:
            return "its kernels read cache rows that are contiguous"
        if batch.head_dim % 2:
            return f"its kernels take an even entry width, the cache's is {batch.head_dim}"
        return super().supports(plan)

    def write_cache(self, plan, layer_idx, q, kv, freqs_cis, kv_norm_gamma, epsilon, interleaved=True):
        for name, t in (("q", q), ("kv", kv), ("kv_norm_gamma", kv_norm_gamma)):
            if t.dtype == torch.float64:
                _compute_dtype(plan.batch, **{name: t})  # raises, naming it
        return kernels.write_cache(q, kv, freqs_cis, kv_norm_gamma, _layer(plan.batch, layer_idx), epsilon=epsilon,
                                   interleaved=interleaved)

    def write_rows(self, fmt, layer, rows, entries, kv_lora_rank, scale):
        """One native pass where the kernel reads the format and the tensors (CPU, unit-stride rows,
        bf16 / fp16 / float32 entries, no autograd); else the format object's torch write."""
        code = fmt.kernel_code(layer.dtype)
        if (code is None or layer.device.type != "cpu" or entries.device.type != "cpu" or rows.device.type != "cpu"
                or layer.dim() != 3 or layer.stride(-1) != 1 or entries.dim() != 2 or entries.dtype not in kernels.ROWS_DTYPES
                or entries.requires_grad):
            return super().write_rows(fmt, layer, rows, entries, kv_lora_rank, scale)
        kernels.write_rows(entries, layer, rows, fmt=code, kv_scale=1.0 if scale is None else float(scale),
                           kv_lora_rank=kv_lora_rank)

    def absorb(self, q_rot: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
        """One native call (``w_uk`` packed once, see ``packed``) where the kernel takes the inputs."""
        L, Dn = w_uk.shape[1], w_uk.shape[2]
        if not _heads_native(q_rot, w_uk, Dn):
            return super().absorb(q_rot, w_uk)
        return kernels.heads_gemm(q_rot, packed.packed(w_uk), L, Dn)

    def unabsorb(self, out_lat: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
        """One native call (``w_uv`` packed once) where the kernel takes the inputs."""
        Dv, L = w_uv.shape[1], w_uv.shape[2]
        if out_lat.shape[2] != L or not _heads_native(out_lat, w_uv, L):
            return super().unabsorb(out_lat, w_uv)
        return kernels.heads_gemm(out_lat, packed.packed(w_uv), Dv, L)

    def supports_shared_kv(self, plan):
        """The native V4 kernel runs CPU stores of float32, bf16 or fp16 entries with unit-stride
        rows; anything else (float64, another device) goes to the fallback."""
        stores = [("raw", plan.raw)] + ([("compressed", plan.compressed)] if plan.compressed is not None else [])
        for name, store in stores:
            blocks = store.blocks
            if blocks.device.type != "cpu":
                return f"its shared-KV kernel runs on the CPU, the {name} entries are on {blocks.device}"
            if blocks.dtype not in kernels.SHARED_KV_DTYPES:
                return f"its shared-KV kernel reads float32, bfloat16 or float16 entries, not {blocks.dtype}"
            if blocks.stride(-1) != 1:
                return f"its shared-KV kernel reads {name} entry rows that are contiguous"
        return True

    def shared_kv_attention(self, plan, q):
        """DeepSeek-V4 attention (``openmla.v4.SharedKVPlan``): ``q [T, H, D]`` -> float32 ``out``, ``lse``."""
        spec, ck, comp = plan.spec, plan.spec.compressed, plan.compressed
        return kernels.shared_kv(q, plan.raw.blocks, plan.raw.block_table, plan.token_seq, plan.token_pos, window=spec.window,
                                 scale=spec.scale, comp_blocks=None if ck is None else comp.blocks,
                                 comp_table=None if ck is None else comp.block_table, rate=0 if ck is None else ck.rate,
                                 indices=None if ck is None else ck.indices, attn_sink=spec.attn_sink)

    def decode(self, plan, layer_idx, q_abs, spec, kv_lora_rank):
        """Absorbed attention: ``q_abs [T, H, L+R]`` -> ``out_lat [T, H, L]``, ``lse [T, H]``."""
        dtype = _compute_dtype(plan.batch, q=q_abs)
        sparse = spec.sparse
        return kernels.decode(q_abs, _layer(plan.batch, layer_idx), kv_lora_rank=kv_lora_rank, scale=spec.scale, mask=spec.mask,
                              sparse_indices=None if sparse is None else sparse.indices,
                              topk_lengths=None if sparse is None else sparse.topk_lengths,
                              physical=True if sparse is None else sparse.physical, attn_sink=spec.attn_sink,
                              num_partitions=plan.num_partitions, dtype=dtype)

    def prefill(self, plan, layer_idx, q_rot, w_k, w_uv, spec):
        """Dense prefill form: ``q_rot [T, H, Dn+R]`` -> ``out [T, H, Dv]``, ``lse [T, H]``, per chunk of
        the plan's chunk plan (host lists made once per step)."""
        batch = plan.batch
        dtype = _compute_dtype(batch, q=q_rot, w_k=w_k, w_uv=w_uv)
        T, H, Dq = q_rot.shape
        Dv, L = w_uv.shape[1], w_uv.shape[2]
        B = batch.batch_size
        chunks = plan.chunks(plan.buffer_size or default_buffer_size(H, Dq, Dv, L, dtype))
        pairs = [(bro, co[:B]) for bro, co in zip(chunks.buffer_row_offsets, chunks.cache_offsets)]
        return kernels.prefill(q_rot, _layer(batch, layer_idx), w_k, w_uv, chunks=pairs, offsets=batch.offsets_list,
                               cache_lens=batch.cache_lengths_list, scale=spec.scale, mask=spec.mask, attn_sink=spec.attn_sink,
                               dtype=dtype)

    def flare_mla_prefill(self, plan, layer_idx, q, k, v, chunk: "ChunkRows", spec: "AttentionSpec", tile=None):
        """One chunk with up-projected keys ``k [S, H, Dn]``, ``v [S, H, Dv]`` (rope from the cache).
        ``tile`` only schedules work; the native kernel keeps its own tiles."""
        batch = plan.batch
        dtype = _compute_dtype(batch, q=q, k=k, v=v)
        layer = _layer(batch, layer_idx)
        S, H, Dn = k.shape
        R = q.shape[2] - Dn
        L = batch.head_dim - R
        B = batch.batch_size
        bro, co = chunk.bro, chunk.co[:B]
        counts = [bro[b + 1] - bro[b] for b in range(B)]
        spans = [(b, co[b], n) for b, n in enumerate(counts) if n]
        rope = kernels.gather(layer, spans, kv_lora_rank=L, rope_dim=R, cols=(L, L + R), dtype=dtype)
        table = torch.tensor([bro[:B], co, counts], dtype=torch.int64).reshape(3, B)
        return kernels.prefill_chunk(q.to(dtype).contiguous(), k.to(dtype).reshape(S, H * Dn).contiguous(),
                                     v.to(dtype).reshape(S, -1).contiguous(), rope, offsets=batch.input_row_offsets,
                                     cache_lengths=batch.cache_lengths, spans=table, scale=spec.scale, mask=spec.mask,
                                     attn_sink=None)
