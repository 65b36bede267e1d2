"""A catalogue of malformed calls to every public entry point (ops, cache methods, layer).

Each ``Bad`` names the argument its error must name and builds, from a valid small case and a
``draw`` (``Replay``: picks from option lists by hypothesis-drawn numbers), a call that must
raise ``ValueError`` (or ``CacheFullError``) before anything is written. ``run_bad`` runs one and reports what happened, in a picklable form, so the
same code runs in this process (torch, reference backends) and in a child process (triton,
whose kernels could take the process down).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable

import torch

import openmla
from openmla.cache import HostLists
from openmla import CacheBatch, CacheFullError, MlaConfigV2, PagedLatentCache
from openmla.layer import LatentAttention
from openmla_tools.testing import Case, make_case, small_config

NAN = float("nan")


def base_case(seed: int, decode: bool) -> Case:
    """Three ragged sequences (one with no cached token); decode-sized or prefill-sized new tokens."""
    new = [2, 1, 3] if decode else [9, 0, 8]
    return make_case([5, 0, 11], new, page_size=4, config=small_config(num_heads=2, L=32, R=8, Dn=16, Dv=16), seed=seed)


def fused_kwargs(c: Case) -> dict:
    return dict(q=c.q, kv=c.kv, input_row_offsets=c.batch.input_row_offsets, freqs_cis=c.freqs_cis, kv_norm_gamma=c.gamma,
                kv_collection=c.batch, layer_idx=c.layer_idx, w_k=c.w_k, w_uk=c.w_uk, w_uv=c.w_uv, scale=c.scale)


def edited(batch: CacheBatch, **fields) -> CacheBatch:
    """``batch`` with metadata tensors edited *in place* after ``prepare`` (host lists kept)."""
    for name, fn in fields.items():
        t = getattr(batch, name)
        t.copy_(fn(t.clone()))
    return batch


def replaced(batch: CacheBatch, **fields) -> CacheBatch:
    """A new CacheBatch with some fields replaced (runs the constructor's checks)."""
    return dataclasses.replace(batch, _host=HostLists(), **fields)


# Values that are not what an argument wants ------------------------------------------------
def not_a_tensor(draw, t: torch.Tensor):
    return draw([None, 3, 2.5, "tensor", [1, 2], t.tolist() if t.numel() < 64 else [0]])


def bad_float_dtype(draw):
    return draw([torch.int32, torch.int64, torch.bool, torch.uint8, torch.complex64])


def bad_index_dtype(draw):
    return draw([torch.float32, torch.float64, torch.bool, torch.int8, torch.int16, torch.float16])


def to_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype) if not dtype.is_complex else t.to(torch.float32).to(dtype)


def bad_scalar(draw):
    vals = [NAN, math.inf, -math.inf, "1.0", None, [1.0], torch.tensor(1.0), True]
    return draw(vals)


def bad_count(draw):
    return draw([0, -1, -7, 1.5, 2.0, "4", True, NAN])


def meta(t: torch.Tensor) -> torch.Tensor:
    return t.to("meta")


