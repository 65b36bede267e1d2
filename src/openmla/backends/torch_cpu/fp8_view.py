"""FP8 caches on the torch backend: dequantise the pages one call touches into a bfloat16 view.

The CPU has no fp8 arithmetic, so every read dequantises anyway; doing it once per call, for
exactly the pages the batch's sequences (and any physical sparse indices) use, lets the native
decode and prefill paths run unchanged. Extra memory: the touched pages in bfloat16, i.e. the
batch's context at 1152 bytes per token for this one layer.
"""

from __future__ import annotations

import torch

from ...cache import CacheBatch

CACHE_FORMATS = ("native", "fp8_e4m3", "fp8_ds_mla")


def dequantised_view(
    batch: CacheBatch, layer_idx: int, sparse_indices: torch.Tensor | None, physical_indices: bool,
    query_dtype: torch.dtype = torch.bfloat16,
) -> tuple[CacheBatch, int, torch.Tensor | None]:
    """A native one-layer ``CacheBatch`` over dequantised copies of the pages the call reads:
    bfloat16 for 16-bit queries, float32 for wider ones (so fp32 runs see exact fp8 values).

    Returns the view, its layer index (0) and ``sparse_indices`` remapped to the view's rows
    when they are physical (-1 stays -1).
    """
    ps = batch.page_size
    device = batch.blocks.device
    table = batch.block_table.to(device, torch.int64)
    used = [table[b, : -(-n // ps)] for b, n in enumerate(batch.seq_lens_list)]
    if sparse_indices is not None and physical_indices:
        rows = sparse_indices.to(device, torch.int64)
        used.append(torch.div(rows[rows >= 0], ps, rounding_mode="floor"))
    pages = torch.unique(torch.cat(used)) if used else torch.zeros(0, dtype=torch.int64, device=device)
    page_map = torch.zeros(batch.num_pages, dtype=torch.int64, device=device)
    page_map[pages] = torch.arange(pages.numel(), device=device)
    dtype = torch.float32 if query_dtype in (torch.float32, torch.float64) else torch.bfloat16
    blocks = batch.read_pages(layer_idx, pages, dtype).unsqueeze(0)  # [1, n, ps, L+R]
    view = CacheBatch(blocks, page_map[table].to(torch.int32), batch.cache_lengths, batch.input_row_offsets, ps,
                      batch.seq_ids, _host=batch._host)
    if sparse_indices is not None and physical_indices:
        idx = sparse_indices.to(device, torch.int64)
        remapped = page_map[torch.div(idx.clamp_min(0), ps, rounding_mode="floor")] * ps + idx.clamp_min(0) % ps
        sparse_indices = torch.where(idx >= 0, remapped, idx).to(sparse_indices.dtype)
    return view, 0, sparse_indices
