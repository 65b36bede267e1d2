"""Public functional ops (the seeds' entry points). Each validates its arguments once, then
hands them to a backend chosen by ``backend=`` / ``OPENMLA_BACKEND`` / the tensors' device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .backends import load_backend, resolve_backend_name
from .cache import CacheBatch
from .fp8 import FP8, dequantize_q
from .masks import MaskVariant
from .validate import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_attention_common,
    check_cache_batch,
    check_int,
    check_offsets,
    check_optional_positive,
    check_tensor,
)

DECODE_MAX_Q_LEN = 6  # MAX's threshold: up to this many new tokens per sequence runs the decode form


def _backend(backend: str | None, device: torch.device, batch: CacheBatch | None = None):
    name = resolve_backend_name(backend, device)
    be = load_backend(name)
    if batch is not None and batch.cache_format not in getattr(be, "CACHE_FORMATS", ("native",)):
        raise ValueError(f"kv_collection: the {name} backend cannot read a {batch.cache_format} cache yet")
    return be


def _query(q: object, q_scale: object) -> tuple[torch.Tensor, torch.dtype]:
    """Check q; a float8_e4m3fn q is dequantised with ``q_scale`` and gives bfloat16 output.

    Returns ``(q in a compute dtype, output dtype)``.
    """
    check_tensor("q", q, rank=3, dtypes=FLOAT_DTYPES + (FP8,))
    if q.dtype != FP8:
        if q_scale is not None:
            raise ValueError("q_scale: only a float8_e4m3fn q takes a scale")
        return q, q.dtype
    if q_scale is not None:
        if isinstance(q_scale, torch.Tensor):
            check_tensor("q_scale", q_scale, dtypes=(torch.float32,), device=q.device)
            if q_scale.numel() not in (1, q.shape[0]) or q_scale.dim() > 1:
                raise ValueError(f"q_scale: expected a scalar, [1] or per-token [{q.shape[0]}], got {tuple(q_scale.shape)}")
            bad = not bool(torch.isfinite(q_scale).all())
        else:
            bad = isinstance(q_scale, bool) or not isinstance(q_scale, (int, float)) or not math.isfinite(q_scale)
        if bad:
            raise ValueError(f"q_scale: must be finite, got {q_scale!r}")
    return dequantize_q(q, q_scale, torch.bfloat16), torch.bfloat16


def _finish(out: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype, device: torch.device, return_lse: bool):
    out = out.to(device=device, dtype=dtype)
    if return_lse:
        return out, lse.to(device=device, dtype=torch.float32)
    return out


# Utilities -------------------------------------------------------------------------
def merge_states(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attentions over disjoint key sets.

    ``o_* [..., D]`` are each part's normalised output, ``lse_* [...]`` its log-sum-exp
    (-inf for an empty part). Returns ``(o, lse)`` in float32 as if computed over both sets.
    """
    la, lb = lse_a.float(), lse_b.float()
    m = torch.maximum(la, lb)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    wa, wb = torch.exp(la - m_safe), torch.exp(lb - m_safe)
    denom = wa + wb
    lse = m_safe + torch.log(denom)
    denom = torch.where(denom > 0, denom, torch.ones_like(denom))
    o = (o_a.float() * (wa / denom)[..., None]) + (o_b.float() * (wb / denom)[..., None])
    return o, torch.where(torch.isfinite(m), lse, m)


