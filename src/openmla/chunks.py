"""How a prefill walks its keys: the chunk plan, one chunk's rows, the tile configuration.

The keys every sequence of a step sees (cached + new) are laid end to end and cut every
``buffer_size`` rows (``chunk_plan``); a backend up-projects and attends one chunk at a time,
so memory stays bounded whatever the context length. Backends and the plan both read these,
so they live below both.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .cache import CacheBatch
from .validate import FLOAT_DTYPES, INDEX_DTYPES, check_int, check_offsets, check_tensor

# Default chunk: one chunk's up-projected K/V buffer (and its gathered latent rows) stays around
# this many bytes (the torch and cpu backends; Triton sizes its own by shared memory).
KV_BUFFER_BYTES = 256 * 2**20
MIN_BUFFER_ROWS = 256


def default_buffer_size(num_heads: int, q_depth: int, v_depth: int, latent: int, dtype: torch.dtype) -> int:
    """Key rows per chunk so that the chunk's up-projected keys and values (plus its gathered
    latent rows) stay within ``KV_BUFFER_BYTES``."""
    elt = torch.empty((), dtype=dtype).element_size()
    per_row = elt * (num_heads * (q_depth + v_depth) + 2 * latent)
    return max(MIN_BUFFER_ROWS, KV_BUFFER_BYTES // per_row)


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
    Host lists; ``tensors()`` gives MAX's int32 layout (``mla_prefill_plan``).
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
    if R < 0 or R >= batch.head_dim:
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
