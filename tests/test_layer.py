"""LatentAttention: parameters under DeepSeek's names, weight loading (state dicts, safetensors
folders, block FP8), the kv_b split, and forward against a naive float64 MLA written here."""

from __future__ import annotations

import dataclasses

import functools
import json

import pytest
import torch

from cases import make_case, rel_err
from openmla import MLAConfig, PagedLatentCache, YarnScaling, mla_prefill_decode_graph
from openmla.layer import LatentAttention, dequant_block_fp8, shared_freqs_cis

HF_NAMES_QLORA = ["q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight",
                  "kv_a_layernorm.weight", "kv_b_proj.weight", "o_proj.weight"]
HF_NAMES_PLAIN = ["q_proj.weight", "kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight", "kv_b_proj.weight", "o_proj.weight"]


# The torch backend is built by others; skip it (visibly) only while it says so ----------------
@functools.lru_cache(maxsize=None)
def torch_backend_missing() -> str | None:
    """The torch backend's 'not built yet' message, or None once both op forms run."""
    for new_lens in ([8, 3], [1, 2]):  # prefill form, then decode form
        case = make_case([5, 0], new_lens, seed=3)
        try:
            mla_prefill_decode_graph(*case.fused_args(), scale=case.scale, backend="torch")
        except ValueError as exc:
            if "not built yet" in str(exc):
                return str(exc)
            raise
    return None


@pytest.fixture(params=["reference", "torch", "cpu"])
def backend(request) -> str:
    """Every layer test runs on the float64 oracle and on both CPU backends (torch and native cpu)."""
    if request.param == "cpu":
        from openmla.backends.cpu import available

        if not available():
            pytest.skip("the native cpu backend did not build here")
    if request.param == "torch":
        missing = torch_backend_missing()
        if missing:
            pytest.skip(f"torch backend not built yet: {missing}")
    return request.param


# Helpers ------------------------------------------------------------------------------------------
def tiny_config(q_lora: bool = True, yarn: bool = True, interleave: bool = True) -> MLAConfig:
    scaling = YarnScaling(factor=40.0, mscale=1.0, mscale_all_dim=0.8) if yarn else None
    return MLAConfig(num_heads=3, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                     q_lora_rank=24 if q_lora else None, hidden_size=48, rope_scaling=scaling, rope_interleave=interleave)


def random_hf_weights(config: MLAConfig, seed: int = 0, prefix: str = "") -> dict[str, torch.Tensor]:
    """Random float32 tensors under the HF names of one attention layer (norm weights near 1)."""
    g = torch.Generator().manual_seed(seed)
    shapes = LatentAttention(config, 0, dtype=torch.float32).hf_param_shapes()
    out = {}
    for name, shape in shapes.items():
        if "layernorm" in name:
            t = 1.0 + 0.1 * torch.randn(shape, generator=g)
        else:
            t = torch.randn(shape, generator=g) * shape[1] ** -0.5
        out[prefix + name] = t
    return out


def rope_pairs(x: torch.Tensor, config: MLAConfig, positions: torch.Tensor) -> torch.Tensor:
    """DeepSeek's complex-number rope on interleaved pairs, float64, written independently."""
    from openmla.rope import rope_inv_freq, rope_magnitude

    angles = positions.double()[:, None] * rope_inv_freq(config)[None]  # [T, R/2]
    rot = torch.polar(torch.full_like(angles, rope_magnitude(config)), angles)
    rot = rot.reshape(x.shape[0], *([1] * (x.dim() - 2)), -1)
    xc = torch.view_as_complex(x.double().reshape(*x.shape[:-1], -1, 2).contiguous())
    return torch.view_as_real(xc * rot).flatten(-2)


