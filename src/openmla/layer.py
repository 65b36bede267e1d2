"""The DeepSeek-V2/V3/Kimi-K2 attention layer on top of the fused MLA op.

``LatentAttention`` holds the projections of one checkpoint layer under the Hugging Face
names (``q_a_proj``, ``q_a_layernorm``, ``q_b_proj`` or ``q_proj``, ``kv_a_proj_with_mqa``,
``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``) and runs attention over the paged latent cache
through the step's plan (``openmla.plan``: made once per step, shared by every layer). ``kv_b_proj.weight`` is split once into the
three layouts the op wants (``w_k``, ``w_uk``, ``w_uv``); any weight load re-splits it.

Rotary layout: the rope dims are rotated as the checkpoint expects, interleaved pairs for
DeepSeek's checkpoints (``rope_interleave`` true, the default, also Hugging Face's V2 model) and
half-split pairs for a config with ``rope_interleave: false`` (Hugging Face's ``rotate_half``
variant of V3). The cache keeps the rope part in that same layout.
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import nn

from .cache import CacheBatch
from .config import MLAConfig
from .planning import MLAPlan, Step, plan
from .rope import rope_freqs_cis
from .weights import LayerWeights

# Options the layer sets itself; passing them through **plan_options would be ambiguous.
_RESERVED_KWARGS = frozenset({"scale", "epsilon", "rope_interleaved", "return_lse"})
# "...layers.{i}.self_attn.{name}" with any model prefix (model., language_model.model., ...).
_LAYER_KEY = re.compile(r"^(?:.*\.)?layers\.(\d+)\.self_attn\.(.+)$")
_DEFAULT_FP8_BLOCK = (128, 128)  # DeepSeek-V3 / Kimi-K2 ``weight_block_size``
# self_attn children that are not this layer's: V3.2's top-k indexer (it produces sparse_indices)
# and the inv_freq some old remote-code checkpoints carry (derived from the config here).
_NOT_OURS = ("indexer.", "rotary_emb.")


# RoPE tables shared by every layer of a model (one per rope setting and device) -----------
_FREQS: dict[tuple, torch.Tensor] = {}


def _rope_key(config: MLAConfig, device: torch.device) -> tuple:
    return (config.qk_rope_head_dim, config.rope_theta, config.rope_scaling, str(device))


def shared_freqs_cis(config: MLAConfig, rows: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """A ``[>= rows, R]`` float32 table for ``config``'s rope, shared by every layer on ``device``.

    Grown (by doubling) when a longer one is asked for, so 60 layers hold one table, not 60.
    """
    device = torch.device(device)
    key = _rope_key(config, device)
    table = _FREQS.get(key)
    if table is None or table.shape[0] < rows:
        have = 0 if table is None else table.shape[0]
        size = max(rows, 2 * have)
        table = rope_freqs_cis(config, size, device=device)
        _FREQS[key] = table
    return table


class RMSNorm(nn.Module):
    """``x * rsqrt(mean(x^2) + eps) * weight``, computed in float32 (DeepSeek's norm)."""

    def __init__(self, dim: int, eps: float, *, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., dim]`` -> same shape and dtype."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def _linear(n_in: int, n_out: int, dtype: torch.dtype, device: torch.device | str) -> nn.Linear:
    return nn.Linear(n_in, n_out, bias=False, dtype=dtype, device=device)


def dequant_block_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = _DEFAULT_FP8_BLOCK) -> torch.Tensor:
    """DeepSeek's block-quantised weight: ``weight [out, in]`` (fp8) times ``scale_inv
    [ceil(out/b0), ceil(in/b1)]`` broadcast over ``b0 x b1`` tiles. Returns float32 ``[out, in]``."""
    out_f, in_f = weight.shape
    b0, b1 = block
    want = (math.ceil(out_f / b0), math.ceil(in_f / b1))
    if scale_inv.dim() != 2 or tuple(scale_inv.shape) != want:
        raise ValueError(f"weight_scale_inv: expected shape {want} for a {tuple(weight.shape)} weight in {b0}x{b1} blocks, "
                         f"got {tuple(scale_inv.shape)}")
    scale = scale_inv.float().repeat_interleave(b0, 0)[:out_f].repeat_interleave(b1, 1)[:, :in_f]
    return weight.float() * scale


