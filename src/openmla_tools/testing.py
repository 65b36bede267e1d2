"""Random MLA problems: used by the test-suite and by ``openmla check``.

``make_case`` builds a paged cache whose pages are handed out in a shuffled order (so a
wrong page-table lookup shows), fills the cached prefix with random entries, and draws
q, kv and weights. Sizes are small so the float64 reference stays quick.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from openmla.cache import CacheBatch, PagedLatentCache
from openmla.config import MLAConfig
from openmla.rope import rope_freqs_cis
from openmla.weights import LayerWeights


@dataclass
class Case:
    config: MLAConfig
    cache: PagedLatentCache
    batch: CacheBatch
    q: torch.Tensor  # [T, H, Dn+R]
    kv: torch.Tensor  # [T, L+R]
    freqs_cis: torch.Tensor
    gamma: torch.Tensor
    w_k: torch.Tensor
    w_uk: torch.Tensor
    w_uv: torch.Tensor
    layer_idx: int
    seed: int
    extras: dict = field(default_factory=dict)

    @property
    def scale(self) -> float:
        return self.config.softmax_scale

    @property
    def weights(self) -> LayerWeights:
        """The case's per-layer constants as ``plan.run`` takes them (``extras["epsilon"]``, if set,
        the latent norm's epsilon)."""
        return LayerWeights(self.gamma, self.w_k, self.w_uk, self.w_uv, epsilon=self.extras.get("epsilon", 1e-6))

    def run_args(self) -> tuple:
        """Positional arguments of ``MLAPlan.run``."""
        return (self.q, self.kv, self.layer_idx, self.weights, self.freqs_cis)

    def fused_args(self):
        """Positional arguments of ``mla_prefill_decode_graph``."""
        return (self.q, self.kv, self.batch.input_row_offsets, self.freqs_cis, self.gamma, self.batch,
                self.layer_idx, self.w_k, self.w_uk, self.w_uv)

    def clone_cache(self) -> "Case":
        """The same case with its own copy of the cache storage (for running two backends)."""
        batch = self.batch.with_blocks(self.cache.blocks.clone())
        return Case(self.config, self.cache, batch, self.q, self.kv, self.freqs_cis, self.gamma, self.w_k, self.w_uk,
                    self.w_uv, self.layer_idx, self.seed, dict(self.extras))


@torch.no_grad()
def randomize_v4_untrained(model: torch.nn.Module) -> torch.nn.Module:
    """A random-weight transformers ``DeepseekV4ForCausalLM`` with the parameters its init leaves
    inert made to matter: per-head sinks and position biases N(0, 0.5), hash-MoE token tables
    random (their init routes every token alike). Uses the global torch RNG; returns ``model``."""
    for name, p in model.named_parameters():
        if name.endswith("sinks") or name.endswith("position_bias"):
            p.normal_(0, 0.5)
    for layer in model.model.layers:
        if getattr(layer.mlp.gate, "tid2eid", None) is not None:
            layer.mlp.gate.tid2eid.random_(0, model.config.n_routed_experts)
    return model


def small_config(num_heads: int = 4, L: int = 64, R: int = 16, Dn: int = 32, Dv: int = 32) -> MLAConfig:
    return MLAConfig(num_heads=num_heads, kv_lora_rank=L, qk_rope_head_dim=R, qk_nope_head_dim=Dn, v_head_dim=Dv,
                     q_lora_rank=None, hidden_size=64)


