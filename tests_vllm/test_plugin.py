"""The plugin's entry point: version range, opt-in, what it registers."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest
import vllm
from vllm.v1.attention.backends.registry import AttentionBackendEnum

from openmla.integrations.vllm import plugin

OURS = "openmla.integrations.vllm.backend.OpenMLABackend"


@pytest.fixture(autouse=True)
def clean_slots(monkeypatch):
    monkeypatch.delenv("OPENMLA_VLLM", raising=False)
    yield
    AttentionBackendEnum.CPU_MLA.clear_override()
    AttentionBackendEnum.AMX_MLA.clear_override()


def test_entry_point_is_installed():
    (ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "openmla"]
    assert ep.load() is plugin.register


@pytest.mark.parametrize("version", ["0.32.0", "0.32.5+cpu", "0.32.1rc2"])
def test_supported_versions(version):
    plugin.check_version(version)


@pytest.mark.parametrize("version", ["0.31.2", "0.33.0", "1.0.0", "dev"])
def test_other_versions_raise_a_clear_error(version):
    with pytest.raises(RuntimeError, match=rf"supports vLLM >=0\.32,<0\.33, this is vLLM {version}"):
        plugin.check_version(version)


def test_without_opt_in_only_the_name_is_registered():
    plugin.register()
    plugin.register()  # vLLM may load plugins more than once
    assert AttentionBackendEnum["OPENMLA"].get_path() == OURS
    assert not AttentionBackendEnum.CPU_MLA.is_overridden() and not AttentionBackendEnum.AMX_MLA.is_overridden()


@pytest.mark.parametrize("value,on", [("1", True), ("yes", True), ("0", False), ("false", False), ("", False)])
def test_opt_in_takes_the_cpu_mla_slots(monkeypatch, value, on):
    monkeypatch.setenv("OPENMLA_VLLM", value)
    plugin.register()
    for slot in (AttentionBackendEnum.CPU_MLA, AttentionBackendEnum.AMX_MLA):
        assert (slot.get_path() == OURS) is on


def test_unsupported_vllm(monkeypatch, caplog):
    monkeypatch.setattr(vllm, "__version__", "0.40.0")
    plugin.register()  # not opted in: a warning, nothing taken
    assert not AttentionBackendEnum.CPU_MLA.is_overridden()
    assert "not supported" in caplog.text
    monkeypatch.setenv("OPENMLA_VLLM", "1")
    with pytest.raises(RuntimeError, match="this is vLLM 0.40.0"):
        plugin.register()
    assert not AttentionBackendEnum.CPU_MLA.is_overridden()


def test_opt_in_leaves_other_platforms_alone(monkeypatch):
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    monkeypatch.setenv("OPENMLA_VLLM", "1")
    plugin.register()  # on CUDA the backend is chosen by name, never by taking a slot
    assert not AttentionBackendEnum.CPU_MLA.is_overridden() and not AttentionBackendEnum.AMX_MLA.is_overridden()
    assert AttentionBackendEnum["OPENMLA"].get_path() == OURS


def test_backend_declares_the_cache_dtypes_it_serves():
    from openmla.integrations.vllm.backend import OpenMLABackend
    from openmla.integrations.vllm.metadata import cache_format

    assert OpenMLABackend.supported_kv_cache_dtypes == ["auto", "fp8", "fp8_e4m3", "fp8_ds_mla"]
    assert [cache_format(d) for d in OpenMLABackend.supported_kv_cache_dtypes] == ["native", "fp8_e4m3", "fp8_e4m3", "fp8_ds_mla"]
    for other in ("fp8_e5m2", "fp8_inc", "nvfp4_ds_mla", "bfloat16"):
        with pytest.raises(NotImplementedError, match=rf"kv_cache_dtype='{other}' is not served; it serves 'auto'"):
            cache_format(other)


def test_fp8_caches_are_viewed_in_place():
    """vLLM allocates fp8 caches as uint8: openmla's blocks are views of the same bytes."""
    import torch

    from openmla.integrations.vllm.metadata import layer_blocks

    cache = torch.zeros(3, 16, 576, dtype=torch.uint8)
    fp8 = layer_blocks(cache, "fp8_e4m3")
    assert fp8.dtype == torch.float8_e4m3fn and fp8.shape == (1, 3, 16, 576) and fp8.data_ptr() == cache.data_ptr()
    assert layer_blocks(cache.view(torch.float8_e4m3fn), "fp8_e4m3").data_ptr() == cache.data_ptr()  # as forward_mqa gets it
    records = torch.zeros(3, 16, 656, dtype=torch.uint8)
    assert layer_blocks(records, "fp8_ds_mla").data_ptr() == records.data_ptr()


