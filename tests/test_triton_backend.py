"""The triton backend against the float64 oracle (``openmla.reference``).

Without a GPU the kernels run on CPU tensors through Triton's interpreter
(``TRITON_INTERPRET=1``, which ``tests/conftest.py`` sets before triton is first imported);
with CUDA they run compiled on the GPU. Shapes are tiny because the interpreter is slow.
Every case draws a
fresh seed (printed in the failure message); every buffer the backend allocates starts as
NaN (``poison``), so an element a kernel forgets to write fails the comparison.
Heavier cases carry ``heavy`` in their name (deselect with ``-k "not heavy"``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from triton_support import CUDA, DEV, poison, require_triton  # noqa: F401  (poison: autouse, backend buffers start as NaN)

_common = require_triton()  # skips the module where the backend cannot run

import openmla  # noqa: E402
from openmla import CacheBatch, MlaConfigV2, reference as ref  # noqa: E402
from openmla import combine  # noqa: E402
from openmla.backends import load_backend  # noqa: E402
from openmla.backends.triton.decode import decode_into, default_num_splits  # noqa: E402
from openmla.masks import MaskVariant  # noqa: E402

from cases import TOL, Case, make_case, rel_err, small_config  # noqa: E402

F32, BF16 = torch.float32, torch.bfloat16
MASKS = [
    ("causal", {}),
    ("null", {}),
    ("sliding_window_causal", {"window_size": 4}),
    ("sliding_window_noncausal", {"window_size": 5}),
    ("chunked_causal", {"chunk_size": 8}),
]


# Helpers ---------------------------------------------------------------------------
def on_device(case: Case) -> Case:
    """The case with its own copy of the cache, every tensor on DEV (host lists kept)."""
    b = case.batch
    batch = CacheBatch(b.blocks.clone().to(DEV), b.block_table.to(DEV), b.cache_lengths.to(DEV),
                       b.input_row_offsets.to(DEV), b.page_size, b.seq_ids)
    batch._host = b._host.copy()
    mv = {f: getattr(case, f).to(DEV) for f in ("q", "kv", "freqs_cis", "gamma", "w_k", "w_uk", "w_uv")}
    return dataclasses.replace(case, batch=batch, extras=dict(case.extras), **mv)


def written(case: Case) -> Case:
    """Write this call's tokens into the CPU cache with the oracle (for the attention-only ops)."""
    ref.write_cache(case.kv, case.freqs_cis, case.gamma, case.batch, case.layer_idx, 1e-6)
    return case


def absorbed_q(case: Case) -> torch.Tensor:
    """A random absorbed query ``[T, H, L+R]`` in the case's dtype (CPU)."""
    cfg = case.config
    g = torch.Generator().manual_seed(case.seed + 1)
    T = case.q.shape[0]
    return torch.randn(T, cfg.num_heads, cfg.cache_head_dim, generator=g).to(case.q.dtype)


def check(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, case: Case, what: str) -> None:
    err = rel_err(got, want)
    assert err <= TOL[dtype], f"{what}: relative error {err:.3g} > {TOL[dtype]:g} (seed={case.seed})"


def check_lse(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, case: Case, what: str) -> None:
    """-inf exactly where the oracle has it, relative error elsewhere."""
    got, want = got.double().cpu(), want.double().cpu()
    assert not torch.isnan(got).any(), f"{what}: NaN in lse (seed={case.seed})"
    empty = torch.isneginf(want)
    assert torch.equal(torch.isneginf(got), empty), f"{what}: -inf pattern differs (seed={case.seed})"
    check(got[~empty], want[~empty], dtype, case, what + " lse")