def make_case(
    cache_lens: list[int],
    new_lens: list[int],
    *,
    config: MLAConfig | None = None,
    page_size: int = 16,
    num_layers: int = 2,
    layer_idx: int = 1,
    dtype: torch.dtype = torch.float32,
    seed: int | None = None,
    spare_pages: int = 3,
    cache_dtype: str | None = None,
    kv_scale: float = 1.0,
) -> Case:
    """A ragged batch: sequence ``b`` has ``cache_lens[b]`` cached tokens and ``new_lens[b]`` new ones.

    The cache is prepared (pages reserved) but this call's tokens are not yet written.
    ``cache_dtype`` ("fp8_e4m3", "fp8_ds_mla") picks an fp8 cache; inputs stay in ``dtype``.
    """
    if seed is None:
        seed = random.randrange(2**31)
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    cfg = config or small_config()
    H, L, R, Dn, Dv = cfg.num_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
    pages_needed = sum(-(-(c + n) // page_size) for c, n in zip(cache_lens, new_lens))
    num_pages = pages_needed + spare_pages
    cache = PagedLatentCache(num_layers, num_pages, page_size=page_size, head_dim=L + R, dtype=cache_dtype or dtype,
                             rope_dim=R, kv_scale=kv_scale)
    # Hand pages out in a shuffled order so sequences own scattered, non-monotonic pages.
    order = list(range(num_pages))
    rng.shuffle(order)
    cache.allocator._free = order
    if cache.cache_format == "native":
        cache.blocks.copy_((torch.randn(cache.blocks.shape, generator=g)).to(dtype))
    else:  # store random entries through the quantising writer
        entries = torch.randn(num_pages * page_size, L + R, generator=g)
        filler = cache.prepare([], [])  # an empty batch: a view of the storage, no sequence
        for layer in range(num_layers):
            filler.write_rows(layer, torch.arange(num_pages * page_size), entries)
    ids = [f"s{i}" for i in range(len(cache_lens))]
    if any(cache_lens):
        pre = cache.prepare(ids, cache_lens)
        cache.commit(pre)
    batch = cache.prepare(ids, new_lens)
    T = sum(new_lens)
    max_pos = max([c + n for c, n in zip(cache_lens, new_lens)] + [1])
    w = lambda *shape, s=1.0: (torch.randn(*shape, generator=g) * s).to(dtype)  # noqa: E731
    w_k = w(H * Dn, L, s=L**-0.5)
    return Case(
        config=cfg,
        cache=cache,
        batch=batch,
        q=w(T, H, Dn + R),
        kv=w(T, L + R),
        freqs_cis=rope_freqs_cis(cfg, max_pos + 8),
        gamma=(1.0 + 0.1 * torch.randn(L, generator=g)).to(dtype),
        w_k=w_k,
        w_uk=w_k.reshape(H, Dn, L).transpose(1, 2).contiguous(),
        w_uv=w(H, Dv, L, s=L**-0.5),
        layer_idx=layer_idx,
        seed=seed,
    )


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max(|want|, tiny); NaN anywhere gives inf so it never passes."""
    got, want = got.double().cpu(), want.double().cpu()
    if torch.isnan(got).any() or torch.isnan(want).any():
        return float("inf")
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30)) if want.numel() else 0.0


# Every mask variant with parameters that cut through small ragged cases: (mask, kwargs).
MASK_CASES = [
    ("causal", {}),
    ("null", {}),
    ("sliding_window_causal", {"window_size": 5}),
    ("sliding_window_noncausal", {"window_size": 9}),
    ("chunked_causal", {"chunk_size": 7}),
]

TOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def assert_close(got: torch.Tensor, want: torch.Tensor, tol: float, what: str, seed: int) -> None:
    err = rel_err(got, want)
    assert err <= tol, f"{what}: rel err {err:.3g} > {tol} (seed {seed})"


def assert_close_nan(got: torch.Tensor, want: torch.Tensor, tol: float, what: str, seed: int) -> None:
    """NaN exactly where ``want`` has NaN (docs/api.md's NaN rule), ``inf`` where it has ``inf``, and
    the rest within ``tol`` (as ``assert_close``)."""
    got, want = got.double().cpu(), want.double().cpu()
    assert torch.equal(torch.isnan(got), torch.isnan(want)), (
        f"{what}: NaN at {torch.isnan(got).nonzero()[:4].tolist()}, the reference at {torch.isnan(want).nonzero()[:4].tolist()} "
        f"(seed {seed})")
    keep = ~torch.isnan(want)
    assert torch.equal(torch.isinf(got) & keep, torch.isinf(want) & keep), f"{what}: inf entries differ (seed {seed})"
    fin = keep & ~torch.isinf(want)
    if fin.any():
        assert_close(got[fin], want[fin], tol, what, seed)


def assert_lse(got: torch.Tensor, want: torch.Tensor, tol: float, seed: int) -> None:
    """-inf exactly where the reference has -inf; elsewhere close (absolute, scaled by max(|lse|, 1))."""
    got, want = got.double(), want.double()
    assert not torch.isnan(got).any(), f"lse has NaN (seed {seed})"
    empty = torch.isinf(want)
    assert torch.equal(torch.isinf(got), empty), f"lse -inf rows differ (seed {seed})"
    if (~empty).any():
        err = float((got[~empty] - want[~empty]).abs().max() / want[~empty].abs().max().clamp_min(1.0))
        assert err <= tol, f"lse: err {err:.3g} > {tol} (seed {seed})"


# Shared scenario lists (one list, every backend) ---------------------------------------------------
@dataclass(frozen=True)
class Scenario:
    """One random step for ``scenario_case``: ragged lengths (0 and 1 included), page size, dims,
    dtypes, and ``plan`` options. ``sparse``: None, ``"logical"`` or ``"physical"`` top-k lists
    (5 slots per token, some -1, ``topk_lengths`` cutting the lists); ``sink``: a per-head sink.
    ``poison`` (``EDGE_SCENARIOS``): ``"nan-kv"`` a NaN in the latent of the step's first new token,
    ``"zero-latent"`` that latent all zeros with ``epsilon=0`` (RMSNorm gives 0/0 = NaN),
    ``"nan-cached"`` a NaN in the cached entry at position 1 of the first sequence."""

    name: str
    cache_lens: tuple[int, ...]
    new_lens: tuple[int, ...]
    page_size: int = 16
    heads: int = 3
    L: int = 64
    R: int = 0
    Dn: int = 32
    Dv: int = 32
    dtype: torch.dtype = torch.float32
    cache_dtype: str | None = None
    options: tuple = ()  # plan options as (name, value) pairs
    sparse: str | None = None
    sink: bool = False
    poison: str | None = None

    @property
    def tol(self) -> float:
        return TOL[self.dtype]


def scenario_case(s: Scenario, seed: int | None = None) -> tuple[Case, dict]:
    """The ``Case`` of a scenario and the ``openmla.plan`` options it runs with."""
    case = make_case(list(s.cache_lens), list(s.new_lens), config=small_config(s.heads, s.L, s.R, s.Dn, s.Dv),
                     page_size=s.page_size, dtype=s.dtype, cache_dtype=s.cache_dtype, kv_scale=0.5 if s.cache_dtype else 1.0,
                     seed=seed)
    g = torch.Generator().manual_seed(case.seed + 7)
    opts = dict(s.options)
    if s.sink:
        opts["attn_sink"] = torch.randn(s.heads, generator=g)
    if s.sparse:
        b = case.batch
        seq = torch.repeat_interleave(torch.arange(b.batch_size), torch.tensor(b.new_tokens_list))
        lens = torch.tensor(b.seq_lens_list, dtype=torch.long)[seq]
        pos = (torch.rand(seq.shape[0], 5, generator=g) * lens[:, None]).long()
        idx = pos
        if s.sparse == "physical":
            table = b.block_table.long()[seq]
            idx = table.gather(1, pos // s.page_size) * s.page_size + pos % s.page_size
        idx = torch.where(torch.rand(idx.shape, generator=g) < 0.2, -1, idx).to(torch.int32)
        opts.update(sparse_indices=idx, topk_lengths=torch.full((b.batch_size,), 4, dtype=torch.int32),
                    physical_indices=s.sparse == "physical")
    if s.poison in ("nan-kv", "zero-latent"):
        t = 0  # the step's first new token (the first sequence with new tokens)
        if s.poison == "nan-kv":
            case.kv[t, 1] = float("nan")
        else:
            case.kv[t, : s.L] = 0
            case.extras["epsilon"] = 0.0
    elif s.poison == "nan-cached":
        b = case.batch
        row = b.physical_rows(torch.tensor([0]), torch.tensor([1]))
        entry = b.read_rows(case.layer_idx, row, torch.float32)
        entry[0, 2] = float("nan")
        b.write_rows(case.layer_idx, row, entry)
    elif s.poison is not None:
        raise ValueError(f"poison: unknown {s.poison!r}")
    return case, opts


# MLA without a rope part (R = 0: the key is the latent alone, q is its Dn nope dims; GLM-5-Next,
# some of Mistral Large 4's layers): dense, sparse, split-KV, sinks, masks, both forms, page sizes
# 1/16/64, several head counts, a fp8_e4m3 cache and DeepSeek's L = 512.
NO_ROPE_SCENARIOS = [
    Scenario("decode-p1-h1", (0, 1, 5, 17), (1, 1, 0, 1), page_size=1, heads=1),
    Scenario("decode-p16-h5-split-sink", (5, 0, 3, 40), (1, 2, 0, 1), heads=5, options=(("num_partitions", 3),), sink=True),
    Scenario("decode-p64-h16-swc", (70, 2, 0), (2, 1, 1), page_size=64, heads=16,
             options=(("mask", "sliding_window_causal"), ("window_size", 5))),
    Scenario("decode-p16-sparse-logical", (20, 7, 0), (2, 1, 1), sparse="logical", options=(("mask", "null"),)),
    Scenario("decode-p16-sparse-physical-sink", (20, 7, 1), (1, 1, 2), sparse="physical", sink=True),
    Scenario("prefill-p16-h3-chunked", (9, 0, 3, 1), (7, 1, 0, 8), options=(("mask", "chunked_causal"), ("chunk_size", 7),
                                                                            ("buffer_size", 8))),
    Scenario("prefill-p1-h2-swn-sink", (4, 0), (7, 8), page_size=1, heads=2,
             options=(("mask", "sliding_window_noncausal"), ("window_size", 9)), sink=True),
    Scenario("prefill-p64-sparse-logical", (30, 0), (7, 8), page_size=64, sparse="logical"),
    Scenario("fp8-e4m3-decode", (9, 0, 5), (1, 2, 1), L=128, cache_dtype="fp8_e4m3"),
    Scenario("fp8-e4m3-prefill", (9, 0, 5), (8, 7, 0), L=128, cache_dtype="fp8_e4m3"),
    Scenario("bf16-L512-decode", (33, 0, 2), (1, 3, 1), heads=4, L=512, Dn=64, Dv=64, dtype=torch.bfloat16),
    Scenario("bf16-L512-prefill", (3, 0), (7, 8), heads=2, L=512, Dn=64, Dv=64, dtype=torch.bfloat16),
]


# The edges of every cache format and of the NaN rule (issue 34): a NaN reaching the cache through
# the write (a NaN latent, or an all-zero one with epsilon = 0) must be stored as NaN in every
# format, and every query that sees a NaN entry gets a NaN output row and a NaN LSE (docs/api.md),
# split-KV, prefill chunks and sinks included; every other row stays exact.
EDGE_SCENARIOS = [
    Scenario("nan-kv-fp8-e4m3-decode", (9, 0, 5), (1, 2, 1), L=128, R=16, cache_dtype="fp8_e4m3", poison="nan-kv"),
    Scenario("nan-kv-fp8-ds-mla-decode", (9, 4), (1, 1), L=128, R=16, cache_dtype="fp8_ds_mla", poison="nan-kv"),
    Scenario("zero-latent-fp8-ds-mla-prefill", (3, 6), (7, 2), L=128, R=16, cache_dtype="fp8_ds_mla", poison="zero-latent"),
    Scenario("zero-latent-fp8-e4m3-split", (12, 3), (1, 1), L=128, R=16, cache_dtype="fp8_e4m3", poison="zero-latent",
             options=(("num_partitions", 3),)),
    Scenario("nan-kv-nvfp4-decode", (5, 2), (1, 1), heads=2, L=512, R=64, Dn=16, Dv=16, cache_dtype="nvfp4_ds_mla",
             poison="nan-kv"),
    Scenario("nan-cached-f32-decode-split-sink", (20, 5), (1, 1), R=16, poison="nan-cached", options=(("num_partitions", 3),),
             sink=True),
    Scenario("nan-cached-bf16-decode", (20, 5), (1, 1), R=16, dtype=torch.bfloat16, poison="nan-cached"),
    Scenario("nan-cached-f32-prefill-chunks", (6, 3), (9, 4), R=16, poison="nan-cached", options=(("buffer_size", 8),)),
    Scenario("nan-cached-bf16-prefill-sink", (6, 3), (9, 4), R=16, dtype=torch.bfloat16, poison="nan-cached", sink=True),
]
