"""FlashInfer's ``BatchMLAPagedAttentionWrapper`` computed by openmla.

    from openmla.compat.flashinfer import BatchMLAPagedAttentionWrapper

Code written against ``flashinfer.mla.BatchMLAPagedAttentionWrapper`` runs unchanged, on the CPU
(torch backend) or any Triton GPU, with FlashInfer's conventions:

- ``plan(qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv, head_dim_kpe,
  page_size, causal, sm_scale, q_data_type, kv_data_type)``: sequence ``b`` has query rows
  ``qo_indptr[b]:qo_indptr[b+1]`` and ``kv_len_arr[b]`` keys (the new tokens included) in pages
  ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``; ``causal`` aligns the queries with the last keys
  (query ``i`` of ``q_len`` sees keys ``j <= kv_len - q_len + i``);
- ``run(q_nope [T, H, L], q_pe [T, H, R], ckv_cache [pages, page_size, L], kpe_cache [pages,
  page_size, R])`` -> ``out [T, H, L]`` (and ``lse [T, H]`` with ``return_lse=True``);
- the LSE is base 2 (``return_lse_base_on_e=True``: natural log), float32, -inf for a query
  without keys (whose output is 0);
- FP8 caches (``kv_data_type=torch.float8_e4m3fn``) with ``ckv_scale`` or ``ckv_scale_arr``
  (per token and 128 channels) and ``kpe_scale``: real value = stored value * scale.

Beyond FlashInfer: float32 inputs, and causal rows with more queries than keys (those that see no
key are empty rows). Not supported (ValueError): ``backend="cutlass"`` (another ``run`` layout),
``use_cuda_graph=True``, the profiler, ``o_scale`` and NoPE MLA (``head_dim_kpe=0``).

Caches. openmla reads one ``[pages, page_size, L+R]`` entry per token. When ``ckv_cache`` and
``kpe_cache`` are the two halves of one such tensor (``ckv = kv[..., :L]``, ``kpe = kv[..., L:]``,
the usual engine layout) it is read in place. Otherwise each ``run`` copies the pages the step
touches (``ceil(kv_len / page_size)`` per sequence, FP8 dequantised) into one staging buffer kept
by the wrapper: extra memory is bounded by the touched pages, never the whole pool.

Planning: ``plan`` checks the step once (host reads of the index arrays, as in FlashInfer)
and every ``run`` (one per layer) checks shapes only; the openmla plan is made on the first
``run`` and reused by the later ones (``MLAPlan.with_blocks`` for in-place caches).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..fp8 import FP8
from ..planning import MLAPlan, plan
from ..validate import FLOAT_DTYPES, INDEX_DTYPES, check_float, check_int, check_tensor
from ._layout import Layout, layout

__all__ = ["BatchMLAPagedAttentionWrapper"]

LOG2E = 1.0 / math.log(2.0)
KV_DTYPES = FLOAT_DTYPES + (FP8,)
FP8_GROUP = 128  # ckv channels per ckv_scale_arr entry


@dataclass
class _Step:
    """What ``plan`` fixed for the following ``run`` calls."""

    layout: Layout
    pages: torch.Tensor  # int64 [B, P]: the caller's pages per sequence (0 past its last page)
    touched: torch.Tensor  # int64 [N]: the touched pages, sequence after sequence
    staging_table: torch.Tensor  # int32 [B, P]: the same pages in the staging buffer
    max_page: int  # largest page id touched (-1: none)
    num_heads: int
    head_dim_ckv: int
    head_dim_kpe: int
    page_size: int
    causal: bool
    sm_scale: float
    q_data_type: torch.dtype
    kv_data_type: torch.dtype


class BatchMLAPagedAttentionWrapper:
    """MLA over a paged cache with separate latent (ckv) and rope (kpe) caches (FlashInfer's API).

    ``float_workspace_buffer``: any tensor on the device the wrapper runs on (FlashInfer's
    split-k scratch; openmla allocates its own and only takes the device from it).
    ``openmla_backend`` (``torch``, ``triton``, ``reference``; None picks by device) is the one
    argument FlashInfer does not have.
    """

    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        use_cuda_graph: bool = False,
        qo_indptr: torch.Tensor | None = None,
        kv_indptr: torch.Tensor | None = None,
        kv_indices: torch.Tensor | None = None,
        kv_len_arr: torch.Tensor | None = None,
        backend: str = "auto",
        *,
        openmla_backend: str | None = None,
    ) -> None:
        check_tensor("float_workspace_buffer", float_workspace_buffer)
        if use_cuda_graph is not False:
            raise ValueError("use_cuda_graph: not supported by the openmla wrapper (openmla's own plans support CUDA graphs: "
                             "openmla.plan with max_pages and num_partitions, then plan.refill)")
        for name, buf in (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr), ("kv_indices", kv_indices), ("kv_len_arr", kv_len_arr)):
            if buf is not None:
                raise ValueError(f"{name}: CUDA-graph buffers are not supported by the openmla wrapper")
        if backend not in ("auto", "fa2", "fa3"):
            raise ValueError(f"backend: {backend!r} is not supported; 'auto', 'fa2' and 'fa3' all run openmla "
                             "('cutlass' has another run() layout)")
        self.device = float_workspace_buffer.device
        self._openmla_backend = openmla_backend
        self._step: _Step | None = None
        self._plans: dict[tuple, MLAPlan] = {}
        self._staging: torch.Tensor | None = None

    # plan -------------------------------------------------------------------------------
    def plan(
        self,
        qo_indptr: torch.Tensor,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        kv_len_arr: torch.Tensor,
        num_heads: int,
        head_dim_ckv: int,
        head_dim_kpe: int,
        page_size: int,
        causal: bool,
        sm_scale: float,
        q_data_type: torch.dtype,
        kv_data_type: torch.dtype,
        use_profiler: bool = False,
    ) -> None:
        """Check one batch step and keep it for the following ``run`` calls (see the module doc).
        Index tensors may live on any device (they are copied to the wrapper's)."""
        num_heads = check_int("num_heads", num_heads, 1)
        L = check_int("head_dim_ckv", head_dim_ckv, 1)
        R = check_int("head_dim_kpe", head_dim_kpe, 0)
        if R == 0:
            raise ValueError("head_dim_kpe: NoPE MLA (0) is not supported; openmla's cache entries hold a rope part")
        ps = check_int("page_size", page_size, 1)
        if not isinstance(causal, bool):
            raise ValueError(f"causal: expected a bool, got {causal!r}")
        scale = check_float("sm_scale", sm_scale)
        if q_data_type not in FLOAT_DTYPES:
            raise ValueError(f"q_data_type: expected a float dtype, got {q_data_type!r}")
        if kv_data_type not in KV_DTYPES:
            raise ValueError(f"kv_data_type: expected a float dtype or torch.float8_e4m3fn, got {kv_data_type!r}")
        if use_profiler is not False:
            raise ValueError("use_profiler: the profiler is FlashInfer's; not available")
        qo = _host_indptr("qo_indptr", qo_indptr)
        B = len(qo) - 1
        kvp = _host_indptr("kv_indptr", kv_indptr)
        if len(kvp) != B + 1:
            raise ValueError(f"kv_indptr: {len(kvp)} entries for {B} sequences (qo_indptr)")
        check_tensor("kv_len_arr", kv_len_arr, shape=(B,), dtypes=INDEX_DTYPES)
        kv_lens = [int(n) for n in kv_len_arr.tolist()]
        if any(n < 0 for n in kv_lens):
            raise ValueError(f"kv_len_arr: lengths must be >= 0, got {kv_lens}")
        check_tensor("kv_indices", kv_indices, rank=1, dtypes=INDEX_DTYPES)
        if kvp[-1] > kv_indices.shape[0]:
            raise ValueError(f"kv_indices: holds {kv_indices.shape[0]} pages, kv_indptr ends at {kvp[-1]}")
        need = [-(-n // ps) for n in kv_lens]
        for b in range(B):
            if kvp[b + 1] - kvp[b] < need[b]:
                raise ValueError(f"kv_indptr: sequence {b} lists {kvp[b + 1] - kvp[b]} pages, its {kv_lens[b]} keys need {need[b]}")
        dev = self.device
        width = max(need + [1])
        col = torch.arange(width, device=dev)
        need_t = torch.tensor(need, dtype=torch.int64, device=dev)
        used = col[None, :] < need_t[:, None]
        start = torch.tensor(kvp[:-1], dtype=torch.int64, device=dev)
        indices = kv_indices.to(dev, torch.int64)
        pos = (start[:, None] + col[None, :]).clamp_max(max(kv_indices.shape[0] - 1, 0))
        pages = torch.where(used, indices[pos] if indices.numel() else col[None, :] * 0, 0)
        touched = pages[used]
        max_page = -1
        if touched.numel():
            lo, max_page = (int(v) for v in torch.stack([touched.min(), touched.max()]).tolist())
            if lo < 0:
                raise ValueError("kv_indices: a page a sequence reads is negative")
        first = torch.tensor([0] + need[:-1], dtype=torch.int64, device=dev).cumsum(0)
        staging_table = torch.where(used, first[:, None] + col[None, :], 0).to(torch.int32)
        q_lens = [qo[b + 1] - qo[b] for b in range(B)]
        self._step = _Step(layout(q_lens, kv_lens, causal, dev), pages, touched, staging_table, max_page, num_heads, L, R,
                           ps, causal, scale, q_data_type, kv_data_type)
        self._plans.clear()

    # run --------------------------------------------------------------------------------
    def run(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        ckv_cache: torch.Tensor,
        kpe_cache: torch.Tensor,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
        return_lse: bool = False,
        profiler_buffer: torch.Tensor | None = None,
        kv_len: torch.Tensor | None = None,
        page_table: torch.Tensor | None = None,
        return_lse_base_on_e: bool = False,
        o_scale: float | None = None,
        *,
        ckv_scale: float | None = None,
        ckv_scale_arr: torch.Tensor | None = None,
        kpe_scale: float | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attention of the planned step for one layer: ``out [T, H, head_dim_ckv]`` in q's dtype
        (written into ``out`` when given) and, with ``return_lse``, float32 ``lse [T, H]`` (base 2
        unless ``return_lse_base_on_e``; written into ``lse`` when given)."""
        st = self._step
        if st is None:
            raise ValueError("plan: call plan() before run()")
        for name, value in (("profiler_buffer", profiler_buffer), ("kv_len", kv_len), ("page_table", page_table),
                            ("o_scale", o_scale)):
            if value is not None:
                raise ValueError(f"{name}: not supported by the openmla wrapper (FlashInfer's cutlass/profiler path)")
        for name, value in (("return_lse", return_lse), ("return_lse_base_on_e", return_lse_base_on_e)):
            if not isinstance(value, bool):
                raise ValueError(f"{name}: expected a bool, got {value!r}")
        T, H, L, R, dev = st.layout.num_rows, st.num_heads, st.head_dim_ckv, st.head_dim_kpe, self.device
        check_tensor("q_nope", q_nope, shape=(T, H, L), dtypes=(st.q_data_type,), device=dev)
        check_tensor("q_pe", q_pe, shape=(T, H, R), dtypes=(st.q_data_type,), device=dev)
        check_tensor("ckv_cache", ckv_cache, shape=(None, st.page_size, L), dtypes=(st.kv_data_type,), device=dev)
        check_tensor("kpe_cache", kpe_cache, shape=(ckv_cache.shape[0], st.page_size, R), dtypes=(st.kv_data_type,), device=dev)
        if st.max_page >= ckv_cache.shape[0]:
            raise ValueError(f"kv_indices: page {st.max_page} lies outside the caches' {ckv_cache.shape[0]} pages")
        if out is not None:
            check_tensor("out", out, shape=(T, H, L), dtypes=(st.q_data_type,), device=dev)
        if lse is not None:
            check_tensor("lse", lse, shape=(T, H), dtypes=(torch.float32,), device=dev)
        scales = self._check_scales(ckv_cache, ckv_scale, ckv_scale_arr, kpe_scale)
        step = self._plan_for(ckv_cache, kpe_cache, scales)
        q = torch.cat([q_nope, q_pe], dim=-1)  # openmla takes one [T, H, L+R] query
        o, lse_e = step.decode(st.layout.select(q), 0, kv_lora_rank=L, return_lse=True)
        o, lse_e = st.layout.expand(o, lse_e)
        o = out.copy_(o) if out is not None else o
        if not return_lse:
            return o
        lse_out = lse_e if return_lse_base_on_e else lse_e * LOG2E
        return o, (lse.copy_(lse_out) if lse is not None else lse_out)

    # Storage ----------------------------------------------------------------------------
    def _check_scales(self, ckv_cache: torch.Tensor, ckv_scale: object, ckv_scale_arr: object,
                      kpe_scale: object) -> tuple | None:
        """FP8 dequantisation scales (FlashInfer's rules); None for a float cache."""
        st = self._step
        if st.kv_data_type != FP8:
            for name, value in (("ckv_scale", ckv_scale), ("ckv_scale_arr", ckv_scale_arr), ("kpe_scale", kpe_scale)):
                if value is not None:
                    raise ValueError(f"{name}: only an FP8 cache (kv_data_type=torch.float8_e4m3fn) takes scales")
            return None
        if (ckv_scale is None) == (ckv_scale_arr is None):
            raise ValueError("ckv_scale: exactly one of ckv_scale and ckv_scale_arr is required for an FP8 cache")
        if kpe_scale is None:
            raise ValueError("kpe_scale: required for an FP8 cache")
        if ckv_scale is not None and not check_float("ckv_scale", ckv_scale) > 0:
            raise ValueError(f"ckv_scale: must be > 0, got {ckv_scale!r}")
        if not check_float("kpe_scale", kpe_scale) > 0:
            raise ValueError(f"kpe_scale: must be > 0, got {kpe_scale!r}")
        if ckv_scale_arr is not None:
            if st.head_dim_ckv % FP8_GROUP:
                raise ValueError(f"ckv_scale_arr: needs head_dim_ckv a multiple of {FP8_GROUP}, got {st.head_dim_ckv}")
            check_tensor("ckv_scale_arr", ckv_scale_arr, shape=(*ckv_cache.shape[:-1], st.head_dim_ckv // FP8_GROUP),
                         dtypes=(torch.float32,), device=self.device)
        return (ckv_scale, ckv_scale_arr, float(kpe_scale))

    def _plan_for(self, ckv: torch.Tensor, kpe: torch.Tensor, scales: tuple | None) -> MLAPlan:
        """The step's openmla plan over the caches: in place when they are halves of one tensor,
        else over the staging buffer, refreshed with this layer's touched pages."""
        st = self._step
        whole = _joined(ckv, kpe) if scales is None else None
        if whole is not None:
            blocks = whole.unsqueeze(0)
            key = ("in place", tuple(blocks.shape), blocks.dtype)
            table = st.pages
        else:
            blocks = self._stage(ckv, kpe, scales).unsqueeze(0)
            key = ("staged", tuple(blocks.shape), blocks.dtype)
            table = st.staging_table
        base = self._plans.get(key)
        if base is None:
            batch = st.layout.batch(blocks, table, st.page_size)
            mask = "causal" if st.causal else "null"
            base = self._plans[key] = plan(batch, scale=st.sm_scale, mask=mask, backend=self._openmla_backend)
        return base.with_blocks(blocks)

    def _stage(self, ckv: torch.Tensor, kpe: torch.Tensor, scales: tuple | None) -> torch.Tensor:
        """This layer's touched pages as openmla entries ``[N, page_size, L+R]`` in the staging
        buffer (allocated once per shape; FP8 dequantised into q's dtype)."""
        st = self._step
        L, N = st.head_dim_ckv, max(int(st.touched.shape[0]), 1)
        dtype = st.kv_data_type if scales is None else st.q_data_type
        shape = (N, st.page_size, L + st.head_dim_kpe)
        if self._staging is None or tuple(self._staging.shape) != shape or self._staging.dtype != dtype:
            self._staging = torch.zeros(shape, dtype=dtype, device=self.device)
        stage = self._staging
        n = int(st.touched.shape[0])
        if n == 0:
            return stage
        lat, rope = _pages(ckv, st.touched), _pages(kpe, st.touched)
        if scales is not None:
            ckv_scale, ckv_scale_arr, kpe_scale = scales
            wide = lat.float().view(n, st.page_size, L // FP8_GROUP if ckv_scale is None else 1, -1)
            factor = ckv_scale if ckv_scale_arr is None else ckv_scale_arr.index_select(0, st.touched)[..., None]
            lat = (wide * factor).view(n, st.page_size, L)
            rope = rope.float() * kpe_scale
        stage[:n, :, :L] = lat
        stage[:n, :, L:] = rope
        return stage


def _pages(cache: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """``cache[pages]``, through a byte view for float8 (torch has no float8 index_select on CPU)."""
    if cache.dtype == FP8:
        return cache.view(torch.uint8).index_select(0, pages).view(FP8)
    return cache.index_select(0, pages)


def _host_indptr(name: str, indptr: object) -> list[int]:
    """An indptr ``[n+1]``: 0 first, non-decreasing, at least two entries (one host read)."""
    check_tensor(name, indptr, rank=1, dtypes=INDEX_DTYPES)
    vals = [int(v) for v in indptr.tolist()]
    if len(vals) < 2:
        raise ValueError(f"{name}: needs batch_size + 1 >= 2 entries, got {len(vals)}")
    if vals[0] != 0 or any(b < a for a, b in zip(vals, vals[1:])):
        raise ValueError(f"{name}: must start at 0 and be non-decreasing, got {vals}")
    return vals


def _joined(ckv: torch.Tensor, kpe: torch.Tensor) -> torch.Tensor | None:
    """``[pages, page_size, L+R]`` when ``ckv`` and ``kpe`` are the two halves of one such tensor's
    entries (a view; nothing copied), else None."""
    L, R = ckv.shape[-1], kpe.shape[-1]
    if ckv.stride() != kpe.stride() or ckv.stride(-1) != 1 or ckv.stride(-2) < L + R:
        return None
    if kpe.untyped_storage().data_ptr() != ckv.untyped_storage().data_ptr():
        return None
    if kpe.storage_offset() != ckv.storage_offset() + L:
        return None
    return ckv.as_strided((*ckv.shape[:-1], L + R), ckv.stride())