def cut(draw, t: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``t`` with one dimension one shorter or longer (or a dimension added or dropped)."""
    how = draw(["shorter", "longer", "extra_dim", "drop_dim"])
    if dim is None:
        dim = draw(range(t.dim()))
    if how == "shorter" and t.shape[dim] > 0:
        return t.narrow(dim, 0, t.shape[dim] - 1)
    if how == "longer" or how == "shorter":
        return torch.cat([t, t.narrow(dim, 0, 1) if t.shape[dim] else torch.zeros_like(t.narrow(dim, 0, 0)).expand(
            *[1 if i == dim else s for i, s in enumerate(t.shape)])], dim=dim)
    if how == "extra_dim":
        return t[None]
    return t.reshape(-1) if t.dim() > 1 else t.reshape(1, -1)


# The catalogue ------------------------------------------------------------------------------
@dataclass
class Bad:
    name: str
    names: tuple[str, ...]  # the error message must start with one of these
    build: Callable  # (case, draw) -> thunk(backend) running the malformed call
    decode: bool | None = None  # force the decode (True) or prefill (False) sized case
    errors: tuple = (ValueError,)


def fused(**over):
    def thunk_of(c, draw):
        kw = fused_kwargs(c)
        kw.update({k: (v(c, draw) if callable(v) else v) for k, v in over.items()})
        return lambda backend: openmla.mla_prefill_decode_graph(**kw, backend=backend)
    return thunk_of


def fused_batch(fn):
    """A fused call whose kv_collection (and the offsets it must match) is ``fn(case, draw)``."""
    def thunk_of(c, draw):
        kw = fused_kwargs(c)
        kw["kv_collection"] = fn(c, draw)
        if isinstance(kw["kv_collection"], CacheBatch):
            kw["input_row_offsets"] = kw["kv_collection"].input_row_offsets.clone()
        return lambda backend: openmla.mla_prefill_decode_graph(**kw, backend=backend)
    return thunk_of


def page_out_of_pool(c, draw):
    b = c.batch
    s = draw([0, 2])  # sequences with pages
    bad = draw([b.num_pages, b.num_pages + 5, -1, -1000, 2**31 - 1])
    return edited(b, block_table=lambda t: t.index_put_((torch.tensor(s), torch.tensor(0)), torch.tensor(bad, dtype=t.dtype)))


def lengths_edited(c, draw):
    bad = draw([1000, 2**31 - 100, -3])
    return edited(c.batch, cache_lengths=lambda t: t.fill_(bad))


def offsets_edited(c, draw):
    return edited(c.batch, input_row_offsets=lambda t: t.flip(0))


def hand_batch(c, draw):
    """A CacheBatch built by hand with one wrong field (the constructor must reject it)."""
    b = c.batch
    which = draw(["blocks_dtype", "blocks_rank", "table_dtype", "lengths_dtype", "page_size", "offsets_len",
                                  "table_rows", "cache_format", "kv_scale"])
    if which == "blocks_dtype":
        return replaced(b, blocks=b.blocks.to(draw([torch.int16, torch.int32, torch.bool, torch.uint8])))
    if which == "blocks_rank":
        return replaced(b, blocks=b.blocks[0])
    if which == "table_dtype":
        return replaced(b, block_table=b.block_table.to(bad_index_dtype(draw)))
    if which == "lengths_dtype":
        return replaced(b, cache_lengths=b.cache_lengths.float())
    if which == "page_size":
        return replaced(b, page_size=draw([0, -4, 3, 8, 4.0, True, None]))
    if which == "offsets_len":
        return replaced(b, input_row_offsets=b.input_row_offsets[:-1])
    if which == "table_rows":
        return replaced(b, block_table=b.block_table[:-1])
    if which == "cache_format":
        return replaced(b, cache_format=draw(["fp8", "bf16", None, "fp8_e4m3"]))
    return replaced(b, cache_format="native", kv_scale=torch.ones(3))


FUSED = [
    Bad("q not a tensor", ("q",), fused(q=lambda c, d: not_a_tensor(d, c.q))),
    Bad("q rank", ("q", "kv"), fused(q=lambda c, d: cut(d, c.q) if d([False, True]) else c.q[0])),
    Bad("q dtype", ("q",), fused(q=lambda c, d: to_dtype(c.q, bad_float_dtype(d)))),
    Bad("q depth below rope", ("q",), fused(q=lambda c, d: c.q[..., : d(range(1, c.config.qk_rope_head_dim + 1))])),
    Bad("q rows", ("q", "kv"), fused(q=lambda c, d: cut(d, c.q, 0))),
    Bad("q device", ("q", "kv"), fused(q=lambda c, d: meta(c.q))),
    Bad("q_scale without fp8 q", ("q_scale",), fused(q_scale=lambda c, d: d([1.0, torch.ones(1)]))),
    Bad("kv not a tensor", ("kv",), fused(kv=lambda c, d: not_a_tensor(d, c.kv))),
    Bad("kv shape", ("kv",), fused(kv=lambda c, d: cut(d, c.kv))),
    Bad("kv dtype", ("kv",), fused(kv=lambda c, d: to_dtype(c.kv, bad_float_dtype(d)))),
    Bad("kv device", ("kv",), fused(kv=lambda c, d: meta(c.kv))),
    Bad("offsets not a tensor", ("input_row_offsets",), fused(input_row_offsets=lambda c, d: c.batch.offsets_list)),
    Bad("offsets dtype", ("input_row_offsets",), fused(input_row_offsets=lambda c, d: c.batch.input_row_offsets.to(bad_index_dtype(d)))),
    Bad("offsets differ", ("input_row_offsets",), fused(input_row_offsets=lambda c, d: torch.tensor(
        d([[0, 1, 2, 6], [0, 3, 3, 6], [1, 2, 3, 6], [0, 4, 2, 6], [0, 6], [0, 2, 3, 6, 6]]), dtype=torch.int32)),
        decode=True),
    Bad("freqs not a tensor", ("freqs_cis",), fused(freqs_cis=lambda c, d: not_a_tensor(d, c.freqs_cis))),
    Bad("freqs too short", ("freqs_cis",), fused(freqs_cis=lambda c, d: c.freqs_cis[: d(range(11))])),
    Bad("freqs width", ("freqs_cis",), fused(freqs_cis=lambda c, d: cut(d, c.freqs_cis, 1))),
    Bad("freqs dtype", ("freqs_cis",), fused(freqs_cis=lambda c, d: c.freqs_cis.to(d([torch.float16, torch.int64])))),
    Bad("gamma shape", ("kv_norm_gamma", "kv"), fused(kv_norm_gamma=lambda c, d: cut(d, c.gamma))),
    Bad("gamma dtype", ("kv_norm_gamma",), fused(kv_norm_gamma=lambda c, d: to_dtype(c.gamma, bad_float_dtype(d)))),
    Bad("gamma not a tensor", ("kv_norm_gamma",), fused(kv_norm_gamma=lambda c, d: not_a_tensor(d, c.gamma))),
    Bad("batch not a CacheBatch", ("kv_collection",), fused(kv_collection=lambda c, d: d([None, {}, "batch"]))),
    Bad("layer_idx", ("layer_idx",), fused(layer_idx=lambda c, d: d([-1, 2, 7, 1.0, True, None, "1"]))),
    Bad("w_k shape", ("w_k",), fused(w_k=lambda c, d: cut(d, c.w_k))),
    Bad("w_uk shape", ("w_uk",), fused(w_uk=lambda c, d: cut(d, c.w_uk))),
    Bad("w_uv shape", ("w_uv",), fused(w_uv=lambda c, d: cut(d, c.w_uv, d([0, 2])))),
    Bad("w_uv dtype", ("w_uv",), fused(w_uv=lambda c, d: to_dtype(c.w_uv, bad_float_dtype(d)))),
    Bad("weights not tensors", ("w_k", "w_uk", "w_uv"), fused(**{"w_uk": lambda c, d: not_a_tensor(d, c.w_uk)})),
    Bad("scale", ("scale",), fused(scale=lambda c, d: bad_scalar(d))),
    Bad("epsilon", ("epsilon",), fused(epsilon=lambda c, d: d([-1e-6, NAN, math.inf, "1e-6", None, True]))),
    Bad("mask", ("mask", "window_size", "chunk_size"), fused(mask=lambda c, d: d(["diag", None, 3, "CAUSAL"]))),
    Bad("window size", ("window_size",), fused(mask="sliding_window_causal", window_size=lambda c, d: d([0, -2, None, 2.5, True]))),
    Bad("chunk size", ("chunk_size",), fused(mask="chunked_causal", chunk_size=lambda c, d: d([0, -2, None, 2.5]))),
    Bad("window without sliding", ("window_size",), fused(window_size=4)),
    Bad("sparse rows", ("sparse_indices",), fused(sparse_indices=lambda c, d: torch.zeros(c.q.shape[0] + d([-1, 1]), 4, dtype=torch.int32))),
    Bad("sparse dtype", ("sparse_indices",), fused(sparse_indices=lambda c, d: torch.zeros(c.q.shape[0], 4, dtype=bad_index_dtype(d)))),
    Bad("sparse below -1", ("sparse_indices",), fused(sparse_indices=lambda c, d: torch.full((c.q.shape[0], 3), d([-2, -100]), dtype=torch.int32))),
    Bad("sparse physical outside", ("sparse_indices",), fused(sparse_indices=lambda c, d: torch.full(
        (c.q.shape[0], 3), c.batch.num_pages * c.batch.page_size + d([0, 1, 10**6]), dtype=torch.int64))),
    Bad("sparse logical past length", ("sparse_indices",), fused(physical_indices=False, sparse_indices=lambda c, d: torch.full(
        (c.q.shape[0], 3), 11 + 3 + d(range(51)), dtype=torch.int32))),
    Bad("topk without sparse", ("topk_lengths",), fused(topk_lengths=lambda c, d: torch.ones(3, dtype=torch.int32))),
    Bad("topk range", ("topk_lengths",), fused(sparse_indices=lambda c, d: torch.full((c.q.shape[0], 4), -1, dtype=torch.int32),
                                               topk_lengths=lambda c, d: torch.tensor(d([[5, 0, 0], [-1, 0, 0]]), dtype=torch.int32))),
    Bad("topk shape", ("topk_lengths",), fused(sparse_indices=lambda c, d: torch.full((c.q.shape[0], 4), -1, dtype=torch.int32),
                                               topk_lengths=lambda c, d: torch.ones(d([2, 4]), dtype=torch.int32))),
    Bad("physical_indices", ("physical_indices",), fused(physical_indices=lambda c, d: d([1, "yes", None]))),
    Bad("attn_sink", ("attn_sink",), fused(attn_sink=lambda c, d: d(
        [torch.zeros(3), torch.zeros(2, dtype=torch.float64), torch.full((2,), NAN), torch.zeros(2, 2), torch.zeros(3, 3), [0.0, 0.0]]))),
    Bad("num_partitions", ("num_partitions",), fused(num_partitions=lambda c, d: bad_count(d))),
    Bad("buffer_size", ("buffer_size",), fused(buffer_size=lambda c, d: bad_count(d))),
    Bad("decode_max_q_len", ("decode_max_q_len",), fused(decode_max_q_len=lambda c, d: d([-1, 1.5, None, "6"]))),
    Bad("backend", ("backend",), lambda c, d: (lambda backend: openmla.mla_prefill_decode_graph(**fused_kwargs(c), backend="cuda_magic"))),
    Bad("rope_interleaved", ("rope_interleaved",), fused(rope_interleaved=lambda c, d: d([None, "yes", 2]))),
    Bad("return_lse", ("return_lse",), fused(return_lse=lambda c, d: d([None, "yes", 2]))),
    Bad("page out of pool (edited after prepare)", ("kv_collection.block_table",), fused_batch(page_out_of_pool)),
    Bad("cache_lengths edited after prepare", ("kv_collection.cache_lengths", "kv_collection.block_table", "freqs_cis"),
        fused_batch(lengths_edited)),
    Bad("offsets edited after prepare", ("kv_collection.input_row_offsets", "input_row_offsets"), fused_batch(offsets_edited)),
    Bad("hand-built batch with a wrong field", ("kv_collection.",), fused_batch(hand_batch)),
    Bad("pages outside the cache (fresh batch)", ("kv_collection.block_table",), fused_batch(
        lambda c, d: replaced(c.batch, block_table=c.batch.block_table.clone().fill_(d([-1, c.batch.num_pages]))))),
]


# Other ops ---------------------------------------------------------------------------------
def absorbed_q(c: Case) -> torch.Tensor:
    return torch.randn(c.q.shape[0], c.config.num_heads, c.config.cache_head_dim, generator=torch.Generator().manual_seed(c.seed))


def _op_call(op: str, base):
    """A ``Bad`` thunk factory for ``openmla.<op>``: its well-formed arguments ``base(case)``, with
    ``over``'s entries (values, or ``(case, draw) -> value``) in their place."""
    def call(**over):
        def thunk_of(c, draw):
            kw = base(c)
            kw.update({k: (v(c, draw) if callable(v) else v) for k, v in over.items()})
            return lambda backend: getattr(openmla, op)(**kw, backend=backend)
        return thunk_of
    return call


decode_call = _op_call("flare_mla_decode", lambda c: dict(
    q=absorbed_q(c), kv_collection=c.batch, layer_idx=c.layer_idx, scale=c.scale, kv_lora_rank=c.config.kv_lora_rank))
prefill_call = _op_call("mla_prefill", lambda c: dict(
    q=c.q, kv_collection=c.batch, layer_idx=c.layer_idx, w_k=c.w_k, w_uv=c.w_uv, scale=c.scale))
write_call = _op_call("mla_write_cache", lambda c: dict(
    q=c.q, kv=c.kv, freqs_cis=c.freqs_cis, kv_norm_gamma=c.gamma, kv_collection=c.batch, layer_idx=c.layer_idx))


def flare_args(c: Case) -> dict:
    """Valid ``flare_mla_prefill`` arguments: every sequence's keys in one chunk."""
    H, Dn, Dv = c.config.num_heads, c.config.qk_nope_head_dim, c.config.v_head_dim
    lens = c.batch.seq_lens_list
    S = sum(lens)
    g = torch.Generator().manual_seed(c.seed)
    bro = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32)
    return dict(q=c.q, k=torch.randn(S, H, Dn, generator=g), v=torch.randn(S, H, Dv, generator=g), buffer_row_offsets=bro,
                cache_offsets=torch.zeros(len(lens), dtype=torch.int32), kv_collection=c.batch, layer_idx=c.layer_idx, scale=c.scale)


