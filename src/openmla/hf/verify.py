"""``attach``'s self-check: the model's own attention against openmla's, on the model's own parameters.

openmla.hf reproduces each family's attention from a table (``openmla.hf.families``) written against
one transformers release; a later release can move a detail inside an attention module's
``forward`` (Hunyuan V4's rope went from half-split to interleaved in 5.25 with the same config).
So ``attach`` does not trust the table: before it hands the model back, it runs the model twice on
the same random token ids, once as transformers runs it (the unpatched attention modules, the
attention implementation the model was configured with, transformers' own cache) and once on
openmla (a small cache of its own), and compares every attention module's output.

Three steps, one sequence: a prefill of ``prefix`` tokens, a chunk of ``chunk`` tokens after that
cached prefix, and one decode token, so the cache write, rope positions, the causal mask over a
cached prefix, sinks, gates, the top-k picks (the prefix outgrows a small ``index_topk``) and the
reuse of picks between layers all take part. Each attention module's input is replaced, in both
runs alike, by the same random hidden states (unit RMS, the module's dtype), so each module is
compared on identical inputs: a difference is that module's alone, not one carried down the
stack, and the tolerance is the dtype's (``TOLERANCE``). The rest of the model (MLPs, experts,
norms, hyper-connections, linear-attention layers) runs as usual and is not compared.

The check costs three short forwards of the whole model in each run (measured in
bench/RESULTS.md, "attach's self-check"); ``attach(..., verify=False)`` skips it with a warning.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

# max |openmla - transformers| / max |transformers| over one module's output, per weight dtype: float32 runs agree
# to ~1e-6 (1e-4 leaves room for long sums); 16-bit ones round q, k and p in transformers' eager attention
TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 2e-2}
_SEED = 20261206


@dataclass(frozen=True)
class CheckSteps:
    """The token ids of the three steps (``[prefix]``, ``[chunk]``, ``[1]``) and what they are called in a message."""

    ids: tuple[torch.Tensor, ...]
    names: tuple[str, ...]

    @property
    def total(self) -> int:
        return sum(int(t.numel()) for t in self.ids)


def check_steps(vocab_size: int, index_topk: int = 0, banned: Sequence[int] = ()) -> CheckSteps:
    """Random token ids for the three steps. With a top-k indexer whose ``index_topk`` is small, the prefix
    outgrows it so that the later steps pick fewer keys than they see (a real checkpoint's 2048 would make the
    check a long prefill: there every key is picked, the indexer still runs)."""
    prefix = index_topk + 3 if 0 < index_topk <= 40 else 7
    chunk = 4
    g = torch.Generator().manual_seed(_SEED)
    ids = torch.randint(0, vocab_size, (prefix + chunk + 1,), generator=g)
    for token in banned:  # a text-only model's media placeholders are refused in prompts
        ids[ids == token] = (token + 1) % vocab_size if (token + 1) % vocab_size not in banned else 0
    names = (f"prefill of {prefix} tokens", f"prefill of {chunk} tokens after {prefix} cached",
             f"decode of 1 token after {prefix + chunk} cached")
    return CheckSteps((ids[:prefix], ids[prefix:prefix + chunk], ids[prefix + chunk:]), names)


def check_inputs(steps: CheckSteps, modules: Sequence[nn.Module], hidden: int) -> list[list[torch.Tensor]]:
    """Per step and module, the hidden states that module receives in both runs: ``[1, T, hidden]`` on the
    module's own device and in its dtype (a model split over devices keeps each layer where it is)."""
    g = torch.Generator().manual_seed(_SEED + 1)
    where = [next(m.parameters()) for m in modules]
    return [[torch.randn(1, int(ids.numel()), hidden, generator=g).to(device=w.device, dtype=w.dtype) for w in where]
            for ids in steps.ids]


