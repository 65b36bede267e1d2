"""One attention layer's constant inputs, built once: ``LayerWeights``.

``kv_b_proj.weight [H*(Dn+Dv), L]`` is one matrix that MLA reads in three layouts: the prefill
form's K up-projection ``w_k [H*Dn, L]``, the decode form's query absorption ``w_uk [H, L, Dn]``
and the V up-projection / output projection ``w_uv [H, Dv, L]``. ``from_kv_b`` splits it once (three
contiguous copies); a layer call is then ``plan.run(q, kv, layer_idx, weights, freqs_cis)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .validate import FLOAT_DTYPES, check_float, check_tensor


@dataclass(frozen=True, eq=False)
class LayerWeights:
    """``kv_norm_gamma [L]`` (``kv_a_layernorm.weight``), ``w_k [H*Dn, L]``, ``w_uk [H, L, Dn]``,
    ``w_uv [H, Dv, L]``, the latent norm's ``epsilon`` and the rope layout (``rope_interleaved``:
    DeepSeek's interleaved pairs, else half-split). Shapes, dtypes and devices are checked here,
    once; a plan checks only that they match its step. Do not edit the tensors in place and
    expect derived forms to follow: make a new ``LayerWeights`` (``LatentAttention`` does)."""

    kv_norm_gamma: torch.Tensor
    w_k: torch.Tensor
    w_uk: torch.Tensor
    w_uv: torch.Tensor
    epsilon: float = 1e-6
    rope_interleaved: bool = True

    def __post_init__(self) -> None:
        dev = check_tensor("weights.kv_norm_gamma", self.kv_norm_gamma, rank=1, dtypes=FLOAT_DTYPES).device
        for name in ("w_uk", "w_uv", "w_k"):
            check_tensor(f"weights.{name}", getattr(self, name), rank=2 if name == "w_k" else 3, dtypes=FLOAT_DTYPES, device=dev)
        # Sizes two sources agree on, so that an error names the odd one out.
        L = _agreed(self.kv_norm_gamma.shape[0], self.w_uk.shape[1], self.w_uv.shape[2], self.w_k.shape[1])
        Dn = self.w_uk.shape[2]
        H = _agreed(self.w_uk.shape[0], self.w_uv.shape[0], self.w_k.shape[0] // Dn if Dn and self.w_k.shape[0] % Dn == 0 else None)
        check_tensor("weights.kv_norm_gamma", self.kv_norm_gamma, shape=(L,))
        check_tensor("weights.w_uk", self.w_uk, shape=(H, L, None))
        check_tensor("weights.w_uv", self.w_uv, shape=(H, None, L))
        check_tensor("weights.w_k", self.w_k, shape=(H * Dn, L))
        object.__setattr__(self, "epsilon", check_float("weights.epsilon", self.epsilon, lo=0.0))
        if not isinstance(self.rope_interleaved, bool):
            raise ValueError(f"weights.rope_interleaved: expected a bool, got {self.rope_interleaved!r}")

    @classmethod
    def from_kv_b(cls, kv_b_weight: torch.Tensor, kv_norm_gamma: torch.Tensor, *, num_heads: int, qk_nope_head_dim: int,
                  epsilon: float = 1e-6, rope_interleaved: bool = True, dtype: torch.dtype | None = None) -> "LayerWeights":
        """Split ``kv_b_proj.weight [H*(Dn+Dv), L]`` (per head: Dn rows of W_UK, then Dv rows of W_UV)
        into the three layouts, each a fresh contiguous tensor in ``dtype`` (default: the weight's)."""
        check_tensor("kv_b_weight", kv_b_weight, rank=2, dtypes=FLOAT_DTYPES)
        rows, L = kv_b_weight.shape
        H, Dn = num_heads, qk_nope_head_dim
        if H < 1 or Dn < 1 or rows % H or rows // H <= Dn:
            raise ValueError(f"kv_b_weight: {rows} rows do not split into {H} heads of {Dn} key rows and some value rows")
        dtype = dtype or kv_b_weight.dtype
        fresh = dict(dtype=dtype, memory_format=torch.contiguous_format, copy=True)  # never a view of the weight
        with torch.inference_mode(False):  # normal tensors: a backend may cache derived forms keyed by version
            w = kv_b_weight.detach().reshape(H, rows // H, L)
            w_uk_rows, w_uv = w[:, :Dn], w[:, Dn:]
            return cls(kv_norm_gamma, w_uk_rows.to(**fresh).view(H * Dn, L), w_uk_rows.transpose(1, 2).to(**fresh),
                       w_uv.to(**fresh), epsilon, rope_interleaved)

    @property
    def num_heads(self) -> int:
        return self.w_uk.shape[0]

    @property
    def kv_lora_rank(self) -> int:
        return self.w_uk.shape[1]

    @property
    def qk_nope_head_dim(self) -> int:
        return self.w_uk.shape[2]

    @property
    def v_head_dim(self) -> int:
        return self.w_uv.shape[1]

    @property
    def device(self) -> torch.device:
        return self.kv_norm_gamma.device

    def __repr__(self) -> str:
        return (f"LayerWeights(heads={self.num_heads}, L={self.kv_lora_rank}, Dn={self.qk_nope_head_dim}, Dv={self.v_head_dim}, "
                f"dtype={self.w_uk.dtype}, epsilon={self.epsilon}, rope_interleaved={self.rope_interleaved})")


def _agreed(*sizes: int | None) -> int:
    """The size most of ``sizes`` agree on (the first on a tie; None: a source that gives none)."""
    given = [v for v in sizes if v is not None]
    return max(given, key=given.count)