def flare_call(v2: bool = False, **over):
    def thunk_of(c, draw):
        kw = flare_args(c)
        kw.update({k: (v(c, draw) if callable(v) else v) for k, v in over.items()})
        if v2:
            cfg = MlaConfigV2(num_heads=c.config.num_heads, q_depth=c.q.shape[2], depth=c.config.v_head_dim, dtype=c.q.dtype,
                              output_dtype=c.q.dtype)
            kw = {("k_nope" if k == "k" else k): v for k, v in kw.items()}
            return lambda backend: openmla.mla_prefill_v2_ragged(**kw, config=cfg, backend=backend)
        return lambda backend: openmla.flare_mla_prefill(**kw, backend=backend)
    return thunk_of


def plan_call(**over):
    def thunk_of(c, draw):
        kw = dict(input_row_offsets=c.batch.input_row_offsets, kv_collection=c.batch, buffer_size=16, max_chunks=8)
        kw.update({k: (v(c, draw) if callable(v) else v) for k, v in over.items()})
        return lambda backend: openmla.mla_prefill_plan(**kw)
    return thunk_of


def merge_call(which: str, make):
    def thunk_of(c, draw):
        g = torch.Generator().manual_seed(c.seed)
        kw = dict(o_a=torch.randn(5, 2, 8, generator=g), lse_a=torch.randn(5, 2, generator=g),
                  o_b=torch.randn(5, 2, 8, generator=g), lse_b=torch.randn(5, 2, generator=g))
        kw[which] = make(kw[which], draw)
        return lambda backend: openmla.merge_states(**kw)
    return thunk_of