def mla_prefill_plan(
    input_row_offsets: torch.Tensor, kv_collection: CacheBatch, buffer_size: int, max_chunks: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split the keys every sequence sees (cached + new) into chunks of at most ``buffer_size`` rows.

    The batch's keys are laid end to end (sequence 0's positions 0..n0-1, then sequence 1's,
    ...) and cut every ``buffer_size`` rows. For chunk ``c``: ``buffer_row_offsets[c, b]:[c, b+1]``
    are sequence ``b``'s rows in the buffer, starting at key position ``cache_offsets[c, b]``;
    ``buffer_lengths[c]`` is the chunk's row count, -1 past the last chunk. All int32.
    """
    check_int("buffer_size", buffer_size, 1)
    check_int("max_chunks", max_chunks, 1)
    if not isinstance(kv_collection, CacheBatch):
        raise ValueError(f"kv_collection: expected a CacheBatch, got {type(kv_collection).__name__}")
    offs = check_offsets("input_row_offsets", input_row_offsets, int(input_row_offsets[-1]), input_row_offsets.device)
    if len(offs) != kv_collection.batch_size + 1:
        raise ValueError(f"input_row_offsets: {len(offs)} entries for {kv_collection.batch_size} sequences")
    lens = [c + offs[b + 1] - offs[b] for b, c in enumerate(kv_collection.cache_lengths_list)]
    total = sum(lens)
    num_chunks = max(1, -(-total // buffer_size))
    if num_chunks > max_chunks:
        raise ValueError(f"max_chunks: {total} keys need {num_chunks} chunks of {buffer_size}, more than max_chunks={max_chunks}")
    B = len(lens)
    bro = torch.zeros(max_chunks, B + 1, dtype=torch.int32)
    co = torch.zeros(max_chunks, B + 1, dtype=torch.int32)
    blen = torch.full((max_chunks,), -1, dtype=torch.int32)
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    for c in range(num_chunks):
        lo, hi = c * buffer_size, min((c + 1) * buffer_size, total)
        for b in range(B):
            s, e = max(starts[b], lo), min(starts[b + 1], hi)
            bro[c, b + 1] = bro[c, b] + max(0, e - s)
            co[c, b] = max(0, s - starts[b]) if e > s else 0
        co[c, B] = co[c, B - 1] if B else 0
        blen[c] = hi - lo
    dev = input_row_offsets.device
    return bro.to(dev), co.to(dev), blen.to(dev)


@dataclass(frozen=True)
class MlaConfigV2:
    """Tile configuration of ``mla_prefill_v2_ragged``: changes blocking, never results.

    ``block_m`` query rows and ``block_n`` key rows per tile (powers of two); ``num_heads``,
    ``q_depth`` (Dn+R), ``depth`` (Dv) and the dtypes must match the tensors passed.
    """

    num_heads: int
    q_depth: int = 192
    depth: int = 128
    block_m: int = 64
    block_n: int = 64
    dtype: torch.dtype = torch.bfloat16
    output_dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1 or v & (v - 1):
                raise ValueError(f"config.{name}: must be a power of two, got {v!r}")


# Cache write -----------------------------------------------------------------------
def _check_write_inputs(q, kv, freqs_cis, kv_norm_gamma, batch: CacheBatch, layer_idx, epsilon, dev) -> tuple[int, int]:
    T = q.shape[0]
    L = check_tensor("kv_norm_gamma", kv_norm_gamma, rank=1, dtypes=FLOAT_DTYPES, device=dev).shape[0]
    check_tensor("kv", kv, shape=(T, None), dtypes=FLOAT_DTYPES, device=dev)
    R = kv.shape[1] - L
    if R < 2 or R % 2:
        raise ValueError(f"kv: width {kv.shape[1]} minus kv_norm_gamma's {L} leaves {R} rope dims (need an even R >= 2)")
    check_cache_batch(batch, layer_idx, dev, head_dim=L + R)
    check_tensor("freqs_cis", freqs_cis, shape=(None, R), dtypes=(torch.float32, torch.float64), device=dev)
    longest = max(batch.seq_lens_list, default=0)
    if longest > freqs_cis.shape[0]:
        raise ValueError(f"freqs_cis: has {freqs_cis.shape[0]} positions, the batch reaches position {longest - 1}")
    if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)) or not (epsilon >= 0 and math.isfinite(epsilon)):
        raise ValueError(f"epsilon: expected a finite float >= 0, got {epsilon!r}")
    return L, R


def mla_write_cache(
    q: torch.Tensor,
    kv: torch.Tensor,
    freqs_cis: torch.Tensor,
    kv_norm_gamma: torch.Tensor,
    kv_collection: CacheBatch,
    layer_idx: int,
    *,
    epsilon: float = 1e-6,
    rope_interleaved: bool = True,
    backend: str | None = None,
) -> torch.Tensor:
    """Write ``kv [T, L+R]`` into the cache (RMSNorm latent, RoPE'd key rope) and return q
    ``[T, H, Dn+R]`` with its last R dims rotated (a new tensor of q's dtype)."""
    dev = check_tensor("q", q, rank=3, dtypes=FLOAT_DTYPES).device
    _check_write_inputs(q, kv, freqs_cis, kv_norm_gamma, kv_collection, layer_idx, epsilon, dev)
    check_offsets("kv_collection.input_row_offsets", kv_collection.input_row_offsets, q.shape[0], dev)
    be = _backend(backend, dev, kv_collection)
    return be.write_cache(q, kv, freqs_cis, kv_norm_gamma, kv_collection, layer_idx, float(epsilon), rope_interleaved).to(q.dtype)


# The fused op ----------------------------------------------------------------------
def mla_prefill_decode_graph(
    q: torch.Tensor,
    kv: torch.Tensor,
    input_row_offsets: torch.Tensor,
    freqs_cis: torch.Tensor,
    kv_norm_gamma: torch.Tensor,
    kv_collection: CacheBatch,
    layer_idx: int,
    w_k: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    *,
    scale: float,
    epsilon: float = 1e-6,
    mask: str | MaskVariant = "causal",
    window_size: int | None = None,
    chunk_size: int | None = None,
    sparse_indices: torch.Tensor | None = None,
    topk_lengths: torch.Tensor | None = None,
    physical_indices: bool = True,
    attn_sink: torch.Tensor | None = None,
    num_partitions: int | None = None,
    buffer_size: int | None = None,
    decode_max_q_len: int = DECODE_MAX_Q_LEN,
    rope_interleaved: bool = True,
    q_scale: torch.Tensor | float | None = None,
    return_lse: bool = False,
    backend: str | None = None,
):
    """MLA for one layer of a ragged batch: cache write, q rope, then attention.

    Shapes: ``q [T, H, Dn+R]``, ``kv [T, L+R]`` (``kv_a_proj_with_mqa`` output, before norm and
    rope), ``input_row_offsets [B+1]``, ``freqs_cis [max_seq_len, R]``, ``kv_norm_gamma [L]``,
    ``w_k [H*Dn, L]``, ``w_uk [H, L, Dn]``, ``w_uv [H, Dv, L]``. Returns ``out [T, H, Dv]`` in q's
    dtype (and float32 ``lse [T, H]`` with ``return_lse``). Runs the decode (absorbed) form when
    no sequence has more than ``decode_max_q_len`` new tokens, the prefill form otherwise.
    Nothing is written to the cache when an argument is rejected. A float8_e4m3fn ``q`` (with
    ``q_scale``: scalar or per token) gives bfloat16 output.
    """
    q, out_dtype = _query(q, q_scale)
    dev = q.device
    T, H, qd = q.shape
    L, R = _check_write_inputs(q, kv, freqs_cis, kv_norm_gamma, kv_collection, layer_idx, epsilon, dev)
    Dn = qd - R
    if Dn < 1:
        raise ValueError(f"q: depth {qd} must exceed the rope width {R}")
    offs = check_offsets("input_row_offsets", input_row_offsets, T, dev)
    if offs != kv_collection.offsets_list:
        raise ValueError("input_row_offsets: differs from kv_collection.input_row_offsets")
    check_tensor("w_uk", w_uk, shape=(H, L, Dn), dtypes=FLOAT_DTYPES, device=dev)
    check_tensor("w_uv", w_uv, shape=(H, None, L), dtypes=FLOAT_DTYPES, device=dev)
    check_tensor("w_k", w_k, shape=(H * Dn, L), dtypes=FLOAT_DTYPES, device=dev)
    scale, variant = check_attention_common(
        q_rows=T, num_heads=H, batch=kv_collection, offsets=offs, scale=scale, mask=mask, window_size=window_size,
        chunk_size=chunk_size, sparse_indices=sparse_indices, topk_lengths=topk_lengths,
        physical_indices=physical_indices, attn_sink=attn_sink, device=dev,
    )
    check_optional_positive("num_partitions", num_partitions)
    check_optional_positive("buffer_size", buffer_size)
    check_int("decode_max_q_len", decode_max_q_len, 0)
    be = _backend(backend, dev, kv_collection)

    q_rot = be.write_cache(q, kv, freqs_cis, kv_norm_gamma, kv_collection, layer_idx, float(epsilon), rope_interleaved)
    sparse = dict(sparse_indices=sparse_indices, topk_lengths=topk_lengths, physical_indices=physical_indices, attn_sink=attn_sink)
    if kv_collection.max_new_tokens <= decode_max_q_len:
        q_abs = be.absorb(q_rot, w_uk)
        out_lat, lse = be.decode(q_abs, kv_collection, layer_idx, scale=scale, kv_lora_rank=L, mask=variant,
                                 num_partitions=num_partitions, **sparse)
        out = be.unabsorb(out_lat, w_uv)
    else:
        out, lse = be.prefill(q_rot, kv_collection, layer_idx, w_k, w_uv, scale=scale, mask=variant,
                              buffer_size=buffer_size, **sparse)
    return _finish(out, lse, out_dtype, dev, return_lse)


# Kernel-level entry points ---------------------------------------------------------
def flare_mla_decode(
    q: torch.Tensor,
    kv_collection: CacheBatch,
    layer_idx: int,
    *,
    scale: float,
    kv_lora_rank: int = 512,
    mask: str | MaskVariant = "causal",
    window_size: int | None = None,
    chunk_size: int | None = None,
    num_partitions: int | None = None,
    sparse_indices: torch.Tensor | None = None,
    topk_lengths: torch.Tensor | None = None,
    physical_indices: bool = True,
    attn_sink: torch.Tensor | None = None,
    q_scale: torch.Tensor | float | None = None,
    return_lse: bool = False,
    backend: str | None = None,
):
    """Absorbed (MQA) attention over the paged latent cache.

    ``q [T, H, L+R]`` is already absorbed (``W_UK^T q_nope``) and roped; the cache already holds
    this call's tokens (positions ``cache_lengths[b] + i``). Returns ``out [T, H, L]`` in q's dtype
    (and float32 ``lse [T, H]``). ``kv_lora_rank`` is L, the value width. A float8_e4m3fn ``q``
    (with ``q_scale``) gives bfloat16 output.
    """
    q, out_dtype = _query(q, q_scale)
    dev = q.device
    T, H, D = q.shape
    check_cache_batch(kv_collection, layer_idx, dev)
    if D != kv_collection.head_dim:
        raise ValueError(f"q: depth {D} must equal the cache entry width {kv_collection.head_dim} (L+R)")
    check_int("kv_lora_rank", kv_lora_rank, 1, D)
    offs = check_offsets("kv_collection.input_row_offsets", kv_collection.input_row_offsets, T, dev)
    scale, variant = check_attention_common(
        q_rows=T, num_heads=H, batch=kv_collection, offsets=offs, scale=scale, mask=mask, window_size=window_size,
        chunk_size=chunk_size, sparse_indices=sparse_indices, topk_lengths=topk_lengths,
        physical_indices=physical_indices, attn_sink=attn_sink, device=dev,
    )
    check_optional_positive("num_partitions", num_partitions)
    be = _backend(backend, dev, kv_collection)
    out, lse = be.decode(q, kv_collection, layer_idx, scale=scale, kv_lora_rank=kv_lora_rank, mask=variant,
                         sparse_indices=sparse_indices, topk_lengths=topk_lengths, physical_indices=physical_indices,
                         attn_sink=attn_sink, num_partitions=num_partitions)
    return _finish(out, lse, out_dtype, dev, return_lse)


def mla_prefill(
    q: torch.Tensor,
    kv_collection: CacheBatch,
    layer_idx: int,
    w_k: torch.Tensor,
    w_uv: torch.Tensor,
    *,
    scale: float,
    mask: str | MaskVariant = "causal",
    window_size: int | None = None,
    chunk_size: int | None = None,
    sparse_indices: torch.Tensor | None = None,
    topk_lengths: torch.Tensor | None = None,
    physical_indices: bool = True,
    attn_sink: torch.Tensor | None = None,
    buffer_size: int | None = None,
    q_scale: torch.Tensor | float | None = None,
    return_lse: bool = False,
    backend: str | None = None,
):
    """Prefill (up-projected) form over the cache: ``q [T, H, Dn+R]`` (roped), keys = every cached
    position the mask shows (this call's tokens already written). K_nope and V are up-projected
    with ``w_k [H*Dn, L]`` and ``w_uv [H, Dv, L]`` in chunks of at most ``buffer_size`` keys.
    Returns ``out [T, H, Dv]`` (and float32 ``lse``); bfloat16 for a float8_e4m3fn ``q``."""
    q, out_dtype = _query(q, q_scale)
    dev = q.device
    T, H, qd = q.shape
    check_cache_batch(kv_collection, layer_idx, dev)
    L = check_tensor("w_uv", w_uv, shape=(H, None, None), dtypes=FLOAT_DTYPES, device=dev).shape[2]
    R = kv_collection.head_dim - L
    if R < 1 or qd <= R:
        raise ValueError(f"w_uv: latent width {L} does not fit cache entries of {kv_collection.head_dim} and q depth {qd}")
    check_tensor("w_k", w_k, shape=(H * (qd - R), L), dtypes=FLOAT_DTYPES, device=dev)
    offs = check_offsets("kv_collection.input_row_offsets", kv_collection.input_row_offsets, T, dev)
    scale, variant = check_attention_common(
        q_rows=T, num_heads=H, batch=kv_collection, offsets=offs, scale=scale, mask=mask, window_size=window_size,
        chunk_size=chunk_size, sparse_indices=sparse_indices, topk_lengths=topk_lengths,
        physical_indices=physical_indices, attn_sink=attn_sink, device=dev,
    )
    check_optional_positive("buffer_size", buffer_size)
    be = _backend(backend, dev, kv_collection)
    out, lse = be.prefill(q, kv_collection, layer_idx, w_k, w_uv, scale=scale, mask=variant,
                          sparse_indices=sparse_indices, topk_lengths=topk_lengths,
                          physical_indices=physical_indices, attn_sink=attn_sink, buffer_size=buffer_size)
    return _finish(out, lse, out_dtype, dev, return_lse)


def _check_flare_prefill(q, k, v, buffer_row_offsets, cache_offsets, batch, layer_idx, dev):
    T, H, qd = q.shape
    check_cache_batch(batch, layer_idx, dev)
    S = check_tensor("k", k, shape=(None, H, None), dtypes=FLOAT_DTYPES, device=dev).shape[0]
    check_tensor("v", v, shape=(S, H, None), dtypes=FLOAT_DTYPES, device=dev)
    R = qd - k.shape[2]
    if R < 1 or R >= batch.head_dim:
        raise ValueError(f"k: depth {k.shape[2]} leaves {R} rope dims of q's {qd}")
    B = batch.batch_size
    check_tensor("buffer_row_offsets", buffer_row_offsets, shape=(B + 1,), dtypes=INDEX_DTYPES, device=dev)
    bro = check_offsets("buffer_row_offsets", buffer_row_offsets, S, dev)
    check_tensor("cache_offsets", cache_offsets, rank=1, dtypes=INDEX_DTYPES, device=dev)
    if cache_offsets.shape[0] not in (B, B + 1):
        raise ValueError(f"cache_offsets: expected {B} or {B + 1} entries, got {cache_offsets.shape[0]}")
    co = [int(x) for x in cache_offsets.tolist()]
    for b, n in enumerate(batch.seq_lens_list):
        if co[b] < 0 or co[b] + bro[b + 1] - bro[b] > n:
            raise ValueError(f"cache_offsets: sequence {b}'s keys [{co[b]}, {co[b] + bro[b + 1] - bro[b]}) exceed its {n} cached tokens")
    return check_offsets("kv_collection.input_row_offsets", batch.input_row_offsets, T, dev)


def flare_mla_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    buffer_row_offsets: torch.Tensor,
    cache_offsets: torch.Tensor,
    kv_collection: CacheBatch,
    layer_idx: int,
    *,
    scale: float,
    mask: str | MaskVariant = "causal",
    window_size: int | None = None,
    chunk_size: int | None = None,
    q_scale: torch.Tensor | float | None = None,
    return_lse: bool = False,
    backend: str | None = None,
    _tile: MlaConfigV2 | None = None,
):
    """One prefill chunk with already up-projected keys (the seeds' ``flare_mla_prefill``).

    ``q [T, H, Dn+R]`` (roped); ``k [S, H, Dn]`` and ``v [S, H, Dv]`` hold, in rows
    ``buffer_row_offsets[b]:[b+1]``, sequence ``b``'s keys at positions ``cache_offsets[b] + j``,
    whose rope part is read from the cache. Queries sit at ``cache_lengths[b] + i``. Returns
    ``out [T, H, Dv]`` (and float32 ``lse`` over this chunk's keys, for ``merge_states``); bfloat16
    for a float8_e4m3fn ``q`` (with ``q_scale``).
    """
    q, out_dtype = _query(q, q_scale)
    dev = q.device
    offs = _check_flare_prefill(q, k, v, buffer_row_offsets, cache_offsets, kv_collection, layer_idx, dev)
    scale, variant = check_attention_common(
        q_rows=q.shape[0], num_heads=q.shape[1], batch=kv_collection, offsets=offs, scale=scale, mask=mask,
        window_size=window_size, chunk_size=chunk_size, sparse_indices=None, topk_lengths=None,
        physical_indices=True, attn_sink=None, device=dev,
    )
    be = _backend(backend, dev, kv_collection)
    out, lse = be.flare_mla_prefill(q, k, v, buffer_row_offsets, cache_offsets, kv_collection, layer_idx,
                                    scale=scale, mask=variant, tile=_tile)
    return _finish(out, lse, out_dtype, dev, return_lse)


def mla_prefill_v2_ragged(
    q: torch.Tensor,
    k_nope: torch.Tensor,
    v: torch.Tensor,
    buffer_row_offsets: torch.Tensor,
    cache_offsets: torch.Tensor,
    kv_collection: CacheBatch,
    layer_idx: int,
    *,
    scale: float,
    config: MlaConfigV2,
    mask: str | MaskVariant = "causal",
    window_size: int | None = None,
    chunk_size: int | None = None,
    q_scale: torch.Tensor | float | None = None,
    return_lse: bool = False,
    backend: str | None = None,
):
    """``flare_mla_prefill`` with an explicit tile config (``MlaConfigV2``); same result for any tiles."""
    if not isinstance(config, MlaConfigV2):
        raise ValueError(f"config: expected an MlaConfigV2, got {type(config).__name__}")
    check_tensor("q", q, rank=3, dtypes=FLOAT_DTYPES + (FP8,))
    if q.shape[1] != config.num_heads or q.shape[2] != config.q_depth:
        raise ValueError(f"config: num_heads={config.num_heads}, q_depth={config.q_depth} but q is {tuple(q.shape)}")
    if v.dim() == 3 and v.shape[2] != config.depth:
        raise ValueError(f"config: depth={config.depth} but v is {tuple(v.shape)}")
    if q.dtype != config.dtype:
        raise ValueError(f"config: dtype={config.dtype} but q is {q.dtype}")
    out = flare_mla_prefill(q, k_nope, v, buffer_row_offsets, cache_offsets, kv_collection, layer_idx, scale=scale,
                            mask=mask, window_size=window_size, chunk_size=chunk_size, q_scale=q_scale,
                            return_lse=return_lse, backend=backend, _tile=config)
    if return_lse:
        return out[0].to(config.output_dtype), out[1]
    return out.to(config.output_dtype)
