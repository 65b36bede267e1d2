"""``OpenMLAImpl``: one MLA layer's attention in vLLM, through the step's openmla plans.

vLLM's ``MLAAttention`` layer does the projections, the kv RMSNorm and RoPE, then calls:
``do_kv_cache_update`` (store the new tokens' latents and roped key parts), ``forward_mha`` for
the prefill tokens (roped q, up-projected form over the cached prefix and the new tokens) and
``forward_mqa`` for the decode tokens (q already absorbed by vLLM, which also applies W_UV to
the latent output). Each runs the plan the metadata builder made for the step over this
layer's own cache tensor, in the format vLLM's ``kv_cache_dtype`` names (``metadata.py``): the
native cache, ``fp8_e4m3`` (``fp8`` / ``fp8_e4m3``: entries / the layer's ``k_scale``, quantised on
write, dequantised by openmla's kernels on read) or ``fp8_ds_mla``; q stays in the model dtype.
The cache write stores vLLM's normed, roped entries at the step's slots through
``openmla.dispatch.write_rows``: the cpu backend's native write kernel (one pass, quantising as
openmla's format objects do, padding slots skipped in the kernel), or the format object's torch
write where that kernel does not run.
Before each attention call of an fp8_e4m3 layer, the layer's ``k_scale`` is copied into the
float32 ``[1]`` scale the step's plans read (4 bytes; layers may have their own scales).

The decode form's absorption (q x W_UK) and output projection (x W_UV) are vLLM's, outside
the backend. For a bfloat16 model on a CPU that multiplies bfloat16 natively (AMX, or
AVX-512-BF16) the impl opts into vLLM's CPU batched GEMM ``bmm_cpu`` for both (``uses_amx_bmm``:
the weights packed once by vLLM's own ``AMXMLAImpl`` code, as its AMX_MLA backend does); that GEMM
takes bfloat16 only (float16 gives wrong results, float32 weights are refused) and feature sizes
in multiples of 32, so other dtypes, shapes and CPUs run one ``torch.bmm`` each.

The first impl of a process logs one line (on vLLM's logger) saying that openmla serves its
MLA layers, with the openmla backend the kernels run on.
"""

from __future__ import annotations

import logging

import torch
from vllm.model_executor.layers.attention.mla_attention import MLACommonImpl
from vllm.model_executor.layers.quantization.utils.quant_utils import get_and_maybe_dequant_weights
from vllm.v1.attention.backend import AttentionType

from openmla import LayerWeights, MLAPlan, dispatch
from openmla.fp8 import ds_mla_record_bytes

from .metadata import OpenMLAMetadata, cache_format, layer_blocks

VLLM_DS_MLA_BYTES = 656  # the fp8_ds_mla record vLLM allocates (MLAAttention.get_kv_cache_spec), whatever L and R

logger = logging.getLogger("vllm.openmla")  # a child of vLLM's logger: printed with vLLM's own lines
_announced: list[bool] = []


