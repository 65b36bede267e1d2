"""One packed ragged step of an attached model: every sequence's new tokens in one forward.

The step's tokens go to transformers as ``input_ids [1, T]`` with per-token ``position_ids``
(each sequence's cached length onward); the attention context, made once per step by
``step_context``, reaches every attached layer through transformers' keyword arguments.
Only the rows whose next token is wanted go through ``lm_head`` (``logits_to_keep``).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ..cache import CacheBatch, PagedLatentCache
from ..planning import MLAPlan, plan
from .state import Attachment, attachment
from .attention import INDEX_KWARG, STEP_KWARG, StepPlans
from .hybrid import LINEAR_KWARG
from .indexer import IndexStep


def _plan(state: Attachment, batch: CacheBatch, scale: float, window: int | None) -> MLAPlan:
    if window is None:
        return plan(batch, scale=scale, backend=state.backend)
    return plan(batch, scale=scale, mask="sliding_window_causal", window_size=window, backend=state.backend)


def _storage_batch(batch: CacheBatch, cache: PagedLatentCache) -> CacheBatch:
    """``batch`` (the page tables, lengths and rows of the attachment's first cache) over another
    storage of the same pages: the layers of another latent width (``Family.per_layer``), and its own rope
    width (Mistral Large 4: R = 64 and R = 0 storages)."""
    return dataclasses.replace(batch, blocks=cache.blocks, kv_scale=cache.kv_scale if batch.kv_scale is not None else None,
                               rope_dim=cache.rope_dim, _host=batch._host.copy())


def step_context(state: Attachment, batch: CacheBatch) -> MLAPlan | StepPlans:
    """The attention context every layer of one step receives, made once per step: one plan, or for a
    model whose layers differ in latent width, softmax scale or window, one plan per distinct kind."""
    keys = state.plan_keys or [(0, state.config.softmax_scale, None)]
    if len(keys) == 1:
        return _plan(state, batch, keys[0][1], keys[0][2])
    batches = [batch] + [_storage_batch(batch, c) for c in state.caches[1:]]
    return StepPlans(tuple(_plan(state, batches[g], scale, window) for g, scale, window in keys))


@torch.no_grad()  # not inference_mode: the torch backend keeps scratch tensors across calls, which must stay writable outside it
def forward_step(model: nn.Module, batch: CacheBatch, input_ids: torch.Tensor, logit_rows: torch.Tensor) -> torch.Tensor:
    """Run ``model`` on one packed step; returns the logits ``[len(logit_rows), vocab]`` of those rows.

    ``batch`` comes from the attached cache's ``prepare`` (the caller commits it afterwards);
    ``input_ids`` int64 ``[T]`` are the step's new tokens in ``batch``'s row order;
    ``logit_rows`` int64 ``[n]`` picks the rows whose logits are wanted.
    """
    state = attachment(model)
    T = batch.offsets_list[-1] if batch.offsets_list else 0
    if input_ids.dim() != 1 or input_ids.shape[0] != T:
        raise ValueError(f"input_ids: expected [{T}] (the batch's new tokens), got {tuple(input_ids.shape)}")
    device = state.cache.blocks.device
    context = {STEP_KWARG: step_context(state, batch)}
    if state.index_keys is not None:
        first = context[STEP_KWARG]
        context[INDEX_KWARG] = IndexStep.build(first.first if isinstance(first, StepPlans) else first, state.index_topk)
    if state.hybrid is not None:  # each sequence's linear-attention state (a hybrid model)
        context[LINEAR_KWARG] = state.hybrid.states.begin(batch.seq_ids, batch.cache_lengths_list, batch.new_tokens_list,
                                                          live=set(state.cache.sequences))
    out = model(
        input_ids=input_ids.to(device)[None],
        position_ids=batch.token_positions()[1].to(device)[None],  # the cache's one definition of positions
        use_cache=False,
        logits_to_keep=logit_rows.to(device),
        **context,
    )
    return out.logits[0]
