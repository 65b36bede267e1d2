"""Greedy generation with vLLM's offline ``LLM`` in a fresh process (the plugin's registration
is process-wide): ``python generate.py SPEC.json`` prints one JSON line ``RESULT {...}`` with
the token ids of every round, the prompt tokens each request found in the prefix cache and the
engine settings that were in force (``amx_bmm``: the decode absorption ran on vLLM's AMX bmm).

RESULT also holds ``margins``: per generated token, the log-probability gap between the greedy
token and the runner-up (vLLM's top-2 logprobs).

SPEC: ``model`` (a checkpoint folder), ``rounds`` (lists of token-id prompts; each round is one
``generate`` call, so a later round can hit the prefix cache filled by an earlier one),
``max_tokens``, ``engine`` (extra ``LLM`` keywords), ``no_amx`` (hide AMX from vLLM, to take
its CPU platform's non-AMX path on any machine), ``compare_with`` (an openmla backend name: every
decode and prefill call of the plugin is also run by that backend on the same plan and cache,
and RESULT gets the largest relative difference, ``max_rel_err``).
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from models import ENGINE_DTYPE  # tests_vllm/ (this script's folder is on sys.path)

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process


ERRORS: list[float] = []


def compare_with(backend: str) -> None:
    """Wrap the plugin's decode and prefill to rerun each call with ``backend`` (same plan
    metadata, same cache) and record the relative difference of the outputs in ``ERRORS``."""
    import openmla
    from openmla.integrations.vllm.impl import OpenMLAImpl
    from openmla.integrations.vllm.metadata import layer_blocks
    from openmla.testing import rel_err

    def other(plan, kv_cache):
        return openmla.plan(plan.batch.with_blocks(layer_blocks(kv_cache)), scale=plan.spec.scale, backend=backend)

    mqa, mha = OpenMLAImpl.forward_mqa, OpenMLAImpl.forward_mha

    def forward_mqa(self, q, kv_cache, md, layer):
        out, lse = mqa(self, q, kv_cache, md, layer)
        q = torch.cat(q, dim=-1) if isinstance(q, tuple) else q
        ERRORS.append(rel_err(out, other(md.decode_plan, kv_cache).decode(q, 0, kv_lora_rank=self.kv_lora_rank)))
        return out, lse

    def forward_mha(self, q, kv_c_normed, k_pe, kv_cache, md, k_scale, output, output_scale=None):
        mha(self, q, kv_c_normed, k_pe, kv_cache, md, k_scale, output, output_scale)
        want = other(md.prefill_plan, kv_cache).prefill(q, 0, self.w_k, self.w_uv)
        ERRORS.append(rel_err(output.view(want.shape), want))

    OpenMLAImpl.forward_mqa, OpenMLAImpl.forward_mha = forward_mqa, forward_mha


def _margin(step: dict) -> float:
    """Log-probability gap between the greedy token and the runner-up at one step (a near-tie
    is a step whose token any rounding difference may flip)."""
    top = sorted((lp.logprob for lp in step.values()), reverse=True)
    return top[0] - top[1] if len(top) > 1 else float("inf")


def main(path: str) -> None:
    spec = json.loads(open(path).read())
    if spec.get("no_amx"):
        torch.cpu._is_amx_tile_supported = lambda: False
    if spec.get("compare_with"):
        compare_with(spec["compare_with"])
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    engine = dict(dtype=spec.get("dtype", ENGINE_DTYPE), enforce_eager=True, max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=128,
                  enable_chunked_prefill=True, enable_prefix_caching=True, kv_cache_memory_bytes=64 << 20, seed=0)
    engine.update(spec.get("engine", {}))
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, **engine)
    t1 = time.perf_counter()
    params = SamplingParams(temperature=0.0, max_tokens=spec.get("max_tokens", 8), ignore_eos=True, logprobs=2)
    rounds, cached, margins = [], [], []
    for prompts in spec["rounds"]:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        rounds.append([list(o.outputs[0].token_ids) for o in outs])
        cached.append([o.num_cached_tokens or 0 for o in outs])  # prompt tokens read from the prefix cache
        margins.append([[_margin(step) for step in (o.outputs[0].logprobs or [])] for o in outs])
    t2 = time.perf_counter()
    cfg = llm.llm_engine.vllm_config
    layer = next(iter(cfg.compilation_config.static_forward_context.values()))  # the first attention layer
    impl = type(layer.impl)
    print("RESULT " + json.dumps(dict(
        tokens=rounds, margins=margins, cached_tokens=cached, block_size=cfg.cache_config.block_size,
        chunked_prefill=cfg.scheduler_config.enable_chunked_prefill,
        prefix_caching=cfg.cache_config.enable_prefix_caching, impl=f"{impl.__module__}.{impl.__qualname__}",
        amx_bmm=bool(getattr(layer, "is_amx_bmm_enabled", False)),
        init_s=round(t1 - t0, 1), generate_s=round(t2 - t1, 1), calls_compared=len(ERRORS),
        max_rel_err=max(ERRORS, default=None))), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