OTHER_OPS = [
    Bad("decode q depth", ("q",), decode_call(q=lambda c, d: absorbed_q(c)[..., :-1]), decode=True),
    Bad("decode q rows", ("q", "kv_collection.input_row_offsets"), decode_call(q=lambda c, d: cut(d, absorbed_q(c), 0)), decode=True),
    Bad("decode kv_lora_rank", ("kv_lora_rank",), decode_call(kv_lora_rank=lambda c, d: d([0, 40, 1000, 2.0, None])), decode=True),
    Bad("decode layer_idx", ("layer_idx",), decode_call(layer_idx=lambda c, d: d([-1, 2, None])), decode=True),
    Bad("decode scale", ("scale",), decode_call(scale=lambda c, d: bad_scalar(d)), decode=True),
    Bad("decode num_partitions", ("num_partitions",), decode_call(num_partitions=lambda c, d: bad_count(d)), decode=True),
    Bad("decode pages edited", ("kv_collection.block_table",), decode_call(kv_collection=page_out_of_pool), decode=True),
    Bad("decode lengths edited", ("kv_collection.cache_lengths", "kv_collection.block_table"), decode_call(kv_collection=lengths_edited),
        decode=True),
    Bad("prefill w_uv", ("w_uv", "w_k"), prefill_call(w_uv=lambda c, d: cut(d, c.w_uv, d([0, 2])))),
    Bad("prefill w_k", ("w_k",), prefill_call(w_k=lambda c, d: cut(d, c.w_k))),
    Bad("prefill q dtype", ("q",), prefill_call(q=lambda c, d: to_dtype(c.q, bad_float_dtype(d)))),
    Bad("prefill buffer_size", ("buffer_size",), prefill_call(buffer_size=lambda c, d: bad_count(d))),
    Bad("write q depth below rope", ("q",), write_call(q=lambda c, d: c.q[..., : d(range(1, c.config.qk_rope_head_dim))])),
    Bad("write kv rows", ("kv",), write_call(kv=lambda c, d: cut(d, c.kv, 0))),
    Bad("write freqs short", ("freqs_cis",), write_call(freqs_cis=lambda c, d: c.freqs_cis[:3])),
    Bad("write epsilon", ("epsilon",), write_call(epsilon=lambda c, d: d([-1.0, NAN, None]))),
    Bad("write rope_interleaved", ("rope_interleaved",), write_call(rope_interleaved=lambda c, d: d([None, "no"]))),
    Bad("write lengths edited", ("kv_collection.cache_lengths", "kv_collection.block_table", "freqs_cis"),
        write_call(kv_collection=lengths_edited)),
    Bad("flare k shape", ("k", "v", "buffer_row_offsets"), flare_call(k=lambda c, d: cut(d, flare_args(c)["k"], d([0, 1])))),
    Bad("flare v not a tensor", ("v",), flare_call(v=lambda c, d: not_a_tensor(d, flare_args(c)["v"]))),
    Bad("flare buffer offsets", ("buffer_row_offsets",), flare_call(buffer_row_offsets=lambda c, d: torch.tensor(
        d([[0, 1, 2], [0, 5, 3, 100], [1, 2, 3, 4]]), dtype=torch.int32))),
    Bad("flare cache offsets", ("cache_offsets",), flare_call(cache_offsets=lambda c, d: torch.tensor(
        d([[-1, 0, 0], [100, 0, 0], [0, 0]]), dtype=torch.int32))),
    Bad("flare cache offsets dtype", ("cache_offsets",), flare_call(cache_offsets=lambda c, d: torch.zeros(3, dtype=bad_index_dtype(d)))),
    Bad("v2 v not a tensor", ("v",), flare_call(v2=True, v=lambda c, d: not_a_tensor(d, flare_args(c)["v"]))),
    Bad("v2 k shape", ("k", "v", "buffer_row_offsets"), flare_call(v2=True, k=lambda c, d: cut(d, flare_args(c)["k"], d([0, 1])))),
    Bad("v2 config", ("config",), lambda c, d: (lambda backend: openmla.mla_prefill_v2_ragged(
        **{("k_nope" if k == "k" else k): v for k, v in flare_args(c).items()}, config=None, backend=backend))),
    Bad("plan offsets not a tensor", ("input_row_offsets",), plan_call(input_row_offsets=lambda c, d: c.batch.offsets_list)),
    Bad("plan offsets empty", ("input_row_offsets",), plan_call(input_row_offsets=lambda c, d: torch.zeros(0, dtype=torch.int32))),
    Bad("plan offsets float", ("input_row_offsets",), plan_call(input_row_offsets=lambda c, d: c.batch.input_row_offsets.float())),
    Bad("plan offsets length", ("input_row_offsets",), plan_call(input_row_offsets=lambda c, d: c.batch.input_row_offsets[:-1])),
    Bad("plan buffer_size", ("buffer_size",), plan_call(buffer_size=lambda c, d: bad_count(d))),
    Bad("plan max_chunks", ("max_chunks",), plan_call(max_chunks=lambda c, d: d([0, 1, 1.5, None]))),
    Bad("plan batch", ("kv_collection",), plan_call(kv_collection=lambda c, d: d([None, "b"]))),
    Bad("plan cache_lengths float", ("kv_collection.cache_lengths", "kv_collection"),
        plan_call(kv_collection=lambda c, d: dataclasses.replace(c.batch, cache_lengths=c.batch.cache_lengths.float(), _host=HostLists()))),
    Bad("merge o shape", ("o_a", "o_b", "lse_a", "lse_b"), merge_call("o_b", lambda t, d: cut(d, t))),
    Bad("merge lse shape", ("o_a", "o_b", "lse_a", "lse_b"), merge_call("lse_a", lambda t, d: cut(d, t))),
    Bad("merge not a tensor", ("o_a", "o_b", "lse_a", "lse_b"), merge_call("o_a", lambda t, d: not_a_tensor(d, t))),
    Bad("merge dtype", ("o_a", "o_b", "lse_a", "lse_b"), merge_call("lse_b", lambda t, d: to_dtype(t, bad_float_dtype(d)))),
    Bad("merge device", ("o_a", "o_b", "lse_a", "lse_b"), merge_call("o_b", lambda t, d: meta(t))),
]


