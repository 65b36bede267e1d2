"""What one attention call computes, as one validated object handed to every backend.

``AttentionSpec`` replaces the loose ``scale, mask, sparse_indices, topk_lengths,
physical_indices, attn_sink`` keywords: a plan builds it once per step (``openmla.plan``)
after checking every field, and backends read it as is.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .masks import MaskVariant


@dataclass(frozen=True)
class SparseSpec:
    """DeepSeek Sparse Attention top-k lists.

    - ``indices``: ``[T, stride]`` int32/int64; row t lists the keys query t attends to, -1 marks
      an unused slot.
    - ``topk_lengths``: optional ``[B]``; slots at or past ``topk_lengths[b]`` are ignored.
    - ``physical``: entries are physical cache rows (``page * page_size + offset``, no page table,
      no mask) when True, logical positions in the query's own sequence (mask applies) when False.
    """

    indices: torch.Tensor
    topk_lengths: torch.Tensor | None = None
    physical: bool = True

    @property
    def stride(self) -> int:
        return int(self.indices.shape[1])


@dataclass(frozen=True)
class AttentionSpec:
    """``scale`` (the softmax scale, any finite float), ``mask``, optional ``sparse`` top-k lists and
    an optional float32 ``attn_sink`` ``[H]`` or ``[B, H]`` (one extra logit per head in the
    softmax denominator; the returned LSE leaves it out)."""

    scale: float
    mask: MaskVariant = MaskVariant()
    sparse: SparseSpec | None = None
    attn_sink: torch.Tensor | None = None

    @classmethod
    def build(cls, scale: float, mask: MaskVariant | str = "causal", sparse_indices: torch.Tensor | None = None,
              topk_lengths: torch.Tensor | None = None, physical_indices: bool = True,
              attn_sink: torch.Tensor | None = None) -> "AttentionSpec":
        """A spec from the loose keywords (unvalidated: for the oracle and tests; ``openmla.plan``
        builds validated ones)."""
        sparse = None if sparse_indices is None else SparseSpec(sparse_indices, topk_lengths, physical_indices)
        return cls(float(scale), MaskVariant.parse(mask), sparse, attn_sink)

    def with_sink(self, attn_sink: torch.Tensor | None) -> "AttentionSpec":
        return dataclasses.replace(self, attn_sink=attn_sink)
