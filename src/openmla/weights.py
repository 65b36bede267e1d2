"""One attention layer's constant inputs, built once: ``LayerWeights``.

``kv_b_proj.weight [H*(Dn+Dv), L]`` is one matrix that MLA reads in three layouts: the prefill
form's K up-projection ``w_k [H*Dn, L]``, the decode form's query absorption ``w_uk [H, L, Dn]``
and the V up-projection / output projection ``w_uv [H, Dv, L]``. ``from_kv_b`` splits it once (three
contiguous copies); a layer call is then ``plan.run(q, kv, layer_idx, weights, freqs_cis)``.
"""

from __future__ import annotations

import math

import torch

from .validate import FLOAT_DTYPES, check_float, check_tensor


class LayerWeights:
    """``kv_norm_gamma [L]`` (``kv_a_layernorm.weight``), ``w_k [H*Dn, L]``, ``w_uk [H, L, Dn]``,
    ``w_uv [H, Dv, L]``, the latent norm's ``epsilon`` and the rope layout (``rope_interleaved``:
    DeepSeek's interleaved pairs, else half-split). Shapes, dtypes and devices are checked here,
    once; a plan checks only that they match its step. Read-only: to change a layer's weights make
    a new ``LayerWeights`` (``LatentAttention`` does). Also ``num_heads``, ``kv_lora_rank``,
    ``qk_nope_head_dim``, ``v_head_dim`` and ``device``, read off the tensors."""

    __slots__ = ("kv_norm_gamma", "w_k", "w_uk", "w_uv", "epsilon", "rope_interleaved",
                 "num_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "device")

    def __init__(self, kv_norm_gamma: torch.Tensor, w_k: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor,
                 epsilon: float = 1e-6, rope_interleaved: bool = True) -> None:
        sizes = _consistent(kv_norm_gamma, w_k, w_uk, w_uv)
        if sizes is None:
            explain_mismatch(kv_norm_gamma, w_k, w_uk, w_uv)  # raises ValueError naming the odd tensor
        if not (type(epsilon) is float and 0.0 <= epsilon < math.inf):
            epsilon = check_float("weights.epsilon", epsilon, lo=0.0)
        if not isinstance(rope_interleaved, bool):
            raise ValueError(f"weights.rope_interleaved: expected a bool, got {rope_interleaved!r}")
        self.kv_norm_gamma, self.w_k, self.w_uk, self.w_uv = kv_norm_gamma, w_k, w_uk, w_uv
        self.epsilon, self.rope_interleaved = epsilon, rope_interleaved
        self.num_heads, self.kv_lora_rank, self.qk_nope_head_dim, self.v_head_dim = sizes
        self.device = kv_norm_gamma.device

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

    def __repr__(self) -> str:
        return (f"LayerWeights(heads={self.num_heads}, L={self.kv_lora_rank}, Dn={self.qk_nope_head_dim}, Dv={self.v_head_dim}, "
                f"dtype={self.w_uk.dtype}, epsilon={self.epsilon}, rope_interleaved={self.rope_interleaved})")


def _consistent(g: object, w_k: object, w_uk: object, w_uv: object) -> tuple[int, int, int, int] | None:
    """``(H, L, Dn, Dv)`` when the four are float tensors of one device with matching shapes, else None
    (one expression: a MAX-named op makes a LayerWeights on every layer call)."""
    T = torch.Tensor
    if not (isinstance(g, T) and isinstance(w_k, T) and isinstance(w_uk, T) and isinstance(w_uv, T)
            and g.dim() == 1 and w_k.dim() == 2 and w_uk.dim() == 3 and w_uv.dim() == 3):
        return None
    H, L, Dn = w_uk.shape
    Dv = w_uv.shape[1]
    dev = g.device
    ok = (g.shape[0] == L and w_uv.shape[0] == H and w_uv.shape[2] == L and w_k.shape == (H * Dn, L)
          and g.dtype in FLOAT_DTYPES and w_k.dtype in FLOAT_DTYPES and w_uk.dtype in FLOAT_DTYPES and w_uv.dtype in FLOAT_DTYPES
          and w_k.device == dev and w_uk.device == dev and w_uv.device == dev)
    return (H, L, Dn, Dv) if ok else None


def explain_mismatch(g: object, w_k: object, w_uk: object, w_uv: object, *, heads: int | None = None, nope: int | None = None) -> None:
    """The ``ValueError`` for weights ``_consistent`` rejected, naming the odd tensor out. ``heads``
    and ``nope``: what a caller knows of H and Dn from elsewhere (a query), a vote each."""
    for name, t, rank in (("kv_norm_gamma", g, 1), ("w_uk", w_uk, 3), ("w_uv", w_uv, 3), ("w_k", w_k, 2)):
        check_tensor(f"weights.{name}", t, rank=rank)
    L = _agreed(g.shape[0], w_uk.shape[1], w_uv.shape[2], w_k.shape[1])  # sizes most sources agree on
    rows, d = w_k.shape[0], w_uk.shape[2]
    H = _agreed(w_uk.shape[0], w_uv.shape[0], heads, rows // d if d and rows % d == 0 else None)
    Dn = _agreed(w_uk.shape[2], nope, rows // H if H and rows % H == 0 else None)
    dev = g.device
    check_tensor("weights.kv_norm_gamma", g, shape=(L,), dtypes=FLOAT_DTYPES)
    check_tensor("weights.w_uk", w_uk, shape=(H, L, Dn), dtypes=FLOAT_DTYPES, device=dev)
    check_tensor("weights.w_uv", w_uv, shape=(H, None, L), dtypes=FLOAT_DTYPES, device=dev)
    check_tensor("weights.w_k", w_k, shape=(H * Dn, L), dtypes=FLOAT_DTYPES, device=dev)
    raise AssertionError("weights: _consistent and explain_mismatch disagree")  # unreachable when both are right


def _agreed(*sizes: int | None) -> int:
    """The size most of ``sizes`` agree on (the first on a tie; None: a source that gives none)."""
    given = [v for v in sizes if v is not None]
    return max(given, key=given.count)
