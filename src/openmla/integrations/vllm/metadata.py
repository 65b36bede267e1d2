"""Per-step metadata: vLLM's MLA metadata plus one openmla plan per part of the batch.

vLLM orders a step's requests decodes first (one new token each), then prefills (new prompt
tokens, possibly a chunk after a cached prefix). ``forward_mqa`` gets the decode tokens and
``forward_mha`` the prefill tokens of every layer, so the builder plans each part once per
step: the validation, token positions and chunk plans are then shared by every layer. A plan
is made over the first layer's cache tensor ``[num_blocks, block_size, W]`` viewed as
``[1, num_blocks, block_size, W]`` (one layer of openmla's layout); each layer runs it over
its own tensor with ``MLAPlan.with_blocks``, at ``layer_idx`` 0.

vLLM's ``kv_cache_dtype`` picks the format of those tensors, read and written in place by
openmla's own formats (``KV_CACHE_FORMATS``): ``auto`` is the native cache (the model dtype,
W = L+R); ``fp8`` / ``fp8_e4m3`` is openmla's ``fp8_e4m3`` (W = L+R float8_e4m3fn values, each
entry divided by the layer's per-tensor ``k_scale``; vLLM allocates the tensor as uint8 and views
it as float8 around the attention calls, so ``layer_blocks`` views it the same way everywhere);
``fp8_ds_mla`` is openmla's ``fp8_ds_mla`` (vLLM's 656-byte uint8 record: 512 float8 latent
values, 4 float32 scales, 64 bfloat16 rope values, byte for byte the same layout). The step's
plans read the fp8 scale from one float32 ``[1]`` tensor of the builder (``kv_scale``), into
which each layer copies its own ``k_scale`` before its call (``OpenMLAImpl``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.model_executor.layers.attention.mla_attention import (
    MLACommonDecodeMetadata,
    MLACommonMetadata,
    MLACommonMetadataBuilder,
    QueryLenSupport,
)

import openmla
from openmla import CacheBatch, MLAPlan
from openmla.backends import resolve_backend_name
from openmla.fp8 import FP8

# vLLM's kv_cache_dtype -> openmla's cache format of the same bytes (the dtypes the backend serves).
KV_CACHE_FORMATS = {"auto": "native", "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_ds_mla": "fp8_ds_mla"}
_STORAGE = {"fp8_e4m3": FP8, "fp8_ds_mla": torch.uint8}  # the element type openmla reads (native: the tensor's own)


@dataclass
class OpenMLAMetadata(MLACommonMetadata[MLACommonDecodeMetadata]):
    decode_plan: MLAPlan | None = None  # the first num_decodes requests
    prefill_plan: MLAPlan | None = None  # the other num_prefills requests

    def __post_init__(self) -> None:
        """No head-size check. vLLM's MLA metadata accepts only its own kernels' entry widths (320,
        512, 576) and, under its Transformers modeling backend, checks ``get_head_size()``, which is
        not L+R for a model outside vLLM's DeepSeek-MLA list (MiniCPM3: 32). openmla serves other
        widths (MiniCPM3's 256 + 32) and checks the cache entry width itself when it plans."""


def cache_format(kv_cache_dtype: str) -> str:
    """openmla's cache format for vLLM's ``kv_cache_dtype``; ``NotImplementedError`` naming the
    served ones for any other."""
    fmt = KV_CACHE_FORMATS.get(kv_cache_dtype)
    if fmt is None:
        raise NotImplementedError(
            f"openmla's vLLM backend: kv_cache_dtype={kv_cache_dtype!r} is not served; it serves 'auto' (the model dtype), "
            "'fp8' / 'fp8_e4m3' (float8_e4m3fn divided by the layer's k_scale) and 'fp8_ds_mla' (DeepSeek's 656-byte record)")
    return fmt


def layer_blocks(kv_cache: torch.Tensor, fmt: str = "native") -> torch.Tensor:
    """vLLM's per-layer cache ``[num_blocks, block_size, W]`` as openmla's one-layer
    ``blocks [1, num_blocks, block_size, W]`` of format ``fmt`` (a view: no copy; a uint8 fp8_e4m3
    cache, as vLLM allocates it, is viewed as float8_e4m3fn)."""
    if kv_cache.dim() != 3 or not kv_cache.is_contiguous():
        raise ValueError(f"kv_cache: expected a contiguous [num_blocks, block_size, W] tensor, got shape "
                         f"{tuple(kv_cache.shape)} strides {kv_cache.stride()}")
    storage = _STORAGE.get(fmt)
    if storage is not None and kv_cache.dtype != storage:
        if kv_cache.element_size() != 1:
            raise ValueError(f"kv_cache: a {fmt} cache is stored in bytes, got {kv_cache.dtype}")
        kv_cache = kv_cache.view(storage)
    return kv_cache.unsqueeze(0)


class OpenMLAMetadataBuilder(MLACommonMetadataBuilder[OpenMLAMetadata]):
    """vLLM's MLA metadata builder, plus the step's openmla plans.

    ``VARLEN``: openmla's decode form takes any number of new tokens per request up to the plan's
    ``decode_max_q_len`` (bottom-right causal over the request's cache), lengths mixed in one step.
    With speculative decoding vLLM then raises ``reorder_batch_threshold`` to 1 + the number of
    speculative tokens, and every request with at most that many new tokens (a verification
    step, a short prompt or chunk) is a decode request: ``forward_mqa``, the absorbed form."""

    query_len_support = QueryLenSupport.VARLEN

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device, metadata_cls=OpenMLAMetadata)
        context = vllm_config.compilation_config.static_forward_context
        self._layers = [context[name] for name in layer_names]
        scales = {float(layer.scale) for layer in self._layers}
        if len(scales) != 1:
            raise NotImplementedError(f"openmla's vLLM backend plans a step for layers of one softmax scale, these have {sorted(scales)}")
        self.scale = scales.pop()
        dtypes = {layer.kv_cache_dtype for layer in self._layers}
        if len(dtypes) != 1:
            raise NotImplementedError(f"openmla's vLLM backend plans a step for layers of one kv_cache_dtype, these have {sorted(dtypes)}")
        self.cache_format = cache_format(dtypes.pop())
        self.rope_dim = int(self._layers[0].qk_rope_head_dim) if self.cache_format == "fp8_ds_mla" else None
        # The fp8_e4m3 scale the plans read: each layer copies its k_scale here before its call.
        self.kv_scale = torch.ones(1, dtype=torch.float32, device=device) if self.cache_format == "fp8_e4m3" else None
        # openmla's kernels (OPENMLA_BACKEND, else by device), fixed for the engine's life: resolved once here
        # rather than by every step's plan (an environment read and a lookup, ~40 us with the caches cold).
        self.backend = resolve_backend_name(None, torch.device(device))

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False) -> OpenMLAMetadata:
        md = super().build(common_prefix_len, common_attn_metadata, fast_build)
        kv_cache = self._layers[0].kv_cache
        if kv_cache.numel() == 0:  # no cache bound yet (a profiling run): nothing to plan
            return md
        blocks = layer_blocks(kv_cache, self.cache_format)
        cm = common_attn_metadata
        nd, nr = md.num_decodes, cm.num_reqs
        if nd:
            md.decode_plan = self._plan(blocks, cm, 0, nd)
        if nr > nd:
            md.prefill_plan = self._plan(blocks, cm, nd, nr)
        return md

    def _plan(self, blocks: torch.Tensor, cm, lo: int, hi: int) -> MLAPlan:
        """The plan of requests ``lo:hi`` of the step."""
        offsets = _rows(cm.query_start_loc, lo, hi + 1)
        if lo:  # the prefills: their rows start after the decodes'
            offsets = offsets - offsets[0]
        cache_lengths = _rows(cm.seq_lens, lo, hi) - offsets.diff()  # tokens cached before this step
        batch = CacheBatch(blocks, _rows(cm.block_table_tensor, lo, hi), cache_lengths, offsets, page_size=int(blocks.shape[2]),
                           cache_format=self.cache_format, kv_scale=self.kv_scale, rope_dim=self.rope_dim)
        return openmla.plan(batch, scale=self.scale, decode_max_q_len=self.reorder_batch_threshold, backend=self.backend)


def _rows(t: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """``t[lo:hi]``, or ``t`` itself when that is all of it (a decode-only step: one torch call fewer
    each, and each costs tens of microseconds with the engine's caches cold)."""
    return t if lo == 0 and t.shape[0] == hi else t[lo:hi]