class OpenMLAImpl(MLACommonImpl[OpenMLAMetadata]):
    can_return_lse_for_decode = True  # openmla's decode gives the natural-log LSE
    lse_base_on_e = True

    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                 logits_soft_cap, attn_type, kv_sharing_target_layer_name, **mla_args) -> None:
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                         logits_soft_cap, attn_type, kv_sharing_target_layer_name, **mla_args)
        if alibi_slopes is not None or sliding_window is not None or logits_soft_cap is not None:
            raise NotImplementedError("openmla's vLLM backend: alibi slopes, sliding windows and logit soft caps are not supported")
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(f"openmla's vLLM backend serves decoder self-attention only, not {attn_type}")
        self.cache_format = cache_format(kv_cache_dtype)  # NotImplementedError for a dtype openmla does not serve
        if self.cache_format == "fp8_ds_mla":
            _check_ds_mla(self.kv_lora_rank, self.qk_rope_head_dim)
        self.supports_quant_query_input = False  # q stays in the model dtype; openmla dequantises fp8 caches itself
        self.w_k: torch.Tensor | None = None  # [H*Dn, L], the prefill K up-projection
        self.w_uv: torch.Tensor | None = None  # [H, Dv, L], the V up-projection
        self.layer_weights: LayerWeights | None = None  # both, for MLAPlan.attend (w_uk: a view of w_k)
        # Read by MLAAttention once this impl exists: vLLM's bmm_cpu for the decode absorption
        # and W_UV, against the packed weights that process_weights_after_loading makes.
        self.uses_amx_bmm = _vllm_bmm_usable(_model_dtype(), self.qk_nope_head_dim, self.kv_lora_rank, self.v_head_dim)
        self._w_uk_packed = self._w_uv_packed = self._w_scale = None
        _announce(self.uses_amx_bmm, self.cache_format, kv_cache_dtype)

    def fused_output_quant_supported(self, quant_key) -> bool:
        return False  # forward_mha writes the model dtype

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        # forward_mha gets no layer, so the prefill weights come from kv_b_proj [H*(Dn+Dv), L].
        H, Dn, Dv = self.num_heads, self.qk_nope_head_dim, self.v_head_dim
        w = get_and_maybe_dequant_weights(self.kv_b_proj, out_dtype=act_dtype).view(H, Dn + Dv, self.kv_lora_rank)
        self.w_k = w[:, :Dn].reshape(H * Dn, self.kv_lora_rank).contiguous()
        self.w_uv = w[:, Dn:].contiguous()
        # The latent is normed by vLLM before the cache write, so the plan never reads this gamma;
        # w_uk (the absorbed form, which a prefill plan runs only for a sparse step) is a view, no copy.
        gamma = torch.ones(self.kv_lora_rank, dtype=self.w_k.dtype, device=self.w_k.device)
        self.layer_weights = LayerWeights(gamma, self.w_k, self.w_k.view(H, Dn, self.kv_lora_rank).transpose(1, 2), self.w_uv)
        if self.uses_amx_bmm:  # vLLM's own packing (sets _w_uk_packed, _w_uv_packed, _w_scale)
            from vllm.v1.attention.backends.mla.amx_mla import AMXMLAImpl

            AMXMLAImpl.process_weights_after_loading(self, act_dtype)

    def do_kv_cache_update(self, kv_c_normed: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor, kv_cache_dtype: str, k_scale: torch.Tensor) -> None:
        """Store ``[kv_c_normed | k_pe]`` (``[T, L]``, ``[T, 1, R]``) at the cache rows ``slot_mapping``
        (block * block_size + offset; -1 marks a padding token, which is skipped: in the native
        kernel, or by the torch write, which on CUDA reads one flag back per layer for it)."""
        if kv_cache.numel() == 0:
            return
        T = kv_c_normed.shape[0]
        entries = torch.cat([kv_c_normed, k_pe.reshape(T, -1)], dim=-1)
        scale = _scale_vector(k_scale) if self.cache_format == "fp8_e4m3" else None
        dispatch.write_rows(layer_blocks(kv_cache, self.cache_format)[0], slot_mapping.flatten()[:T], entries,
                            cache_format=self.cache_format, kv_lora_rank=self.kv_lora_rank, scale=scale)

    def layer_plan(self, plan: MLAPlan, kv_cache: torch.Tensor, k_scale: torch.Tensor) -> MLAPlan:
        """The step's ``plan`` over this layer's cache tensor, reading this layer's fp8 scale."""
        plan = plan.with_blocks(layer_blocks(kv_cache, self.cache_format))
        if self.cache_format == "fp8_e4m3":
            plan.batch.kv_scale.copy_(k_scale.reshape(1))  # the builder's shared [1] scale (see metadata.py)
        return plan

    def forward_mqa(self, q, kv_c_and_k_pe_cache: torch.Tensor, attn_metadata: OpenMLAMetadata, layer):
        """Decode tokens: absorbed ``q [T, H, L+R]`` (or its two parts) -> ``([T, H, L], lse [T, H])``."""
        if isinstance(q, tuple):
            q = torch.cat(q, dim=-1)
        plan = self.layer_plan(attn_metadata.decode_plan, kv_c_and_k_pe_cache, layer._k_scale)
        return plan.decode(q, 0, kv_lora_rank=self.kv_lora_rank, return_lse=True)

    def forward_mha(self, q: torch.Tensor, kv_c_normed: torch.Tensor, k_pe: torch.Tensor, kv_c_and_k_pe_cache: torch.Tensor,
                    attn_metadata: OpenMLAMetadata, k_scale: torch.Tensor, output: torch.Tensor,
                    output_scale: torch.Tensor | None = None) -> None:
        """Prefill tokens: roped ``q [T, H, Dn+R]`` over each request's cached prefix and its new
        tokens (already in the cache) -> ``output [T, H*Dv]``."""
        if output_scale is not None:
            raise NotImplementedError("openmla's vLLM backend: fused output quantization is not supported")
        plan = self.layer_plan(attn_metadata.prefill_plan, kv_c_and_k_pe_cache, k_scale)
        out = plan.attend(q, 0, self.layer_weights)  # the plan's form rule (up-projected unless the step is absorbed)
        output.view(out.shape).copy_(out)