# Cache methods and the layer ------------------------------------------------------------------
def cache_call(method: str, args):
    def thunk_of(c, draw):
        a = args(c, draw)
        return lambda backend: getattr(c.cache, method)(*a)
    return thunk_of


def commit_stale(c, draw):
    cache = c.cache
    how = draw(["twice", "released", "readmitted", "other cache", "not a batch", "by hand"])
    if how == "twice":
        b = cache.prepare(["x"], [3])
        cache.commit(b)
        return (b,)
    if how in ("released", "readmitted"):
        b = cache.prepare(["x", "s0"], [2, 1])
        cache.release("x")
        if how == "readmitted":
            cache.prepare(["x"], [5])
        return (b,)
    if how == "other cache":
        other = PagedLatentCache(2, 4, page_size=4, head_dim=40, dtype=torch.float32, rope_dim=8)
        return (other.prepare(["s0"], [1]),)
    if how == "not a batch":
        return (draw([None, "b", c.batch.ticket]),)
    return (replaced(c.batch, ticket=None),)


def layer_call(kind: str):
    def thunk_of(c, draw):
        cfg = c.config
        layer = LatentAttention(cfg, c.layer_idx, dtype=torch.float32)
        T = c.q.shape[0]
        x = torch.randn(T, cfg.hidden_size, generator=torch.Generator().manual_seed(c.seed))
        kwargs = {}
        if kind == "rows":
            x = cut(draw, x, 0)
        elif kind == "width":
            x = cut(draw, x, 1)
        elif kind == "not a tensor":
            x = not_a_tensor(draw, x)
        elif kind == "reserved kwarg":
            kwargs = {draw(["scale", "epsilon", "return_lse"]): 1.0}
        elif kind == "bad kwarg":
            kwargs = {"mask": "diag"}
        batch = c.batch if kind != "batch" else draw([None, "b"])
        return lambda backend: layer(x, batch, backend=backend, **kwargs)
    return thunk_of


