"""Each malformed argument raises ValueError naming it, before any cache write."""

import pytest
import torch

import openmla

from cases import make_case, small_config


def base_case():
    return make_case([5, 0, 17], [3, 2, 4], page_size=4, config=small_config(num_heads=2))


def fused_kwargs(c):
    return dict(q=c.q, kv=c.kv, input_row_offsets=c.batch.input_row_offsets, freqs_cis=c.freqs_cis, kv_norm_gamma=c.gamma,
                kv_collection=c.batch, layer_idx=c.layer_idx, w_k=c.w_k, w_uk=c.w_uk, w_uv=c.w_uv, scale=c.scale)


def bad_table(c):
    t = c.batch.block_table.clone()
    t[2, 0] = c.batch.num_pages
    return openmla.CacheBatch(c.batch.blocks, t, c.batch.cache_lengths, c.batch.input_row_offsets, c.batch.page_size)


def short_table(c):
    return openmla.CacheBatch(c.batch.blocks, c.batch.block_table[:, :1].clone(), c.batch.cache_lengths,
                              c.batch.input_row_offsets, c.batch.page_size)


def offsets(vals):
    return torch.tensor(vals, dtype=torch.int32)


T = 9
BAD = {
    "q rank": ("q", lambda c: dict(q=c.q[0])),
    "q dtype": ("q", lambda c: dict(q=c.q.to(torch.int32))),
    "kv rows": ("kv", lambda c: dict(kv=c.kv[:-1])),
    "kv width": ("kv", lambda c: dict(kv=c.kv[:, :-1])),
    "gamma rank": ("kv_norm_gamma", lambda c: dict(kv_norm_gamma=c.gamma[None])),
    "offsets decreasing": ("input_row_offsets", lambda c: dict(input_row_offsets=offsets([0, 3, 2, 9]))),
    "offsets end": ("input_row_offsets", lambda c: dict(input_row_offsets=offsets([0, 3, 5, 8]))),
    "offsets start": ("input_row_offsets", lambda c: dict(input_row_offsets=offsets([1, 3, 5, 9]))),
    "offsets dtype": ("input_row_offsets", lambda c: dict(input_row_offsets=offsets([0, 3, 5, 9]).float())),
    "offsets differ": ("input_row_offsets", lambda c: dict(input_row_offsets=offsets([0, 2, 5, 9]))),
    "page outside pool": ("block_table", lambda c: dict(kv_collection=bad_table(c))),
    "table too short": ("block_table", lambda c: dict(kv_collection=short_table(c))),
    "not a batch": ("kv_collection", lambda c: dict(kv_collection=object())),
    "freqs too short": ("freqs_cis", lambda c: dict(freqs_cis=c.freqs_cis[:20])),
    "freqs width": ("freqs_cis", lambda c: dict(freqs_cis=c.freqs_cis[:, :-2])),
    "layer high": ("layer_idx", lambda c: dict(layer_idx=2)),
    "layer negative": ("layer_idx", lambda c: dict(layer_idx=-1)),
    "w_uk shape": ("w_uk", lambda c: dict(w_uk=c.w_uk.transpose(1, 2))),
    "w_uv shape": ("w_uv", lambda c: dict(w_uv=c.w_uv[:1])),
    "w_k shape": ("w_k", lambda c: dict(w_k=c.w_k[:-1])),
    "w_k device": ("w_k", lambda c: dict(w_k=c.w_k.to("meta"))),
    "scale nan": ("scale", lambda c: dict(scale=float("nan"))),
    "epsilon": ("epsilon", lambda c: dict(epsilon=-1.0)),
    "mask": ("mask", lambda c: dict(mask="diagonal")),
    "window": ("window_size", lambda c: dict(mask="sliding_window_causal")),
    "chunk": ("chunk_size", lambda c: dict(mask="chunked_causal", chunk_size=0)),
    "physical row": ("sparse_indices", lambda c: dict(sparse_indices=torch.full((T, 4), c.batch.num_pages * 4, dtype=torch.int32))),
    "logical past length": ("sparse_indices", lambda c: dict(sparse_indices=torch.full((T, 4), 8, dtype=torch.int32), physical_indices=False)),
    "index below -1": ("sparse_indices", lambda c: dict(sparse_indices=torch.full((T, 4), -2, dtype=torch.int32))),
    "sparse rows": ("sparse_indices", lambda c: dict(sparse_indices=torch.zeros((T - 1, 4), dtype=torch.int32))),
    "topk above stride": ("topk_lengths", lambda c: dict(sparse_indices=torch.zeros((T, 4), dtype=torch.int32), topk_lengths=offsets([1, 5, 2]))),
    "topk without indices": ("topk_lengths", lambda c: dict(topk_lengths=offsets([1, 1, 1]))),
    "physical flag": ("physical_indices", lambda c: dict(physical_indices=1)),
    "sink shape": ("attn_sink", lambda c: dict(attn_sink=torch.zeros(3))),
    "sink dtype": ("attn_sink", lambda c: dict(attn_sink=torch.zeros(2, dtype=torch.float64))),
    "partitions": ("num_partitions", lambda c: dict(num_partitions=0)),
    "buffer": ("buffer_size", lambda c: dict(buffer_size=0)),
    "backend": ("backend", lambda c: dict(backend="cuda-magic")),
}


