"""``DeepseekV4ForCausalLM`` on openmla: attach, one packed step, greedy generation.

``attach_v4`` (reached through ``openmla.hf.attach``) checks the model, then seats every
decoder layer's ``self_attn`` on a ``V4Attention`` that adopts the module's submodules and
parameters (same objects, same names: the projections, norms, ``sinks``, the compressor and
its indexer). One ``openmla.v4.V4Cache`` serves all layers: raw entries in a sliding store,
compressed entries (and the CSA indexer's keys) in paged stores beside them, and each
(sequence, layer)'s compressor state. Per layer and step: q and the entry as transformers
computes them (RMSNorm, RoPE from the model's own tables), the entry written to the raw store,
each sequence's compressor run on its new tokens with its own state (``v4_compress``), the
indexer's picks for CSA layers, ``openmla.v4`` attention (window + compressed keys + sinks), the
output's inverse RoPE, the grouped output projection. Everything else (embeddings,
hyper-connections, MoE, norms, ``lm_head``) stays transformers' code.

``forward_step_v4`` runs one packed ragged step (sequences' new tokens in one ``[1, T]``
forward); ``generate_v4`` is greedy continuous batching over it with chunked prefill.
Preemption (on a full pool) is not done: ``CacheFullError`` reaches the caller.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable, Sequence

import torch
from torch import nn

from ..cache import CacheFullError
from ..v4 import CompressedKeys, EntryLayout, SharedKVSpec, plan_shared_kv
from ..v4.cache import V4Cache, V4Layout
from ..shared_kv_spec import physical_rows
from .implementation import ATTN_IMPLEMENTATION, packed_step, register
from .v4_compress import compress, top_k
from .verify import check_inputs, check_steps, openmla_outputs, transformers_outputs, unverified_warning, worst_difference

STEP_KWARG = "openmla_v4_step"
MODEL_CLASS = "DeepseekV4ForCausalLM"
_ATTR = "_openmla_v4"
CSA, HCA, SLIDING = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"


@dataclass
class V4Step:
    """What every layer of one packed step reads (made once per step)."""

    cache: V4Cache
    seq_ids: list
    counts: list[int]
    before: list[int]
    q_offsets: torch.Tensor  # int64 [B+1]
    positions: torch.Tensor  # int64 [T]
    raw_table: tuple[torch.Tensor, torch.Tensor]
    raw_rows: torch.Tensor
    tables: dict = field(default_factory=dict)  # kind -> (table, rows, new entries per sequence)
    index_table: tuple | None = None
    backend: str | None = None
    offsets: list[int] = field(default_factory=list)  # q_offsets on the host
    plans: dict = field(default_factory=dict)  # layer kind -> the step's validated SharedKVPlan


@dataclass
class V4Attachment:
    cache: V4Cache
    layers: list
    originals: list
    previous_attn_implementation: str | None
    backend: str | None
    vocab_size: int
    preemptions: int = 0  # sequences generate_v4 preempted (released, prefilled again) on a full pool


def _rope():
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb

    return apply_rotary_pos_emb


class V4Attention(nn.Module):
    """A transformers ``DeepseekV4Attention``'s submodules and parameters on openmla's stores and kernels."""

    def __init__(self, module: nn.Module, layer_idx: int, slot: int | None, config: Any) -> None:
        super().__init__()
        for name, child in module.named_children():
            setattr(self, name, child)
        for name, param in module.named_parameters(recurse=False):
            setattr(self, name, param)
        self.layer_idx, self.slot = layer_idx, slot
        self.layer_type = module.layer_type
        self.rope_layer_type = module.rope_layer_type
        self.num_heads, self.head_dim, self.scaling = module.num_heads, module.head_dim, module.scaling
        self.window = int(config.sliding_window)
        self.rope_dim = int(config.qk_rope_head_dim)
        self.o_groups = int(config.o_groups)
        self.rate = int(config.compress_rates[self.layer_type]) if self.layer_type != SLIDING else None

    def forward(self, hidden_states: torch.Tensor, position_embeddings: Any = None, *args: Any, **kwargs: Any) -> tuple:
        step = packed_step(hidden_states, kwargs, STEP_KWARG, V4Step, hint="run it through openmla.hf.v4.generate_v4 / "
                           "forward_step_v4, or call openmla.hf.detach(model) first")
        rope = _rope()
        h = hidden_states[0]
        T, H, D = h.shape[0], self.num_heads, self.head_dim
        cos, sin = position_embeddings[self.rope_layer_type]  # transformers' tables at the step's positions [1, T, R/2]
        q_residual = self.q_a_norm(self.q_a_proj(h))
        q = self.q_b_norm(self.q_b_proj(q_residual).view(T, H, D))
        q = rope(q[None], cos, sin, unsqueeze_dim=2)[0]
        kv = rope(self.kv_norm(self.kv_proj(h))[None, None], cos, sin)[0, 0]
        cache = step.cache
        cache.raw.write(self.layer_idx, step.raw_rows, kv)
        comp_view, keys = None, None
        if self.layer_type != SLIDING:
            keys = CompressedKeys(self.rate, self._compress(step, h, q_residual))
            table, _, _ = step.tables[self.layer_type]
            comp_view = cache.compressed[self.layer_type].view(self.slot, table)
        spec = SharedKVSpec(float(self.scaling), self.window, EntryLayout(D, self.rope_dim), keys, self.sinks.float())
        raw_view = cache.raw.view(self.layer_idx, step.raw_table)
        planned = step.plans.get(self.layer_type)  # the first layer of a kind validates the step, the rest reuse it
        if planned is None:
            planned = step.plans[self.layer_type] = plan_shared_kv(q, step.q_offsets, raw_view, spec, comp_view, backend=step.backend)
        else:
            planned = planned.for_layer(raw_view, spec, comp_view)
        out, _ = planned.run(q)
        out = rope(out[None], cos, -sin, unsqueeze_dim=2)  # the value's rope slice rotated back to the query's position
        grouped = self.o_a_proj(out.reshape(1, T, self.o_groups, -1)).flatten(2)
        return self.o_b_proj(grouped), None

    def _compress(self, step: V4Step, h: torch.Tensor, q_residual: torch.Tensor) -> torch.Tensor | None:
        """Run this layer's compressor (and indexer) on each sequence's new tokens; write the
        entries; return the CSA picks ``[T, K]`` (-1: none) or None (HCA: every entry by the rule)."""
        cache, kind, comp = step.cache, self.layer_type, self.compressor
        csa = kind == CSA
        table, rows, new = step.tables[kind]
        offs = step.offsets
        entries, index_keys = [], []
        for b, s in enumerate(step.seq_ids):
            hb = h[offs[b]:offs[b + 1]]
            state = cache.state.setdefault((s, self.layer_idx), {})
            e = compress(comp, hb, state.setdefault("compressor", {}), self.rate, self.head_dim, overlap=csa)
            if e.shape[0] != new[b]:
                raise RuntimeError(f"V4Attention: layer {self.layer_idx} emitted {e.shape[0]} entries for sequence {s!r}, "
                                   f"the store reserved {new[b]}")
            entries.append(e)
            if csa:
                ix = comp.indexer
                index_keys.append(compress(ix, hb, state.setdefault("indexer", {}), self.rate, ix.head_dim, overlap=True))
        cache.compressed[kind].write(self.slot, rows, torch.cat(entries))
        if not csa:
            return None
        index_store = cache.index
        itable, irows, _ = step.index_table
        index_store.write(self.slot, irows, torch.cat(index_keys))
        flat = index_store.blocks[self.slot].view(-1, index_store.width)
        lengths = [index_store.length(s) for s in step.seq_ids]  # host lengths: no device read
        picks = []
        for b in range(len(step.seq_ids)):
            all_rows = physical_rows(itable[0], torch.tensor(b), torch.arange(lengths[b], device=h.device), index_store.page_size)
            picks.append(top_k(comp.indexer, h[offs[b]:offs[b + 1]], q_residual[offs[b]:offs[b + 1]],
                               step.positions[offs[b]:offs[b + 1]], flat[all_rows], self.rate))
        width = max([p.shape[1] for p in picks] + [0])
        return torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1]), value=-1) for p in picks])


# Attach ------------------------------------------------------------------------------------
def is_v4(model: nn.Module) -> bool:
    return type(model).__name__ == MODEL_CLASS


def _check(model: nn.Module) -> tuple[Any, nn.ModuleList]:
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
        DeepseekV4Attention, DeepseekV4CSACompressor, DeepseekV4HCACompressor, DeepseekV4Indexer)

    config = model.config
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise ValueError("model: DeepseekV4ForCausalLM has no decoder layers at model.layers")
    window = getattr(config, "sliding_window", None)
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"sliding_window: every V4 layer reads a sliding window of raw entries; expected an int >= 1, got {window!r}")
    for kind in set(config.layer_types) - {SLIDING}:
        rate = (config.compress_rates or {}).get(kind)
        if isinstance(rate, bool) or not isinstance(rate, int) or rate < 1:
            raise ValueError(f"compress_rates: {kind} needs an int rate >= 1, got {rate!r}")
    if int(config.num_key_value_heads) != 1:
        raise ValueError(f"num_key_value_heads: V4 attention shares one entry across heads; got {config.num_key_value_heads}")
    if (config.num_attention_heads * config.head_dim) % config.o_groups:
        raise ValueError("o_groups: must divide num_attention_heads * head_dim")
    if config.qk_rope_head_dim % 2 or not 0 < config.qk_rope_head_dim <= config.head_dim:
        raise ValueError(f"qk_rope_head_dim: expected an even width in (0, head_dim], got {config.qk_rope_head_dim}")
    if getattr(config, "attention_dropout", 0.0) and model.training:
        raise ValueError("attention_dropout: openmla runs inference only (call model.eval())")
    expected = {SLIDING: type(None), CSA: DeepseekV4CSACompressor, HCA: DeepseekV4HCACompressor}
    for i, layer in enumerate(layers):
        attn = getattr(layer, "self_attn", None)
        if type(attn) is not DeepseekV4Attention:
            raise ValueError(f"model.layers.{i}.self_attn: expected transformers' DeepseekV4Attention, got {type(attn).__name__}")
        if attn.layer_type not in expected or type(attn.compressor) is not expected[attn.layer_type]:
            raise ValueError(f"model.layers.{i}.self_attn: layer type {attn.layer_type!r} with compressor "
                             f"{type(attn.compressor).__name__} is not one openmla reproduces")
        if attn.layer_type == CSA and type(attn.compressor.indexer) is not DeepseekV4Indexer:
            raise ValueError(f"model.layers.{i}.self_attn.compressor.indexer: expected transformers' DeepseekV4Indexer")
    return config, layers


def attach_v4(model: nn.Module, num_pages: int, page_size: int = 64, cache_dtype: Any = None, *,
              backend: str | None = None, compressed_pages: int | None = None, verify: bool = True) -> V4Cache:
    """Route every attention layer of a ``DeepseekV4ForCausalLM`` through openmla; returns the cache.

    ``num_pages`` x ``page_size`` raw entries per layer (a sliding layer keeps about
    ``sliding_window + page_size`` per sequence); ``compressed_pages`` pages for each compressed
    store (default ``num_pages``). Entries are stored in the attention weights' dtype
    (``cache_dtype`` None or that dtype: V4's FP8 record is not done yet). ``verify``: the self-check
    of ``openmla.hf.attach`` (every layer against transformers' own forward on random inputs), else a warning.
    """
    if getattr(model, _ATTR, None) is not None:
        raise ValueError("model: already attached; call openmla.hf.detach(model) first")
    config, layers = _check(model)
    weight = layers[0].self_attn.kv_proj.weight
    if cache_dtype is not None and cache_dtype != weight.dtype:
        raise ValueError(f"cache_dtype: DeepSeek-V4 entries are stored in the weights' dtype {weight.dtype} for now "
                         f"(FlashMLA's V4 FP8 record is not wired in), got {cache_dtype!r}")
    if verify:
        _verify(model, config, layers, page_size, backend)
    else:
        unverified_warning(type(model).__name__)
    return _seat(model, config, layers, num_pages, page_size, backend, compressed_pages)


def _seat(model: nn.Module, config: Any, layers: nn.ModuleList, num_pages: int, page_size: int, backend: str | None,
          compressed_pages: int | None) -> V4Cache:
    weight = layers[0].self_attn.kv_proj.weight
    types = tuple(layer.self_attn.layer_type for layer in layers)
    rates = tuple((k, int(config.compress_rates[k])) for k in (CSA, HCA) if k in types)
    layout = V4Layout(types, int(config.head_dim), int(config.qk_rope_head_dim), int(config.sliding_window), rates,
                      int(config.index_head_dim) if CSA in types else None)
    cache = V4Cache(layout, num_pages, page_size, weight.dtype, weight.device, compressed_pages)
    originals = [layer.self_attn for layer in layers]
    attached = [V4Attention(m, i, cache.slot[i], config) for i, m in enumerate(originals)]
    register()
    previous = config._attn_implementation
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    for layer, module in zip(layers, attached):
        layer.self_attn = module
    setattr(model, _ATTR, V4Attachment(cache, attached, originals, previous, backend, int(config.vocab_size)))
    return cache


def _verify(model: nn.Module, config: Any, layers: nn.ModuleList, page_size: int, backend: str | None) -> None:
    """``openmla.hf.verify``'s self-check: ``ValueError`` (the model left as it was) when a layer differs."""
    modules = [layer.self_attn for layer in layers]
    weight = modules[0].kv_proj.weight
    topk = int(getattr(config, "index_topk", 0) or 0) if CSA in {m.layer_type for m in modules} else 0
    steps = check_steps(int(config.vocab_size), topk)
    inputs = check_inputs(steps, modules, int(config.hidden_size))
    want = transformers_outputs(model, modules, steps, inputs)
    cache = _seat(model, config, layers, -(-steps.total // page_size) + 1, page_size, backend, None)
    key = ("openmla.hf.verify", id(model))

    def run_step(i: int, ids: torch.Tensor) -> None:
        forward_step_v4(model, [key], [ids.tolist()], torch.tensor([int(ids.numel()) - 1]))

    try:
        got = openmla_outputs(v4_attachment(model).layers, steps, inputs, run_step)
    finally:
        if cache.has(key):
            cache.release(key)
        detach_v4(model)
    difference = worst_difference(want, got, [f"model.layers.{i}.self_attn" for i in range(len(modules))], steps, weight.dtype)
    if difference is not None:
        raise ValueError(difference.message(type(model).__name__))


def is_attached(model: nn.Module) -> bool:
    """Whether ``model`` is a DeepSeek-V4 model attached to openmla."""
    return getattr(model, _ATTR, None) is not None


def v4_attachment(model: nn.Module) -> V4Attachment:
    found = getattr(model, _ATTR, None)
    if found is None:
        raise ValueError("model: not attached to openmla; call openmla.hf.attach(model, num_pages=...) first")
    return found


def detach_v4(model: nn.Module) -> None:
    state = v4_attachment(model)
    for layer, module in zip(model.model.layers, state.originals):
        layer.self_attn = module
    if state.previous_attn_implementation is not None:
        model.set_attn_implementation(state.previous_attn_implementation)
    delattr(model, _ATTR)


# One step and generation ---------------------------------------------------------------------
def _step(cache: V4Cache, seq_ids: list, counts: list[int], backend: str | None) -> V4Step:
    before = cache.extend(seq_ids, counts)
    dev = cache.raw.blocks.device
    raw_table = cache.raw.table(seq_ids)
    offsets = torch.tensor([0] + torch.tensor(counts, dtype=torch.int64).cumsum(0).tolist(), dtype=torch.int64)
    positions = torch.cat([torch.arange(c, c + n) for c, n in zip(before, counts)] or [torch.zeros(0, dtype=torch.int64)])
    step = V4Step(cache, list(seq_ids), list(counts), before, offsets.to(dev), positions.to(dev), raw_table,
                  cache.raw.rows(raw_table, counts), backend=backend, offsets=offsets.tolist())
    for kind, store in cache.compressed.items():
        rate = cache.layout.rate(kind)
        new = [(c + n) // rate - c // rate for c, n in zip(before, counts)]
        table = store.table(seq_ids)
        step.tables[kind] = (table, store.rows(table, new), new)
        if kind == CSA:
            itable = cache.index.table(seq_ids)
            step.index_table = (itable, cache.index.rows(itable, new), new)
    return step


@torch.no_grad()
def forward_step_v4(model: nn.Module, seq_ids: Sequence[Hashable], input_ids: Sequence[Sequence[int]],
                    logit_rows: torch.Tensor) -> torch.Tensor:
    """Run one packed step: ``input_ids[b]`` are sequence ``seq_ids[b]``'s new tokens (a new id
    starts empty). Returns the logits ``[len(logit_rows), vocab]`` of those packed rows. The
    step's entries are reserved before the forward: if it raises, release its sequences
    (``cache.release``), whose compressor state may be part-way through the step."""
    state = v4_attachment(model)
    cache = state.cache
    counts = [len(x) for x in input_ids]
    step = _step(cache, list(seq_ids), counts, state.backend)
    dev = cache.raw.blocks.device
    ids = torch.tensor([t for x in input_ids for t in x], dtype=torch.long, device=dev)
    try:
        out = model(input_ids=ids[None], position_ids=step.positions[None], use_cache=False,
                    logits_to_keep=logit_rows.to(dev), **{STEP_KWARG: step})
    finally:
        cache.trim(list(seq_ids))
    return out.logits[0]


def generate_v4(model: nn.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                prefill_chunk: int | None = None, max_running: int | None = None,
                eos_token_id: int | Sequence[int] | None = None, return_logits: bool = False,
                ) -> list[list[int]] | tuple[list[list[int]], list[list[torch.Tensor]]]:
    """Greedy generation for every prompt (continuous batching: decodes and prefill chunks of up
    to ``prefill_chunk`` tokens share each step; at most ``max_running`` sequences at once).
    When the pool cannot hold a step, the newest running sequence is preempted (its pages and
    compressor state released; it is prefilled again from its prompt and generated tokens); a
    single sequence that does not fit raises ``CacheFullError``. A sequence ends after
    ``max_new_tokens`` or on a token of ``eos_token_id`` (kept, as transformers does). Returns the
    generated tokens per prompt (and each token's logits with ``return_logits``)."""
    state = v4_attachment(model)
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected a positive int, got {max_new_tokens!r}")
    if prefill_chunk is not None and (not isinstance(prefill_chunk, int) or prefill_chunk < 1):
        raise ValueError(f"prefill_chunk: expected None or a positive int, got {prefill_chunk!r}")
    eos_ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or [])
    if isinstance(eos_token_id, bool) or not all(isinstance(t, int) and not isinstance(t, bool) for t in eos_ids):
        raise ValueError(f"eos_token_id: expected None, an int or a list of ints, got {eos_token_id!r}")
    eos = frozenset(eos_ids)
    seqs = []
    for i, p in enumerate(prompts):
        p = list(p)
        if not p or not all(isinstance(t, int) and 0 <= t < state.vocab_size for t in p):
            raise ValueError(f"prompts[{i}]: expected a non-empty list of token ids in [0, {state.vocab_size})")
        seqs.append({"id": ("openmla.v4", id(seqs), i), "tokens": p, "prompt": len(p), "done": 0, "out": [], "logits": []})
    waiting = list(seqs)
    running: list[dict] = []
    limit = max_running or len(seqs)
    try:
        while waiting or running:
            while waiting and len(running) < limit:
                running.append(waiting.pop(0))
            ids, feed = [], []
            for s in running:
                pending = s["tokens"][s["done"]:]
                n = len(pending) if prefill_chunk is None else min(len(pending), prefill_chunk)
                ids.append(s["id"])
                feed.append(pending[:n])
            ends = torch.tensor(feed and [len(x) for x in feed]).cumsum(0) - 1
            reach = [s["done"] + len(f) == len(s["tokens"]) for s, f in zip(running, feed)]
            rows = ends[torch.tensor(reach, dtype=torch.bool)]
            try:
                logits = forward_step_v4(model, ids, feed, rows)
            except CacheFullError:  # nothing was reserved: preempt the newest sequence, prefill it again later
                if len(running) == 1:
                    raise
                victim = running.pop()
                state.cache.release(victim["id"])
                victim["done"] = 0
                waiting.insert(0, victim)
                limit = len(running)  # until a sequence finishes
                state.preemptions += 1
                continue
            j = 0
            for s, f, r in zip(running, feed, reach):
                s["done"] += len(f)
                if r:
                    row = logits[j].float()
                    j += 1
                    s["out"].append(int(row.argmax()))
                    s["tokens"].append(s["out"][-1])
                    if return_logits:
                        s["logits"].append(row.cpu())
            for s in [s for s in running if len(s["out"]) >= max_new_tokens or (s["out"] and s["out"][-1] in eos)]:
                running.remove(s)
                state.cache.release(s["id"])
                limit = max_running or len(seqs)
    finally:
        for s in seqs:
            if state.cache.has(s["id"]):
                state.cache.release(s["id"])
    outs = [s["out"] for s in seqs]
    return (outs, [s["logits"] for s in seqs]) if return_logits else outs
