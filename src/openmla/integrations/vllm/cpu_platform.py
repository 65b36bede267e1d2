"""vLLM CPU platform settings for MLA models when openmla serves them (``OPENMLA_VLLM=1``).

1. Keep chunked prefill and prefix caching on a CPU without AMX. vLLM's CPU platform
   (``CpuPlatform.check_and_update_config``) assumes that an MLA model on a CPU without AMX runs
   its reference ``CPU_MLA`` backend, whose decode kernel needs 16-token pages and which cannot
   attend over a cached prefix; so it forces ``block_size=16`` and turns chunked prefill and
   prefix caching off. openmla has neither limit: the wrapper runs vLLM's check, then restores
   those three settings (and the token budget it raised) to what they were before it, with
   vLLM's usual CPU page size of 128 when none was asked for. On an AMX CPU vLLM changes none of
   them and the wrapper restores nothing.
2. Rotate the queries right. vLLM's CPU ``rotary_embedding`` op (``RotaryEmbedding.forward_cpu``,
   vLLM 0.32) treats a ``[T, H, R]`` query as ``[T, 1, R]`` rows: it rotates the first T of the
   T*H rope rows, row t at ``positions[t]``, and leaves the others as they are. MLA passes the
   query's rope part exactly so (``q[..., qk_nope_head_dim:]``), so every MLA model whose rope is
   vLLM's plain ``RotaryEmbedding`` (GLM-4.7-Flash; DeepSeek-V2 without YaRN) gets wrong queries
   that depend on the other tokens of the step, whichever attention backend runs (YaRN models
   use ``DeepseekScalingRotaryEmbedding``, which runs its PyTorch code and is right). The keys'
   ``[T, 1, R]`` rope part is right. The wrapper turns that op off (``-rotary_embedding`` in
   ``compilation_config.custom_ops``), so vLLM runs the op's PyTorch code (``forward_native``),
   unless the user turned it on explicitly (``+rotary_embedding``; a warning then says why not).
"""

from __future__ import annotations

import logging

DEFAULT_BLOCK_SIZE = 128  # what vLLM's CPU platform picks for its other backends
ROPE_OP = "rotary_embedding"  # vLLM's custom op name of RotaryEmbedding

logger = logging.getLogger("vllm.openmla")


def keep_cpu_scheduling() -> None:
    """Wrap ``CpuPlatform.check_and_update_config`` (once per process): for an MLA model, the
    scheduling settings (1.) and the rotary op (2.) of the module doc."""
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.__dict__["check_and_update_config"].__func__
    if getattr(original, "openmla_wrapped", False):
        return

    def check_and_update_config(cls, vllm_config) -> None:
        model, cache, sched = vllm_config.model_config, vllm_config.cache_config, vllm_config.scheduler_config
        mla = model is not None and getattr(model, "use_mla", False) and getattr(model.hf_config, "model_type", None) != "deepseek_v4"
        before = (sched.enable_chunked_prefill, cache.enable_prefix_caching, sched.max_num_batched_tokens)
        user_block = cache.block_size if cache.user_specified_block_size else None
        original(cls, vllm_config)
        if not mla:
            return
        cache.block_size = user_block or (cache.block_size if cache.block_size != 16 else DEFAULT_BLOCK_SIZE)
        sched.enable_chunked_prefill, cache.enable_prefix_caching, sched.max_num_batched_tokens = before
        native_rope(vllm_config.compilation_config)

    check_and_update_config.openmla_wrapped = True
    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)


def native_rope(compilation_config) -> None:
    """Turn vLLM's CPU rotary_embedding op off (see the module doc, 2.) unless the user turned it on."""
    ops = compilation_config.custom_ops
    if f"+{ROPE_OP}" in ops:
        logger.warning("openmla: +%s keeps vLLM's CPU rotary op, which rotates an MLA query's rope part at the wrong "
                       "positions (vLLM 0.32); drop it to let openmla turn the op off", ROPE_OP)
    elif f"-{ROPE_OP}" not in ops:
        ops.append(f"-{ROPE_OP}")
