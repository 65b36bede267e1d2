"""Per-step metadata: vLLM's MLA metadata plus one openmla plan per part of the batch.

vLLM orders a step's requests decodes first (one new token each), then prefills (new prompt
tokens, possibly a chunk after a cached prefix). ``forward_mqa`` gets the decode tokens and
``forward_mha`` the prefill tokens of every layer, so the builder plans each part once per
step: the validation, token positions and chunk plans are then shared by every layer. A plan
is made over the first layer's cache tensor ``[num_blocks, block_size, L+R]`` viewed as
``[1, num_blocks, block_size, L+R]`` (one layer of openmla's layout); each layer runs it over
its own tensor with ``MLAPlan.with_blocks``, at ``layer_idx`` 0.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from vllm.model_executor.layers.attention.mla_attention import (
    MLACommonDecodeMetadata,
    MLACommonMetadata,
    MLACommonMetadataBuilder,
)

import openmla
from openmla import CacheBatch, MLAPlan


@dataclass
class OpenMLAMetadata(MLACommonMetadata[MLACommonDecodeMetadata]):
    decode_plan: MLAPlan | None = None  # the first num_decodes requests
    prefill_plan: MLAPlan | None = None  # the other num_prefills requests


def layer_blocks(kv_cache: torch.Tensor) -> torch.Tensor:
    """vLLM's per-layer cache ``[num_blocks, block_size, L+R]`` as openmla's one-layer
    ``blocks [1, num_blocks, block_size, L+R]`` (a view: no copy)."""
    if kv_cache.dim() != 3 or not kv_cache.is_contiguous():
        raise ValueError(f"kv_cache: expected a contiguous [num_blocks, block_size, L+R] tensor, got shape "
                         f"{tuple(kv_cache.shape)} strides {kv_cache.stride()}")
    return kv_cache.unsqueeze(0)


class OpenMLAMetadataBuilder(MLACommonMetadataBuilder[OpenMLAMetadata]):
    """vLLM's MLA metadata builder, plus the step's openmla plans."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device, metadata_cls=OpenMLAMetadata)
        context = vllm_config.compilation_config.static_forward_context
        self._layers = [context[name] for name in layer_names]
        scales = {float(layer.scale) for layer in self._layers}
        if len(scales) != 1:
            raise NotImplementedError(f"openmla's vLLM backend plans a step for layers of one softmax scale, these have {sorted(scales)}")
        self.scale = scales.pop()
        self.backend = os.environ.get("OPENMLA_BACKEND") or None  # openmla's kernels: torch, triton, ... (None: by device)

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False) -> OpenMLAMetadata:
        md = super().build(common_prefix_len, common_attn_metadata, fast_build)
        kv_cache = self._layers[0].kv_cache
        if kv_cache.numel() == 0:  # no cache bound yet (a profiling run): nothing to plan
            return md
        blocks = layer_blocks(kv_cache)
        cm = common_attn_metadata
        nd, nr = md.num_decodes, cm.num_reqs
        if nd:
            md.decode_plan = self._plan(blocks, cm, 0, nd)
        if nr > nd:
            md.prefill_plan = self._plan(blocks, cm, nd, nr)
        return md

    def _plan(self, blocks: torch.Tensor, cm, lo: int, hi: int) -> MLAPlan:
        """The plan of requests ``lo:hi`` of the step."""
        offsets = cm.query_start_loc[lo: hi + 1]
        offsets = offsets - offsets[0]
        cache_lengths = cm.seq_lens[lo:hi] - offsets.diff()  # tokens cached before this step
        batch = CacheBatch(blocks, cm.block_table_tensor[lo:hi], cache_lengths, offsets, page_size=int(blocks.shape[2]))
        return openmla.plan(batch, scale=self.scale, decode_max_q_len=self.reorder_batch_threshold, backend=self.backend)
