"""Greedy generation with vLLM's offline ``LLM`` in a fresh process (the plugin's registration
is process-wide): ``python generate.py SPEC.json`` prints one JSON line ``RESULT {...}`` with
the token ids of every round, the prompt tokens each request found in the prefix cache and the
engine settings that were in force (``amx_bmm``: the decode absorption ran on vLLM's ``bmm_cpu``).
A file ``{"cases": [SPEC, ...], ...}`` runs one engine per case, one after the other in this
process (importing vLLM takes ~13 s of a 2-core box's time; an engine a few), one RESULT line
each; its own ``no_amx`` and ``compare_with`` hold for every case.

RESULT also holds ``margins``: per generated token, the log-probability gap between the greedy
token and the runner-up (vLLM's top-2 logprobs).

SPEC: ``model`` (a checkpoint folder), ``rounds`` (lists of token-id prompts; each round is one
``generate`` call, so a later round can hit the prefix cache filled by an earlier one),
``max_tokens``, ``engine`` (extra ``LLM`` keywords), ``no_amx`` (hide AMX from vLLM, to take
its CPU platform's non-AMX path on any machine), ``compare_with`` (an openmla backend name: every
decode and prefill call of the plugin is also run by that backend on the same plan and cache,
with the layer's own fp8 scale, and RESULT gets the largest relative difference, ``max_rel_err``),
``k_scales`` (one fp8 ``k_scale`` per attention layer, set after the engine starts, as a
checkpoint's scales would be), ``fake_quant`` (``fp8_e4m3`` or ``fp8_ds_mla``: every layer's new
latents and rope keys are rounded through that fp8 format, here in plain torch, before the
attention backend sees them, so that vLLM's own backend on its native cache computes on the
values an fp8 cache stores), ``native_rope`` (turn vLLM's CPU rotary op off, as the plugin does for MLA models: the op
rotates an MLA query's rope part at the wrong positions, see cpu_platform.py; RESULT's
``native_rope`` says that the op did not run), ``expect_error`` (the engine is expected to refuse the case: RESULT
is ``{"error": "<type>: <message>"}``, or ``{"error": null}`` when it did not). RESULT's ``cache`` is
the first layer's cache tensor: dtype and shape; ``impls`` the impl classes of all ``attention_layers``
(a speculative draft model's layers among them); with tensor parallelism (workers in their own
processes) ``impl``, ``impls`` and ``cache`` say nothing (None, []): the workers' log lines do.

With the plugin, RESULT's ``decode_plans`` counts the step's decode plans by their largest number
of new tokens per request (``{"1": 40, "4": 12}``: 12 decode plans had a request with 4 query
tokens) and ``decode_max_q_len`` lists the thresholds they were made with. With a
``speculative_config`` in ``engine``, RESULT's ``spec_decode`` holds vLLM's own counters of the run
(``drafts``, ``draft_tokens``, ``accepted_tokens``).
"""

from __future__ import annotations

import dataclasses
import gc
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
    from openmla_tools.testing import rel_err

    def other(impl, plan, kv_cache, k_scale):
        batch = plan.batch.with_blocks(layer_blocks(kv_cache, impl.cache_format))
        if batch.cache_format == "fp8_e4m3":  # the layer's own scale, not the one the plugin copied for its plans
            batch = dataclasses.replace(batch, kv_scale=k_scale.reshape(1).clone())
        return openmla.plan(batch, scale=plan.spec.scale, backend=backend)

    mqa, mha = OpenMLAImpl.forward_mqa, OpenMLAImpl.forward_mha

    def forward_mqa(self, q, kv_cache, md, layer):
        out, lse = mqa(self, q, kv_cache, md, layer)
        q = torch.cat(q, dim=-1) if isinstance(q, tuple) else q
        want = other(self, md.decode_plan, kv_cache, layer._k_scale).decode(q, 0, kv_lora_rank=self.kv_lora_rank)
        ERRORS.append(rel_err(out, want))
        return out, lse

    def forward_mha(self, q, kv_c_normed, k_pe, kv_cache, md, k_scale, output, output_scale=None):
        mha(self, q, kv_c_normed, k_pe, kv_cache, md, k_scale, output, output_scale)
        want = other(self, md.prefill_plan, kv_cache, k_scale).prefill(q, 0, self.w_k, self.w_uv)
        ERRORS.append(rel_err(output.view(want.shape), want))

    OpenMLAImpl.forward_mqa, OpenMLAImpl.forward_mha = forward_mqa, forward_mha


FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