CACHE_AND_LAYER = [
    Bad("prepare counts", ("num_new_tokens",), cache_call("prepare", lambda c, d: (
        ["s0", "new"], [1, d([-1, -7, 1.5, 2.0, "4", True, None, NAN, 10**40])]))),
    Bad("prepare count length", ("num_new_tokens",), cache_call("prepare", lambda c, d: (["s0", "new"], [1] * d([0, 1, 3])))),
    Bad("prepare counts not a sequence", ("num_new_tokens",), cache_call("prepare", lambda c, d: (["s0"], d([3, None, "1", {1}])))),
    Bad("prepare ids", ("seq_ids",), cache_call("prepare", lambda c, d: (d([None, "ab", 3, [[1], 2], [torch.tensor(1)], ["s0", "s0"]]), [1, 1]))),
    Bad("prepare too many tokens", ("num_new_tokens",), cache_call("prepare", lambda c, d: (["s0"], [2**31 - d(range(1, 6))]))),
    Bad("prepare cache full", (), cache_call("prepare", lambda c, d: (["s1", "new"], [1, d(range(c.cache.num_free_pages * 4 + 1, 10**6))])),
        errors=(CacheFullError,)),
    Bad("commit stale or foreign", ("batch",), cache_call("commit", commit_stale)),
    Bad("release unknown", ("seq_id",), cache_call("release", lambda c, d: (d(["nobody", 7, None, ["s0"], torch.tensor(0)]),))),
    Bad("batch_for unknown", ("seq_ids",), cache_call("batch_for", lambda c, d: (d([["nobody"], "s0", None]),))),
    Bad("cache constructor", ("num_layers", "num_pages", "page_size", "head_dim", "dtype", "device", "rope_dim", "kv_scale"),
        lambda c, d: (lambda backend, a=d([
            dict(num_layers=0), dict(num_pages=-1), dict(page_size=2.0), dict(head_dim=True), dict(dtype=torch.int32),
            dict(dtype="bf16"), dict(dtype=torch.float8_e5m2), dict(device="nowhere"), dict(device="meta"), dict(rope_dim=3),
            dict(rope_dim=-2), dict(dtype="fp8_ds_mla", head_dim=128, rope_dim=0), dict(kv_scale=0.0), dict(kv_scale=NAN),
            dict(kv_scale="1"), dict(kv_scale=1e-60),
            dict(dtype="fp8_ds_mla", head_dim=100), dict(num_pages=2**30, page_size=64)]): PagedLatentCache(
            **{**dict(num_layers=1, num_pages=2, page_size=4, head_dim=40, dtype=torch.float32, rope_dim=8), **a}))),
    Bad("layer rows", ("hidden_states",), layer_call("rows")),
    Bad("layer width", ("hidden_states",), layer_call("width")),
    Bad("layer input not a tensor", ("hidden_states",), layer_call("not a tensor")),
    Bad("layer batch", ("step",), layer_call("batch")),
    Bad("layer reserved kwarg", ("plan_options",), layer_call("reserved kwarg")),
    Bad("layer bad kwarg", ("mask",), layer_call("bad kwarg")),
]

