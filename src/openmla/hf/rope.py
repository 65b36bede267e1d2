"""The rope table of an attached model, read from the model's own rotary embedding module.

openmla's kernels rotate by a float32 table ``[rows, R]`` of interleaved ``(cos, sin)`` pairs, one
pair per frequency. ``RopeTable`` fills it by calling the model's ``rotary_emb`` on positions
``0..rows-1``, so every static rope variant transformers implements (default, linear, YaRN,
Llama-3, proportional, learned frequencies, the magnitude YaRN folds into cos and sin) is the
model's own arithmetic, not a re-derivation. Rope types whose frequencies depend on the length of
the sequence in the current forward are refused (``dynamic``), or held to the range where they
are static (``longrope`` below ``original_max_position_embeddings``: a step past it is a
``ValueError``, not other frequencies). The table grows by doubling, once for all layers. A model
whose MLA rotates nothing (Kimi Linear: R values per key shared across heads, never rotated) gets
the identity table (cos 1, sin 0: the kernels' rotation returns its input exactly).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

_FIRST_ROWS = 4096
STATIC_ROPE_TYPES = ("default", "linear", "yarn", "llama3", "proportional")


def rope_type_of(rotary: nn.Module, layer_type: str | None = None) -> str:
    kind = getattr(rotary, "rope_type", "default")
    if layer_type is not None and isinstance(kind, dict):  # a rope per layer type (dots3)
        kind = kind.get(layer_type, f"none for layer type {layer_type!r}")
    return kind if isinstance(kind, str) else repr(kind)


def rope_limit(rotary: nn.Module, hf_config: Any, layer_type: str | None = None) -> int | None:
    """Positions the table may cover (None: any), or ``ValueError`` for a rope type it cannot hold."""
    kind = rope_type_of(rotary, layer_type)
    if kind in STATIC_ROPE_TYPES:
        return None
    if kind == "longrope" and layer_type is not None:
        raise ValueError(f"rope type 'longrope' of layer type {layer_type!r} (a rope per layer type is held static only)")
    if kind == "longrope":  # short factors up to the original length; past it transformers switches every position
        original = (getattr(hf_config, "rope_parameters", None) or {}).get("original_max_position_embeddings")
        if not isinstance(original, int) or original < 1:
            raise ValueError("longrope without original_max_position_embeddings")
        return original
    raise ValueError(f"rope type {kind!r} (its frequencies change with the sequence length of each forward)")


class RopeTable:
    """``[rows, R]`` float32 interleaved (cos, sin) of ``rotary`` (a transformers rotary module).

    ``layout``: ``"cos_sin"`` for modules returning ``(cos, sin)`` as ``cat(freqs, freqs)``,
    ``"complex"`` for DeepSeek-V2's complex ``freqs_cis``, ``"none"`` for no rotation (``rotary`` None:
    the identity table). ``limit``: the positions it may cover. ``layer_type``: for a rotary module with a
    rope per layer type (called ``rotary(x, positions, layer_type)``: dots3), the type this table is of.
    """

    def __init__(self, rotary: nn.Module | None, width: int, layout: str, limit: int | None,
                 layer_type: str | None = None) -> None:
        if layout not in ("cos_sin", "complex", "none"):
            raise ValueError(f"layout: expected 'cos_sin', 'complex' or 'none', got {layout!r}")
        self.rotary, self.width, self.layout, self.limit = rotary, width, layout, limit
        self.layer_type = layer_type
        self._table: torch.Tensor | None = None

    def check(self, device: torch.device) -> None:
        """``ValueError`` unless the module gives ``width`` rope values per position in pairs."""
        self._compute(8, device)

    @torch.no_grad()
    def _compute(self, rows: int, device: torch.device) -> torch.Tensor:
        x = torch.zeros(1, dtype=torch.float32, device=device)
        pos = torch.arange(rows, device=device)[None]
        R = self.width
        if self.layout == "none":  # interleaved (cos, sin) = (1, 0) pairs
            return torch.tensor([1.0, 0.0], device=device).repeat(rows, R // 2).contiguous()
        if self.layout == "complex":
            freqs = self.rotary(x, pos)
            if not (isinstance(freqs, torch.Tensor) and freqs.is_complex() and tuple(freqs.shape) == (1, rows, R // 2)):
                raise ValueError(f"its rotary embedding does not give complex [{rows}, {R // 2}] frequencies")
            return torch.view_as_real(freqs[0]).reshape(rows, R).to(torch.float32).contiguous()
        out = self.rotary(x, pos) if self.layer_type is None else self.rotary(x, pos, self.layer_type)
        if not (isinstance(out, tuple) and len(out) == 2 and all(isinstance(t, torch.Tensor) for t in out)):
            raise ValueError("its rotary embedding does not return (cos, sin)")
        cos, sin = (t[0].to(torch.float32) for t in out)
        if tuple(cos.shape) != (rows, R) or tuple(sin.shape) != (rows, R):
            raise ValueError(f"its rotary embedding gives {tuple(cos.shape[1:])} values per position, the attention rotates {R}")
        half = R // 2
        if not (torch.equal(cos[:, :half], cos[:, half:]) and torch.equal(sin[:, :half], sin[:, half:])):
            raise ValueError("its rotary embedding's (cos, sin) are not one frequency per pair (cat(freqs, freqs))")
        return torch.stack((cos[:, :half], sin[:, :half]), dim=-1).reshape(rows, R).contiguous()

    def table(self, rows: int, device: torch.device) -> torch.Tensor:
        """A table covering positions ``[0, rows)`` on ``device`` (grown by doubling when short)."""
        if self.limit is not None and rows > self.limit:
            raise ValueError(f"position {rows - 1}: this model's rope (longrope) is static only below position {self.limit}; "
                             "transformers changes every position's frequencies past it")
        t = self._table
        if t is None or t.shape[0] < rows or t.device != device:
            size = max(rows, _FIRST_ROWS, 2 * (0 if t is None else t.shape[0]))
            if self.limit is not None:
                size = min(size, self.limit)
            self._table = t = self._compute(size, device)
        return t
