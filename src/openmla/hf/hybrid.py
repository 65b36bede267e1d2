"""Linear-attention layers of hybrid models (Ling 3's KDA layers) under openmla's packed ragged step.

A hybrid model (``Family.linear_attention``) has linear-attention layers between its MLA layers:
each keeps a causal-conv state and a recurrent state per sequence, which transformers holds per
batch row in its own cache object. openmla runs a whole continuous batch as one packed step
``[1, T, hidden]``, so such a layer would see every sequence of the step as one. Here:

- ``LinearStates`` keeps one transformers ``DynamicCache`` (built from the model's config: the
  same ``LinearAttentionLayer`` state objects transformers' own generation uses) per sequence id,
  created at the sequence's first prefill chunk (its cached length is 0: a preempted sequence
  prefilled again starts over), carried between prefill chunks and decode steps, and dropped when
  the sequence finishes, is preempted or leaves the cache. Each state counts the tokens it has
  consumed; a step whose cached length differs (a step not committed, or run twice) is a ValueError.
- ``AttachedLinearAttention`` takes a linear-attention module's place in its decoder layer, sharing
  its submodules and parameters (same objects, same names), and runs the module itself on each
  sequence's rows of the step with that sequence's state: one call of the layer per sequence per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable, Sequence

import torch
from torch import nn

from .families import Family
from .implementation import packed_step

LINEAR_KWARG = "openmla_linear_step"  # the keyword a step's per-sequence states travel under


@dataclass(frozen=True)
class LinearStep:
    """Per sequence of one packed step: its rows ``[start, end)`` and its state (a transformers ``Cache``)."""

    parts: tuple[tuple[int, int, Any], ...]


@dataclass
class _State:
    cache: Any  # transformers DynamicCache: one LinearAttentionLayer per linear layer of the model
    seen: int = 0  # tokens of the sequence the state has consumed


class LinearStates:
    """The per-sequence linear-attention states of one attached hybrid model, by cache sequence id."""

    def __init__(self, hf_config: Any) -> None:
        self.hf_config = hf_config
        self._states: dict[Hashable, _State] = {}

    def __len__(self) -> int:
        return len(self._states)

    def new_cache(self) -> Any:
        from transformers.cache_utils import DynamicCache

        return DynamicCache(config=self.hf_config)

    def begin(self, seq_ids: Sequence[Hashable], cache_lengths: Sequence[int], counts: Sequence[int],
              live: Any = None) -> LinearStep:
        """The ``LinearStep`` of a step whose sequences ``seq_ids`` hold ``cache_lengths`` tokens and bring
        ``counts`` new ones (packed in that order). A sequence at length 0 gets a fresh state. ``live``: the
        ids the cache still holds; states of other ids are dropped (forward_step called directly)."""
        if live is not None:
            for key in [k for k in self._states if k not in live]:
                del self._states[key]
        for key, length, n in zip(seq_ids, cache_lengths, counts):  # every check before any state changes
            state = self._states.get(key)
            if n and length and (state is None or state.seen != length):
                have = "no linear-attention state" if state is None else f"a linear-attention state of {state.seen} tokens"
                raise ValueError(f"batch: sequence {key!r} holds {length} cached tokens but {have}: every step of a hybrid "
                                 "model must run once through openmla.hf.forward_step and be committed")
        parts, start = [], 0
        for key, length, n in zip(seq_ids, cache_lengths, counts):
            if n == 0:
                continue
            if length == 0:  # a first prefill chunk (again, after a preemption): a fresh state
                self._states[key] = _State(self.new_cache())
            state = self._states[key]
            state.seen += n
            parts.append((start, start + n, state.cache))
            start += n
        return LinearStep(tuple(parts))

    def drop(self, seq_id: Hashable) -> None:
        """Forget ``seq_id``'s state (it finished, was preempted or left the cache)."""
        self._states.pop(seq_id, None)

    def clear(self) -> None:
        self._states.clear()


