"""FlashMLA's Python interface (DeepSeek's ``flash_mla`` package) computed by openmla.

    from openmla.compat.flashmla import get_mla_metadata, flash_mla_with_kvcache, flash_mla_sparse_fwd

Code written against ``flash_mla`` runs unchanged, on the CPU (torch backend) or any Triton GPU,
with FlashMLA's argument names, shapes, defaults and conventions:

- ``q [b, s_q, h_q, d_qk]``; ``k_cache [num_blocks, page_block_size, 1, d_qk]`` read in place:
  bfloat16/float16/float32 entries, or FlashMLA's FP8 records (``is_fp8_kvcache=True``: 656 bytes
  for d_qk = 576, d_v = 512; 512 float8_e4m3 latent values, 4 float32 scales, one per 128 values,
  64 bfloat16 rope values; byte for byte openmla's ``fp8_ds_mla`` format) as float8_e4m3fn, int8
  or uint8;
- ``cache_seqlens [b]`` counts every key, the new tokens included; ``causal`` aligns the ``s_q``
  queries with the last ``s_q`` keys (query ``i`` sees keys ``j <= seqlen - s_q + i``);
- ``softmax_scale`` defaults to ``1/sqrt(d_qk)``;
- sparse indices are physical cache rows (``block * page_block_size + offset``); any index
  ``< 0`` or past the cache's rows is skipped (openmla itself takes only -1: the others are mapped
  to -1 on the device); ``topk_length`` keeps the leftmost entries (per sequence in decode, per
  token in ``flash_mla_sparse_fwd``);
- the LSE is natural-log, float32, ``[b, h_q, s_q]`` (decode) or ``[s_q, h_q]`` (sparse prefill),
  +inf for a query without keys (whose output is 0), and leaves the attention sink out; the output
  is scaled by ``exp(lse) / (exp(lse) + exp(attn_sink))``.

Beyond FlashMLA: any page size, float32 inputs, FP8 records in dense decode and bfloat16 caches in
sparse decode. Not supported: several KV heads (``k_cache.shape[2] > 1``) and DeepSeek's later
512-wide ("MODEL1") FP8 record.

Planning: ``get_mla_metadata()`` returns a ``FlashMLASchedMeta``. Its first dense call checks the
step's ``cache_seqlens`` and ``block_table`` once and makes one openmla plan; every later call (one
per layer) checks shapes only and runs that plan over its own layer's cache
(``MLAPlan.with_blocks``). As in FlashMLA, reuse a metadata object only while ``cache_seqlens``
keeps its values (a different ``block_table`` tensor is re-planned). Sparse calls carry new indices
each time, which openmla validates on every call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .. import combine
from ..fp8 import FP8, ds_mla_record_bytes
from ..planning import MLAPlan, plan
from ..validate import FLOAT_DTYPES, INDEX_DTYPES, check_float, check_int, check_tensor
from ._layout import Layout, empty_to, layout

__all__ = ["FlashMLASchedMeta", "get_mla_metadata", "flash_mla_with_kvcache", "flash_mla_sparse_fwd"]

FP8_CACHE_DTYPES = (FP8, torch.int8, torch.uint8)  # FlashMLA accepts its records in any of these
MAX_LOGITS_BUDGET = 1 << 26  # bytes of gathered keys and scores per chunk of flash_mla_sparse_fwd's max_logits


@dataclass(frozen=True)
class _Config:
    """What one metadata object was first used with (FlashMLA checks these on every call)."""

    b: int
    s_q: int
    h_q: int
    page_block_size: int
    h_k: int
    causal: bool
    is_fp8_kvcache: bool
    topk: int | None
    extra_page_block_size: int | None
    extra_topk: int | None


class FlashMLASchedMeta:
    """One batch step's metadata, as returned by ``get_mla_metadata`` (FlashMLA's type name).

    The first ``flash_mla_with_kvcache`` call fixes the step's shapes; a dense call also reads
    ``cache_seqlens`` and ``block_table`` (once) and plans the step with openmla. Later calls must
    have the same shapes, flags and ``cache_seqlens`` values.
    """

    def __init__(self) -> None:
        self.config: _Config | None = None
        self._dense_key: tuple | None = None
        self._layout: Layout | None = None
        self._table: torch.Tensor | None = None
        self._plans: dict[tuple, MLAPlan] = {}
        self._skeletons: dict[tuple, tuple[Layout, torch.Tensor]] = {}

    @property
    def have_initialized(self) -> bool:
        return self.config is not None

    def __repr__(self) -> str:
        return f"FlashMLASchedMeta(config={self.config}, plans={len(self._plans)})"

    def check(self, config: _Config) -> None:
        """Fix the configuration on first use; afterwards every call must match it."""
        if self.config is None:
            self.config = config
        elif config != self.config:
            diff = [f"{k}={getattr(config, k)!r} (was {getattr(self.config, k)!r})" for k in config.__dataclass_fields__
                    if getattr(config, k) != getattr(self.config, k)]
            raise ValueError("tile_scheduler_metadata: made by an earlier call with other arguments: " + ", ".join(diff)
                             + "; call get_mla_metadata() for each batch step")

    # Dense decode: one plan per step ------------------------------------------------------
    def dense_plan(self, blocks: torch.Tensor, block_table: torch.Tensor, cache_seqlens: torch.Tensor, fmt: str,
                   rope_dim: int, scale: float, backend: str | None) -> tuple[MLAPlan, Layout]:
        """The step's plan over ``blocks`` (made on first use, reused by every layer)."""
        key = (_identity(block_table), _identity(cache_seqlens))
        if key != self._dense_key:
            self._layout, self._table = _dense_layout(block_table, cache_seqlens, self.config, blocks.shape[1], blocks.device)
            self._plans.clear()
            self._dense_key = key
        pkey = (tuple(blocks.shape), blocks.dtype, fmt, rope_dim, scale, backend)
        base = self._plans.get(pkey)
        if base is None:
            batch = self._layout.batch(blocks, self._table, self.config.page_block_size, fmt, rope_dim)
            mask = "causal" if self.config.causal else "null"
            base = self._plans[pkey] = plan(batch, scale=scale, mask=mask, backend=backend)
        return base.with_blocks(blocks), self._layout

    def sparse_skeleton(self, b: int, s_q: int, page_size: int, device: torch.device) -> tuple[Layout, torch.Tensor]:
        """``b`` sequences of ``s_q`` query rows over physical rows (nothing cached, no mask) and
        their all-zero page table (every index is a physical row: the table is never read)."""
        key = (b, s_q, page_size, str(device))
        if key not in self._skeletons:
            lay = layout([s_q] * b, [s_q] * b, False, device)
            table = torch.zeros(b, -(-s_q // page_size), dtype=torch.int32, device=device)
            self._skeletons[key] = (lay, table)
        return self._skeletons[key]


def _identity(t: torch.Tensor) -> tuple:
    """A tensor's storage, view and (when tracked) in-place version: a changed one is re-read."""
    try:
        version = t._version
    except RuntimeError:  # inference tensors track no version
        version = None
    return (t.data_ptr(), tuple(t.shape), t.stride(), str(t.device), version)


def get_mla_metadata(*args, **kwargs) -> tuple[FlashMLASchedMeta, None]:
    """A fresh ``FlashMLASchedMeta`` for one batch step, and None (FlashMLA's ``num_splits`` slot).

    Arguments are accepted and ignored, as in FlashMLA (older versions took ``cache_seqlens``,
    ``num_q_tokens_per_head_k``, ``num_heads_k``, ...): the first ``flash_mla_with_kvcache`` call
    with the object plans the step.
    """
    return FlashMLASchedMeta(), None


# Argument checks -----------------------------------------------------------------------------
def _check_q(q: object, rank: int) -> torch.Tensor:
    check_tensor("q", q, rank=rank, dtypes=FLOAT_DTYPES)
    if any(n < 1 for n in q.shape):
        raise ValueError(f"q: every dimension must be >= 1, got shape {tuple(q.shape)}")
    return q


def _check_dims(d_qk: int, head_dim_v: object, name: str) -> int:
    dv = check_int(name, head_dim_v, 1)
    if dv >= d_qk:
        raise ValueError(f"{name}: {dv} leaves no rope part of q's head dim {d_qk}")
    return dv


def _cache_blocks(name: str, k_cache: object, q: torch.Tensor, dv: int, is_fp8: bool) -> tuple[torch.Tensor, str]:
    """``k_cache [num_blocks, page_block_size, 1, width]`` as openmla storage ``[1, num_blocks,
    page_block_size, width]`` (a view) and its openmla cache format."""
    d_qk = q.shape[-1]
    check_tensor(name, k_cache, rank=4, device=q.device)
    nb, ps, h_k, width = k_cache.shape
    if nb < 1 or ps < 1:
        raise ValueError(f"{name}: needs at least one block of at least one token, got shape {tuple(k_cache.shape)}")
    if h_k != 1:
        raise ValueError(f"{name}: openmla's latent cache has one KV head (MLA); got num_heads_k = {h_k}")
    if k_cache.stride(-1) != 1:
        raise ValueError(f"{name}: the last dimension must be contiguous")
    if is_fp8:
        want = ds_mla_record_bytes(dv, d_qk - dv) if dv % 128 == 0 else None
        if k_cache.dtype not in FP8_CACHE_DTYPES:
            raise ValueError(f"{name}: FP8 records are float8_e4m3fn, int8 or uint8, got {k_cache.dtype}")
        if want is None or width != want:
            raise ValueError(f"{name}: FP8 records for d_qk={d_qk}, head_dim_v={dv} are "
                             f"{want if want else 'not available (head_dim_v must be a multiple of 128)'} bytes, got {width}")
        return k_cache.view(torch.uint8).squeeze(2).unsqueeze(0), "fp8_ds_mla"
    if k_cache.dtype != q.dtype:
        raise ValueError(f"{name}: dtype {k_cache.dtype} differs from q's {q.dtype} (pass is_fp8_kvcache=True for FP8 records)")
    if width != d_qk:
        raise ValueError(f"{name}: entries are {width} wide, q's head dim is {d_qk}")
    return k_cache.squeeze(2).unsqueeze(0), "native"


def _check_scale(softmax_scale: object, d_qk: int, name: str = "softmax_scale") -> float:
    return d_qk ** -0.5 if softmax_scale is None else check_float(name, softmax_scale)


def _check_flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name}: expected a bool, got {value!r}")
    return value


def _check_sink(attn_sink: object, h_q: int, device: torch.device) -> torch.Tensor | None:
    if attn_sink is not None:
        check_tensor("attn_sink", attn_sink, shape=(h_q,), dtypes=(torch.float32,), device=device)
    return attn_sink


def _check_topk_length(name: str, topk_length: object, n: int, topk: int, device: torch.device) -> torch.Tensor | None:
    """``[n]`` integers; values are clamped to ``[0, topk]`` on the device (FlashMLA keeps the leftmost
    ``topk_length`` entries: a longer length keeps them all)."""
    if topk_length is None:
        return None
    check_tensor(name, topk_length, shape=(n,), dtypes=INDEX_DTYPES, device=device)
    return topk_length.to(torch.int64).clamp(0, topk).to(torch.int32)


def _valid_rows(indices: torch.Tensor, num_rows: int) -> torch.Tensor:
    """FlashMLA's invalid-index rule in openmla's form: an entry outside ``[0, num_rows)`` becomes -1."""
    return torch.where((indices >= 0) & (indices < num_rows), indices, -1).to(torch.int32)


def _check_indices(name: str, indices: object, shape: tuple, device: torch.device) -> torch.Tensor:
    check_tensor(name, indices, shape=shape, dtypes=INDEX_DTYPES, device=device)
    if indices.shape[-1] < 1:
        raise ValueError(f"{name}: topk (the last dimension) must be >= 1")
    return indices


# flash_mla_with_kvcache ---------------------------------------------------------------------
def flash_mla_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor | None,
    cache_seqlens: torch.Tensor | None,
    head_dim_v: int,
    tile_scheduler_metadata: FlashMLASchedMeta,
    num_splits: None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    is_fp8_kvcache: bool = False,
    indices: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    extra_k_cache: torch.Tensor | None = None,
    extra_indices_in_kvcache: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
    *,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA decode over a paged cache, FlashMLA's ``flash_mla_with_kvcache``.

    Dense (``indices`` None): ``q [b, s_q, h_q, d_qk]`` against the first ``cache_seqlens[b]``
    keys of sequence ``b`` (pages ``block_table [b, max_blocks]``), causal or not. Sparse:
    ``indices [b, s_q, topk]`` physical cache rows per query (``block_table`` and
    ``cache_seqlens`` unused), optional ``topk_length [b]``, ``attn_sink [h_q]`` float32, and an
    optional second cache (``extra_k_cache`` with ``extra_indices_in_kvcache [b, s_q, extra_topk]``
    and ``extra_topk_length [b]``) attended to in the same softmax. Values are the first
    ``head_dim_v`` entries of each key.

    Returns ``out [b, s_q, h_q, head_dim_v]`` (q's dtype) and ``lse [b, h_q, s_q]`` (float32,
    natural log, +inf for a query without keys, sink excluded). ``backend`` (openmla's: ``torch``,
    ``triton``, ``reference``; None picks by device) is the one argument FlashMLA does not have.
    Raises ``ValueError`` naming the argument on bad input.
    """
    if not isinstance(tile_scheduler_metadata, FlashMLASchedMeta):
        raise ValueError("tile_scheduler_metadata: expected the FlashMLASchedMeta from get_mla_metadata(), "
                         f"got {type(tile_scheduler_metadata).__name__}")
    if num_splits is not None:
        raise ValueError("num_splits: must be None (the second value get_mla_metadata() returns)")
    _check_q(q, 4)
    b, s_q, h_q, d_qk = q.shape
    dv = _check_dims(d_qk, head_dim_v, "head_dim_v")
    causal = _check_flag("causal", causal)
    is_fp8 = _check_flag("is_fp8_kvcache", is_fp8_kvcache)
    scale = _check_scale(softmax_scale, d_qk)
    blocks, fmt = _cache_blocks("k_cache", k_cache, q, dv, is_fp8)
    sparse = indices is not None
    extra = extra_k_cache is not None
    if not sparse:
        for name, value in (("attn_sink", attn_sink), ("extra_k_cache", extra_k_cache), ("topk_length", topk_length),
                            ("extra_indices_in_kvcache", extra_indices_in_kvcache), ("extra_topk_length", extra_topk_length)):
            if value is not None:
                raise ValueError(f"{name}: only sparse attention (indices given) takes it")
    elif causal:
        raise ValueError("causal: must be False with sparse indices (the indices say which keys each query sees)")
    if sparse and not extra:
        for name, value in (("extra_indices_in_kvcache", extra_indices_in_kvcache), ("extra_topk_length", extra_topk_length)):
            if value is not None:
                raise ValueError(f"{name}: given without extra_k_cache")
    if extra and extra_indices_in_kvcache is None:
        raise ValueError("extra_indices_in_kvcache: required with extra_k_cache")
    meta = tile_scheduler_metadata
    topk = _check_indices("indices", indices, (b, s_q, None), q.device).shape[2] if sparse else None
    parts = []
    if sparse:
        parts.append((blocks, fmt, indices, _check_topk_length("topk_length", topk_length, b, topk, q.device)))
    extra_topk = None
    if extra:
        extra_blocks, extra_fmt = _cache_blocks("extra_k_cache", extra_k_cache, q, dv, is_fp8)
        extra_topk = _check_indices("extra_indices_in_kvcache", extra_indices_in_kvcache, (b, s_q, None), q.device).shape[2]
        parts.append((extra_blocks, extra_fmt, extra_indices_in_kvcache,
                      _check_topk_length("extra_topk_length", extra_topk_length, b, extra_topk, q.device)))
    sink = _check_sink(attn_sink, h_q, q.device)
    meta.check(_Config(b, s_q, h_q, k_cache.shape[1], k_cache.shape[2], causal, is_fp8, topk,
                       extra_k_cache.shape[1] if extra else None, extra_topk))
    if not sparse:
        out, lse = _dense(meta, q, blocks, fmt, block_table, cache_seqlens, dv, scale, backend)
    else:
        out, lse = _sparse_decode(meta, q.reshape(b * s_q, h_q, d_qk), parts, dv, scale, sink, backend)
    out = out.view(b, s_q, h_q, dv)
    lse = empty_to(lse, math.inf).view(b, s_q, h_q).transpose(1, 2).contiguous()
    return out, lse


def _dense_layout(block_table: object, cache_seqlens: object, config: _Config, num_blocks: int,
                  device: torch.device) -> tuple[Layout, torch.Tensor]:
    """Check ``cache_seqlens`` and the pages they touch in ``block_table`` (one host read each)."""
    b, ps = config.b, config.page_block_size
    seqlens = [int(n) for n in cache_seqlens.tolist()]
    if any(n < 0 for n in seqlens):
        raise ValueError(f"cache_seqlens: lengths must be >= 0, got {seqlens}")
    pages = [-(-n // ps) for n in seqlens]
    width = block_table.shape[1]
    if max(pages) > width:
        i = max(range(b), key=lambda j: pages[j])
        raise ValueError(f"block_table: sequence {i} has {seqlens[i]} keys ({pages[i]} blocks), the table has {width} columns")
    if max(pages):
        used = torch.arange(width, device=device)[None, :] < torch.tensor(pages, device=device)[:, None]
        touched = block_table[used]
        lo, hi = (int(v) for v in torch.stack([touched.min(), touched.max()]).tolist())
        if lo < 0 or hi >= num_blocks:
            raise ValueError(f"block_table: a block a sequence reads lies outside k_cache's {num_blocks} blocks")
    return layout([config.s_q] * b, seqlens, config.causal, device), block_table


def _dense(meta: FlashMLASchedMeta, q: torch.Tensor, blocks: torch.Tensor, fmt: str, block_table: object,
           cache_seqlens: object, dv: int, scale: float, backend: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    if cache_seqlens is None or block_table is None:
        raise ValueError(f"{'cache_seqlens' if cache_seqlens is None else 'block_table'}: required for dense attention")
    b, s_q, h_q, d_qk = q.shape
    check_tensor("cache_seqlens", cache_seqlens, shape=(b,), dtypes=INDEX_DTYPES, device=q.device)
    check_tensor("block_table", block_table, shape=(b, None), dtypes=INDEX_DTYPES, device=q.device)
    step, lay = meta.dense_plan(blocks, block_table, cache_seqlens, fmt, d_qk - dv, scale, backend)
    out, lse = step.decode(lay.select(q.reshape(b * s_q, h_q, d_qk)), 0, kv_lora_rank=dv, return_lse=True)
    return lay.expand(out, lse)


def _sparse_decode(meta: FlashMLASchedMeta, q: torch.Tensor, parts: list, dv: int, scale: float,
                   sink: torch.Tensor | None, backend: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [b*s_q, h_q, d_qk]`` over each (cache, indices, topk_length) part; several parts are
    LSE-merged and the sink applied once."""
    cfg = meta.config
    results = []
    for blocks, fmt, indices, topk in parts:
        _, nb, ps, _ = blocks.shape
        lay, table = meta.sparse_skeleton(cfg.b, cfg.s_q, ps, q.device)
        idx = _valid_rows(indices.reshape(cfg.b * cfg.s_q, -1), nb * ps)
        step = plan(lay.batch(blocks, table, ps, fmt, q.shape[-1] - dv), scale=scale, sparse_indices=idx,
                    topk_lengths=topk, physical_indices=True, attn_sink=sink if len(parts) == 1 else None, backend=backend)
        results.append(step.decode(q, 0, kv_lora_rank=dv, return_lse=True))
    if len(results) == 1:
        return results[0]
    (o_a, lse_a), (o_b, lse_b) = results
    out, lse = combine.merge_states(o_a, lse_a, o_b, lse_b)
    if sink is not None:
        combine.apply_sink(out, lse, sink, None)
    return out.to(q.dtype), lse.float()


# flash_mla_sparse_fwd -----------------------------------------------------------------------
def flash_mla_sparse_fwd(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = 512,
    attn_sink: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    *,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sparse attention prefill, FlashMLA's ``flash_mla_sparse_fwd``.

    ``q [s_q, h_q, d_qk]``, ``kv [s_kv, 1, d_qk]`` (one KV head; values are the first ``d_v``
    entries), ``indices [s_q, 1, topk]`` rows of ``kv`` per query (an index ``< 0`` or ``>= s_kv`` is
    skipped), optional ``attn_sink [h_q]`` float32 and per-token ``topk_length [s_q]`` (query ``t``
    reads ``indices[t, 0, :topk_length[t]]``).

    Returns ``(out [s_q, h_q, d_v]`` in q's dtype, ``max_logits [s_q, h_q]``, ``lse [s_q, h_q])``:
    float32 ``max_logits`` is the largest scaled score (-inf without keys), ``lse`` the natural-log
    LSE (+inf without keys), both without the sink. ``max_logits`` costs one more pass over the
    scores (in chunks of bounded memory).
    """
    _check_q(q, 3)
    s_q, h_q, d_qk = q.shape
    check_tensor("kv", kv, shape=(None, None, d_qk), dtypes=FLOAT_DTYPES, device=q.device)
    s_kv, h_kv = kv.shape[0], kv.shape[1]
    if h_kv != 1:
        raise ValueError(f"kv: openmla's latent cache has one KV head (MLA); got h_kv = {h_kv}")
    if s_kv < 1:
        raise ValueError("kv: needs at least one row")
    if kv.dtype != q.dtype:
        raise ValueError(f"kv: dtype {kv.dtype} differs from q's {q.dtype}")
    if kv.stride(-1) != 1:
        raise ValueError("kv: the last dimension must be contiguous")
    topk = _check_indices("indices", indices, (s_q, 1, None), q.device).shape[2]
    scale = check_float("sm_scale", sm_scale)
    dv = _check_dims(d_qk, d_v, "d_v")
    sink = _check_sink(attn_sink, h_q, q.device)
    topk = _check_topk_length("topk_length", topk_length, s_q, topk, q.device)
    rows = kv[:, 0, :]
    # kv's rows as openmla pages of one token each (the size-1 dims take the row stride, so the
    # pages are back to back whatever kv's padding).
    blocks = rows.as_strided((1, s_kv, 1, d_qk), (s_kv * rows.stride(0), rows.stride(0), rows.stride(0), 1))
    idx = _valid_rows(indices[:, 0, :], s_kv)
    # Each query is its own openmla sequence: its topk_length is then openmla's per-sequence length.
    lay = layout([1] * s_q, [1] * s_q, False, q.device)
    table = torch.zeros(s_q, 1, dtype=torch.int32, device=q.device)
    step = plan(lay.batch(blocks, table, 1), scale=scale, sparse_indices=idx, topk_lengths=topk, physical_indices=True,
                attn_sink=sink, backend=backend)
    out, lse = step.decode(q, 0, kv_lora_rank=dv, return_lse=True)
    return out, _max_logits(q, rows, idx, topk, scale), empty_to(lse, math.inf)


def _max_logits(q: torch.Tensor, rows: torch.Tensor, idx: torch.Tensor, topk: torch.Tensor | None, scale: float) -> torch.Tensor:
    """``max_t scale * q . rows[idx[t]]`` over each query's valid slots (float32; -inf without any),
    a chunk of queries at a time so that gathered keys and scores stay within MAX_LOGITS_BUDGET."""
    s_q, h_q, d = q.shape
    k = idx.shape[1]
    valid = idx >= 0
    if topk is not None:
        valid &= torch.arange(k, device=idx.device)[None, :] < topk[:, None]
    out = torch.empty(s_q, h_q, dtype=torch.float32, device=q.device)
    chunk = max(1, MAX_LOGITS_BUDGET // (k * 4 * (d + h_q)))
    for t0 in range(0, s_q, chunk):
        t1 = min(s_q, t0 + chunk)
        keys = rows.index_select(0, idx[t0:t1].clamp_min(0).reshape(-1).long()).view(t1 - t0, k, d).float()
        scores = torch.bmm(q[t0:t1].float(), keys.transpose(1, 2)).mul_(scale)  # [n, h_q, topk]
        scores.masked_fill_(~valid[t0:t1, None, :], -math.inf)
        out[t0:t1] = scores.amax(-1)
    return out