def naive_mla(weights: dict[str, torch.Tensor], config: MLAConfig, x: torch.Tensor, past: torch.Tensor | None):
    """One sequence, float64, multi-head form straight from the HF weights.

    ``x [S, hidden]`` new tokens; ``past`` the previous (latent, k_rope) rows ``[P, L+R]`` or None.
    Returns ``(out [S, hidden], cache [P+S, L+R])``.
    """
    c = config
    w = {k: v.double() for k, v in weights.items()}
    H, L, R, Dn, Dv = c.num_heads, c.kv_lora_rank, c.qk_rope_head_dim, c.qk_nope_head_dim, c.v_head_dim
    xd = x.double()
    rms = lambda t, g: t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps) * g  # noqa: E731
    if c.q_lora_rank is None:
        q = xd @ w["q_proj.weight"].T
    else:
        q = rms(xd @ w["q_a_proj.weight"].T, w["q_a_layernorm.weight"]) @ w["q_b_proj.weight"].T
    P = 0 if past is None else past.shape[0]
    S = x.shape[0]
    pos = torch.arange(P, P + S)
    q = q.view(S, H, Dn + R)
    q = torch.cat([q[..., :Dn], rope_pairs(q[..., Dn:], c, pos)], -1)
    kv = xd @ w["kv_a_proj_with_mqa.weight"].T
    new = torch.cat([rms(kv[:, :L], w["kv_a_layernorm.weight"]), rope_pairs(kv[:, L:], c, pos)], -1)
    cache = new if past is None else torch.cat([past, new])
    kvb = (cache[:, :L] @ w["kv_b_proj.weight"].T).view(-1, H, Dn + Dv)
    k = torch.cat([kvb[..., :Dn], cache[:, None, L:].expand(-1, H, R)], -1)  # [P+S, H, Dn+R]
    scores = torch.einsum("shd,khd->hsk", q, k) * c.softmax_scale
    visible = torch.arange(P + S)[None, :] <= pos[:, None]
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    out = torch.einsum("hsk,khv->shv", probs, kvb[..., Dn:]).reshape(S, H * Dv)
    return out @ w["o_proj.weight"].T, cache


# Construction and names ---------------------------------------------------------------------------
@pytest.mark.parametrize("q_lora", [True, False])
def test_parameter_names_match_hf_checkpoints(q_lora):
    layer = LatentAttention(tiny_config(q_lora=q_lora), 0, dtype=torch.float32)
    want = HF_NAMES_QLORA if q_lora else HF_NAMES_PLAIN
    assert sorted(layer.state_dict()) == sorted(want)  # buffers w_k/w_uk/w_uv are not saved
    c = layer.config
    assert layer.w_k.shape == (c.num_heads * c.qk_nope_head_dim, c.kv_lora_rank)
    assert layer.w_uk.shape == (c.num_heads, c.kv_lora_rank, c.qk_nope_head_dim)
    assert layer.w_uv.shape == (c.num_heads, c.v_head_dim, c.kv_lora_rank)
    assert layer.w_k.dtype == torch.float32


def test_default_dtype_follows_torch_and_bad_layer_idx_rejected():
    layer = LatentAttention(tiny_config(), 2)
    assert all(p.dtype == torch.get_default_dtype() for p in layer.parameters())
    assert layer.w_uk.dtype == torch.get_default_dtype()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert LatentAttention(tiny_config(), 0).w_uv.dtype == torch.float64
    finally:
        torch.set_default_dtype(previous)
    with pytest.raises(ValueError, match="layer_idx"):
        LatentAttention(tiny_config(), -1)
    with pytest.raises(ValueError, match="max_position"):
        LatentAttention(tiny_config(), 0, max_position=0)


def test_split_matches_kv_b_proj_layout():
    cfg = tiny_config()
    layer = LatentAttention(cfg, 0, dtype=torch.float32)
    layer.load_hf_state_dict(random_hf_weights(cfg))
    H, Dn, Dv = cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    w = layer.kv_b_proj.weight
    for h in range(H):
        rows = w[h * (Dn + Dv): (h + 1) * (Dn + Dv)]
        torch.testing.assert_close(layer.w_k[h * Dn: (h + 1) * Dn], rows[:Dn], rtol=0, atol=0)
        torch.testing.assert_close(layer.w_uk[h], rows[:Dn].T, rtol=0, atol=0)
        torch.testing.assert_close(layer.w_uv[h], rows[Dn:], rtol=0, atol=0)


def test_split_under_inference_mode_gives_versioned_tensors():
    """Loaded inside torch.inference_mode, the split weights are still normal tensors (a backend
    caches forms of them keyed by version counter) and equal the eager split."""
    cfg = tiny_config()
    weights = random_hf_weights(cfg)
    eager = LatentAttention(cfg, 0, dtype=torch.float32)
    eager.load_hf_state_dict(weights)
    with torch.inference_mode():
        layer = LatentAttention(cfg, 0, dtype=torch.float32)
        layer.load_hf_state_dict(weights)
    for name in ("w_k", "w_uk", "w_uv"):
        assert not getattr(layer, name).is_inference(), name
        torch.testing.assert_close(getattr(layer, name), getattr(eager, name), rtol=0, atol=0)
    assert layer.w_uv.data_ptr() != layer.kv_b_proj.weight.data_ptr()


