"""``openmla check``: a backend against the float64 reference on a handful of random cases."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from openmla import reference as ref
from openmla.masks import MaskVariant
from openmla.compat.max import mla_prefill_decode_graph
from .testing import TOL, make_case, rel_err, small_config


@dataclass
class CheckRow:
    case: str
    dtype: str
    error: float
    tolerance: float
    note: str = ""


def _sparse(case, physical: bool, stride: int = 5) -> torch.Tensor:
    g = torch.Generator().manual_seed(case.seed)
    rows = []
    for b, (n, total) in enumerate(zip(case.batch.new_tokens_list, case.batch.seq_lens_list)):
        for _ in range(n):
            pos = torch.randint(0, total, (stride,), generator=g)
            rows.append(ref.physical_rows(case.batch, b, pos) if physical else pos)
    idx = torch.stack(rows).int()
    idx[:, -1] = -1  # an unused slot in every row
    return idx


def _one(name: str, backend: str, dtype: torch.dtype, case_args: dict, op_kwargs: dict, seed: int) -> CheckRow:
    case = make_case(**case_args, dtype=dtype, seed=seed)
    kwargs = dict(op_kwargs)
    if "sparse" in kwargs:  # the value says whether the indices are physical rows
        physical = kwargs.pop("sparse")
        kwargs.update(sparse_indices=_sparse(case, physical), physical_indices=physical)
    want_case, got_case = case.clone_cache(), case.clone_cache()
    mask = MaskVariant.parse(kwargs.get("mask", "causal"), kwargs.get("window_size"), kwargs.get("chunk_size"))
    ref_kwargs = {k: v for k, v in kwargs.items() if k in ("sparse_indices", "topk_lengths", "physical_indices", "attn_sink")}
    c = want_case
    want, _ = ref.mla_prefill_decode_graph(c.q, c.kv, c.freqs_cis, c.gamma, c.batch, c.layer_idx, c.w_k, c.w_uk, c.w_uv,
                                           scale=c.scale, mask=mask, **ref_kwargs)
    try:
        got = mla_prefill_decode_graph(*got_case.fused_args(), scale=case.scale, backend=backend, **kwargs)
        err, note = rel_err(got, want), ""
    except Exception as exc:  # a crash is a failed check, reported, not a traceback
        err, note = float("inf"), f"{type(exc).__name__}: {exc}"[:80]
    return CheckRow(name, str(dtype).removeprefix("torch."), err, TOL[dtype], note)


def run_checks(backend: str, seed: int | None = None, quick: bool = False) -> list[CheckRow]:
    """Random fused-op cases covering both forms, masks, sparse, sinks, split-KV and chunking."""
    seed = random.randrange(2**31) if seed is None else seed
    ragged_decode = dict(cache_lens=[0, 1, 37, 70], new_lens=[1, 3, 0, 6], page_size=16)
    ragged_prefill = dict(cache_lens=[0, 21, 5], new_lens=[19, 9, 0], page_size=16)
    cases = [
        ("decode form, ragged, 4 heads", ragged_decode, {}),
        ("prefill form, ragged, prefix", ragged_prefill, {}),
        ("decode, 3 partitions, sink", ragged_decode, {"num_partitions": 3, "attn_sink": torch.tensor([0.5, -1.0, 2.0, 0.0])}),
        ("prefill, chunked (buffer 7)", ragged_prefill, {"buffer_size": 7}),
        ("decode, sliding window 5", ragged_decode, {"mask": "sliding_window_causal", "window_size": 5}),
        ("prefill, chunked_causal 8", ragged_prefill, {"mask": "chunked_causal", "chunk_size": 8}),
        ("decode, sparse logical", ragged_decode, {"sparse": False}),
        ("decode, sparse physical", ragged_decode, {"sparse": True}),
        ("decode, fp8_ds_mla cache", dict(ragged_decode, config=small_config(4, 128, 16, 32, 32), cache_dtype="fp8_ds_mla"), {}),
        ("prefill, fp8_e4m3 cache", dict(ragged_prefill, config=small_config(4, 128, 16, 32, 32), cache_dtype="fp8_e4m3"), {}),
        ("decode, DeepSeek dims, 16 heads",
         dict(cache_lens=[40, 3], new_lens=[1, 2], page_size=64, config=small_config(16, 512, 64, 128, 128)), {}),
    ]
    if quick:
        cases = cases[:4]
    rows = []
    for i, (name, case_args, op_kwargs) in enumerate(cases):
        for dtype in (torch.float32, torch.bfloat16):
            rows.append(_one(name, backend, dtype, case_args, op_kwargs, seed + i))
    return rows