def fp8_round_trip(fmt: str, kv_c: torch.Tensor, k_pe: torch.Tensor, k_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What an fp8 cache of format ``fmt`` gives back for ``kv_c [T, L]`` and ``k_pe [T, 1, R]``,
    written from the format's definition (not openmla's code): fp8_e4m3 stores ``x / k_scale`` as
    float8_e4m3fn (saturated at +-448); fp8_ds_mla stores the latent as float8_e4m3fn in groups of
    128 values with one float32 scale ``amax / 448`` each (1 for a group of zeros) and the rope keys
    as bfloat16."""
    def e4m3(x, scale):
        return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale

    if fmt == "fp8_e4m3":
        return e4m3(kv_c, k_scale).to(kv_c.dtype), e4m3(k_pe, k_scale).to(k_pe.dtype)
    groups = kv_c.float().reshape(kv_c.shape[0], -1, 128)
    amax = groups.abs().amax(dim=-1, keepdim=True)
    scales = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return e4m3(groups, scales).reshape(kv_c.shape).to(kv_c.dtype), k_pe.to(torch.bfloat16).to(k_pe.dtype)


def fake_quant(fmt: str):
    """Round every MLA layer's new ``kv_c_normed`` and ``k_pe`` through ``fmt`` before its attention
    (cache write and prefill alike); returns the undo."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    forward = MLAAttention.forward

    def rounded(self, q, kv_c_normed, k_pe, *args, **kwargs):
        kv_c_normed, k_pe = fp8_round_trip(fmt, kv_c_normed, k_pe, self._k_scale)
        return forward(self, q, kv_c_normed, k_pe, *args, **kwargs)

    MLAAttention.forward = rounded
    return lambda: setattr(MLAAttention, "forward", forward)


DECODE_PLANS: dict[str, int] = {}
DECODE_THRESHOLDS: set[int] = set()


def record_decode_plans() -> None:
    """Count the plugin's decode plans by their largest per-request query length (``DECODE_PLANS``)."""
    from openmla.integrations.vllm.metadata import OpenMLAMetadataBuilder

    build = OpenMLAMetadataBuilder.build

    def recorded(self, *args, **kwargs):
        md = build(self, *args, **kwargs)
        if md.decode_plan is not None:
            key = str(md.decode_plan.batch.max_new_tokens)
            DECODE_PLANS[key] = DECODE_PLANS.get(key, 0) + 1
            DECODE_THRESHOLDS.add(md.decode_plan.decode_max_q_len)
        return md

    OpenMLAMetadataBuilder.build = recorded


SPEC_COUNTERS = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens": "accepted_tokens"}


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
    if os.environ.get("OPENMLA_VLLM"):
        record_decode_plans()
    for case in spec.get("cases", [spec]):
        ERRORS.clear()
        DECODE_PLANS.clear()
        DECODE_THRESHOLDS.clear()
        undo = fake_quant(case["fake_quant"]) if case.get("fake_quant") else None
        if case.get("expect_error"):
            try:
                run(case)
                result = dict(error=None)
            except Exception as e:  # noqa: BLE001  (the refusal is the result)
                result = dict(error=f"{type(e).__name__}: {e}")
        else:
            result = run(case)
        print("RESULT " + json.dumps(result), flush=True)
        if undo:
            undo()
        gc.collect()  # the engine goes before the next one starts


def run(spec: dict) -> dict:
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    engine = dict(dtype=spec.get("dtype", ENGINE_DTYPE), enforce_eager=True, max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=128,
                  enable_chunked_prefill=True, enable_prefix_caching=True, kv_cache_memory_bytes=64 << 20, seed=0)
    if spec.get("native_rope"):
        engine["compilation_config"] = {"custom_ops": ["all", "-rotary_embedding"]}
    engine.update(spec.get("engine", {}))
    speculative = "speculative_config" in engine
    if speculative:
        engine["disable_log_stats"] = False  # vLLM's spec-decode counters
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, **engine)
    context = llm.llm_engine.vllm_config.compilation_config.static_forward_context
    layers = [layer for layer in context.values() if hasattr(layer, "kv_cache") and hasattr(layer, "impl")]  # attention layers
    for layer, k_scale in zip(layers, spec.get("k_scales", [])):
        layer._k_scale.fill_(k_scale)
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
    layer = layers[0] if layers else None  # the first attention layer (None: the model runs in worker processes)
    impl = type(layer.impl) if layer is not None else None
    return dict(
        tokens=rounds, margins=margins, cached_tokens=cached, block_size=cfg.cache_config.block_size,
        chunked_prefill=cfg.scheduler_config.enable_chunked_prefill,
        prefix_caching=cfg.cache_config.enable_prefix_caching, impl=None if impl is None else f"{impl.__module__}.{impl.__qualname__}",
        impls=sorted({f"{type(a.impl).__module__}.{type(a.impl).__qualname__}" for a in layers}), attention_layers=len(layers),
        amx_bmm=bool(getattr(layer, "is_amx_bmm_enabled", False)),
        native_rope="rotary_embedding" not in cfg.compilation_config.enabled_custom_ops,
        cache=None if layer is None else [str(layer.kv_cache.dtype), list(layer.kv_cache.shape)],
        init_s=round(t1 - t0, 1), generate_s=round(t2 - t1, 1), calls_compared=len(ERRORS),
        max_rel_err=max(ERRORS, default=None), decode_plans=dict(DECODE_PLANS), decode_max_q_len=sorted(DECODE_THRESHOLDS),
        spec_decode={SPEC_COUNTERS[m.name]: m.value for m in llm.get_metrics() if m.name in SPEC_COUNTERS} if speculative else None)


if __name__ == "__main__":
    main(sys.argv[1])