# load_hf_state_dict -------------------------------------------------------------------------------
@pytest.mark.parametrize("prefix", ["", "self_attn.", "model.layers.1.self_attn.", "language_model.model.layers.1.self_attn."])
def test_load_with_and_without_prefix(prefix):
    cfg = tiny_config()
    sd = random_hf_weights(cfg, seed=1, prefix=prefix)
    if prefix.startswith(("model", "language")):  # a whole-model dict: other layers and modules are skipped
        sd.update(random_hf_weights(cfg, seed=2, prefix=prefix.replace("layers.1", "layers.0")))
        sd.update(random_hf_weights(cfg, seed=2, prefix=prefix.replace("layers.1", "layers.11")))
        sd[prefix.replace("self_attn.", "mlp.gate_proj.weight")] = torch.zeros(3, 3)
        sd["model.embed_tokens.weight"] = torch.zeros(10, 48)
        sd[prefix + "rotary_emb.inv_freq"] = torch.zeros(8)
    sd[prefix + "indexer.wq_b.weight"] = torch.zeros(4, 24)  # DeepSeek-V3.2's indexer is not this module's
    layer = LatentAttention(cfg, 1, dtype=torch.float32)
    loaded = layer.load_hf_state_dict(sd)
    assert sorted(loaded) == sorted(HF_NAMES_QLORA)
    for name, p in layer.named_parameters():
        torch.testing.assert_close(p, sd[prefix + name], rtol=0, atol=0)


def test_load_casts_to_layer_dtype():
    cfg = tiny_config()
    sd = random_hf_weights(cfg)
    layer = LatentAttention(cfg, 0, dtype=torch.bfloat16)
    layer.load_hf_state_dict(sd)
    torch.testing.assert_close(layer.q_b_proj.weight, sd["q_b_proj.weight"].bfloat16(), rtol=0, atol=0)
    torch.testing.assert_close(layer.w_uv[0], sd["kv_b_proj.weight"][16:32].bfloat16(), rtol=0, atol=0)


def test_missing_unexpected_and_misshaped_tensors_raise_and_change_nothing():
    cfg = tiny_config()
    layer = LatentAttention(cfg, 0, dtype=torch.float32)
    layer.load_hf_state_dict(random_hf_weights(cfg, seed=1))
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    w_k_before = layer.w_k.clone()
    good = random_hf_weights(cfg, seed=2)

    missing = {k: v for k, v in good.items() if k != "kv_b_proj.weight"}
    with pytest.raises(ValueError, match=r"missing \['kv_b_proj.weight'\]"):
        layer.load_hf_state_dict(missing)
    with pytest.raises(ValueError, match=r"unexpected \['q_proj.weight'\]"):
        layer.load_hf_state_dict({**good, "q_proj.weight": torch.zeros(3, 3)})
    bad = dict(good, **{"kv_b_proj.weight": torch.zeros(7, 32)})
    with pytest.raises(ValueError, match=r"kv_b_proj.weight has shape \(7, 32\), expected \(96, 32\)"):
        layer.load_hf_state_dict(bad)
    with pytest.raises(ValueError, match="missing"):  # a whole-model dict without this layer
        LatentAttention(cfg, 5, dtype=torch.float32).load_hf_state_dict(random_hf_weights(cfg, prefix="model.layers.4.self_attn."))
    for k, v in layer.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    torch.testing.assert_close(layer.w_k, w_k_before, rtol=0, atol=0)

    # strict=False: loads what is there, still refuses a wrong shape
    loaded = layer.load_hf_state_dict({**missing, "extra.weight": torch.zeros(1)}, strict=False)
    assert "kv_b_proj.weight" not in loaded and "o_proj.weight" in loaded
    with pytest.raises(ValueError, match="shape"):
        layer.load_hf_state_dict(bad, strict=False)


