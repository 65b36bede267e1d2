"""Scale-out over torch.distributed (gloo, CPU): tensor-parallel heads, context-parallel cache.

One world of 4 processes is spawned once for the whole module (start-up dominates on a 2-core
box); each worker runs every scenario of the grids it belongs to and writes its verdicts to a
JSON file, which the tests below read. Grids: two 2-rank grids side by side (tp=2 on ranks 0-1,
cp=2 on ranks 2-3), then tp=4, cp=4 and tp=2 x cp=2 over all four ranks. In each scenario every
rank's layer output must equal the single-process layer (all heads, one cache) within 1e-5
relative (fp32), and the ranks' caches together must hold exactly the single-process cache's
entries, position by position. Ends with the failure paths: a bad input on one rank, a full
pool on one rank, diverging schedulers, and a rank that stops answering (collective timeout).
"""

from __future__ import annotations

import contextlib
import datetime
import io
import json
import os
import socket
import time
import traceback

import pytest
import torch
import torch.distributed as dist

from openmla import CacheFullError, LatentAttention, MLAConfig, PagedLatentCache, YarnScaling
from openmla import distributed
from openmla.distributed import ContextParallelCache, TensorParallelAttention, TokenLayout, init_grid
from openmla_tools.testing import MASK_CASES, assert_close, assert_lse, rel_err

WORLD = 4
MAIN_TIMEOUT = datetime.timedelta(seconds=90)
HANG_TIMEOUT = 3.0  # seconds: the collective timeout of the grid whose rank stops answering
JOIN_SECONDS = 600  # the parent gives up on (and kills) the workers after this long
TOL = 1e-5
CACHE_TOL = 1e-6

# Steps of one scenario: (sequences to release first, [(seq_id, new tokens), ...]). Ragged
# prefills, a prefill with prefix context (b, then a), decodes, a 0-token entry, a 1-token prompt.
STEPS = [
    ((), [("a", 13), ("b", 1), ("c", 0), ("d", 6)]),
    ((), [("a", 1), ("b", 9), ("d", 1), ("e", 7)]),
    (("d",), [("a", 1), ("b", 1), ("e", 3), ("f", 1)]),
    (("c",), [("a", 5), ("b", 1), ("e", 1), ("f", 1)]),
]

# Grids, in the order every worker makes them: name -> (tp, cp, ranks).
GRIDS = {"tp2": (2, 1, [0, 1]), "cp2": (1, 2, [2, 3]), "tp4": (4, 1, None), "cp4": (1, 4, None), "tp2cp2": (2, 2, None)}


def _scenarios() -> dict[str, dict]:
    """name -> scenario keywords (``grid`` names the grid)."""
    out: dict[str, dict] = {}
    for grid in GRIDS:
        cp = GRIDS[grid][1]
        for i, (mask, kw) in enumerate(MASK_CASES):
            # Page size 4 (interleave 4 and 1 alternate) or 16; q_lora and sinks on some.
            out[f"{grid}-{mask}"] = dict(grid=grid, mask=mask, mask_kw=kw, page_size=4 if i % 3 else 16,
                                         interleave=1 if i % 2 else None, q_lora=i % 2 == 0, sink="head" if i == 1 else None)
        out[f"{grid}-sparse-logical"] = dict(grid=grid, mask="causal", mask_kw={}, page_size=4, interleave=None, q_lora=True,
                                             sparse="logical", sink="batch")
        out[f"{grid}-sparse-logical-window"] = dict(grid=grid, mask="sliding_window_causal", mask_kw={"window_size": 6}, page_size=4,
                                                    interleave=1, q_lora=False, sparse="logical", sink=None)
        if GRIDS[grid][0] == 1:  # plan.run called directly too (all kv rows, return_lse)
            out[f"{grid}-causal"]["direct"] = out[f"{grid}-sparse-logical"]["direct"] = True
        out[f"{grid}-sparse-physical"] = dict(grid=grid, mask="causal", mask_kw={}, page_size=4, interleave=None, q_lora=False,
                                              sparse="physical", sink="head", expect_error="physical_indices" if cp > 1 else None)
    out["cp2-longer-than-one-rank"] = dict(grid="cp2", kind="long")
    # Row lists built in many small query chunks, rebuilt for every layer (tiny budgets).
    out["cp2-small-chunks"] = dict(grid="cp2", mask="sliding_window_noncausal", mask_kw={"window_size": 9}, page_size=4,
                                   interleave=None, q_lora=True, budgets=(16, 64), direct=True)
    out["tp2cp2-sparse-small-chunks"] = dict(grid="tp2cp2", mask="chunked_causal", mask_kw={"chunk_size": 7}, page_size=4,
                                             interleave=1, q_lora=False, sparse="logical", sink="head", budgets=(8, 8))
    return out