class AttachedLinearAttention(nn.Module):
    """A linear-attention module of a hybrid model, run per sequence of a packed step with that sequence's state.

    Holds the module's submodules and parameters as its own (the same objects under the same names:
    nothing is copied) and calls the module itself, which keeps reading them from where they were."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        for name, child in module.named_children():
            setattr(self, name, child)
        for name, param in module.named_parameters(recurse=False):
            setattr(self, name, param)
        self.__dict__["wrapped"] = module  # not a child: its parameters are already registered here
        self.layer_idx = module.layer_idx

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """``hidden_states [1, T, hidden]`` of one packed step -> ``[1, T, hidden]``; ``kwargs[LINEAR_KWARG]``
        is the step's ``LinearStep``. transformers' mask and cache arguments are not used."""
        step = packed_step(hidden_states, kwargs, LINEAR_KWARG, LinearStep)
        if not step.parts or step.parts[-1][1] != hidden_states.shape[1]:
            raise ValueError(f"{LINEAR_KWARG}: the step's sequences cover {step.parts[-1][1] if step.parts else 0} rows, "
                             f"hidden_states has {hidden_states.shape[1]}")
        outs = [self.wrapped(hidden_states[:, a:b], cache=state, attention_mask=None) for a, b, state in step.parts]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)

    def extra_repr(self) -> str:
        return f"wraps={type(self.wrapped).__name__}, layer_idx={self.layer_idx}"


def is_linear(module: Any, family: Family) -> bool:
    """Whether ``module`` (a decoder layer's ``self_attn``) is one of ``family``'s linear-attention layers."""
    return family.linear_attention is not None and (
        isinstance(module, AttachedLinearAttention) or type(module).__name__ == family.linear_attention)


def linear_slots(layers: nn.ModuleList, family: Family) -> list[tuple[int, nn.Module, str]]:
    """``(decoder index, decoder layer, where)`` of every linear-attention layer, in order."""
    return [(i, layer, f"{family.decoder}.layers.{i}.self_attn") for i, layer in enumerate(layers)
            if is_linear(getattr(layer, "self_attn", None), family)]


def check_linear(family: Family, hf_config: Any, layers: nn.ModuleList) -> None:
    """``ValueError`` unless every linear-attention layer can run per sequence on a transformers cache of its own."""
    if family.linear_attention is None:
        return
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    slots = linear_slots(layers, family)
    if len(slots) == len(layers):
        raise ValueError("has no MLA layer (every layer is linear attention)")
    cache_layers = LinearStates(hf_config).new_cache().layers
    for i, layer, where in slots:
        module = layer.self_attn
        if isinstance(module, AttachedLinearAttention):
            raise ValueError(f"{where} is attached already")
        if getattr(module, "layer_idx", None) != i:
            raise ValueError(f"{where}.layer_idx is {getattr(module, 'layer_idx', None)!r}, not its decoder index {i}")
        if getattr(layer, "block_type", "linear_attention") != "linear_attention":
            raise ValueError(f"{where} is linear attention in a {layer.block_type!r} block")
        if i >= len(cache_layers) or not isinstance(cache_layers[i], LinearAttentionCacheLayerMixin):
            raise ValueError(f"{where}: transformers' cache for this config has no linear-attention state at layer {i}")
        buffers = [n for n, _ in module.named_buffers()]
        if buffers:  # a buffer would not follow the module through model.to(): refuse rather than diverge
            raise ValueError(f"{where} holds buffers {buffers}, which openmla's per-sequence adapter does not share")


@dataclass
class HybridLayers:
    """The linear-attention layers ``attach`` replaced, and their per-sequence states."""

    states: LinearStates
    layers: list[nn.Module] = field(default_factory=list)  # the decoder layers whose self_attn was replaced
    originals: list[nn.Module] = field(default_factory=list)
    adapters: list[AttachedLinearAttention] = field(default_factory=list)

    @classmethod
    def attach(cls, family: Family, hf_config: Any, layers: nn.ModuleList) -> "HybridLayers | None":
        """Replace every linear-attention layer (already checked by ``check_linear``); None for a non-hybrid family."""
        if family.linear_attention is None:
            return None
        out = cls(LinearStates(hf_config))
        for _, layer, _ in linear_slots(layers, family):
            out.layers.append(layer)
            out.originals.append(layer.self_attn)
            out.adapters.append(AttachedLinearAttention(layer.self_attn))
        for layer, adapter in zip(out.layers, out.adapters):
            layer.self_attn = adapter
        return out

    def detach(self) -> None:
        for layer, module in zip(self.layers, self.originals):
            layer.self_attn = module
        self.states.clear()
