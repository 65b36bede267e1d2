"""``OpenMLABackend``: vLLM's descriptor of the openmla MLA backend (what it supports, which
impl and metadata builder it uses)."""

from __future__ import annotations

from typing import ClassVar

import torch
from vllm.model_executor.layers.attention.mla_attention import MLACommonBackend
from vllm.v1.attention.backend import MultipleOf

from .metadata import KV_CACHE_FORMATS
from .plugin import BACKEND_NAME


class OpenMLABackend(MLACommonBackend):
    """Dense MLA (DeepSeek-V2/V3, Kimi K2, GLM-4.7-Flash, ...) on a latent cache of any page size,
    in bf16, fp16 or fp32 models; the cache native (``auto``), ``fp8`` / ``fp8_e4m3`` (per-tensor
    ``k_scale``) or ``fp8_ds_mla`` (656-byte records: kv_lora_rank 512, rope 64), each read and
    written in place in openmla's format of the same bytes; on the CPU and, through openmla's
    Triton backend, on CUDA."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16, torch.float16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = list(KV_CACHE_FORMATS)

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(1)]

    @staticmethod
    def get_impl_cls():
        from .impl import OpenMLAImpl

        return OpenMLAImpl

    @staticmethod
    def get_builder_cls():
        from .metadata import OpenMLAMetadataBuilder

        return OpenMLAMetadataBuilder