def sparse_indices_for(case: Case, physical: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k indices ``[T, 8]`` for a 3-sequence case (some -1, some repeated, row 0 empty)
    and ``topk_lengths``."""
    g = torch.Generator().manual_seed(case.seed + 2)
    T, stride = case.q.shape[0], 8
    if physical:
        limit = torch.full((T,), case.batch.num_pages * case.batch.page_size)
    else:
        seq_lens = torch.tensor(case.batch.seq_lens_list)
        limit = torch.repeat_interleave(seq_lens, torch.tensor(case.batch.new_tokens_list))
    idx = (torch.rand(T, stride, generator=g) * limit[:, None]).long()
    idx[torch.rand(T, stride, generator=g) < 0.25] = -1
    idx[:, 1] = idx[:, 0]  # a repeated key counts twice
    idx[0] = -1  # a row with no key: zeros and lse -inf
    return idx.int(), torch.tensor([8, 5, 3], dtype=torch.int32)


SPARSE_LENS = ([30, 12, 0], [2, 1, 3])  # cached, new


# Cache write -----------------------------------------------------------------------
@pytest.mark.parametrize("page_size,interleaved,dtype,heads", [(1, True, F32, 1), (16, False, F32, 3), (64, True, BF16, 16)])
def test_write_cache(page_size, interleaved, dtype, heads):
    case = make_case([0, 5, 70], [3, 0, 4], config=small_config(num_heads=heads), page_size=page_size, dtype=dtype)
    dev = on_device(case)
    q_rot = openmla.mla_write_cache(dev.q, dev.kv, dev.freqs_cis, dev.gamma, dev.batch, dev.layer_idx,
                                    rope_interleaved=interleaved, backend="triton")
    ref_plan = openmla.plan(case.batch, scale=case.scale, backend="reference")
    want_q = load_backend("reference").write_cache(ref_plan, case.layer_idx, case.q, case.kv, case.freqs_cis, case.gamma, 1e-6,
                                           interleaved)
    check(q_rot, want_q, dtype, case, "q_rot")
    check(dev.batch.blocks, case.batch.blocks, dtype, case, "cache")


# Decode ----------------------------------------------------------------------------
@pytest.mark.parametrize("mask,kw", MASKS, ids=[m for m, _ in MASKS])
def test_decode_masks_multi_token(mask, kw):
    case = written(make_case([9, 4, 20, 0], [1, 3, 0, 2], config=small_config(num_heads=3), page_size=4))
    dev = on_device(case)
    q = absorbed_q(case)
    L = case.config.kv_lora_rank
    variant = MaskVariant.parse(mask, **kw)
    out, lse = openmla.flare_mla_decode(q.to(DEV), dev.batch, dev.layer_idx, scale=case.scale, kv_lora_rank=L, mask=mask,
                                        num_partitions=2, return_lse=True, backend="triton", **kw)
    want, want_lse = ref.decode(q, case.batch, case.layer_idx, scale=case.scale, kv_lora_rank=L, mask=variant)
    check(out, want, F32, case, f"decode {mask}")
    check_lse(lse, want_lse, F32, case, f"decode {mask}")


def test_decode_num_partitions_agree():
    case = written(make_case([40, 33, 7], [1, 2, 1], config=small_config(num_heads=3), page_size=16))
    dev = on_device(case)
    q = absorbed_q(case)
    L = case.config.kv_lora_rank
    want, want_lse = ref.decode(q, case.batch, case.layer_idx, scale=case.scale, kv_lora_rank=L)
    outs = []
    for parts in (1, 2, 3, 4):
        out, lse = openmla.flare_mla_decode(q.to(DEV), dev.batch, dev.layer_idx, scale=case.scale, kv_lora_rank=L,
                                            num_partitions=parts, return_lse=True, backend="triton")
        check(out, want, F32, case, f"num_partitions={parts}")
        check_lse(lse, want_lse, F32, case, f"num_partitions={parts}")
        outs.append(out)
    for parts, out in enumerate(outs[1:], start=2):
        assert rel_err(out, outs[0]) <= 2e-6, f"num_partitions={parts} differs from 1 (seed={case.seed})"


@pytest.mark.parametrize("physical", [True, False], ids=["physical", "logical"])
def test_decode_sparse_topk_sink(physical):
    case = written(make_case(*SPARSE_LENS, config=small_config(num_heads=3), page_size=16))
    idx, topk = sparse_indices_for(case, physical)
    dev = on_device(case)
    q = absorbed_q(case)
    L, H, B = case.config.kv_lora_rank, case.config.num_heads, case.batch.batch_size
    g = torch.Generator().manual_seed(case.seed + 3)
    sink = torch.randn(H, generator=g) if physical else torch.randn(B, H, generator=g)
    mask = {} if physical else {"mask": "sliding_window_causal", "window_size": 10}  # logical: the mask still applies
    variant = MaskVariant.parse(mask.get("mask", "causal"), mask.get("window_size"))
    out, lse = openmla.flare_mla_decode(q.to(DEV), dev.batch, dev.layer_idx, scale=case.scale, kv_lora_rank=L,
                                        sparse_indices=idx.to(DEV), topk_lengths=topk.to(DEV),
                                        physical_indices=physical, attn_sink=sink.to(DEV), num_partitions=2,
                                        return_lse=True, backend="triton", **mask)
    want, want_lse = ref.decode(q, case.batch, case.layer_idx, scale=case.scale, kv_lora_rank=L, mask=variant,
                                sparse_indices=idx, topk_lengths=topk, physical_indices=physical, attn_sink=sink)
    check(out, want, F32, case, "sparse decode")
    check_lse(lse, want_lse, F32, case, "sparse decode")
    assert torch.equal(out[0].cpu(), torch.zeros_like(out[0].cpu())) and torch.isneginf(lse[0]).all()


def test_decode_capturable_entry_with_preallocated_buffers():
    """``decode_into`` (the CUDA-graph entry) fills caller buffers, spare splits included."""
    case = written(make_case([25, 3], [2, 1], config=small_config(num_heads=16), page_size=64))
    dev = on_device(case)
    q = absorbed_q(case)
    T, H, _ = q.shape
    L = case.config.kv_lora_rank
    out = torch.full((T, H, L), float("nan"), device=DEV)
    lse = torch.full((T, H), float("nan"), device=DEV)
    ws = (torch.full((6, T, H, L), float("nan"), device=DEV), torch.full((6, T, H), float("nan"), device=DEV))
    b = dev.batch
    decode_into(q.to(DEV), b.blocks[dev.layer_idx], b.block_table, b.cache_lengths, b.input_row_offsets, b.page_size,
                scale=case.scale, kv_lora_rank=L, num_splits=5, out=out, lse=lse, workspace=ws)
    want, want_lse = ref.decode(q, case.batch, case.layer_idx, scale=case.scale, kv_lora_rank=L)
    check(out, want, F32, case, "decode_into")
    check_lse(lse, want_lse, F32, case, "decode_into")


def test_default_num_splits_bounds():
    dev = torch.device("cpu")
    assert default_num_splits(1, 16, 100_000, dev) >= 2  # one token, long context: split
    assert default_num_splits(1, 16, 10, dev) == 1  # nothing to split
    assert default_num_splits(4096, 128, 100_000, dev) == 1  # the grid is already full
    assert 1 <= default_num_splits(3, 1, 10**9, dev) <= 64


# Prefill ---------------------------------------------------------------------------
@pytest.mark.parametrize("mask,kw", MASKS, ids=[m for m, _ in MASKS])
def test_prefill_masks_prefix_chunked(mask, kw):
    case = written(make_case([7, 0, 19], [9, 12, 5], config=small_config(num_heads=3), page_size=16))
    dev = on_device(case)
    q = case.q  # any roped q works for the attention-only op
    sink = torch.randn(3, generator=torch.Generator().manual_seed(case.seed)) if mask == "causal" else None
    out, lse = openmla.mla_prefill(q.to(DEV), dev.batch, dev.layer_idx, dev.w_k, dev.w_uv, scale=case.scale, mask=mask,
                                   buffer_size=16, attn_sink=None if sink is None else sink.to(DEV),
                                   return_lse=True, backend="triton", **kw)
    want, want_lse = ref.prefill(q, case.batch, case.layer_idx, case.w_k, case.w_uv, scale=case.scale,
                                 mask=MaskVariant.parse(mask, **kw), attn_sink=sink)
    check(out, want, F32, case, f"prefill {mask}")
    check_lse(lse, want_lse, F32, case, f"prefill {mask}")


@pytest.mark.parametrize("blocks", [(16, 16), (32, 64)])
def test_flare_mla_prefill_tiles(blocks):
    """The kernel-level entry on one chunk of a plan, through ``mla_prefill_v2_ragged``."""
    case = written(make_case([10, 3], [20, 7], config=small_config(num_heads=3), page_size=16))
    dev = on_device(case)
    H, Dn, Dv = case.config.num_heads, case.config.qk_nope_head_dim, case.config.v_head_dim
    bro, co, lengths = openmla.mla_prefill_plan(case.batch.input_row_offsets, case.batch, 24, 4)
    g = torch.Generator().manual_seed(case.seed + 4)
    chunk = 1
    S = int(lengths[chunk])
    k, v = torch.randn(S, H, Dn, generator=g), torch.randn(S, H, Dv, generator=g)
    tile = MlaConfigV2(num_heads=H, q_depth=case.q.shape[2], depth=Dv, block_m=blocks[0], block_n=blocks[1],
                       dtype=F32, output_dtype=F32)
    out, lse = openmla.mla_prefill_v2_ragged(case.q.to(DEV), k.to(DEV), v.to(DEV), bro[chunk].to(DEV), co[chunk].to(DEV),
                                             dev.batch, dev.layer_idx, scale=case.scale, config=tile,
                                             mask="sliding_window_causal", window_size=9, return_lse=True,
                                             backend="triton")
    want, want_lse = ref.flare_mla_prefill(case.q, k, v, bro[chunk], co[chunk], case.batch, case.layer_idx,
                                           scale=case.scale, mask=MaskVariant.parse("sliding_window_causal", 9))
    check(out, want, F32, case, "flare prefill")
    check_lse(lse, want_lse, F32, case, "flare prefill")


# The fused op ----------------------------------------------------------------------
FUSED = [
    # form, dtype, page_size, heads, extra arguments
    ("decode", F32, 1, 1, {}),
    ("decode", BF16, 16, 3, {"mask": "chunked_causal", "chunk_size": 4}),
    ("prefill", F32, 64, 16, {"buffer_size": 20}),
    ("prefill", BF16, 16, 3, {"mask": "sliding_window_noncausal", "window_size": 6, "sink": True}),
    ("decode", F32, 16, 3, {"sparse": "physical", "sink": True}),
    ("prefill", F32, 16, 3, {"sparse": "logical"}),  # sparse prefill runs the absorbed path
]


@pytest.mark.parametrize("form,dtype,page_size,heads,extra", FUSED,
                         ids=[f"{f}-{str(d)[6:]}-p{p}-h{h}-{i}" for i, (f, d, p, h, _) in enumerate(FUSED)])
def test_fused_op(form, dtype, page_size, heads, extra):
    extra = dict(extra)
    sparse = extra.pop("sparse", None)
    use_sink = extra.pop("sink", False)
    if sparse:
        case = make_case(*SPARSE_LENS, config=small_config(num_heads=heads), page_size=page_size, dtype=dtype)
        idx, topk = sparse_indices_for(case, sparse == "physical")
        extra.update(sparse_indices=idx, topk_lengths=topk, physical_indices=sparse == "physical")
    else:
        case = make_case([6, 0, 30], [3, 9, 1] if form == "prefill" else [2, 1, 3],
                         config=small_config(num_heads=heads), page_size=page_size, dtype=dtype)
    if use_sink:
        extra["attn_sink"] = torch.randn(heads, generator=torch.Generator().manual_seed(case.seed))
    _run_fused(case, form, dtype, extra)


def _run_fused(case: Case, form: str, dtype: torch.dtype, extra: dict) -> None:
    dev = on_device(case)
    args = {k: (v.to(DEV) if isinstance(v, torch.Tensor) else v) for k, v in extra.items()}
    max_q = 64 if form == "decode" else 0
    out, lse = openmla.mla_prefill_decode_graph(*dev.fused_args(), scale=case.scale, decode_max_q_len=max_q,
                                                return_lse=True, backend="triton", **args)
    ref_args = {k: v for k, v in extra.items() if k not in ("mask", "window_size", "chunk_size", "buffer_size")}
    variant = MaskVariant.parse(extra.get("mask", "causal"), extra.get("window_size"), extra.get("chunk_size"))
    want, want_lse = ref.mla_prefill_decode_graph(case.q, case.kv, case.freqs_cis, case.gamma, case.batch, case.layer_idx,
                                                  case.w_k, case.w_uk, case.w_uv, scale=case.scale, mask=variant,
                                                  use_decode_form=form == "decode", **ref_args)
    check(out, want, dtype, case, f"fused {form}")
    check_lse(lse, want_lse, dtype, case, f"fused {form}")
    check(dev.batch.blocks, case.batch.blocks, dtype, case, "cache after the fused op")


@pytest.mark.parametrize("form,dtype", [("decode", F32), ("prefill", BF16)])
def test_deepseek_dims_heavy(form, dtype):
    """L=512, R=64, Dn=128, Dv=128 (the real tile shapes), a couple of tokens."""
    cfg = small_config(num_heads=2, L=512, R=64, Dn=128, Dv=128)
    case = make_case([21, 4], [2, 1], config=cfg, page_size=16, dtype=dtype)
    _run_fused(case, form, dtype, {})


# Replaying a step after in-place metadata updates (a CUDA graph on GPU) ----------------
def replayable(step):
    """Run ``step`` once (compiling it); on CUDA capture it in a graph and return the replay,
    on the CPU return ``step`` itself (same metadata-update semantics, no capture)."""
    step()
    if not CUDA:
        return step
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def test_decode_into_replay_after_metadata_update():
    """``decode_into`` with fixed buffers: change q and lengths in place, replay, compare."""
    case = written(make_case([50, 20, 33], [1, 1, 1], config=small_config(num_heads=16), page_size=16))
    dev = on_device(case)
    L = case.config.kv_lora_rank
    b = dev.batch
    q = absorbed_q(case).to(DEV)
    T, H, _ = q.shape
    out, lse = torch.empty(T, H, L, device=DEV), torch.empty(T, H, device=DEV)
    ws = (torch.empty(3, T, H, L, device=DEV), torch.empty(3, T, H, device=DEV))

    def step():
        decode_into(q, b.blocks[dev.layer_idx], b.block_table, b.cache_lengths, b.input_row_offsets, b.page_size,
                    scale=case.scale, kv_lora_rank=L, num_splits=3, out=out, lse=lse, workspace=ws)

    replay = replayable(step)
    for shrink in (0, 7):
        lengths = torch.tensor([50 - shrink, 20, 33 - shrink], dtype=torch.int32)
        b.cache_lengths.copy_(lengths.to(DEV))
        q.copy_(torch.randn(q.shape, generator=torch.Generator().manual_seed(case.seed + shrink)).to(DEV))
        replay()
        view = CacheBatch(case.batch.blocks, case.batch.block_table, lengths, case.batch.input_row_offsets,
                          case.batch.page_size)
        want, want_lse = ref.decode(q.cpu(), view, case.layer_idx, scale=case.scale, kv_lora_rank=L)
        check(out, want, F32, case, f"replay (shrink {shrink})")
        check_lse(lse, want_lse, F32, case, f"replay (shrink {shrink})")


def test_plan_decode_step_replay():
    """A whole decode step from a plan with fixed capacities (write, absorb, decode with fixed
    splits, unabsorb) replayed after ``plan.refill`` with new q/kv and lengths: what an engine
    captures per layer in a CUDA graph."""
    case = make_case([40, 9], [2, 1], config=small_config(num_heads=3), page_size=16)
    dev = on_device(case)
    b = dev.batch
    step_plan = openmla.plan(b, scale=case.scale, num_partitions=2, max_pages=b.block_table.shape[1] + 1, backend="triton")
    res = {}

    def step():
        q_rot = step_plan.write_cache(dev.q, dev.kv, dev.freqs_cis, dev.gamma, dev.layer_idx)
        out_lat, res["lse"] = step_plan.decode(combine.absorb(q_rot, dev.w_uk), dev.layer_idx,
                                               kv_lora_rank=case.config.kv_lora_rank, return_lse=True)
        res["out"] = combine.unabsorb(out_lat, dev.w_uv)

    replay = replayable(step)
    for shrink in (0, 5):
        lengths = torch.tensor([40 - shrink, 9], dtype=torch.int32)
        g = torch.Generator().manual_seed(case.seed + shrink)
        q, kv = torch.randn(case.q.shape, generator=g), torch.randn(case.kv.shape, generator=g)
        view = CacheBatch(case.batch.blocks.clone(), case.batch.block_table, lengths, case.batch.input_row_offsets,
                          case.batch.page_size)
        b.blocks.copy_(view.blocks.to(DEV))  # both caches start equal
        step_plan.refill(dataclasses.replace(b, cache_lengths=lengths.to(DEV)))
        dev.q.copy_(q.to(DEV))
        dev.kv.copy_(kv.to(DEV))
        replay()
        want, want_lse = ref.mla_prefill_decode_graph(q, kv, case.freqs_cis, case.gamma, view, case.layer_idx, case.w_k,
                                                      case.w_uk, case.w_uv, scale=case.scale, use_decode_form=True)
        check(res["out"], want, F32, case, f"step replay (shrink {shrink})")
        check_lse(res["lse"], want_lse, F32, case, f"step replay (shrink {shrink})")
        check(b.blocks, view.blocks, F32, case, f"cache after step replay (shrink {shrink})")


def test_interpreter_or_cuda():
    """The module really ran the kernels the way its header says."""
    assert CUDA or _common.INTERPRET
