"""``OpenMLABackend``: vLLM's descriptor of the openmla MLA backend (what it supports, which
impl and metadata builder it uses)."""

from __future__ import annotations

from typing import ClassVar

import torch
from vllm.model_executor.layers.attention.mla_attention import MLACommonBackend
from vllm.v1.attention.backend import MultipleOf

from .plugin import BACKEND_NAME


class OpenMLABackend(MLACommonBackend):
    """Dense MLA (DeepSeek-V2/V3, Kimi K2) on a native (unquantized) latent cache of any page
    size, in bf16, fp16 or fp32; on the CPU and, through openmla's Triton backend, on CUDA."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16, torch.float16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto"]

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