@pytest.mark.parametrize("what", list(BAD))
def test_fused_op_rejects_before_writing(what):
    name, mutate = BAD[what]
    c = base_case()
    before = c.batch.blocks.clone()
    kwargs = {"backend": "reference", **fused_kwargs(c), **mutate(c)}
    with pytest.raises(ValueError, match=name):
        openmla.mla_prefill_decode_graph(**kwargs)
    assert torch.equal(c.batch.blocks, before), "the cache changed on rejected input"


def test_valid_input_passes_and_writes():
    c = base_case()
    before = c.batch.blocks.clone()
    out = openmla.mla_prefill_decode_graph(**fused_kwargs(c), backend="reference")
    assert out.shape == (T, 2, c.config.v_head_dim) and not torch.isnan(out).any()
    assert not torch.equal(c.batch.blocks, before)


def test_decode_entry_rejects():
    c = base_case()
    q = torch.randn(T, 2, c.batch.head_dim)
    with pytest.raises(ValueError, match="q"):
        openmla.flare_mla_decode(q[..., :-1], c.batch, 0, scale=1.0, kv_lora_rank=64, backend="reference")
    with pytest.raises(ValueError, match="kv_lora_rank"):
        openmla.flare_mla_decode(q, c.batch, 0, scale=1.0, kv_lora_rank=c.batch.head_dim, backend="reference")
    with pytest.raises(ValueError, match="layer_idx"):
        openmla.flare_mla_decode(q, c.batch, 5, scale=1.0, kv_lora_rank=64, backend="reference")


def test_prefill_entry_rejects_bad_cache_offsets():
    c = base_case()
    S = sum(c.batch.seq_lens_list)
    k = torch.randn(S, 2, 32)
    v = torch.randn(S, 2, 32)
    bro = torch.tensor([0, 8, 10, S], dtype=torch.int32)
    co = torch.tensor([1, 0, 0], dtype=torch.int32)  # sequence 0 has 8 keys: [1, 9) runs past them
    with pytest.raises(ValueError, match="cache_offsets"):
        openmla.flare_mla_prefill(c.q, k, v, bro, co, c.batch, 0, scale=1.0, backend="reference")
    with pytest.raises(ValueError, match="buffer_row_offsets"):
        openmla.flare_mla_prefill(c.q, k, v, bro[:-1], co, c.batch, 0, scale=1.0, backend="reference")


@pytest.mark.parametrize("table_on_host", [True, False])
@pytest.mark.parametrize("dtypes", [(torch.int32, torch.int32), (torch.uint32, torch.int64), (torch.int64, torch.uint32)])
def test_page_table_range_checked_on_either_read(table_on_host, dtypes, monkeypatch):
    """The page table is range-checked from the host read of the lengths (small tables) or by its
    own min/max (large ones): the same verdicts either way, for any mix of index dtypes. Entries
    past a sequence's pages are never read, so they may hold anything."""
    import openmla.validate as validate

    monkeypatch.setattr(validate, "HOST_TABLE_MAX", 10**6 if table_on_host else 0)
    table_dtype, len_dtype = dtypes
    c = base_case()  # sequences of 8, 2 and 21 tokens in 4-token pages: 2, 1 and 6 pages
    b = c.batch
    table = b.block_table.to(torch.int64)
    table[1, 1:] = b.num_pages + 7  # unused by sequence 1: accepted
    cast = lambda t, d: t.to(torch.int64).to(d)  # noqa: E731
    ok = openmla.CacheBatch(b.blocks, cast(table, table_dtype), cast(b.cache_lengths, len_dtype),
                            cast(b.input_row_offsets, len_dtype), b.page_size)
    plan = openmla.plan(ok, scale=1.0, backend="reference")
    assert plan.batch.block_table.dtype == torch.int32 and torch.equal(plan.batch.block_table.long(), table)
    assert plan.batch.cache_lengths.tolist() == b.cache_lengths.tolist() == plan.batch._host.cache_lengths
    assert plan.batch.input_row_offsets.tolist() == b.input_row_offsets.tolist() == plan.batch._host.offsets
    table[2, 5] = b.num_pages  # sequence 2's last page: rejected
    bad = openmla.CacheBatch(b.blocks, cast(table, table_dtype), b.cache_lengths, b.input_row_offsets, b.page_size)
    with pytest.raises(ValueError, match="block_table: sequence 2 has a page outside the pool"):
        openmla.plan(bad, scale=1.0, backend="reference")