def test_reload_resplits_kv_b():
    cfg = tiny_config()
    layer = LatentAttention(cfg, 0, dtype=torch.float32)
    layer.load_hf_state_dict(random_hf_weights(cfg, seed=1))
    first = layer.w_uk.clone()
    sd2 = random_hf_weights(cfg, seed=2)
    layer.load_hf_state_dict(sd2)
    assert not torch.equal(layer.w_uk, first)
    torch.testing.assert_close(layer.w_uk[0], sd2["kv_b_proj.weight"][:16].T, rtol=0, atol=0)
    # torch's own load_state_dict re-splits too, and so does split_kv_b after an in-place edit
    sd3 = random_hf_weights(cfg, seed=3)
    layer.load_state_dict(sd3)
    torch.testing.assert_close(layer.w_k, sd3["kv_b_proj.weight"].view(3, 32, 32)[:, :16].reshape(48, 32), rtol=0, atol=0)
    with torch.no_grad():
        layer.kv_b_proj.weight.mul_(2.0)
    layer.split_kv_b()
    torch.testing.assert_close(layer.w_uv[2], 2.0 * sd3["kv_b_proj.weight"][80:96], rtol=0, atol=0)
    # the layer pickles (torch.save of the module) and keeps its split
    import io
    buf = io.BytesIO()
    torch.save(layer, buf)
    buf.seek(0)
    again = torch.load(buf, weights_only=False)
    torch.testing.assert_close(again.w_uv, layer.w_uv, rtol=0, atol=0)