SCENARIOS = _scenarios()
FAILURES = ["bad-input-on-one-rank", "cache-full-on-one-rank", "ranks-disagree", "rank-stops-answering", "demo-tp2-cp2"]


# Scenario pieces (run inside the workers) ---------------------------------------------------------
def _config(q_lora: bool) -> MLAConfig:
    return MLAConfig(num_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                     q_lora_rank=24 if q_lora else None, hidden_size=48,
                     rope_scaling=YarnScaling(factor=40.0, mscale=1.0, mscale_all_dim=0.8))


def _weights(cfg: MLAConfig, seed: int) -> dict[str, torch.Tensor]:
    """Random float32 tensors of one whole layer under the HF names (full keys, other layers'
    keys too, so that a shard must pick its own)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in (0, 1):
        for name, shape in LatentAttention(cfg, 0, dtype=torch.float32).hf_param_shapes().items():
            t = 1.0 + 0.1 * torch.randn(shape, generator=g) if "layernorm" in name else torch.randn(shape, generator=g) * shape[1] ** -0.5
            out[f"model.layers.{layer}.self_attn.{name}"] = t
    return out


def _layers(grid, cfg: MLAConfig, seed: int) -> tuple[LatentAttention, TensorParallelAttention]:
    weights = _weights(cfg, seed)
    ref = LatentAttention(cfg, 1, dtype=torch.float32)
    ref.load_hf_state_dict(weights)
    shard = TensorParallelAttention(cfg, 1, grid=grid, dtype=torch.float32)
    shard.load_hf_state_dict(weights)
    return ref, shard


def _caches(grid, cfg: MLAConfig, page_size: int, interleave: int | None, pages: int = 48):
    D, R = cfg.cache_head_dim, cfg.qk_rope_head_dim
    ref = PagedLatentCache(2, pages, page_size, D, torch.float32, rope_dim=R)
    mine = ContextParallelCache(grid, 2, pages, page_size, D, torch.float32, rope_dim=R, interleave=interleave)
    return ref, mine


def _sparse(batch, g: torch.Generator, physical: bool) -> dict:
    """Logical top-k lists [T, 6] (-1 pads, repeats allowed) and topk_lengths; physical ones are
    the same positions through the single-process page table."""
    seq, pos = batch.token_positions()
    lens = torch.tensor(batch.seq_lens_list)[seq]
    idx = (torch.rand(seq.shape[0], 6, generator=g) * lens[:, None]).long()
    idx[torch.rand(idx.shape, generator=g) < 0.2] = -1
    topk = torch.randint(3, 7, (batch.batch_size,), generator=g)
    if physical:
        rows = batch.physical_rows(seq[:, None].expand_as(idx), idx.clamp_min(0))
        idx = torch.where(idx >= 0, rows, -1)
    return {"sparse_indices": idx.int(), "topk_lengths": topk.int(), "physical_indices": physical}


def _check_caches(ref: PagedLatentCache, mine: ContextParallelCache, exact: bool = False) -> None:
    """Every token of every sequence sits on its owner rank (and nowhere else), its entry equal to
    the single-process one (bit for bit when ``exact``)."""
    ps, D = ref.page_size, ref.blocks.shape[-1]
    lay: TokenLayout = mine.layout
    assert sorted(map(str, mine.sequences)) == sorted(map(str, ref.sequences))
    for s in mine.sequences:
        n = mine.length(s)
        assert ref.length(s) == n
        nl = mine.local_length(s)
        assert nl == lay.count(n), f"{s}: {nl} local tokens, the layout gives {lay.count(n)}"
        j = torch.arange(nl)
        gpos = lay.global_position(j)
        assert bool((lay.owner(gpos) == lay.rank).all())
        mine_pages, ref_pages = torch.tensor(mine.local.pages(s), dtype=torch.long), torch.tensor(ref.pages(s), dtype=torch.long)
        rows = mine_pages[j // ps] * ps + j % ps
        ref_rows = ref_pages[gpos // ps] * ps + gpos % ps
        for layer in range(ref.num_layers):
            got = mine.blocks[layer].reshape(-1, D)[rows]
            want = ref.blocks[layer].reshape(-1, D)[ref_rows]
            if exact:
                assert torch.equal(got, want), f"{s} layer {layer}: cache entries differ (rel err {rel_err(got, want):.3g})"
            else:  # equal up to the rounding of kv_a_proj_with_mqa, which a CP rank runs on its own rows only
                assert rel_err(got, want) <= CACHE_TOL, f"{s} layer {layer}: cache entries differ (rel err {rel_err(got, want):.3g})"


def _run_scenario(grid, s: dict, seed: int) -> None:
    from openmla.distributed import cp_plan

    if s.get("kind") == "long":
        return _run_long(grid, seed)
    saved = cp_plan.ENTRY_BUDGET, cp_plan.KEEP_BUDGET
    cp_plan.ENTRY_BUDGET, cp_plan.KEEP_BUDGET = s.get("budgets", saved)
    try:
        _run_steps(grid, s, seed)
    finally:
        cp_plan.ENTRY_BUDGET, cp_plan.KEEP_BUDGET = saved


def _run_steps(grid, s: dict, seed: int) -> None:
    cfg = _config(s["q_lora"])
    ref_layer, layer = _layers(grid, cfg, seed)
    ref_cache, cache = _caches(grid, cfg, s["page_size"], s["interleave"])
    g = torch.Generator().manual_seed(seed)
    for i, (release, entries) in enumerate(STEPS):
        for sid in release:
            ref_cache.release(sid)
            cache.release(sid)
        ids, counts = [e[0] for e in entries], [e[1] for e in entries]
        rb, cb = ref_cache.prepare(ids, counts), cache.prepare(ids, counts)
        hidden = torch.randn(sum(counts), cfg.hidden_size, generator=g)
        opts = {"mask": s["mask"], **s["mask_kw"]}
        if s.get("sparse"):
            opts.update(_sparse(rb, g, s["sparse"] == "physical"))
        if s.get("sink") == "head":
            opts["attn_sink"] = torch.randn(cfg.num_heads, generator=g)
        elif s.get("sink") == "batch":
            opts["attn_sink"] = torch.randn(len(ids), cfg.num_heads, generator=g)
        with torch.inference_mode():
            ref_plan = ref_layer.plan(rb, **opts)
            want = ref_layer(hidden, ref_plan)
            if s.get("expect_error"):
                try:
                    distributed.plan(cb, scale=cfg.softmax_scale, **opts)
                except ValueError as exc:
                    assert s["expect_error"] in str(exc), str(exc)
                    return
                raise AssertionError(f"no error naming {s['expect_error']}")
            # Layers 0 and 1 of one plan: the same lists serve every layer.
            step = distributed.plan(cb, scale=cfg.softmax_scale, **opts)
            got = layer(hidden, step)
        err = rel_err(got, want)
        assert err <= TOL, f"step {i}: rel err {err:.3g} > {TOL}"
        if s.get("direct"):
            _check_direct(ref_layer, ref_plan, step, hidden)
        ref_cache.commit(rb)
        cache.commit(cb)
    # The direct runs rewrote every entry from the same kv rows as the single process: bit-exact.
    _check_caches(ref_cache, cache, exact=bool(s.get("direct")))


def _check_direct(ref_layer: LatentAttention, ref_plan, step, hidden: torch.Tensor) -> None:
    """``ContextParallelPlan.run`` with every kv row and ``return_lse`` against ``MLAPlan.run`` (tp=1:
    the same heads). Both rewrite the step's entries with the same values."""
    with torch.inference_mode():
        q, kv = ref_layer.project_q(hidden), ref_layer.kv_a_proj_with_mqa(hidden)
        args = (q, kv, ref_layer.layer_idx, ref_layer.weights, ref_layer.freqs_cis)
        want, want_lse = ref_plan.run(*args, return_lse=True)
        got, got_lse = step.run(*args, return_lse=True)
    assert_close(got, want, TOL, "direct run", 0)
    assert_lse(got_lse, want_lse, TOL, 0)


