"""attach's self-check (``openmla.hf.verify``): a host model whose code moved is reproduced or refused.

Each test changes a built model the way a transformers release could — after building it, before
``attach`` — and checks that ``attach`` either reproduces transformers' new tokens (the change is
one openmla.hf reads from the live model: the rope layout a module computes, its ``scaling``) or
refuses with a ``ValueError`` naming the class, the layer, the error and the transformers version,
the model untouched (modules, parameters, attention implementation). A silent difference fails.
Also: ``is_attached`` / ``detach`` are one pair for every family and DeepSeek-V4.
"""

from __future__ import annotations

import contextlib
import importlib
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

from openmla.hf import attach, detach, is_attached, presets  # noqa: E402
from openmla.hf.attach import attention_slots, decoder_layers  # noqa: E402
from openmla.hf.families import family_of  # noqa: E402
from openmla.hf.presets import PRESETS  # noqa: E402
from test_hf_generate import assert_serves_like_transformers, prompts_for, transformers_greedy  # noqa: E402
from test_hf_v4 import tiny as tiny_v4  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def _modules(model):
    family = family_of(model)
    return [getattr(parent, name) for parent, name, _ in attention_slots(decoder_layers(model, family), family)]


def _snapshot(model):
    text = model.config.get_text_config()
    return (list(model.named_modules()), {n: (p.data_ptr(), p.clone()) for n, p in model.named_parameters()},
            text._attn_implementation)


def _assert_unchanged(model, before):
    modules, params, impl = before
    assert list(model.named_modules()) == modules
    now = dict(model.named_parameters())
    assert set(now) == set(params)
    for n, (ptr, value) in params.items():
        assert now[n].data_ptr() == ptr and torch.equal(now[n], value), n
    assert model.config.get_text_config()._attn_implementation == impl
    assert not is_attached(model)


def _assert_refused(model, what: str):
    before = _snapshot(model)
    with pytest.raises(ValueError) as info:
        attach(model, num_pages=40, page_size=8)
    msg = str(info.value)
    assert type(model).__name__ in msg and "self-check" in msg, msg
    assert re.search(r"self_attn", msg) and f"transformers {transformers.__version__}" in msg and "tolerance" in msg, msg
    _assert_unchanged(model, before)
    detach(model)  # harmless after a refusal
    _assert_unchanged(model, before)
    return msg


def _assert_reproduced(model):
    prompts = prompts_for()[:2]
    want_tokens, want_logits = transformers_greedy(model, prompts)
    cache = attach(model, num_pages=40, page_size=8)
    try:
        assert_serves_like_transformers(model, cache, prompts, want_tokens, want_logits)
    finally:
        detach(model)


