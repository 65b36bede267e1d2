"""FLOP and byte counts of MLA work, shared by the demo, the benchmarks and the bench scripts.

A multiply-add counts 2 FLOPs. Counts follow the math actually needed (causal keys only),
so achieved rates are honest: work a kernel wastes on masked keys is not credited.
"""

from __future__ import annotations

from typing import Sequence

from openmla.config import MLAConfig


def visible_keys(cache_lens: Sequence[int], new_lens: Sequence[int], causal: bool = True) -> int:
    """Total (query, key) pairs of a ragged batch: sum over new tokens of the keys each sees."""
    total = 0
    for c, n in zip(cache_lens, new_lens):
        if causal:
            total += n * c + n * (n + 1) // 2  # token i sees c + i + 1 keys
        else:
            total += n * (c + n)
    return total


def decode_attention_flops(cfg: MLAConfig, pairs: int) -> int:
    """Absorbed form: QK over L+R and PV over L per (query, key, head)."""
    return 2 * pairs * cfg.num_heads * (cfg.cache_head_dim + cfg.kv_lora_rank)


def absorption_flops(cfg: MLAConfig, tokens: int) -> int:
    """Query absorption (Dn -> L) and output projection (L -> Dv) per token and head."""
    return 2 * tokens * cfg.num_heads * cfg.kv_lora_rank * (cfg.qk_nope_head_dim + cfg.v_head_dim)


def prefill_attention_flops(cfg: MLAConfig, pairs: int) -> int:
    """Up-projected form: QK over Dn+R and PV over Dv per (query, key, head)."""
    return 2 * pairs * cfg.num_heads * (cfg.qk_head_dim + cfg.v_head_dim)


def up_projection_flops(cfg: MLAConfig, keys: int) -> int:
    """K_nope and V up-projection of ``keys`` latent rows for every head."""
    return 2 * keys * cfg.kv_lora_rank * cfg.num_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)


def projection_flops(cfg: MLAConfig, tokens: int) -> int:
    """The layer's dense projections (q path, kv_a, o_proj) for ``tokens`` tokens."""
    H = cfg.num_heads
    if cfg.q_lora_rank:
        q = cfg.hidden_size * cfg.q_lora_rank + cfg.q_lora_rank * H * cfg.qk_head_dim
    else:
        q = cfg.hidden_size * H * cfg.qk_head_dim
    return 2 * tokens * (q + cfg.hidden_size * cfg.cache_head_dim + H * cfg.v_head_dim * cfg.hidden_size)


def fused_op_flops(cfg: MLAConfig, cache_lens: Sequence[int], new_lens: Sequence[int], decode_form: bool, causal: bool = True) -> int:
    """FLOPs of ``mla_prefill_decode_graph`` for one batch in the form it runs."""
    pairs = visible_keys(cache_lens, new_lens, causal)
    tokens = sum(new_lens)
    if decode_form:
        return decode_attention_flops(cfg, pairs) + absorption_flops(cfg, tokens)
    keys = sum(c + n for c, n in zip(cache_lens, new_lens))
    return prefill_attention_flops(cfg, pairs) + up_projection_flops(cfg, keys)


def cache_bytes(cfg: MLAConfig, keys: int, bytes_per_value: int = 2) -> int:
    """Bytes of latent cache read when each key row is read once."""
    return keys * cfg.cache_head_dim * bytes_per_value