def _run_long(grid, seed: int) -> None:
    """cp=2, 3 pages of 4 tokens per rank: a 22-token sequence (more than one rank holds) completes."""
    cfg = _config(True)
    ref_layer, layer = _layers(grid, cfg, seed)
    ref_cache, cache = _caches(grid, cfg, 4, None, pages=3)
    ref_cache = PagedLatentCache(2, 16, 4, cfg.cache_head_dim, torch.float32, rope_dim=cfg.qk_rope_head_dim)
    try:
        PagedLatentCache(2, 3, 4, cfg.cache_head_dim, torch.float32).prepare(["x"], [13])
        raise AssertionError("one rank's pool should not hold 13 tokens")
    except CacheFullError:
        pass
    g = torch.Generator().manual_seed(seed)
    for n in [14] + [1] * 8:
        rb, cb = ref_cache.prepare(["x"], [n]), cache.prepare(["x"], [n])
        hidden = torch.randn(n, cfg.hidden_size, generator=g)
        with torch.inference_mode():
            want = ref_layer(hidden, rb)
            got = layer(hidden, cb)
        err = rel_err(got, want)
        assert err <= TOL, f"length {cache.length('x') + n}: rel err {err:.3g}"
        ref_cache.commit(rb)
        cache.commit(cb)
    assert cache.length("x") == 22 and cache.local_length("x") <= 12
    _check_caches(ref_cache, cache)


