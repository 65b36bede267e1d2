"""Keep chunked prefill and prefix caching when openmla serves MLA on a CPU without AMX.

vLLM's CPU platform (``CpuPlatform.check_and_update_config``) assumes that an MLA model on a
CPU without AMX runs its reference ``CPU_MLA`` backend, whose decode kernel needs 16-token
pages and which cannot attend over a cached prefix; so it forces ``block_size=16`` and turns
chunked prefill and prefix caching off. openmla has neither limit. With ``OPENMLA_VLLM=1``
this wrapper runs vLLM's check, then restores those three settings (and the token budget it
raised) to what they were before it, with vLLM's usual CPU page size of 128 when none was
asked for. On an AMX CPU vLLM changes none of them and the wrapper restores nothing.
"""

from __future__ import annotations

DEFAULT_BLOCK_SIZE = 128  # what vLLM's CPU platform picks for its other backends


def keep_cpu_scheduling() -> None:
    """Wrap ``CpuPlatform.check_and_update_config`` (once per process)."""
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

    check_and_update_config.openmla_wrapped = True
    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
