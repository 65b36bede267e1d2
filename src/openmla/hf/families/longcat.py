"""Meituan's LongCat-Flash: two MLA blocks per decoder layer, each with DeepSeek-V3's attention and
scaled LoRA outputs (the query times ``sqrt(hidden / q_lora_rank)``, the normed latent times
``sqrt(hidden / kv_lora_rank)``), interleaved rope."""

from __future__ import annotations

from typing import Any

from .family import Family


def _qk_head_dim(hf_config: Any) -> str | None:
    want = hf_config.qk_nope_head_dim + hf_config.qk_rope_head_dim
    if getattr(hf_config, "qk_head_dim", want) != want:
        return f"qk_head_dim={hf_config.qk_head_dim} is not qk_nope_head_dim + qk_rope_head_dim = {want}"
    return None


LONGCAT_FLASH = Family(
    name="longcat_flash", model_types=("longcat_flash",), model_classes=("LongcatFlashForCausalLM",),
    attention_class="LongcatFlashMLA", rope_layout="interleave", sublayers=2, lora_scales="query",
    config_checks=(_qk_head_dim,), example="meituan-longcat/LongCat-Flash-Chat",
)