# Failure paths (run inside the workers, on the 2 x 2 grid) ---------------------------------------------
def _expect(exc_type, fn, *words):
    t0 = time.perf_counter()
    try:
        fn()
    except exc_type as exc:
        for w in words:
            assert w in str(exc), f"{w!r} not in {exc}"
        return time.perf_counter() - t0
    raise AssertionError(f"no {exc_type.__name__}")


def _bad_input(grid) -> None:
    cfg = _config(False)
    _, cache = _caches(grid, cfg, 4, None)
    batch = cache.prepare(["a"], [9])
    window = 0 if grid.rank == 1 else 5  # rank 1's scheduler passes a bad window
    words = ("window_size",) if grid.rank == 1 else ("rank 1", "window_size")
    dt = _expect(ValueError, lambda: distributed.plan(batch, scale=cfg.softmax_scale, mask="sliding_window_causal", window_size=window), *words)
    assert dt < 10, f"took {dt:.1f} s"


def _cache_full(grid) -> None:
    cfg = _config(False)
    _, cache = _caches(grid, cfg, 4, None, pages=2)
    # 20 tokens over cp=2 in runs of 4: cp rank 0 holds 12 (3 pages), cp rank 1 holds 8 (2 pages).
    words = ("needs 3 free pages",) if grid.cp_rank == 0 else ("rank 0", "needs 3 free pages")
    _expect(CacheFullError, lambda: cache.prepare(["a"], [20]), *words)
    assert cache.num_free_pages == 2 and cache.sequences == []  # nothing reserved on any rank
    cache.prepare(["a"], [16])
    assert cache.num_free_pages == 0


def _disagree(grid) -> None:
    cfg = _config(False)
    _, cache = _caches(grid, cfg, 4, None)
    n = 5 if grid.rank == 2 else 6
    _expect(ValueError, lambda: cache.prepare(["a"], [n]), "ranks [2]", "differ")


