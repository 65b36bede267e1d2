"""Plan once per step, run per layer.

``openmla.plan(batch, scale=..., ...)`` does the host work a batch step needs once: it takes
private copies of the batch's metadata (so editing the batch afterwards changes nothing the
kernels read), validates every argument that is the same for every layer, picks the decode or
prefill form, and precomputes what every layer shares (token positions, the physical rows of
the cache write, the prefill chunk plan). ``plan.run(...)`` is then called once per layer with
that layer's tensors; it checks only shapes, dtypes and devices (O(1)), never reads a tensor's
values on the host and never syncs with a device.

    plan = openmla.plan(batch, scale=cfg.softmax_scale)          # once per step
    for i, layer in enumerate(layers):
        out = plan.run(q[i], kv[i], freqs_cis, gamma[i], i, w_k[i], w_uk[i], w_uv[i])
    cache.commit(batch)

``run`` is the fused op (cache write, q rope, then attention in the chosen form); the unfused
pieces are ``write_cache``, ``decode`` (absorbed q in, latent out) and ``prefill`` (roped q in).
Under ``torch.compile`` each piece is one ``openmla::`` custom op (see ``openmla.custom_ops``),
so a model compiles without graph breaks.
"""

from __future__ import annotations

import copy
import dataclasses
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, overload

import torch

from . import combine
from .backends import load_backend, resolve_backend_name
from .cache import CacheBatch
from .fp8 import FP8, dequantize_q
from .masks import MaskVariant
from .spec import AttentionSpec, SparseSpec
from .validate import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_attn_sink,
    check_float,
    check_int,
    check_offsets,
    check_optional_positive,
    check_sparse,
    check_tensor,
    snapshot_batch,
)

if TYPE_CHECKING:
    from .backends.base import Backend

DECODE_MAX_Q_LEN = 6  # MAX's threshold: up to this many new tokens per sequence runs the decode form