CATALOGUE = {b.name: b for b in FUSED + OTHER_OPS + CACHE_AND_LAYER}


# Running one ------------------------------------------------------------------------------
def cache_state(c: Case) -> tuple:
    a = c.cache.allocator
    return (list(a._free), bytes(a._taken), {k: list(v) for k, v in c.cache._pages.items()}, dict(c.cache._lengths),
            dict(c.cache._generations))


def run_bad(name: str, backend: str, seed: int, decode: bool, choices: list[int]) -> dict:
    """Build catalogue entry ``name`` on a fresh case, run it on ``backend``; report the outcome.

    ``choices`` are the numbers behind the entry's draws (see ``Replay``): the same arguments
    give the same call in this process and in a child.
    """
    bad = CATALOGUE[name]
    c = base_case(seed, bad.decode if bad.decode is not None else decode)
    err, msg = None, ""
    blocks_before, state_before = c.cache.blocks.clone(), cache_state(c)
    try:  # building the call may raise already (a CacheBatch constructor rejecting a field)
        thunk = bad.build(c, Replay(choices))
    except Exception as e:  # noqa: BLE001 - the test reports any exception type
        err, msg, thunk = type(e).__name__, str(e), None
    if thunk is not None:
        blocks_before, state_before = c.cache.blocks.clone(), cache_state(c)  # after the entry's own setup
        try:
            thunk(backend)
        except Exception as e:  # noqa: BLE001
            err, msg = type(e).__name__, str(e)
    changed_bytes = not torch.equal(blocks_before.view(torch.uint8), c.cache.blocks.view(torch.uint8))
    return dict(error=err, message=msg, cache_bytes_changed=changed_bytes, state_changed=cache_state(c) != state_before)


class Replay:
    """The ``draw`` a catalogue entry gets: the i-th call picks ``options[choices[i] % len(options)]``
    from a list or range. Hypothesis draws ``choices`` (and shrinks them); the same choices give
    the same call in any process."""

    def __init__(self, choices: list[int]) -> None:
        self.choices = list(choices) or [0]
        self.i = 0

    def __call__(self, options):
        pick = self.choices[self.i % len(self.choices)]
        self.i += 1
        return options[pick % len(options)]
