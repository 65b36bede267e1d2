"""What one shared-KV (DeepSeek-V4) attention call computes, as data.

V4's cache entry is ``D = entry.width`` values per token (RMS-normed, RoPE on the trailing
``entry.rope_dim``, stored rotated) and is both key and value: the value is the whole entry,
rope slice included. One entry per token serves every query head. Beside the raw entries a
layer may have a second key stream, compressed entries (one per ``rate`` tokens), read in the
same softmax. Entry ``w`` of that stream sits at logical position ``(w + 1) * rate - 1``: the
query at absolute position ``t`` may see it iff ``(w + 1) * rate - 1 <= t``, i.e.
``w < (t + 1) // rate``.

For the query at position ``t`` of sequence ``b``:

- window keys: raw entries at positions ``k`` with ``t - window < k <= t``;
- compressed keys: every entry allowed by the rule above (``indices is None``: heavily
  compressed attention), or the entries listed in row ``t`` of ``indices`` that the rule allows
  (-1 marks an unused slot; compressed sparse attention);
- one softmax over both sets plus the sink: ``out = sum e^{s} v / (e^{sink} + sum e^{s})``,
  ``s = scale * q . k``; the returned LSE leaves the sink out (as ``AttentionSpec``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class EntryLayout:
    """One stored entry: ``width`` values, the trailing ``rope_dim`` of them RoPE'd (stored
    rotated). ``value="whole"``: the value read from an entry is the entry itself (K = V); it is
    the only layout the V4 kernels take (the V3 latent layout stays ``AttentionSpec``'s)."""

    width: int
    rope_dim: int
    value: str = "whole"


@dataclass(frozen=True)
class CompressedKeys:
    """The second key stream: compressed entries, one per ``rate`` raw tokens.

    - ``rate``: tokens per compressed entry (entry ``w`` at logical position ``(w+1)*rate - 1``).
    - ``indices``: None (every entry the causal rule allows: HCA), or int32/int64 ``[T, K]``,
      row ``i`` the compressed entries query row ``i`` reads (-1: unused slot; CSA's top-k).
      Listed entries still obey the rule; a repeated entry counts twice.
    """

    rate: int
    indices: torch.Tensor | None = None


@dataclass(frozen=True)
class SharedKVSpec:
    """``scale`` (softmax scale: V4 uses ``head_dim ** -0.5``), ``window`` (raw keys visible to
    the query at ``t``: ``t - window < k <= t``), the ``entry`` layout, an optional
    ``compressed`` key stream and an optional float32 ``attn_sink [H]``."""

    scale: float
    window: int
    entry: EntryLayout
    compressed: CompressedKeys | None = None
    attn_sink: torch.Tensor | None = None


@dataclass(frozen=True)
class PagedEntries:
    """A paged store's view for one call: entries of every sequence in pages.

    - ``blocks``: ``[num_pages, page_size, D]``; a row is one entry.
    - ``block_table``: int ``[B, max_pages]``; ``[b, j]`` is the physical page of sequence
      ``b``'s logical page ``j`` (entries ``j*page_size ..``). Pages no query of the call reads
      (out of every window, freed) may hold anything, -1 included.
    - ``lengths``: int ``[B]``: entries of each sequence. For raw entries this counts the
      call's new tokens, already written (their queries read themselves).
    """

    blocks: torch.Tensor
    block_table: torch.Tensor
    lengths: torch.Tensor

    @property
    def page_size(self) -> int:
        return int(self.blocks.shape[1])


def physical_rows(block_table: torch.Tensor, seq: torch.Tensor, positions: torch.Tensor, page_size: int) -> torch.Tensor:
    """Physical row (``page * page_size + offset``) of entry ``positions`` of sequences ``seq``
    (broadcasting int64 tensors; positions must be >= 0). The one definition the V4 stores and
    plan use; kernels may inline it."""
    return block_table[seq, torch.div(positions, page_size, rounding_mode="floor")].long() * page_size + positions % page_size
