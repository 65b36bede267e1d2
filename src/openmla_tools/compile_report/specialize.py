"""What a recorded launch compiles to: its signature, constexprs, attributes and options, made
by Triton's own launch binder for a target, as ``kernel[grid](...)`` would on that device.

A launch on a GPU runs the arguments through the binder ``JITFunction.run`` builds
(``triton.runtime.jit.create_function_from_signature``): each pointer whose address is 16-byte
aligned and each integer divisible by 16 gets ``tt.divisibility = 16``, an integer equal to 1
becomes the constant 1, and on AMD a tensor whose storage fits in 2 GiB gets
``tt.pointer_range = 32`` (buffer loads). Those hints change the code (vectorised loads, fewer
address registers). ``hints=False`` compiles without them, as this report did before: every
integer a typed argument, no attributes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from triton.compiler import make_backend
from triton.runtime.jit import create_function_from_signature

from .launches import Launch
from .targets import Target

POINTER_RANGE = "tt.pointer_range"


@dataclass
class Specialization:
    """Arguments of ``triton.compile(ASTSource(kernel, signature, constexprs, attrs), target, options)``."""

    signature: dict
    constexprs: dict
    attrs: dict
    options: dict

    def key(self, kernel_name: str) -> str:
        """Identity of the compiled binary (two launches with one key compile to the same code)."""
        consts = sorted((repr(k), str(v)) for k, v in self.constexprs.items())
        attrs = sorted((repr(k), repr(v)) for k, v in self.attrs.items() if v)
        return repr((kernel_name, sorted(self.signature.items()), consts, attrs, sorted(self.options.items())))


def _launch_options(launch: Launch) -> dict:
    return {k: launch.kwargs[k] for k in ("num_warps", "num_stages") if k in launch.kwargs}


def _drop_pointer_range(attrs: dict, launch: Launch, bound: dict) -> dict:
    """No 32-bit buffer range for tensors on a storage taken to be over 2 GiB (the paged cache)."""
    out = dict(attrs)
    for i, value in enumerate(bound.values()):
        if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() in launch.large_storages and (i,) in out:
            out[(i,)] = [a for a in out[(i,)] if a[0] != POINTER_RANGE]
    return out


def _without_hints(launch: Launch, signature: dict, constexprs: dict) -> tuple[dict, dict]:
    """Integers the binder made the constant 1 back as typed arguments (``i32``)."""
    sig, consts = dict(signature), dict(constexprs)
    for i, param in enumerate(launch.kernel.params):
        if not param.is_constexpr and sig[param.name] == "constexpr":
            sig[param.name] = "i32"
            consts.pop((i,), None)
    return sig, consts


def specialize(launch: Launch, target: Target, hints: bool = True) -> Specialization:
    """The launch as ``target``'s runtime would compile it (``hints=False``: without the hints)."""
    backend = make_backend(target.gpu_target())
    binder = create_function_from_signature(launch.kernel.signature, launch.kernel.params, backend)
    bound, spec, options = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = launch.kernel._pack_args(backend, launch.kwargs, bound, spec, options)
    if not hints:
        signature, constexprs = _without_hints(launch, signature, constexprs)
        attrs = {}
    elif target.is_amd:
        attrs = _drop_pointer_range(attrs, launch, bound)
    return Specialization(signature, constexprs, attrs, _launch_options(launch))
