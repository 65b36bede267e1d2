"""MLA model configuration: dimensions, presets, Hugging Face parsing, softmax scale.

The numbers here are the ones of the public checkpoints' ``config.json``; the
softmax scale follows DeepSeek's YaRN rule (``1/sqrt(Dn+R) * mscale^2``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Mapping


@dataclass(frozen=True)
class YarnScaling:
    """DeepSeek YaRN RoPE scaling (the ``rope_scaling`` block of config.json)."""

    factor: float
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention magnitude factor ``0.1 * mscale * ln(scale) + 1`` (1 when scale <= 1)."""
    if scale <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class MLAConfig:
    """Shapes and RoPE settings of one MLA attention layer.

    ``num_heads`` is the number of query heads this process computes; a
    tensor-parallel shard holds ``total_heads / tp`` of them (see ``with_heads``).
    """

    num_heads: int = 128
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    q_lora_rank: int | None = 1536
    hidden_size: int = 7168
    rope_theta: float = 10000.0
    rope_scaling: YarnScaling | None = None
    rope_interleave: bool = True
    max_position_embeddings: int = 163840
    rms_norm_eps: float = 1e-6
    name: str = field(default="custom", compare=False)
    # The softmax scale itself, for a model whose scale is not DeepSeek's rule (``openmla.hf`` reads it
    # from the transformers attention module); None: ``1/sqrt(Dn+R)`` times YaRN's ``mscale^2``.
    attention_scale: float | None = None

    def __post_init__(self) -> None:
        for attr in ("num_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "hidden_size"):
            value = getattr(self, attr)
            if not isinstance(value, int) or value < (0 if attr == "qk_rope_head_dim" else 1):
                kind = "an int >= 0" if attr == "qk_rope_head_dim" else "a positive int"
                raise ValueError(f"{attr} must be {kind}, got {value!r}")
        if self.qk_rope_head_dim % 2:  # 0 is MLA without a rope part (the key is the latent alone)
            raise ValueError(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ValueError(f"q_lora_rank must be None or positive, got {self.q_lora_rank}")
        if self.attention_scale is not None and not (isinstance(self.attention_scale, float) and 0 < self.attention_scale < math.inf):
            raise ValueError(f"attention_scale must be None or a positive finite float, got {self.attention_scale!r}")

    # Derived widths -----------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        """Query/key depth of the prefill form, Dn + R (192 for DeepSeek)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_head_dim(self) -> int:
        """Width of one latent cache entry, L + R (576 for DeepSeek)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """``attention_scale`` when set, else ``1/sqrt(Dn+R)``, times YaRN's ``mscale(factor, mscale_all_dim)^2`` when scaled."""
        if self.attention_scale is not None:
            return self.attention_scale
        scale = self.qk_head_dim**-0.5
        ys = self.rope_scaling
        if ys is not None and ys.mscale_all_dim:
            m = yarn_get_mscale(ys.factor, ys.mscale_all_dim)
            scale *= m * m
        return scale

    def with_heads(self, num_heads: int) -> "MLAConfig":
        """The same layer with ``num_heads`` query heads (a tensor-parallel shard)."""
        return dataclasses.replace(self, num_heads=num_heads)

    # Hugging Face -------------------------------------------------------------------
    @classmethod
    def from_hf(cls, hf_config: Any, num_heads: int | None = None) -> "MLAConfig":
        """Build from a DeepSeek-V2/V3/Kimi-K2 ``config.json`` dict or a transformers config.

        ``num_heads`` overrides ``num_attention_heads`` (for a tensor-parallel shard).
        """
        d: Mapping[str, Any] = hf_config if isinstance(hf_config, Mapping) else hf_config.to_dict()
        required = ("num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "hidden_size")
        missing = [k for k in required if d.get(k) is None]
        if missing:
            raise ValueError(f"hf_config is not an MLA config: missing {', '.join(missing)}")
        rs = d.get("rope_scaling") or d.get("rope_parameters")
        scaling = None
        if rs:
            kind = rs.get("type", rs.get("rope_type"))
            if kind == "yarn":
                if rs.get("factor") is None:
                    raise ValueError("hf_config: rope_scaling of type yarn needs a factor")
                scaling = YarnScaling(
                    factor=float(rs["factor"]),
                    original_max_position_embeddings=int(rs.get("original_max_position_embeddings", 4096)),
                    beta_fast=float(rs.get("beta_fast", 32.0) or 32.0),
                    beta_slow=float(rs.get("beta_slow", 1.0) or 1.0),
                    mscale=float(rs.get("mscale", 1.0) or 1.0),
                    mscale_all_dim=float(rs.get("mscale_all_dim", 0.0) or 0.0),
                )
            elif kind not in (None, "default"):
                raise ValueError(f"hf_config.rope_scaling type {kind!r} is not supported (only yarn)")
        theta = d.get("rope_theta")
        if theta is None and rs:
            theta = rs.get("rope_theta")
        return cls(
            num_heads=int(num_heads if num_heads is not None else d["num_attention_heads"]),
            kv_lora_rank=int(d["kv_lora_rank"]),
            qk_nope_head_dim=int(d["qk_nope_head_dim"]),
            qk_rope_head_dim=int(d["qk_rope_head_dim"]),
            v_head_dim=int(d["v_head_dim"]),
            q_lora_rank=None if d.get("q_lora_rank") is None else int(d["q_lora_rank"]),
            hidden_size=int(d["hidden_size"]),
            rope_theta=float(theta if theta is not None else 10000.0),
            rope_scaling=scaling,
            rope_interleave=bool(d.get("rope_interleave", True)),
            max_position_embeddings=int(d.get("max_position_embeddings", 163840)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            name=str(d.get("_name_or_path") or d.get("model_type") or "hf"),
        )


_DEEPSEEK_V2_YARN = YarnScaling(factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0, mscale=0.707, mscale_all_dim=0.707)
_DEEPSEEK_V3_YARN = YarnScaling(factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)
_KIMI_K2_YARN = YarnScaling(factor=32.0, original_max_position_embeddings=4096, beta_fast=1.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)

PRESETS: dict[str, MLAConfig] = {
    "deepseek-v2-lite": MLAConfig(num_heads=16, q_lora_rank=None, hidden_size=2048, rope_scaling=_DEEPSEEK_V2_YARN, name="deepseek-v2-lite"),
    "deepseek-v2": MLAConfig(num_heads=128, q_lora_rank=1536, hidden_size=5120, rope_scaling=_DEEPSEEK_V2_YARN, name="deepseek-v2"),
    "deepseek-v3": MLAConfig(num_heads=128, q_lora_rank=1536, hidden_size=7168, rope_scaling=_DEEPSEEK_V3_YARN, name="deepseek-v3"),
    "kimi-k2": MLAConfig(
        num_heads=64, q_lora_rank=1536, hidden_size=7168, rope_theta=50000.0, rope_scaling=_KIMI_K2_YARN,
        max_position_embeddings=131072, name="kimi-k2",
    ),
}
# R1 and V3.2 share V3's attention shapes (V3.2 adds the top-k indexer, which feeds sparse_indices).
PRESETS["deepseek-r1"] = dataclasses.replace(PRESETS["deepseek-v3"], name="deepseek-r1")
PRESETS["deepseek-v3.2"] = dataclasses.replace(PRESETS["deepseek-v3"], name="deepseek-v3.2")


def preset(name: str, num_heads: int | None = None) -> MLAConfig:
    """A preset by name (``deepseek-v2-lite``, ``deepseek-v2``, ``deepseek-v3``, ``deepseek-r1``,
    ``deepseek-v3.2``, ``kimi-k2``), optionally sharded to ``num_heads`` query heads."""
    key = name.lower()
    if key not in PRESETS:
        raise ValueError(f"name: unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    cfg = PRESETS[key]
    return cfg if num_heads is None else cfg.with_heads(num_heads)