def test_fp8_ds_mla_only_where_vllms_656_byte_record_fits():
    from openmla.integrations.vllm.impl import _check_ds_mla

    _check_ds_mla(512, 64)  # DeepSeek, Kimi K2, GLM-4.7-Flash
    with pytest.raises(NotImplementedError, match="kv_lora_rank 256 and rope 32 \\(328-byte records\\)"):
        _check_ds_mla(256, 32)  # MiniCPM3
    with pytest.raises(NotImplementedError, match="no whole 128-value groups"):
        _check_ds_mla(320, 64)


def test_opt_in_turns_vllms_cpu_rotary_op_off(caplog):
    """vLLM's CPU rotary_embedding op rotates an MLA query's [T, H, R] rope part at the wrong
    positions (cpu_platform.py): the plugin turns it off for MLA models, unless the user turned it on."""
    import torch
    from types import SimpleNamespace

    from vllm.model_executor.layers.rotary_embedding import get_rope

    from openmla.integrations.vllm.cpu_platform import native_rope

    config = SimpleNamespace(custom_ops=["all"])
    native_rope(config)
    native_rope(config)
    assert config.custom_ops == ["all", "-rotary_embedding"]
    kept = SimpleNamespace(custom_ops=["all", "+rotary_embedding"])
    native_rope(kept)
    assert kept.custom_ops == ["all", "+rotary_embedding"] and "wrong positions" in caplog.text

    # What the op does with MLA's query view (vLLM 0.32): wrong, where its PyTorch code is right.
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(64, max_position=64, is_neox_style=False, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    torch.manual_seed(0)
    q = torch.randn(5, 4, 128 + 64)  # [T, H, Dn + R]
    positions = torch.tensor([0, 1, 2, 0, 1])  # two sequences
    want, _ = rope.forward_native(positions, q[..., 128:].clone(), None)
    got, _ = rope.forward_cpu(positions, q.clone()[..., 128:], None)
    assert torch.allclose(want[0, 0], got[0, 0]) and not torch.allclose(want, got)


@pytest.mark.parametrize("dims", [(128, 512, 128), (64, 256, 64), (192, 512, 256)])  # DeepSeek/Kimi, MiniCPM3, GLM-4.7-Flash
def test_vllm_bmm_only_where_it_is_exact(dims):
    """The decode absorption and W_UV on vLLM's ``bmm_cpu``: bfloat16 only, head sizes in multiples
    of 32, on CPUs that multiply bfloat16 natively; where chosen, both products within bf16 rounding
    of float64 (every token count the engine may batch), NaN-poisoned outputs fully written."""
    import torch

    from openmla.integrations.vllm.impl import _vllm_bmm_usable

    native_bf16 = torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()
    assert _vllm_bmm_usable(torch.bfloat16, *dims) == native_bf16
    assert not _vllm_bmm_usable(torch.float16, *dims) and not _vllm_bmm_usable(torch.float32, *dims)
    assert not _vllm_bmm_usable(torch.bfloat16, 48, 512, 128) and not _vllm_bmm_usable(torch.bfloat16, 128, 512, 80)
    if not native_bf16:
        pytest.skip("vLLM's bmm_cpu is not chosen on this CPU")
    Dn, L, Dv = dims
    g = torch.Generator().manual_seed(7)
    for H in (1, 16):
        w_uk = torch.randn(H, L, Dn, generator=g).bfloat16()  # AMXMLAImpl's layouts: out[n] = x[n] @ w[n]^T
        w_uv = torch.randn(H, Dv, L, generator=g).bfloat16()
        packed = [torch.ops._C.convert_weight_packed(w) for w in (w_uk, w_uv)]
        for T in (1, 8, 33, 257):
            for x, w, p in ((torch.randn(T, H, Dn, generator=g), w_uk, packed[0]), (torch.randn(T, H, L, generator=g), w_uv, packed[1])):
                x = x.bfloat16().transpose(0, 1)  # [H, T, K] views of token-major rows, as MLAAttention passes them
                out = torch.full((T, H, w.shape[1]), float("nan"), dtype=torch.bfloat16)
                torch.ops._C.bmm_cpu(out.transpose(0, 1), x, p, True, None)
                want = torch.einsum("htk,hok->tho", x.double(), w.double())
                assert (out.double() - want).norm() / want.norm() < 4e-3, (H, T, x.shape[-1])
