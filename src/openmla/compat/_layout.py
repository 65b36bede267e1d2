"""How the compat layers describe a batch to openmla: sequences, pages and empty rows.

FlashMLA and FlashInfer give sequence ``b`` ``q_len`` query rows and ``kv_len`` keys (the new
tokens included), the queries being the last ``q_len`` positions: a causal query ``i`` sees keys
``j <= kv_len - q_len + i`` (bottom-right aligned), a non-causal one all ``kv_len``. openmla
describes a sequence by its cached length and its new tokens (the queries at the last
positions), so ``kv_len >= q_len`` maps directly (cached = ``kv_len - q_len``, mask ``causal``
or ``null``). The other cases, which only zero-length or very short caches produce:

- causal, ``kv_len < q_len``: the first ``q_len - kv_len`` queries see no key (empty rows,
  left out of the openmla batch), the others form a sequence with nothing cached;
- non-causal, ``0 < kv_len < q_len``: the queries are cut into runs of at most ``kv_len`` rows,
  each its own openmla sequence over the same pages (cached = ``kv_len - run``);
- ``kv_len = 0``: every query is an empty row.

Empty rows get zeros and an LSE of -inf (openmla's convention; each compat layer converts).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..cache import CacheBatch


@dataclass(frozen=True)
class Layout:
    """The openmla sequences of one batch step.

    - ``source``: int64 ``[B']``, the caller's sequence behind each openmla sequence, or None
      when they are the caller's sequences in order;
    - ``cache_lengths``, ``input_row_offsets``: int32 ``[B']``, ``[B'+1]`` on the device;
    - ``rows``: int64 ``[T']``, the caller's query rows the openmla batch holds (in order), or
      None when it holds all ``num_rows`` of them.
    """

    source: torch.Tensor | None
    cache_lengths: torch.Tensor
    input_row_offsets: torch.Tensor
    rows: torch.Tensor | None
    num_rows: int

    def batch(self, blocks: torch.Tensor, block_table: torch.Tensor, page_size: int, cache_format: str = "native",
              rope_dim: int | None = None) -> CacheBatch:
        """A ``CacheBatch`` over ``blocks [1, pages, page_size, width]``; ``block_table [B, P]`` is
        indexed by the caller's sequences."""
        table = block_table if self.source is None else block_table.index_select(0, self.source)
        return CacheBatch(blocks, table, self.cache_lengths, self.input_row_offsets, page_size,
                          cache_format=cache_format, rope_dim=rope_dim)

    def select(self, q: torch.Tensor) -> torch.Tensor:
        """The caller's query rows ``q [T, ...]`` that the openmla batch holds."""
        return q if self.rows is None else q.index_select(0, self.rows)

    def expand(self, out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """openmla's ``out [T', H, D]``, ``lse [T', H]`` back onto all caller rows (empty rows: 0, -inf)."""
        if self.rows is None:
            return out, lse
        full_out = out.new_zeros((self.num_rows, *out.shape[1:]))
        full_lse = lse.new_full((self.num_rows, *lse.shape[1:]), float("-inf"))
        return full_out.index_copy_(0, self.rows, out), full_lse.index_copy_(0, self.rows, lse)


def layout(q_lens: list[int], kv_lens: list[int], causal: bool, device: torch.device) -> Layout:
    """The ``Layout`` of sequences with ``q_lens[b]`` query rows (in order) and ``kv_lens[b]`` keys.

    Host lists in, a few small device tensors out; the loop over sequences runs only when some
    sequence has fewer keys than queries.
    """
    q = np.asarray(q_lens, dtype=np.int64)
    kv = np.asarray(kv_lens, dtype=np.int64)
    num_rows = int(q.sum())
    if (kv >= q).all():
        source, cache, new, rows = None, kv - q, q, None
    else:
        src, cache_l, new_l, keep = [], [], [], []
        row0 = 0
        for b, (n_q, n_kv) in enumerate(zip(q.tolist(), kv.tolist())):
            if n_kv >= n_q:
                runs = [(0, n_q, n_kv - n_q)]
            elif n_kv == 0:
                runs = []
            elif causal:
                runs = [(n_q - n_kv, n_q, 0)]
            else:
                runs = [(i, min(i + n_kv, n_q), n_kv - (min(i + n_kv, n_q) - i)) for i in range(0, n_q, n_kv)]
            for lo, hi, cached in runs:
                src.append(b)
                cache_l.append(cached)
                new_l.append(hi - lo)
                keep.extend(range(row0 + lo, row0 + hi))
            row0 += n_q
        source = torch.tensor(src, dtype=torch.int64, device=device)
        cache, new = np.asarray(cache_l, dtype=np.int64), np.asarray(new_l, dtype=np.int64)
        rows = torch.tensor(keep, dtype=torch.int64, device=device)
    offsets = np.concatenate([[0], np.cumsum(new)])
    return Layout(source, torch.tensor(cache, dtype=torch.int32, device=device),
                  torch.tensor(offsets, dtype=torch.int32, device=device), rows, num_rows)


def empty_to(lse: torch.Tensor, value: float) -> torch.Tensor:
    """openmla's LSE with its -inf rows (no key) set to ``value`` (FlashMLA: +inf)."""
    return lse.masked_fill(lse == float("-inf"), value)