def _scale_vector(k_scale: torch.Tensor) -> torch.Tensor:
    """vLLM's per-tensor ``k_scale`` (a float32 scalar tensor of the layer) as a ``[1]`` view (no
    copy: a scale vLLM loads later is seen); ``NotImplementedError`` for any other scale."""
    if not isinstance(k_scale, torch.Tensor) or k_scale.dtype != torch.float32 or k_scale.numel() != 1:
        raise NotImplementedError(f"openmla's vLLM backend: an fp8 cache needs one float32 k_scale per layer, got {k_scale!r}")
    return k_scale.reshape(1)


def _check_ds_mla(kv_lora_rank: int, rope_dim: int) -> None:
    """fp8_ds_mla is served where openmla's record for (L, R) is the 656 bytes vLLM allocates."""
    try:
        width = ds_mla_record_bytes(kv_lora_rank, rope_dim)
    except ValueError:
        width = None
    if width != VLLM_DS_MLA_BYTES:
        raise NotImplementedError(
            f"openmla's vLLM backend: kv_cache_dtype='fp8_ds_mla' is DeepSeek's {VLLM_DS_MLA_BYTES}-byte record (vLLM allocates it "
            f"for kv_lora_rank 512 and rope 64); this model has kv_lora_rank {kv_lora_rank} and rope {rope_dim} "
            f"({'no whole 128-value groups' if width is None else f'{width}-byte records'}): use kv_cache_dtype='fp8' or 'auto'")


def _model_dtype() -> torch.dtype | None:
    """The dtype of the model being built (vLLM's current config), None outside one."""
    from vllm.config import get_current_vllm_config

    model_config = getattr(get_current_vllm_config(), "model_config", None)
    return getattr(model_config, "dtype", None)


def _vllm_bmm_usable(dtype: torch.dtype | None, *features: int) -> bool:
    """Whether vLLM's CPU batched GEMM (``bmm_cpu`` and its weight packing) serves the decode
    absorption and W_UV here: a bfloat16 model, feature sizes (Dn, L, Dv) in multiples of 32 (its
    tile kernel refuses others), and a CPU with AMX tiles or AVX-512-BF16 (there it ran both 6x
    faster than ``torch.bmm`` in the engine, bench/RESULTS.md; on other CPUs it is not measured)."""
    from vllm.platforms import current_platform

    ops = getattr(torch.ops, "_C", None)
    native_bf16 = torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()
    return (dtype == torch.bfloat16 and current_platform.is_cpu() and native_bf16 and all(n % 32 == 0 for n in features)
            and hasattr(ops, "convert_weight_packed") and hasattr(ops, "bmm_cpu"))


def _announce(amx_bmm: bool, fmt: str, kv_cache_dtype: str) -> None:
    """One log line per process: openmla serves the MLA layers, on which of its backends, with which cache."""
    if _announced:
        return
    _announced.append(True)
    from vllm.platforms import current_platform

    from openmla import __version__
    from openmla.backends import resolve_backend_name

    kernels = resolve_backend_name(None, torch.device("cpu" if current_platform.is_cpu() else "cuda"))
    logger.info("openmla %s serves the MLA attention layers of this process (kernels: openmla's %s backend; "
                "KV cache: openmla's %s format (kv_cache_dtype=%s); absorption and output projection: %s)",
                __version__, kernels, fmt, kv_cache_dtype, "vLLM's bmm_cpu" if amx_bmm else "torch.bmm")