@contextlib.contextmanager
def _seated(modules: Sequence[nn.Module], inputs: Sequence[torch.Tensor]) -> Iterator[list]:
    """While open, module ``k`` receives ``inputs[k]`` as its hidden states (positional or keyword) and its first
    output is recorded in the yielded list (None where it did not run)."""
    got: list[Any] = [None] * len(modules)
    handles = []
    for k, module in enumerate(modules):
        def pre(mod, args, kwargs, k=k):
            x = inputs[k]
            if args:
                return (x,) + tuple(args[1:]), kwargs
            if "hidden_states" not in kwargs:
                raise RuntimeError(f"self-check: {type(mod).__name__} was called without hidden states")
            return args, {**kwargs, "hidden_states": x}

        def post(mod, args, kwargs, output, k=k):
            got[k] = (output[0] if isinstance(output, tuple) else output).detach().clone()

        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(module.register_forward_hook(post, with_kwargs=True))
    try:
        yield got
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def transformers_outputs(model: nn.Module, modules: Sequence[nn.Module], steps: CheckSteps,
                         inputs: list[list[torch.Tensor]]) -> list[list[torch.Tensor | None]]:
    """Each module's output at each step, as transformers runs the model (its own cache across the steps)."""
    device = model.get_input_embeddings().weight.device
    # transformers 5.25 renamed the forward's and outputs' ``past_key_values`` to ``cache`` (the old name warns)
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    past, outs = None, []
    for ids, step_inputs in zip(steps.ids, inputs):
        with _seated(modules, step_inputs) as got:
            out = model(input_ids=ids.to(device)[None], use_cache=True, logits_to_keep=1, **{name: past})
        past = getattr(out, name)
        outs.append(got)
    return outs


@torch.no_grad()
def openmla_outputs(modules: Sequence[nn.Module], steps: CheckSteps, inputs: list[list[torch.Tensor]],
                    run_step: Callable[[int, torch.Tensor], None]) -> list[list[torch.Tensor | None]]:
    """Each module's output at each step on openmla; ``run_step(i, ids)`` runs step ``i`` of one sequence."""
    outs = []
    for i, (ids, step_inputs) in enumerate(zip(steps.ids, inputs)):
        with _seated(modules, step_inputs) as got:
            run_step(i, ids)
        outs.append(got)
    return outs


def unverified_warning(model_class: str) -> None:
    warnings.warn(f"openmla.hf.attach({model_class}, verify=False): the self-check against transformers' own forward "
                  "was skipped; nothing checks that this transformers release computes the attention as openmla.hf does",
                  stacklevel=3)


@dataclass(frozen=True)
class Difference:
    """The worst disagreement of one check (None when all agree)."""

    where: str
    step: str
    error: float
    tolerance: float

    def message(self, model_class: str) -> str:
        import transformers

        return (f"model: {model_class}: attach's self-check found {self.where} differs from transformers' own forward: "
                f"the attention output of a {self.step} (random inputs, the model's weights) is {self.error:.3g} off "
                f"(max |openmla - transformers| / max |transformers|; tolerance {self.tolerance:.0e}) under transformers "
                f"{transformers.__version__}: this release computes the layer in a way openmla.hf does not reproduce, so "
                "the model was left as it was")


def worst_difference(want: list[list[torch.Tensor | None]], got: list[list[torch.Tensor | None]], where: Sequence[str],
                     steps: CheckSteps, dtype: torch.dtype) -> Difference | None:
    """The largest relative difference between the two runs' outputs, if any exceeds the dtype's tolerance
    (a module that ran in one run and not in the other is a difference too)."""
    tol = TOLERANCE.get(dtype, 5e-2)
    worst = None
    for s, (ws, gs) in enumerate(zip(want, got)):
        for k, (w, g) in enumerate(zip(ws, gs)):
            if w is None and g is None:
                continue
            if w is None or g is None or w.shape != g.shape:
                return Difference(where[k], steps.names[s], math.inf, tol)
            w64, g64 = w.double(), g.double()
            scale = float(w64.abs().max()) if w64.numel() else 0.0
            err = float((g64 - w64).abs().max()) / max(scale, 1e-30) if w64.numel() else 0.0
            if not math.isfinite(err) and bool(torch.equal(w64.isnan(), g64.isnan())):
                err = float((g64 - w64).nan_to_num(0.0).abs().max()) / max(float(w64.nan_to_num(0.0).abs().max()), 1e-30)
            if err > tol and (worst is None or err > worst.error):
                worst = Difference(where[k], steps.names[s], err, tol)
    return worst