def _quantize_block_fp8(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-style block FP8: per ``block`` tile a float32 scale_inv with max|w|/448."""
    b0, b1 = block
    rows, cols = -(-w.shape[0] // b0), -(-w.shape[1] // b1)
    scale = torch.empty(rows, cols)
    for i in range(rows):
        for j in range(cols):
            scale[i, j] = w[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1].abs().max() / 448.0
    full = scale.repeat_interleave(b0, 0)[: w.shape[0]].repeat_interleave(b1, 1)[:, : w.shape[1]]
    return (w / full).to(torch.float8_e4m3fn), scale


def test_block_fp8_weights_are_dequantized():
    cfg = tiny_config()
    sd = random_hf_weights(cfg, seed=4)
    block = (16, 16)
    fp8 = dict(sd)
    for name in ("q_b_proj.weight", "kv_b_proj.weight", "o_proj.weight"):
        fp8[name], fp8[name + "_scale_inv"] = _quantize_block_fp8(sd[name], block)
    layer = LatentAttention(cfg, 0, dtype=torch.float32)
    layer.load_hf_state_dict(fp8, fp8_block_size=block)
    want = dequant_block_fp8(fp8["kv_b_proj.weight"], fp8["kv_b_proj.weight_scale_inv"], block)
    torch.testing.assert_close(layer.kv_b_proj.weight, want, rtol=0, atol=0)
    assert rel_err(layer.kv_b_proj.weight.detach(), sd["kv_b_proj.weight"]) < 0.1  # fp8 keeps ~2 significant digits
    with pytest.raises(ValueError, match="weight_scale_inv"):
        layer.load_hf_state_dict(fp8)  # 128x128 blocks expect a (1, 1) scale here
    no_scale = {k: v for k, v in fp8.items() if k != "o_proj.weight_scale_inv"}
    with pytest.raises(ValueError, match="without a weight_scale_inv"):
        layer.load_hf_state_dict(no_scale, fp8_block_size=block)


# from_pretrained ----------------------------------------------------------------------------------
def _hf_config_json(cfg: MLAConfig, **extra) -> dict:
    d = dict(num_attention_heads=cfg.num_heads, kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
             qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim, q_lora_rank=cfg.q_lora_rank,
             hidden_size=cfg.hidden_size, rope_theta=cfg.rope_theta, max_position_embeddings=cfg.max_position_embeddings,
             rms_norm_eps=cfg.rms_norm_eps, model_type="deepseek_v3", num_hidden_layers=3)
    if cfg.rope_scaling is not None:
        ys = cfg.rope_scaling
        d["rope_scaling"] = dict(type="yarn", factor=ys.factor, original_max_position_embeddings=ys.original_max_position_embeddings,
                                 beta_fast=ys.beta_fast, beta_slow=ys.beta_slow, mscale=ys.mscale, mscale_all_dim=ys.mscale_all_dim)
    d.update(extra)
    return d


def _whole_model(cfg: MLAConfig, num_layers: int = 3) -> dict[str, torch.Tensor]:
    sd = {"model.embed_tokens.weight": torch.randn(10, cfg.hidden_size)}
    for i in range(num_layers):
        sd.update(random_hf_weights(cfg, seed=10 + i, prefix=f"model.layers.{i}.self_attn."))
        sd[f"model.layers.{i}.mlp.down_proj.weight"] = torch.randn(cfg.hidden_size, 8)
        sd[f"model.layers.{i}.self_attn.indexer.wk.weight"] = torch.randn(8, cfg.hidden_size)
    return sd


def _record_reads(monkeypatch) -> list[str]:
    """Patch ``safetensors.safe_open`` to log every tensor read; returns the (live) log."""
    import safetensors

    real, read = safetensors.safe_open, []

    class Logged:
        def __init__(self, *args, **kwargs):
            self._f = real(*args, **kwargs)

        def __enter__(self):
            self._inner = self._f.__enter__()
            return self

        def __exit__(self, *exc):
            return self._f.__exit__(*exc)

        def keys(self):
            return self._inner.keys()

        def get_tensor(self, key):
            read.append(key)
            return self._inner.get_tensor(key)

    monkeypatch.setattr(safetensors, "safe_open", Logged)
    return read


@pytest.mark.parametrize("sharded", [False, True])
def test_from_pretrained_reads_one_layer(tmp_path, monkeypatch, sharded):
    from safetensors.torch import save_file

    cfg = tiny_config()
    sd = _whole_model(cfg)
    (tmp_path / "config.json").write_text(json.dumps(_hf_config_json(cfg)))
    if sharded:  # layer 1's attention is split over two shards
        keys = sorted(sd)
        shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
        weight_map = {}
        for fname, names in shards.items():
            save_file({k: sd[k] for k in names}, str(tmp_path / fname))
            weight_map.update({k: fname for k in names})
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    else:
        save_file(sd, str(tmp_path / "model.safetensors"))
    read = _record_reads(monkeypatch)
    layer = LatentAttention.from_pretrained(tmp_path, 1, dtype=torch.float32, backend="reference")
    assert sorted(read) == sorted(f"model.layers.1.self_attn.{n}" for n in HF_NAMES_QLORA)  # nothing else is read
    assert layer.config == cfg and layer.layer_idx == 1 and layer.backend == "reference"
    for name, p in layer.named_parameters():
        torch.testing.assert_close(p, sd[f"model.layers.1.self_attn.{name}"], rtol=0, atol=0)
    torch.testing.assert_close(layer.w_uk[1], sd["model.layers.1.self_attn.kv_b_proj.weight"][32:48].T, rtol=0, atol=0)
    with pytest.raises(ValueError, match="layer_idx"):
        LatentAttention.from_pretrained(tmp_path, 7, dtype=torch.float32)


def test_from_pretrained_fp8_checkpoint_and_missing_files(tmp_path):
    from safetensors.torch import save_file

    cfg = tiny_config(q_lora=False)
    sd = random_hf_weights(cfg, seed=5, prefix="model.layers.0.self_attn.")
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    sd[name], sd[name + "_scale_inv"] = _quantize_block_fp8(sd[name], (32, 16))
    quant = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [32, 16]}
    (tmp_path / "config.json").write_text(json.dumps(_hf_config_json(cfg, quantization_config=quant)))
    save_file(sd, str(tmp_path / "model.safetensors"))
    layer = LatentAttention.from_pretrained(tmp_path, 0, dtype=torch.float32)
    torch.testing.assert_close(layer.kv_b_proj.weight, dequant_block_fp8(sd[name], sd[name + "_scale_inv"], (32, 16)), rtol=0, atol=0)
    with pytest.raises(ValueError, match="config.json"):
        LatentAttention.from_pretrained(tmp_path / "nowhere", 0)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="model.safetensors"):
        LatentAttention.from_pretrained(tmp_path, 0)


# RoPE table ---------------------------------------------------------------------------------------
def test_rope_table_is_shared_and_grows():
    cfg = tiny_config()
    a = LatentAttention(cfg, 0, dtype=torch.float32, max_position=8)
    b = LatentAttention(cfg, 1, dtype=torch.float32, max_position=8)
    assert a.freqs_cis is b.freqs_cis and a.freqs_cis.shape[0] >= 8
    grown = shared_freqs_cis(cfg, 5000)
    assert grown.shape[0] >= 5000
    from openmla import rope_freqs_cis
    torch.testing.assert_close(grown[:100], rope_freqs_cis(cfg, 100), rtol=0, atol=0)


# Forward ------------------------------------------------------------------------------------------
def _run_steps(layer: LatentAttention, weights, steps: list[list[int]], page_size: int = 4, seed: int = 0, **kw) -> float:
    """Ragged steps through ``layer`` and the paged cache vs ``naive_mla`` per sequence; max rel err."""
    cfg = layer.config
    g = torch.Generator().manual_seed(seed)
    B = len(steps[0])
    cache = PagedLatentCache(layer.layer_idx + 1, 64, page_size=page_size, head_dim=cfg.cache_head_dim, dtype=torch.float32)
    pasts: list[torch.Tensor | None] = [None] * B
    worst = 0.0
    for new in steps:
        xs = [torch.randn(n, cfg.hidden_size, generator=g) for n in new]
        want = []
        for b, x in enumerate(xs):
            if x.shape[0]:
                out, pasts[b] = naive_mla(weights, cfg, x, pasts[b])
                want.append(out)
        batch = cache.prepare(list(range(B)), new)
        with torch.no_grad():
            got = layer(torch.cat(xs).to(layer.o_proj.weight.dtype), batch, **kw)
        cache.commit(batch)
        assert got.shape == (sum(new), cfg.hidden_size) and got.dtype == layer.o_proj.weight.dtype
        worst = max(worst, rel_err(got, torch.cat(want)))
    return worst


@pytest.mark.parametrize("q_lora,yarn", [(True, True), (False, False)])
def test_forward_matches_naive_mla(backend, q_lora, yarn):
    cfg = tiny_config(q_lora=q_lora, yarn=yarn)
    weights = random_hf_weights(cfg, seed=7)
    layer = LatentAttention(cfg, 1, dtype=torch.float32, backend=backend, max_position=4)  # the table must grow
    layer.load_hf_state_dict(weights)
    # prefill (ragged, one empty), multi-token decode, a prefill chunk on top of a cache, single decode
    err = _run_steps(layer, weights, [[9, 0, 12], [1, 3, 2], [8, 1, 0], [1, 1, 1]])
    assert err <= 1e-5


def test_forward_without_rope_matches_naive_mla(backend):
    """R = 0 (GLM-5-Next's MLA): the key is the latent alone, nothing rotates; both forms."""
    cfg = dataclasses.replace(tiny_config(yarn=False), qk_rope_head_dim=0)
    weights = random_hf_weights(cfg, seed=10)
    layer = LatentAttention(cfg, 1, dtype=torch.float32, backend=backend)
    layer.load_hf_state_dict(weights)
    assert layer.kv_a_proj_with_mqa.weight.shape[0] == cfg.kv_lora_rank
    assert _run_steps(layer, weights, [[9, 0, 12], [1, 3, 2], [1, 1, 1]]) <= 1e-5


def test_forward_decode_and_prefill_forms_agree(backend):
    cfg = tiny_config()
    weights = random_hf_weights(cfg, seed=8)
    layer = LatentAttention(cfg, 0, dtype=torch.float32, backend=backend)
    layer.load_hf_state_dict(weights)
    steps = [[7, 4], [2, 1]]
    assert _run_steps(layer, weights, steps, decode_max_q_len=0) <= 1e-5  # attn_kwargs pass through
    assert _run_steps(layer, weights, steps, decode_max_q_len=64) <= 1e-5


def test_forward_bfloat16(backend):
    cfg = tiny_config()
    weights = random_hf_weights(cfg, seed=9)
    layer = LatentAttention(cfg, 0, backend=backend)
    layer.load_hf_state_dict(weights)
    # bf16 weights and activations against the float64 model of the fp32 weights
    assert _run_steps(layer, weights, [[10, 3], [1, 1]]) <= 5e-2


def test_forward_rejects_bad_input():
    cfg = tiny_config()
    layer = LatentAttention(cfg, 0, dtype=torch.float32, backend="reference")
    cache = PagedLatentCache(1, 4, page_size=4, head_dim=cfg.cache_head_dim, dtype=torch.float32)
    batch = cache.prepare([0], [2])
    with pytest.raises(ValueError, match="hidden_states"):
        layer(torch.zeros(2, 47), batch)
    with pytest.raises(ValueError, match="hidden_states"):
        layer(torch.zeros(1, 2, 48), batch)
    with pytest.raises(ValueError, match="step"):
        layer(torch.zeros(2, 48), None)
    with pytest.raises(ValueError, match="scale"):
        layer(torch.zeros(2, 48), batch, scale=1.0)
    with pytest.raises(ValueError, match="hidden_states: 3 rows"):
        layer(torch.zeros(3, 48), batch)
    assert cache.blocks.abs().sum() == 0  # nothing written