def _stops_answering(grid) -> None:
    """Rank 3 never joins the layer's collectives (it sleeps, then exits): the others raise within
    a few collective timeouts, never hang."""
    cfg = _config(False)
    _, layer = _layers(grid, cfg, 0)
    _, cache = _caches(grid, cfg, 4, None)
    batch = cache.prepare(["a"], [9])
    step = distributed.plan(batch, scale=cfg.softmax_scale)
    hidden = torch.randn(9, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    if grid.rank == 3:
        time.sleep(3 * HANG_TIMEOUT)
        raise SystemExit  # the worker records the verdict and exits without another collective
    t0 = time.perf_counter()
    try:
        with torch.inference_mode():
            layer(hidden, step)
    except RuntimeError:
        dt = time.perf_counter() - t0
        assert dt < 3 * HANG_TIMEOUT + 2, f"raised after {dt:.1f} s"
        return
    raise AssertionError("the layer ran without rank 3")


def _demo(grid) -> str:
    from openmla_tools.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["demo", "--tp", "2", "--cp", "2", "--heads", "4", "--requests", "4", "--max-running", "3", "--prompt-min", "5",
                   "--prompt-max", "30", "--gen-min", "2", "--gen-max", "4", "--page-size", "4", "--dtype", "fp32"])
    out = " ".join(buf.getvalue().split())
    assert rc == 0, out
    if grid.rank == 0:
        for words in ("requests served", "0 in use at the end", "pass", "per rank — tp=2 x cp=2", "bytes sent", "cache bytes"):
            assert words in out, f"{words!r} not in {out}"
    else:
        assert out == "", "only rank 0 prints"
    return out


# The worker ---------------------------------------------------------------------------------------
def _worker(rank: int, store: str, out_dir: str, only: list[str] | None) -> None:
    torch.set_num_threads(1)
    results: dict[str, dict] = {}

    def record(name: str, fn) -> bool:
        t0 = time.perf_counter()
        try:
            fn()
            results[name] = {"ok": True, "seconds": time.perf_counter() - t0}
        except SystemExit:
            results[name] = {"ok": True, "seconds": time.perf_counter() - t0, "left": True}
            return False
        except BaseException:  # noqa: BLE001 - every failure is a verdict
            results[name] = {"ok": False, "error": traceback.format_exc()[-3000:]}
        return True

    def save() -> None:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)

    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD, timeout=MAIN_TIMEOUT)
        grids = {name: init_grid(tp, cp, ranks=ranks, timeout=MAIN_TIMEOUT) for name, (tp, cp, ranks) in GRIDS.items()}
        for seed, (name, s) in enumerate(SCENARIOS.items()):
            grid = grids[s["grid"]]
            if grid is None or (only and name not in only):
                continue
            record(name, lambda: _run_scenario(grid, s, seed))
            if not results[name]["ok"]:  # collectives may be out of step now: stop here
                break
        if not only or any(f in only for f in FAILURES):
            grid = grids["tp2cp2"]
            for name, fn in (("bad-input-on-one-rank", _bad_input), ("cache-full-on-one-rank", _cache_full),
                             ("ranks-disagree", _disagree), ("demo-tp2-cp2", _demo)):
                record(name, lambda: fn(grid))
            hang = init_grid(2, 2, timeout=datetime.timedelta(seconds=HANG_TIMEOUT))
            record("rank-stops-answering", lambda: _stops_answering(hang))
    except BaseException:  # noqa: BLE001
        results["worker"] = {"ok": False, "error": traceback.format_exc()[-3000:]}
    finally:
        save()
        os._exit(0)  # no collective teardown: a peer may be gone (and atexit is slow under load)