@contextlib.contextmanager
def _patched(module, **attrs):
    old = {k: getattr(module, k) for k in attrs}
    for k, v in attrs.items():
        setattr(module, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(module, k, v)


def _v3_modeling():
    return importlib.import_module("transformers.models.deepseek_v3.modeling_deepseek_v3")


# Every family: the check passes on the installed transformers; is_attached / detach are one pair ----------
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_family_attaches_verified_and_detaches(name):
    model = presets.build(name, "test")
    before = _snapshot(model)
    attach(model, num_pages=16, page_size=8)
    assert is_attached(model)
    detach(model)
    _assert_unchanged(model, before)


def test_v4_is_attached_and_detaches():
    model = tiny_v4(0)
    originals = [layer.self_attn for layer in model.model.layers]
    attach(model, num_pages=16, page_size=8)
    assert is_attached(model)
    detach(model)
    assert not is_attached(model) and [layer.self_attn for layer in model.model.layers] == originals
    detach(model)  # harmless when not attached


def test_verify_false_warns_and_attaches():
    model = presets.build("deepseek_v3", "test")
    with pytest.warns(UserWarning, match="self-check .* was skipped"):
        attach(model, num_pages=16, page_size=8, verify=False)
    assert is_attached(model)
    detach(model)


# A release that moves the rope: the other layout is read, any other rotation refused ------------------
def test_rope_layout_moved_to_half_split_is_read_and_reproduced():
    """The config says interleaved pairs, the modeling code now rotates half-split: attach follows the code."""
    m = _v3_modeling()
    model = presets.build("deepseek_v3", "test")
    assert model.config.rope_interleave
    with _patched(m, apply_rotary_pos_emb_interleave=m.apply_rotary_pos_emb):
        _assert_reproduced(model)


def test_rope_layout_moved_to_interleaved_is_read_and_reproduced():
    """Hunyuan V4's move in transformers 5.25, made by hand on whatever release is installed: attach follows."""
    m = _v3_modeling()
    model = presets.build("axk1", "test")  # DeepSeek-V3's attention code, rope_interleave=False
    axk = importlib.import_module(type(_modules(model)[0]).__module__)
    with _patched(axk, apply_rotary_pos_emb=getattr(axk, "apply_rotary_pos_emb_interleave", m.apply_rotary_pos_emb_interleave)):
        _assert_reproduced(model)


def test_a_rope_openmla_does_not_compute_is_refused():
    m = _v3_modeling()
    model = presets.build("deepseek_v3", "test")

    half = m.apply_rotary_pos_emb

    def double_angle(q, k, cos, sin, *args, **kwargs):  # a rope that turns twice as fast
        return half(q, k, cos * cos - sin * sin, 2 * sin * cos, *args, **kwargs)

    with _patched(m, apply_rotary_pos_emb_interleave=double_angle, apply_rotary_pos_emb=double_angle):
        _assert_refused(model, "rope")


# A release that adds an operation or changes a scale inside forward ------------------------------------
def _wrap_forward(model, change):
    cls = type(_modules(model)[0])
    original = cls.forward

    def forward(self, *args, **kwargs):
        return change(self, original, args, kwargs)

    return _patched(cls, forward=forward)


def test_an_extra_operation_in_forward_is_refused():
    model = presets.build("glm4_moe_lite", "test")

    def gated(self, original, args, kwargs):  # e.g. a new output gate transformers now applies
        out, *rest = original(self, *args, **kwargs)
        return (out * torch.sigmoid(out), *rest)

    with _wrap_forward(model, gated):
        _assert_refused(model, "extra op")


def test_a_scale_changed_inside_forward_is_refused():
    model = presets.build("minicpm3", "test")

    def rescaled(self, original, args, kwargs):  # the attribute says one scale, the forward applies another
        self.scaling *= 1.5
        try:
            return original(self, *args, **kwargs)
        finally:
            self.scaling /= 1.5

    with _wrap_forward(model, rescaled):
        _assert_refused(model, "scale")


def test_a_changed_scaling_attribute_is_read_and_reproduced():
    model = presets.build("deepseek_v3", "test")
    for module in _modules(model):
        module.scaling *= 1.5
    _assert_reproduced(model)


def test_hunyuan_sinks_changed_inside_forward_are_refused():
    model = presets.build("hy_v4", "test")

    def sinks_off(self, original, args, kwargs):  # a release that stops applying the sinks
        saved = self.sinks.data.clone()
        self.sinks.data.fill_(-1e4)
        try:
            return original(self, *args, **kwargs)
        finally:
            self.sinks.data.copy_(saved)

    with _wrap_forward(model, sinks_off):
        _assert_refused(model, "sinks")


def test_v4_forward_changed_is_refused():
    model = tiny_v4(0)
    cls = type(model.model.layers[0].self_attn)
    original = cls.forward

    def doubled(self, *args, **kwargs):
        out, *rest = original(self, *args, **kwargs)
        return (out * 2, *rest)

    originals = [layer.self_attn for layer in model.model.layers]
    impl = model.config._attn_implementation
    with _patched(cls, forward=doubled):
        with pytest.raises(ValueError, match=r"DeepseekV4ForCausalLM: attach's self-check found model\.layers\.\d\.self_attn"):
            attach(model, num_pages=16, page_size=8)
    assert [layer.self_attn for layer in model.model.layers] == originals
    assert model.config._attn_implementation == impl and not is_attached(model)