def _resplit_after_load(module: "LatentAttention", _incompatible_keys: Any) -> None:
    """load_state_dict post hook (a module-level function, so the layer still pickles)."""
    module.split_kv_b()


class LatentAttention(nn.Module):
    """One MLA attention layer of DeepSeek-V2/V3/V3.2 or Kimi K2 (all query heads).

    Parameters (Hugging Face names, ``[out, in]`` weights):
    ``q_proj [H*(Dn+R), hidden]`` or, with ``q_lora_rank`` Q, ``q_a_proj [Q, hidden]``,
    ``q_a_layernorm [Q]``, ``q_b_proj [H*(Dn+R), Q]``; ``kv_a_proj_with_mqa [L+R, hidden]``,
    ``kv_a_layernorm [L]``, ``kv_b_proj [H*(Dn+Dv), L]``, ``o_proj [hidden, H*Dv]``.
    Buffers (not saved): ``w_k [H*Dn, L]``, ``w_uk [H, L, Dn]``, ``w_uv [H, Dv, L]``.
    """

    def __init__(
        self,
        config: MLAConfig,
        layer_idx: int,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
        backend: str | None = None,
        max_position: int | None = None,
    ) -> None:
        """``dtype`` (default ``torch.get_default_dtype()``, as for every ``nn.Module``) and
        ``device`` of the weights; ``backend`` for plans the layer makes itself; ``max_position``
        rows of the rope table to start with (it grows on demand outside ``torch.compile``)."""
        super().__init__()
        dtype = dtype or torch.get_default_dtype()
        if not isinstance(layer_idx, int) or layer_idx < 0:
            raise ValueError(f"layer_idx: expected an int >= 0, got {layer_idx!r}")
        if max_position is not None and (not isinstance(max_position, int) or max_position < 1):
            raise ValueError(f"max_position: expected a positive int, got {max_position!r}")
        self.config = config
        self.layer_idx = layer_idx
        self.backend = backend
        c = config
        H, L, R, Dn, Dv = c.num_heads, c.kv_lora_rank, c.qk_rope_head_dim, c.qk_nope_head_dim, c.v_head_dim
        q_out = H * (Dn + R)
        if c.q_lora_rank is None:
            self.q_proj = _linear(c.hidden_size, q_out, dtype, device)
        else:
            self.q_a_proj = _linear(c.hidden_size, c.q_lora_rank, dtype, device)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.rms_norm_eps, dtype=dtype, device=device)
            self.q_b_proj = _linear(c.q_lora_rank, q_out, dtype, device)
        self.kv_a_proj_with_mqa = _linear(c.hidden_size, L + R, dtype, device)
        self.kv_a_layernorm = RMSNorm(L, c.rms_norm_eps, dtype=dtype, device=device)
        self.kv_b_proj = _linear(L, H * (Dn + Dv), dtype, device)
        self.o_proj = _linear(H * Dv, c.hidden_size, dtype, device)
        for name, shape in (("w_k", (H * Dn, L)), ("w_uk", (H, L, Dn)), ("w_uv", (H, Dv, L))):
            self.register_buffer(name, torch.empty(shape, dtype=dtype, device=device), persistent=False)
        self.split_kv_b()
        self.register_load_state_dict_post_hook(_resplit_after_load)  # torch's load_state_dict re-splits too
        rows = max_position or min(c.max_position_embeddings, 4096)
        self.freqs_cis = shared_freqs_cis(c, rows, device)

    # Weights ---------------------------------------------------------------------------
    @torch.no_grad()
    def split_kv_b(self) -> None:
        """Refresh ``w_k``, ``w_uk``, ``w_uv`` (and ``weights``) from ``kv_b_proj.weight`` (call after
        editing it by hand). Per head h, rows ``h*(Dn+Dv) : h*(Dn+Dv)+Dn`` are W_UK[h] ``[Dn, L]``,
        the next Dv rows W_UV[h]."""
        c = self.config
        split = LayerWeights.from_kv_b(self.kv_b_proj.weight, self.latent_gamma(), num_heads=c.num_heads,
                                       qk_nope_head_dim=c.qk_nope_head_dim, dtype=self.w_k.dtype)
        self.w_k, self.w_uk, self.w_uv = split.w_k, split.w_uk, split.w_uv
        self._refresh_weights()

    def _refresh_weights(self) -> None:
        """``weights``: the layer's ``LayerWeights`` over its current tensors (after a split or a move)."""
        c = self.config
        self.weights = LayerWeights(self.latent_gamma(), self.w_k, self.w_uk, self.w_uv, c.rms_norm_eps, c.rope_interleave)

    def latent_gamma(self) -> torch.Tensor:
        """The weight the cache write multiplies the RMS-normed latent by: ``kv_a_layernorm``'s."""
        return self.kv_a_layernorm.weight

    def _apply(self, fn, recurse=True):  # .to(), .cuda(), .half() ...: the tensors are new objects
        out = super()._apply(fn, recurse)
        self._refresh_weights()
        return out

    @torch.no_grad()
    def randomize_(self, seed: int) -> "LatentAttention":
        """Random weights for demos and benchmarks: unit-variance activations (std 1/sqrt(fan_in)),
        norms at 1; the same ``seed`` gives the same weights."""
        g = torch.Generator().manual_seed(seed)
        for p in self.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
        self.split_kv_b()
        return self

    def hf_param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Expected ``{hf_name: shape}`` of this layer's tensors (names without the layer prefix)."""
        return {name: tuple(p.shape) for name, p in self.named_parameters()}

    @torch.no_grad()
    def load_hf_state_dict(
        self,
        state_dict: Mapping[str, torch.Tensor],
        strict: bool = True,
        *,
        fp8_block_size: tuple[int, int] = _DEFAULT_FP8_BLOCK,
    ) -> list[str]:
        """Copy this layer's attention tensors from a Hugging Face DeepSeek/Kimi state dict.

        Keys are either bare (``q_a_proj.weight``, optionally ``self_attn.``-prefixed) or full
        (``model.layers.{i}.self_attn.q_a_proj.weight``, any model prefix); full keys of other
        layers, keys of this layer outside ``self_attn`` and DeepSeek-V3.2's ``self_attn.indexer.*``
        (the top-k indexer, a separate module) are skipped. Block-FP8 weights with
        a ``weight_scale_inv`` are dequantised. Everything is checked before anything is copied:
        a missing (when ``strict``), unexpected (when ``strict``) or mis-shaped tensor raises
        ``ValueError`` and leaves the layer unchanged. Returns the names loaded.
        """
        tensors = self._select_layer_tensors(state_dict)
        tensors = _dequantize(tensors, fp8_block_size)
        expected = self.hf_param_shapes()
        unexpected = sorted(set(tensors) - set(expected))
        missing = sorted(set(expected) - set(tensors))
        problems = []
        if strict and missing:
            problems.append(f"missing {missing}")
        if strict and unexpected:
            problems.append(f"unexpected {unexpected}")
        for name in sorted(set(tensors) & set(expected)):
            got = tuple(tensors[name].shape)
            if got != expected[name]:
                problems.append(f"{name} has shape {got}, expected {expected[name]}")
        if problems:
            raise ValueError(f"state_dict: layer {self.layer_idx} attention: " + "; ".join(problems))
        params = dict(self.named_parameters())
        loaded = sorted(set(tensors) & set(expected))
        for name in loaded:
            params[name].copy_(tensors[name].to(params[name].dtype))
        self.split_kv_b()
        return loaded

    def _select_layer_tensors(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``{name_within_self_attn: tensor}`` of this layer.

        A dict with any ``...layers.{i}.self_attn.`` key is a whole-model dict: only this layer's
        attention keys are taken. Otherwise every key is a bare name (``self_attn.`` optional).
        """
        whole_model = any(_LAYER_KEY.match(k) for k in state_dict)
        out: dict[str, torch.Tensor] = {}
        for key, value in state_dict.items():
            if whole_model:
                m = _LAYER_KEY.match(key)
                if m is None or int(m.group(1)) != self.layer_idx:
                    continue
                name = m.group(2)
            else:
                name = key.removeprefix("self_attn.")
            if name.startswith(_NOT_OURS):
                continue
            if not isinstance(value, torch.Tensor):
                raise ValueError(f"state_dict: {key!r} is a {type(value).__name__}, not a tensor")
            out[name] = value
        return out

    @classmethod
    def from_pretrained(
        cls,
        folder: str | os.PathLike,
        layer_idx: int,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
        backend: str | None = None,
        max_position: int | None = None,
    ) -> "LatentAttention":
        """Layer ``layer_idx`` of a Hugging Face checkpoint folder (``config.json`` plus
        ``model.safetensors`` or sharded ``model.safetensors.index.json``); only that layer's
        attention tensors are read (block-FP8 ones dequantised with the config's
        ``quantization_config.weight_block_size``)."""
        folder = os.fspath(folder)
        hf_cfg = _read_json(os.path.join(folder, "config.json"), "folder")
        config = MLAConfig.from_hf(hf_cfg)
        layer = cls(config, layer_idx, dtype=dtype, device=device, backend=backend, max_position=max_position)
        tensors = read_layer_tensors(folder, layer_idx)
        quant = hf_cfg.get("quantization_config") or {}
        block = tuple(quant.get("weight_block_size") or _DEFAULT_FP8_BLOCK)
        layer.load_hf_state_dict(tensors, strict=True, fp8_block_size=block)  # type: ignore[arg-type]
        return layer

    # Forward ---------------------------------------------------------------------------
    def plan(self, batch: CacheBatch, **plan_options: Any) -> MLAPlan:
        """``openmla.plan(batch, scale=<this config's softmax scale>, backend=<the layer's>, **plan_options)``:
        one plan serves every layer of a model for one step."""
        reserved = _RESERVED_KWARGS & set(plan_options)
        if reserved:
            raise ValueError(f"plan_options: {sorted(reserved)} are set by the layer (from its config)")
        plan_options.setdefault("backend", self.backend)
        return plan(batch, scale=self.config.softmax_scale, **plan_options)

    def _freqs_for(self, step: MLAPlan, device: torch.device) -> torch.Tensor:
        """The shared rope table on ``device``, grown to cover every position of the step (eagerly:
        under ``torch.compile`` the table is used as it is, and a short one is an error)."""
        table = self.freqs_cis
        if torch.compiler.is_compiling():
            return table
        if table.device != device or table.shape[0] < step.max_position:
            table = shared_freqs_cis(self.config, max(step.max_position, table.shape[0]), device)
            self.freqs_cis = table
        return table

    def query_latent(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``hidden_states [T, hidden]`` -> the normed query latent ``[T, q_lora_rank]`` (q_lora models)."""
        return self.q_a_layernorm(self.q_a_proj(hidden_states))

    def project_q(self, hidden_states: torch.Tensor, q_latent: torch.Tensor | None = None) -> torch.Tensor:
        """``hidden_states [T, hidden]`` -> ``q [T, H, Dn+R]`` (before rope); ``q_latent``: the
        ``query_latent`` already computed (a V3.2 indexer reads it too)."""
        if self.config.q_lora_rank is None:
            q = self.q_proj(hidden_states)
        else:
            q = self.q_b_proj(self.query_latent(hidden_states) if q_latent is None else q_latent)
        return q.view(hidden_states.shape[0], self.config.num_heads, self.config.qk_head_dim)

    def forward(self, hidden_states: torch.Tensor, step: MLAPlan | CacheBatch, **plan_options: Any) -> torch.Tensor:
        """``hidden_states [T, hidden]`` (the ragged rows of the step) -> ``[T, hidden]``.

        ``step`` is the step's ``MLAPlan`` (make it once per step with ``layer.plan(batch, ...)`` or
        ``openmla.plan(batch, scale=config.softmax_scale, ...)`` and pass it to every layer), or a
        ``CacheBatch`` for one-off use, which plans here with ``plan_options`` (``mask``,
        ``window_size``, ``sparse_indices``, ``attn_sink``, ``num_partitions``, ``buffer_size``,
        ``backend``, ...). Writes this layer's cache entries for the new tokens.
        """
        step = self.check_step(hidden_states, step, plan_options)
        return self.attend(hidden_states, step, self.project_q(hidden_states))

    def check_step(self, hidden_states: torch.Tensor, step: MLAPlan | CacheBatch, plan_options: dict) -> MLAPlan:
        """``forward``'s argument checks; returns the step's plan (made here for a ``CacheBatch``)."""
        c = self.config
        if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 2 or hidden_states.shape[1] != c.hidden_size:
            shape = tuple(hidden_states.shape) if isinstance(hidden_states, torch.Tensor) else type(hidden_states).__name__
            raise ValueError(f"hidden_states: expected shape (T, {c.hidden_size}), got {shape}")
        if isinstance(step, CacheBatch):
            step = self.plan(step, **plan_options)
        elif not isinstance(step, Step):
            raise ValueError(f"step: expected an MLAPlan (a Step) or a CacheBatch, got {type(step).__name__}")
        elif plan_options:
            raise ValueError(f"plan_options: {sorted(plan_options)} belong to the plan (openmla.plan), not to a layer call")
        elif step.spec.scale != c.softmax_scale:
            raise ValueError(f"step: planned with scale {step.spec.scale}, this layer's config needs {c.softmax_scale}")
        if hidden_states.shape[0] != step.num_tokens:
            raise ValueError(f"hidden_states: {hidden_states.shape[0]} rows, the step has {step.num_tokens} new tokens")
        return step

    def attend(self, hidden_states: torch.Tensor, step: MLAPlan, q: torch.Tensor) -> torch.Tensor:
        """The checked step with the projected query ``q [T, H, Dn+R]`` (before rope): cache write,
        attention and output projection."""
        c = self.config
        T = hidden_states.shape[0]
        kv = self.kv_a_proj_with_mqa(hidden_states)
        out = step.run(q, kv, self.layer_idx, self.weights, self._freqs_for(step, hidden_states.device))
        return self.o_proj(out.reshape(T, c.num_heads * c.v_head_dim).to(self.o_proj.weight.dtype))

    def extra_repr(self) -> str:
        c = self.config
        return (f"layer_idx={self.layer_idx}, heads={c.num_heads}, kv_lora_rank={c.kv_lora_rank}, "
                f"q_lora_rank={c.q_lora_rank}, rope={c.qk_rope_head_dim}, nope={c.qk_nope_head_dim}, v={c.v_head_dim}")


# Checkpoint reading ---------------------------------------------------------------------
def _dequantize(tensors: dict[str, torch.Tensor], block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """Fold every ``X.weight_scale_inv`` into ``X.weight`` (float32); other tensors pass through."""
    out = dict(tensors)
    for name in [n for n in tensors if n.endswith(".weight_scale_inv")]:
        base = name[: -len("_scale_inv")]
        if base not in out:
            raise ValueError(f"state_dict: {name!r} has no matching {base!r}")
        out[base] = dequant_block_fp8(out[base], out.pop(name), block)
    for name, t in out.items():
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError(f"state_dict: {name!r} is {t.dtype} without a weight_scale_inv")
    return out


def _read_json(path: str, arg: str) -> dict:
    if not os.path.isfile(path):
        raise ValueError(f"{arg}: {path!r} not found")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _layer_keys(keys: Iterable[str], layer_idx: int) -> list[str]:
    """The ``...layers.{layer_idx}.self_attn.*`` keys among ``keys``."""
    picked = []
    for key in keys:
        m = _LAYER_KEY.match(key)
        if m is not None and int(m.group(1)) == layer_idx and not m.group(2).startswith(_NOT_OURS):
            picked.append(key)
    return picked


def read_layer_tensors(folder: str, layer_idx: int, read: Callable[[str, Any], torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Layer ``layer_idx``'s attention tensors (full keys) from ``model.safetensors`` or the shards
    an index names. ``read(key, handle)`` reads one tensor from an open ``safetensors.safe_open``
    handle (default ``handle.get_tensor(key)``; a tensor-parallel shard reads only its rows)."""
    from safetensors import safe_open  # optional dependency (openmla[hf])

    index_path = os.path.join(folder, "model.safetensors.index.json")
    single = os.path.join(folder, "model.safetensors")
    if os.path.isfile(index_path):
        weight_map: dict[str, str] = _read_json(index_path, "folder")["weight_map"]
        by_file: dict[str, list[str]] = {}
        for key in _layer_keys(weight_map, layer_idx):
            by_file.setdefault(weight_map[key], []).append(key)
    elif os.path.isfile(single):
        with safe_open(single, framework="pt") as f:
            by_file = {"model.safetensors": _layer_keys(f.keys(), layer_idx)}
    else:
        raise ValueError(f"folder: no model.safetensors or model.safetensors.index.json in {folder!r}")
    tensors: dict[str, torch.Tensor] = {}
    for fname, keys in by_file.items():
        with safe_open(os.path.join(folder, fname), framework="pt") as f:
            for key in keys:
                tensors[key] = f.get_tensor(key) if read is None else read(key, f)
    if not tensors:
        raise ValueError(f"layer_idx: no 'layers.{layer_idx}.self_attn.*' tensors in {folder!r}")
    return tensors