# The tests (in the parent) --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def verdicts(tmp_path_factory) -> dict[str, list[dict]]:
    """Spawn the world once; ``{scenario: [each participating rank's verdict]}``."""
    import torch.multiprocessing as mp

    tmp = tmp_path_factory.mktemp("dist")
    only = os.environ.get("OPENMLA_DIST_ONLY")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, str(tmp / "store"), str(tmp), only.split(",") if only else None))
             for r in range(WORLD)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + JOIN_SECONDS
    for p in procs:
        p.join(max(1.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
    by_name: dict[str, list[dict]] = {}
    for r in range(WORLD):
        path = tmp / f"rank{r}.json"
        results = json.loads(path.read_text()) if path.exists() else {"worker": {"ok": False, "error": "no verdicts (killed?)"}}
        for name, v in results.items():
            by_name.setdefault(name, []).append({"rank": r, **v})
    return by_name


def _assert_ran(verdicts: dict, name: str, ranks: int) -> None:
    broken = verdicts.get("worker")
    assert not broken, "\n".join(f"rank {v['rank']}: {v.get('error')}" for v in broken)
    if os.environ.get("OPENMLA_DIST_ONLY") and name not in os.environ["OPENMLA_DIST_ONLY"].split(","):
        pytest.skip("not selected by OPENMLA_DIST_ONLY")
    got = verdicts.get(name, [])
    failed = [v for v in got if not v["ok"]]
    assert not failed, "\n".join(f"rank {v['rank']}: {v['error']}" for v in failed)
    assert len(got) == ranks, f"{len(got)} of {ranks} ranks reported (an earlier scenario failed?)"


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_matches_single_process(verdicts, name):
    tp, cp, ranks = GRIDS[SCENARIOS[name]["grid"]]
    _assert_ran(verdicts, name, tp * cp)


@pytest.mark.parametrize("name", FAILURES)
def test_failures_are_bounded_and_clear(verdicts, name):
    _assert_ran(verdicts, name, WORLD)


# Single-process pieces --------------------------------------------------------------------------------
@pytest.mark.parametrize("cp,interleave", [(1, 1), (2, 1), (2, 4), (3, 8), (4, 16)])
def test_layout_count_matches_enumeration(cp, interleave):
    for rank in range(cp):
        lay = TokenLayout(cp, rank, interleave)
        owned = [p for p in range(200) if (p // interleave) % cp == rank]
        for x in range(200):
            assert lay.count(x) == sum(p < x for p in owned)
        assert [lay.global_position(j) for j in range(len(owned))] == owned
        xs = torch.arange(200)
        assert torch.equal(lay.count(xs), torch.tensor([lay.count(x) for x in range(200)]))


@pytest.mark.parametrize("mask,kw", MASK_CASES)
def test_key_range_on_tensors_equals_ints(mask, kw):
    from openmla import MaskVariant

    v = MaskVariant.parse(mask, **kw)
    pos = torch.arange(40)
    lens = torch.full((40,), 37)
    lo, hi = v.key_range(pos, pos, lens)
    lo = torch.as_tensor(lo).expand_as(pos)
    for p in range(40):
        want = v.key_range(p, p, 37)
        assert (int(lo[p]), int(hi[p])) == want
        keys = torch.arange(37)
        vis = keys[v.visible(torch.tensor(p), keys)]
        if vis.numel():  # one query: the range is exactly its visible interval
            assert (int(vis.min()), int(vis.max()) + 1) == want


def test_tp_shards_load_their_rows_from_a_checkpoint(tmp_path):
    """from_pretrained reads only its rows (safetensors slices; block-fp8 by whole blocks); the
    shards' tensors are the whole layer's, split by head; tp must divide H."""
    from safetensors.torch import save_file

    from openmla.layer import dequant_block_fp8

    cfg = _config(True)
    weights = _weights(cfg, 3)
    block = (12, 8)
    name = "model.layers.1.self_attn.kv_b_proj.weight"  # fp8 in 12-row blocks: heads (32 rows) cut through them
    w = weights[name]
    padded = torch.cat([w, w.new_zeros(-w.shape[0] % 12, w.shape[1])])
    scale = padded.abs().reshape(padded.shape[0] // 12, 12, w.shape[1] // 8, 8).amax((1, 3)) / 448
    weights[name] = (w / scale.repeat_interleave(12, 0)[: w.shape[0]].repeat_interleave(8, 1)).to(torch.float8_e4m3fn)
    weights[name + "_scale_inv"] = scale
    save_file(weights, str(tmp_path / "model.safetensors"))
    hf = {"num_attention_heads": 4, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16,
          "q_lora_rank": 24, "hidden_size": 48, "quantization_config": {"weight_block_size": list(block)}}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    whole = LatentAttention.from_pretrained(tmp_path, 1, dtype=torch.float32)
    full_kv_b = dequant_block_fp8(weights[name], weights[name + "_scale_inv"], block)
    torch.testing.assert_close(whole.kv_b_proj.weight.detach(), full_kv_b, rtol=0, atol=0)
    for tp in (2, 4):
        per = 4 // tp
        for r in range(tp):
            shard = TensorParallelAttention.from_pretrained(tmp_path, 1, tp_rank=r, tp_size=tp, dtype=torch.float32)
            assert shard.config.num_heads == per and shard.config.softmax_scale == whole.config.softmax_scale
            h = slice(r * per, (r + 1) * per)
            for mod, width, dim in (("q_b_proj", 32, 0), ("kv_b_proj", 32, 0), ("o_proj", 16, 1)):
                want = getattr(whole, mod).weight.detach().narrow(dim, h.start * width, per * width)
                torch.testing.assert_close(getattr(shard, mod).weight.detach(), want, rtol=0, atol=0)
            for mod in ("q_a_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "q_a_layernorm"):
                torch.testing.assert_close(getattr(shard, mod).weight, getattr(whole, mod).weight, rtol=0, atol=0)
            torch.testing.assert_close(shard.w_uv, whole.w_uv[h], rtol=0, atol=0)
    with pytest.raises(ValueError, match="tp_size"):
        TensorParallelAttention.from_pretrained(tmp_path, 1, tp_rank=0, tp_size=3)
    with pytest.raises(ValueError, match="tp_rank"):
        TensorParallelAttention(cfg, 0, tp_rank=2, tp_size=2)


def test_tp_shard_without_a_grid_refuses_to_run():
    cfg = _config(False)
    shard = TensorParallelAttention(cfg, 0, tp_rank=0, tp_size=2, dtype=torch.float32)
    cache = PagedLatentCache(1, 4, 4, cfg.cache_head_dim, torch.float32, rope_dim=16)
    with pytest.raises(ValueError, match="grid"):
        shard(torch.randn(3, 48), cache.prepare(["a"], [3]))


def test_python_dash_m_openmla_tools_is_the_cli(monkeypatch, capsys):
    """``python -m openmla_tools`` (and so ``torchrun -m openmla_tools``) runs the ``openmla`` command."""
    import runpy
    import sys

    monkeypatch.setattr(sys, "argv", ["openmla", "demo", "--help"])
    with pytest.raises(SystemExit) as exc:
        runpy.run_module("openmla_tools", run_name="__main__")
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--tp" in out and "--cp" in out and "--timeout" in out


def test_a_gloo_group_init_grid_started_ends_before_finalizing(tmp_path):
    """``init_grid`` destroys the gloo group it started at exit (before Python finalizes, where a
    gloo worker dropping a finished collective's tensors aborts the process): an exit handler
    registered before it runs after it and finds no group; a group started by the caller is left."""
    import subprocess
    import sys
    import textwrap

    script = tmp_path / "exit.py"
    script.write_text(textwrap.dedent("""
        import atexit, sys
        import torch, torch.distributed as dist
        from openmla.distributed import init_grid
        atexit.register(lambda: print("at exit, initialized:", dist.is_initialized(), flush=True))
        if sys.argv[1] == "mine":
            dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=0, world_size=1)
        grid = init_grid(1, 1, backend="gloo")
        dist.all_reduce(torch.ones(3))
    """))
    for who in ("grid", "mine"):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = dict(os.environ, RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        run = subprocess.run([sys.executable, str(script), who, str(port)], env=env, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr[-2000:]
        assert f"at exit, initialized: {who == 'mine'}" in run.stdout, run.stdout + run.stderr[-2000:]