# Tile configuration ----------------------------------------------------------------------
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
        for name in ("num_heads", "q_depth", "depth"):
            check_int(f"config.{name}", getattr(self, name), 1)
        for name in ("block_m", "block_n"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1 or v & (v - 1):
                raise ValueError(f"config.{name}: must be a power of two, got {v!r}")
        for name in ("dtype", "output_dtype"):
            if getattr(self, name) not in FLOAT_DTYPES:
                raise ValueError(f"config.{name}: expected a float dtype, got {getattr(self, name)!r}")


# The prefill chunk plan -----------------------------------------------------------------
@dataclass
class ChunkPlan:
    """The keys every sequence sees (cached + new), laid end to end (sequence 0's positions
    0..n0-1, then sequence 1's, ...) and cut every ``buffer_size`` rows.

    For chunk ``c``: rows ``buffer_row_offsets[c][b]:[c][b+1]`` of its buffer are sequence ``b``'s
    keys, starting at key position ``cache_offsets[c][b]``; ``lengths[c]`` is its row count.
    Host lists; ``tensors()`` gives the seeds' int32 layout.
    """

    buffer_size: int
    buffer_row_offsets: list[list[int]]
    cache_offsets: list[list[int]]
    lengths: list[int]
    _device: dict = dataclasses.field(default_factory=dict, repr=False)

    @property
    def num_chunks(self) -> int:
        return len(self.lengths)

    def tensors(self, max_chunks: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``buffer_row_offsets [max_chunks, B+1]``, ``cache_offsets [max_chunks, B+1]``,
        ``buffer_lengths [max_chunks]`` (-1 past the last chunk), int32 on ``device``."""
        B1 = len(self.buffer_row_offsets[0]) if self.buffer_row_offsets else 1
        pad = max_chunks - self.num_chunks
        bro = torch.tensor(self.buffer_row_offsets + [[0] * B1] * pad, dtype=torch.int32).view(max_chunks, B1)
        co = torch.tensor(self.cache_offsets + [[0] * B1] * pad, dtype=torch.int32).view(max_chunks, B1)
        blen = torch.tensor(self.lengths + [-1] * pad, dtype=torch.int32)
        return bro.to(device), co.to(device), blen.to(device)

    def chunk_tensors(self, c: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Chunk ``c``'s ``buffer_row_offsets`` and ``cache_offsets`` ``[B+1]`` int32 on ``device``
        (copied once per plan, shared by every layer)."""
        key = (c, str(device))
        if key not in self._device:
            both = torch.tensor([self.buffer_row_offsets[c], self.cache_offsets[c]], dtype=torch.int32)
            self._device[key] = tuple(both.to(device).unbind(0))
        return self._device[key]


def chunk_plan(seq_lens: list[int], buffer_size: int) -> ChunkPlan:
    """Cut the ``seq_lens`` keys of each sequence, end to end, into chunks of ``buffer_size`` rows."""
    total = sum(seq_lens)
    num_chunks = max(1, -(-total // buffer_size))
    starts = [0]
    for n in seq_lens:
        starts.append(starts[-1] + n)
    B = len(seq_lens)
    bros, cos, lengths = [], [], []
    for c in range(num_chunks):
        lo, hi = c * buffer_size, min((c + 1) * buffer_size, total)
        bro, co = [0], []
        for b in range(B):
            s, e = max(starts[b], lo), min(starts[b + 1], hi)
            bro.append(bro[-1] + max(0, e - s))
            co.append(max(0, s - starts[b]) if e > s else 0)
        co.append(co[-1] if B else 0)
        bros.append(bro)
        cos.append(co)
        lengths.append(hi - lo)
    return ChunkPlan(buffer_size, bros, cos, lengths)


@dataclass(frozen=True)
class ChunkRows:
    """One chunk's buffer layout as given to ``flare_mla_prefill``: the validated tensors and
    their host values."""

    buffer_row_offsets: torch.Tensor  # [B+1] int32
    cache_offsets: torch.Tensor  # [B+1] int32
    bro: list[int]
    co: list[int]


def check_chunk(q: torch.Tensor, k: object, v: object, buffer_row_offsets: object, cache_offsets: object,
                batch: CacheBatch) -> ChunkRows:
    """``flare_mla_prefill``'s chunk: k/v shapes against q, the offsets' layout, and every
    sequence's keys inside its cached tokens. Returns the validated ``ChunkRows``."""
    T, H, qd = q.shape
    dev = batch.blocks.device
    S = check_tensor("k", k, shape=(None, H, None), dtypes=FLOAT_DTYPES, device=dev).shape[0]
    check_tensor("v", v, shape=(S, H, None), dtypes=FLOAT_DTYPES, device=dev)
    R = qd - k.shape[2]
    if R < 1 or R >= batch.head_dim:
        raise ValueError(f"k: depth {k.shape[2]} leaves {R} rope dims of q's {qd}")
    B = batch.batch_size
    bro = check_offsets("buffer_row_offsets", buffer_row_offsets, S, dev)
    if len(bro) != B + 1:
        raise ValueError(f"buffer_row_offsets: {len(bro)} entries for {B} sequences")
    check_tensor("cache_offsets", cache_offsets, rank=1, dtypes=INDEX_DTYPES, device=dev)
    if cache_offsets.shape[0] not in (B, B + 1):
        raise ValueError(f"cache_offsets: expected {B} or {B + 1} entries, got {cache_offsets.shape[0]}")
    co = [int(x) for x in cache_offsets.to("cpu", torch.int64).tolist()]
    for b, n in enumerate(batch.seq_lens_list):
        if co[b] < 0 or co[b] + bro[b + 1] - bro[b] > n:
            raise ValueError(f"cache_offsets: sequence {b}'s keys [{co[b]}, {co[b] + bro[b + 1] - bro[b]}) exceed its {n} cached tokens")
    co = co + [co[-1] if co else 0] * (B + 1 - len(co))
    both = torch.tensor([bro, co], dtype=torch.int32).to(dev)
    return ChunkRows(both[0], both[1], bro, co)


# The plan --------------------------------------------------------------------------------
_LIVE: dict[int, weakref.ref] = {}  # data_ptr of a plan's input_row_offsets -> the plan


class MLAPlan:
    """One batch step's validated metadata and precomputed shared state (see the module doc).

    Attributes read by backends (all read-only):
    - ``batch``: the step's ``CacheBatch`` over private int32 copies of ``block_table``,
      ``cache_lengths`` and ``input_row_offsets`` (host lists filled from those copies);
    - ``spec``: the ``AttentionSpec`` (scale, mask, sparse top-k, sink);
    - ``token_seq``, ``token_pos``: int64 ``[T]`` sequence and position of every new token;
    - ``write_rows``: int64 ``[T]`` physical cache row of every new token;
    - ``num_partitions`` (None: the backend picks), ``buffer_size`` (None: the backend picks);
    - ``form``: ``"decode"`` or ``"prefill"`` (``run``'s choice by the max-new-tokens rule).
    Make one with ``openmla.plan``.
    """

    def __init__(self, batch: CacheBatch, spec: AttentionSpec, backend: "Backend", backend_name: str, *,
                 num_partitions: int | None, buffer_size: int | None, decode_max_q_len: int) -> None:
        self.batch = batch
        self.spec = spec
        self.backend = backend
        self.backend_name = backend_name
        self.num_partitions = num_partitions
        self.buffer_size = buffer_size
        self.decode_max_q_len = decode_max_q_len
        self.form: Literal["decode", "prefill"] = "decode" if batch.max_new_tokens <= decode_max_q_len else "prefill"
        self.device = batch.blocks.device
        self.num_tokens = batch.offsets_list[-1]
        self.num_layers = batch.num_layers
        self.token_seq, self.token_pos = batch.token_positions()
        self.write_rows = batch.physical_rows(self.token_seq, self.token_pos)
        self._chunks: dict[int, ChunkPlan] = {}
        key = batch.input_row_offsets.data_ptr()
        _LIVE[key] = weakref.ref(self)
        weakref.finalize(self, _LIVE.pop, key, None)

    def __repr__(self) -> str:
        return (f"MLAPlan(form={self.form}, backend={self.backend_name}, sequences={self.batch.batch_size}, "
                f"tokens={self.num_tokens}, mask={self.spec.mask.kind.value}, sparse={self.spec.sparse is not None})")

    @property
    def max_position(self) -> int:
        """Rows of ``freqs_cis`` the step needs: its longest sequence (cached + new)."""
        host = self.batch._host
        if "max_position" not in host:
            host["max_position"] = max(self.batch.seq_lens_list, default=0)
        return host["max_position"]

    # Shared precomputation ----------------------------------------------------------------
    def chunks(self, buffer_size: int) -> ChunkPlan:
        """The prefill chunk plan for ``buffer_size`` key rows per chunk (made once per plan)."""
        plan = self._chunks.get(buffer_size)
        if plan is None:
            plan = self._chunks[buffer_size] = chunk_plan(self.batch.seq_lens_list, buffer_size)
        return plan

    def refill(self, batch: CacheBatch, *, sparse_indices: torch.Tensor | None = None,
               topk_lengths: torch.Tensor | None = None) -> "MLAPlan":
        """Load the next step's metadata into this plan's tensors, in place, and return the plan.

        For a captured CUDA graph: every tensor a kernel reads keeps its address. The new batch
        must view the same cache storage with the same number of sequences and new tokens, the
        same form (decode/prefill), and a page table no wider than the plan's (see ``max_pages``
        of ``openmla.plan``). A sparse plan takes the step's new ``sparse_indices`` (and
        ``topk_lengths``) of the same shapes. Validated like ``openmla.plan``; on a ValueError the
        plan is unchanged.
        """
        snap = snapshot_batch(batch)
        mine = self.batch
        if snap.blocks is not mine.blocks and (snap.blocks.data_ptr(), snap.blocks.shape) != (mine.blocks.data_ptr(), mine.blocks.shape):
            raise ValueError("batch: views other cache storage than the plan's")
        if snap.cache_format != mine.cache_format or snap.page_size != mine.page_size:
            raise ValueError("batch: another cache format or page size than the plan's")
        if snap.batch_size != mine.batch_size or snap.offsets_list[-1] != self.num_tokens:
            raise ValueError(f"batch: {snap.batch_size} sequences and {snap.offsets_list[-1]} new tokens, the plan was made for "
                             f"{mine.batch_size} and {self.num_tokens}")
        if snap.block_table.shape[1] > mine.block_table.shape[1]:
            raise ValueError(f"batch: its page table has {snap.block_table.shape[1]} columns, the plan {mine.block_table.shape[1]} "
                             "(make the plan with a larger max_pages)")
        form = "decode" if snap.max_new_tokens <= self.decode_max_q_len else "prefill"
        if form != self.form:
            raise ValueError(f"batch: needs the {form} form, the plan runs the {self.form} form")
        sparse = self.spec.sparse
        if (sparse_indices is not None or topk_lengths is not None) and sparse is None:
            raise ValueError("sparse_indices: the plan was made without sparse attention")
        if sparse is not None and sparse_indices is not None:
            idx, topk = check_sparse(sparse_indices, topk_lengths, sparse.physical, snap, self.device)
            if idx.shape != sparse.indices.shape or (topk is None) != (sparse.topk_lengths is None):
                raise ValueError(f"sparse_indices: shape {tuple(idx.shape)}, the plan holds {tuple(sparse.indices.shape)}")
            sparse.indices.copy_(idx)
            if topk is not None:
                sparse.topk_lengths.copy_(topk)
        mine.block_table.zero_()[:, : snap.block_table.shape[1]].copy_(snap.block_table)
        mine.cache_lengths.copy_(snap.cache_lengths)
        mine.input_row_offsets.copy_(snap.input_row_offsets)
        mine._host.clear()
        mine._host.update(snap._host)
        seq, pos = mine.token_positions()
        self.token_seq.copy_(seq)
        self.token_pos.copy_(pos)
        self.write_rows.copy_(mine.physical_rows(seq, pos))
        self._chunks.clear()
        return self

    def with_blocks(self, blocks: torch.Tensor) -> "MLAPlan":
        """This plan over other cache storage of the same shape, dtype and device, in O(1).

        For an engine that keeps one cache tensor per layer (vLLM's ``[num_blocks, block_size,
        L+R]``, viewed as ``[1, ...]``): plan the step once over one layer's storage, then run
        every layer through ``plan.with_blocks(its_cache)`` with ``layer_idx`` 0. The view shares
        everything else with this plan (validated metadata, positions, write rows, chunk plans; a
        ``refill`` of either updates both); nothing is copied or recomputed.
        """
        mine = self.batch.blocks
        if blocks is mine:
            return self
        check_tensor("blocks", blocks, shape=tuple(mine.shape), dtypes=(mine.dtype,), device=mine.device)
        view = copy.copy(self)  # not registered in _LIVE: the custom ops map back to this plan
        view.batch = self.batch.with_blocks(blocks)
        return view

    def with_sparse(self, sparse_indices: torch.Tensor, topk_lengths: torch.Tensor | None = None, *,
                    physical_indices: bool = True) -> "MLAPlan":
        """This plan with other sparse top-k lists (validated like ``openmla.plan``'s), for a model
        whose layers each pick their own keys (DeepSeek-V3.2's indexer runs per layer). The view
        shares everything else with this plan; its layers run the sparse (absorbed) form."""
        if not isinstance(physical_indices, bool):
            raise ValueError(f"physical_indices: expected a bool, got {physical_indices!r}")
        indices, topk = check_sparse(sparse_indices, topk_lengths, physical_indices, self.batch, self.device)
        view = copy.copy(self)  # not registered in _LIVE, as with_blocks
        view.spec = dataclasses.replace(self.spec, sparse=SparseSpec(indices, topk, physical_indices))
        return view

    @staticmethod
    def find(input_row_offsets: torch.Tensor) -> "MLAPlan | None":
        """The live plan that owns ``input_row_offsets`` (the custom ops' way back to host state)."""
        ref = _LIVE.get(input_row_offsets.data_ptr())
        plan = ref() if ref is not None else None
        mine = None if plan is None else plan.batch.input_row_offsets
        if mine is None or (mine.shape, mine.dtype) != (input_row_offsets.shape, input_row_offsets.dtype):
            return None
        return plan

    # Per-layer checks (O(1): shapes, dtypes, devices; no tensor values) -------------------
    def _query(self, q: object, q_scale: object, depth: int | None = None) -> tuple[torch.Tensor, torch.dtype]:
        check_tensor("q", q, shape=(self.num_tokens, None, depth), dtypes=FLOAT_DTYPES + (FP8,), device=self.device)
        if q.dtype != FP8:
            if q_scale is not None:
                raise ValueError("q_scale: only a float8_e4m3fn q takes a scale")
            return q, q.dtype
        if isinstance(q_scale, torch.Tensor):
            check_tensor("q_scale", q_scale, dtypes=(torch.float32,), device=self.device)
            if q_scale.numel() not in (1, q.shape[0]) or q_scale.dim() > 1:
                raise ValueError(f"q_scale: expected a scalar, [1] or per-token [{q.shape[0]}], got {tuple(q_scale.shape)}")
        elif q_scale is not None:
            check_float("q_scale", q_scale)
        return dequantize_q(q, q_scale, torch.bfloat16), torch.bfloat16

    def _layer(self, layer_idx: object) -> int:
        return check_int("layer_idx", layer_idx, 0, self.num_layers)

    def _sink(self, attn_sink: object, num_heads: int) -> AttentionSpec:
        """The spec with this call's sink: the plan's, or a per-layer one (shape checked only)."""
        if attn_sink is None:
            sink = self.spec.attn_sink
            if sink is not None and sink.shape[-1] != num_heads:
                raise ValueError(f"attn_sink: the plan's sink has {sink.shape[-1]} heads, q has {num_heads}")
            return self.spec
        check_attn_sink(attn_sink, num_heads, self.batch.batch_size, self.device, check_values=False)
        return self.spec.with_sink(attn_sink)

    # The fused op -----------------------------------------------------------------------
    @overload
    def run(self, q: torch.Tensor, kv: torch.Tensor, freqs_cis: torch.Tensor, kv_norm_gamma: torch.Tensor, layer_idx: int,
            w_k: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor, *, epsilon: float = ..., rope_interleaved: bool = ...,
            q_scale: torch.Tensor | float | None = ..., attn_sink: torch.Tensor | None = ...,
            return_lse: Literal[False] = ...) -> torch.Tensor: ...

    @overload
    def run(self, q: torch.Tensor, kv: torch.Tensor, freqs_cis: torch.Tensor, kv_norm_gamma: torch.Tensor, layer_idx: int,
            w_k: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor, *, epsilon: float = ..., rope_interleaved: bool = ...,
            q_scale: torch.Tensor | float | None = ..., attn_sink: torch.Tensor | None = ...,
            return_lse: Literal[True]) -> tuple[torch.Tensor, torch.Tensor]: ...

    def run(self, q, kv, freqs_cis, kv_norm_gamma, layer_idx, w_k, w_uk, w_uv, *, epsilon=1e-6, rope_interleaved=True,
            q_scale=None, attn_sink=None, return_lse=False):
        """MLA for one layer: cache write, q rope, then attention in the plan's form.

        ``q [T, H, Dn+R]``, ``kv [T, L+R]`` (``kv_a_proj_with_mqa`` output, before norm and rope),
        ``freqs_cis [>= max_position, R]``, ``kv_norm_gamma [L]``, ``w_k [H*Dn, L]``,
        ``w_uk [H, L, Dn]``, ``w_uv [H, Dv, L]``. Returns ``out [T, H, Dv]`` in q's dtype (and float32
        ``lse [T, H]``, natural log, without the sink). A float8_e4m3fn ``q`` (with ``q_scale``)
        gives bfloat16 output. ``attn_sink`` overrides the plan's sink for this layer.
        Nothing is written to the cache when an argument is rejected.
        """
        q, out_dtype = self._query(q, q_scale)
        layer_idx = self._layer(layer_idx)
        _check_return_lse(return_lse)
        T, H, qd = q.shape
        L, R = self._check_write_args(kv, freqs_cis, kv_norm_gamma, epsilon, rope_interleaved)
        Dn = qd - R
        if Dn < 1:
            raise ValueError(f"q: depth {qd} must exceed the rope width {R}")
        check_tensor("w_uk", w_uk, shape=(H, L, Dn), dtypes=FLOAT_DTYPES, device=self.device)
        check_tensor("w_uv", w_uv, shape=(H, None, L), dtypes=FLOAT_DTYPES, device=self.device)
        check_tensor("w_k", w_k, shape=(H * Dn, L), dtypes=FLOAT_DTYPES, device=self.device)
        spec = self._sink(attn_sink, H)
        q_rot = self._write(q, kv, freqs_cis, kv_norm_gamma, layer_idx, float(epsilon), rope_interleaved)
        if self.form == "decode" or spec.sparse is not None:
            # Sparse prefill reads at most ``stride`` keys per token: the absorbed form is the same
            # math without up-projecting every key.
            out_lat, lse = self._decode(self._absorb(q_rot, w_uk), layer_idx, spec, L)
            out = self._unabsorb(out_lat, w_uv)
        else:
            out, lse = self._prefill(q_rot, layer_idx, w_k, w_uv, spec)
        return _finish(out, lse, out_dtype, self.device, return_lse)

    def _check_write_args(self, kv, freqs_cis, kv_norm_gamma, epsilon, rope_interleaved) -> tuple[int, int]:
        L = check_tensor("kv_norm_gamma", kv_norm_gamma, rank=1, dtypes=FLOAT_DTYPES, device=self.device).shape[0]
        check_tensor("kv", kv, shape=(self.num_tokens, None), dtypes=FLOAT_DTYPES, device=self.device)
        R = kv.shape[1] - L
        if R < 2 or R % 2:
            raise ValueError(f"kv: width {kv.shape[1]} minus kv_norm_gamma's {L} leaves {R} rope dims (need an even R >= 2)")
        if L + R != self.batch.head_dim:
            raise ValueError(f"kv: width {L + R} must equal the cache entry width {self.batch.head_dim} (L+R)")
        check_tensor("freqs_cis", freqs_cis, shape=(None, R), dtypes=(torch.float32, torch.float64), device=self.device)
        check_float("epsilon", epsilon, lo=0.0)
        if not isinstance(rope_interleaved, bool):
            raise ValueError(f"rope_interleaved: expected a bool, got {rope_interleaved!r}")
        return L, R

    # The unfused pieces --------------------------------------------------------------------
    def write_cache(self, q: torch.Tensor, kv: torch.Tensor, freqs_cis: torch.Tensor, kv_norm_gamma: torch.Tensor,
                    layer_idx: int, *, epsilon: float = 1e-6, rope_interleaved: bool = True) -> torch.Tensor:
        """Write ``kv [T, L+R]`` into layer ``layer_idx`` (RMSNorm latent, RoPE'd key rope) and return
        q ``[T, H, Dn+R]`` with its last R dims rotated (a new tensor of q's dtype)."""
        check_tensor("q", q, shape=(self.num_tokens, None, None), dtypes=FLOAT_DTYPES, device=self.device)
        layer_idx = self._layer(layer_idx)
        _, R = self._check_write_args(kv, freqs_cis, kv_norm_gamma, epsilon, rope_interleaved)
        if q.shape[2] < R:
            raise ValueError(f"q: depth {q.shape[2]} is smaller than the rope width {R}")
        return self._write(q, kv, freqs_cis, kv_norm_gamma, layer_idx, float(epsilon), rope_interleaved).to(device=self.device, dtype=q.dtype)

    @overload
    def decode(self, q: torch.Tensor, layer_idx: int, *, kv_lora_rank: int = ..., q_scale: torch.Tensor | float | None = ...,
               attn_sink: torch.Tensor | None = ..., return_lse: Literal[False] = ...) -> torch.Tensor: ...

    @overload
    def decode(self, q: torch.Tensor, layer_idx: int, *, kv_lora_rank: int = ..., q_scale: torch.Tensor | float | None = ...,
               attn_sink: torch.Tensor | None = ..., return_lse: Literal[True]) -> tuple[torch.Tensor, torch.Tensor]: ...

    def decode(self, q, layer_idx, *, kv_lora_rank=512, q_scale=None, attn_sink=None, return_lse=False):
        """Absorbed (MQA) attention: ``q [T, H, L+R]`` (absorbed and roped) against the cache rows
        of ``layer_idx`` (which already hold this step's tokens) -> ``out [T, H, L]``."""
        q, out_dtype = self._query(q, q_scale, self.batch.head_dim)
        layer_idx = self._layer(layer_idx)
        _check_return_lse(return_lse)
        check_int("kv_lora_rank", kv_lora_rank, 1, q.shape[2])
        out, lse = self._decode(q, layer_idx, self._sink(attn_sink, q.shape[1]), kv_lora_rank)
        return _finish(out, lse, out_dtype, self.device, return_lse)

    @overload
    def prefill(self, q: torch.Tensor, layer_idx: int, w_k: torch.Tensor, w_uv: torch.Tensor, *,
                q_scale: torch.Tensor | float | None = ..., attn_sink: torch.Tensor | None = ...,
                return_lse: Literal[False] = ...) -> torch.Tensor: ...

    @overload
    def prefill(self, q: torch.Tensor, layer_idx: int, w_k: torch.Tensor, w_uv: torch.Tensor, *,
                q_scale: torch.Tensor | float | None = ..., attn_sink: torch.Tensor | None = ...,
                return_lse: Literal[True]) -> tuple[torch.Tensor, torch.Tensor]: ...

    def prefill(self, q, layer_idx, w_k, w_uv, *, q_scale=None, attn_sink=None, return_lse=False):
        """Up-projected (MHA) attention: ``q [T, H, Dn+R]`` (roped) over every visible cached key,
        chunked by ``buffer_size``; ``w_k [H*Dn, L]``, ``w_uv [H, Dv, L]`` -> ``out [T, H, Dv]``."""
        q, out_dtype = self._query(q, q_scale)
        layer_idx = self._layer(layer_idx)
        _check_return_lse(return_lse)
        T, H, qd = q.shape
        check_tensor("w_uv", w_uv, shape=(H, None, None), dtypes=FLOAT_DTYPES, device=self.device)
        L = w_uv.shape[2]
        R = self.batch.head_dim - L
        Dn = qd - R
        if R < 1 or Dn < 1:
            raise ValueError(f"w_uv: latent width {L} leaves {R} rope dims of q's {qd} (cache entries are {self.batch.head_dim} wide)")
        check_tensor("w_k", w_k, shape=(H * Dn, L), dtypes=FLOAT_DTYPES, device=self.device)
        spec = self._sink(attn_sink, H)
        if spec.sparse is not None:
            out_lat, lse = self._decode(self._absorb(q, w_k.view(H, Dn, L).transpose(1, 2)), layer_idx, spec, L)
            out = self._unabsorb(out_lat, w_uv)
        else:
            out, lse = self._prefill(q, layer_idx, w_k, w_uv, spec)
        return _finish(out, lse, out_dtype, self.device, return_lse)

    def flare_prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, buffer_row_offsets: torch.Tensor,
                      cache_offsets: torch.Tensor, layer_idx: int, *, q_scale: torch.Tensor | float | None = None,
                      tile: MlaConfigV2 | None = None, return_lse: bool = False):
        """One prefill chunk with given up-projected keys (``flare_mla_prefill``): ``q [T, H, Dn+R]``
        (roped); ``k [S, H, Dn]`` and ``v [S, H, Dv]`` hold, in rows ``buffer_row_offsets[b]:[b+1]``,
        sequence ``b``'s keys at positions ``cache_offsets[b] + j`` (their rope part read from the
        cache). The chunk layout is checked on the host (this is the kernel-level entry, not the
        per-layer hot path). LSE is over this chunk's keys (for ``merge_states``); no sink."""
        q, out_dtype = self._query(q, q_scale)
        layer_idx = self._layer(layer_idx)
        _check_return_lse(return_lse)
        chunk = check_chunk(q, k, v, buffer_row_offsets, cache_offsets, self.batch)
        if tile is not None and not isinstance(tile, MlaConfigV2):
            raise ValueError(f"config: expected an MlaConfigV2, got {type(tile).__name__}")
        out, lse = self.backend.flare_mla_prefill(self, layer_idx, q, k, v, chunk, self.spec.with_sink(None), tile)
        return _finish(out, lse, out_dtype, self.device, return_lse)

    # Dispatch: the backend directly, or the openmla:: custom op under torch.compile ----------
    def _write(self, q, kv, freqs_cis, gamma, layer_idx, epsilon, interleaved):
        if torch.compiler.is_compiling():
            from . import custom_ops

            return custom_ops.write_cache(self, q, kv, freqs_cis, gamma, layer_idx, epsilon, interleaved)
        return write_impl(self, q, kv, freqs_cis, gamma, layer_idx, epsilon, interleaved)

    def _decode(self, q_abs, layer_idx, spec, kv_lora_rank):
        if torch.compiler.is_compiling():
            from . import custom_ops

            return custom_ops.decode(self, q_abs, layer_idx, spec, kv_lora_rank)
        return self.backend.decode(self, layer_idx, q_abs, spec, kv_lora_rank)

    def _prefill(self, q_rot, layer_idx, w_k, w_uv, spec):
        if torch.compiler.is_compiling():
            from . import custom_ops

            return custom_ops.prefill(self, q_rot, layer_idx, w_k, w_uv, spec)
        return self.backend.prefill(self, layer_idx, q_rot, w_k, w_uv, spec)

    def _absorb(self, q_rot, w_uk):
        return getattr(self.backend, "absorb", combine.absorb)(q_rot, w_uk)

    def _unabsorb(self, out_lat, w_uv):
        return getattr(self.backend, "unabsorb", combine.unabsorb)(out_lat, w_uv)


def write_impl(plan: MLAPlan, q, kv, freqs_cis, gamma, layer_idx: int, epsilon: float, interleaved: bool) -> torch.Tensor:
    """The cache write behind ``run``/``write_cache`` (eager and custom op alike): the one check
    that needs a step value, then the backend."""
    if plan.max_position > freqs_cis.shape[0]:
        raise ValueError(f"freqs_cis: has {freqs_cis.shape[0]} positions, the batch reaches position {plan.max_position - 1}")
    return plan.backend.write_cache(plan, layer_idx, q, kv, freqs_cis, gamma, epsilon, interleaved)


def _check_return_lse(return_lse: object) -> None:
    if not isinstance(return_lse, bool):
        raise ValueError(f"return_lse: expected a bool, got {return_lse!r}")


def _finish(out: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype, device: torch.device, return_lse: bool):
    out = out.to(device=device, dtype=dtype)
    return (out, lse.to(device=device, dtype=torch.float32)) if return_lse else out


# Making a plan ---------------------------------------------------------------------------
def plan(
    batch: CacheBatch,
    *,
    scale: float,
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
    max_pages: int | None = None,
    backend: str | None = None,
) -> MLAPlan:
    """Validate one batch step and precompute what every layer shares; returns an ``MLAPlan``.

    ``batch`` is the step's ``CacheBatch`` (from ``PagedLatentCache.prepare``). Options, the same
    for every layer of the step: ``scale`` (softmax scale), ``mask`` (``causal``, ``null``,
    ``sliding_window_causal`` / ``sliding_window_noncausal`` with ``window_size``,
    ``chunked_causal`` with ``chunk_size``), ``sparse_indices [T, stride]`` (-1 = unused) with
    optional ``topk_lengths [B]`` and ``physical_indices``, ``attn_sink [H]`` or ``[B, H]``
    (float32), ``num_partitions`` (split-KV of the decode form), ``buffer_size`` (key rows per
    prefill chunk), ``decode_max_q_len`` (the decode form runs when no sequence has more new
    tokens than this), ``max_pages`` (pad the plan's page table to this many columns, so later
    steps can ``refill`` it in place), ``backend`` (``torch``, ``triton``, ``reference``; None: by
    device and ``OPENMLA_BACKEND``). Raises ``ValueError`` naming the argument on bad input.

    For a CUDA graph, make the plan with ``num_partitions`` and ``max_pages`` fixed and call
    ``plan.refill(batch)`` before each replay.
    """
    snap = snapshot_batch(batch)
    if max_pages is not None:
        width = snap.block_table.shape[1]
        check_int("max_pages", max_pages, max(width, 1))
        table = snap.block_table.new_zeros(snap.batch_size, max_pages)
        table[:, :width] = snap.block_table
        snap.block_table = table
    device = snap.blocks.device
    scale = check_float("scale", scale)
    variant = MaskVariant.parse(mask, window_size, chunk_size)
    if not isinstance(physical_indices, bool):
        raise ValueError(f"physical_indices: expected a bool, got {physical_indices!r}")
    sparse = None
    if sparse_indices is not None or topk_lengths is not None:
        indices, topk = check_sparse(sparse_indices, topk_lengths, physical_indices, snap, device)
        sparse = SparseSpec(indices, topk, physical_indices)
    if attn_sink is not None:
        check_attn_sink(attn_sink, None, snap.batch_size, device)
        attn_sink = attn_sink.clone()
    check_optional_positive("num_partitions", num_partitions)
    check_optional_positive("buffer_size", buffer_size)
    check_int("decode_max_q_len", decode_max_q_len, 0)
    name = resolve_backend_name(backend, device)
    be = load_backend(name)
    if snap.cache_format not in be.cache_formats:
        raise ValueError(f"kv_collection: the {name} backend cannot read a {snap.cache_format} cache")
    spec = AttentionSpec(scale, variant, sparse, attn_sink)
    return MLAPlan(snap, spec, be, name, num_partitions=num_partitions, buffer_size=buffer_size,
                   decode_max_q_len=decode_max_q_len)

