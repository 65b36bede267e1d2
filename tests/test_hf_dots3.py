"""openmla.hf on dots3 (``Dots3NoteForCausalLM``, and the text of ``Dots3NoteForConditionalGeneration``).

dots3's layers differ: a sliding-window layer (4 heads, L=1024, Dn=192: the released sliding dims
but for the heads) and an indexed layer (2 heads, L=512, Dn=128, top-8 indexer), R=64 and Dv=128
in both, each with its own rope (theta, layer type). So the attachment holds two cache storages
(one per latent width, one page table) and makes two plans per step (their softmax scales and
masks differ). Also: scaled query and kv latents, an RMSNorm on the key's rope part, a per-head
sigmoid gate, interleaved rope. A tiny random float32 model; prompts of 1, 7, 23 and 50 tokens
with a window of 16, so the window cuts the longer ones in prefill and decode: greedy tokens equal
``model.generate(do_sample=False)`` in one continuous batch and one at a time, logits within 1e-4,
parameters shared. The multimodal class runs its text model on token ids; media are refused.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from cases import rel_err  # noqa: E402
from openmla.hf import attach, attachment, detach, generate, is_attached  # noqa: E402
from openmla.hf import presets  # noqa: E402
from openmla.hf.families import REFUSED  # noqa: E402
from test_hf_generate import NEW, TOL, prompts_for, run_stream, transformers_greedy  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

WINDOW = 16


def _build(**overrides):
    return presets.build("dots3_note", "test", **{"sliding_window": WINDOW, **overrides})


@pytest.fixture(scope="module")
def reference():
    model = _build()
    prompts = prompts_for()
    tokens, logits = transformers_greedy(model, prompts)
    return model, prompts, tokens, logits


def _check_equal(model, prompts, want_tokens, want_logits):
    got, logits, _ = run_stream(model, prompts)  # one continuous batch
    assert got == want_tokens
    for i in range(len(prompts)):
        errs = [rel_err(logits[i][t], want_logits[i][t]) for t in range(NEW)]
        assert max(errs) <= TOL, (i, errs)


def test_tokens_equal_transformers(reference):
    model, prompts, want_tokens, want_logits = reference
    before = {n: p.data_ptr() for n, p in model.named_parameters()}
    impl, originals = model.config._attn_implementation, [layer.self_attn for layer in model.model.layers]
    cache = attach(model, num_pages=40, page_size=8)
    try:
        state = attachment(model)
        assert [tuple(c.blocks.shape) for c in state.caches] == [(1, 40, 8, 1024 + 64), (1, 40, 8, 512 + 64)]
        assert state.plan_keys == [(0, 256**-0.5, WINDOW), (1, 192**-0.5, None)]  # Dn+R: 192+64 and 128+64
        assert {n: p.data_ptr() for n, p in model.named_parameters()} == before
        _check_equal(model, prompts, want_tokens, want_logits)
        assert [generate(model, [p], NEW)[0] for p in prompts] == want_tokens  # one at a time
        assert cache.num_free_pages == cache.num_pages
    finally:
        detach(model)
    assert [layer.self_attn for layer in model.model.layers] == originals
    assert model.config._attn_implementation == impl and not is_attached(model)


def test_the_window_matters(reference):
    """Without the window transformers' logits differ on the 50-token prompt: the test above saw it cut."""
    _, prompts, _, want_logits = reference
    _, wide = transformers_greedy(_build(sliding_window=4096), prompts[3:])
    assert rel_err(wide[0][0], want_logits[3][0]) > 1e-3


def _multimodal():
    text = presets.family_config("dots3_note", "test", sliding_window=WINDOW).to_dict()
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, patch_size=4,
                  mlp_layer_types=["dense"], adapter_in_dim=32, adapter_out_dim=text["hidden_size"])
    audio = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, downsample_hidden_size=16,
                 adapter_input_size=32, adapter_out_dim=text["hidden_size"], feature_size=16)
    config = transformers.Dots3NoteConfig(text_config=text, vision_config=vision, audio_config=audio, image_token_id=249,
                                          video_token_id=250, audio_token_id=251, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.Dots3NoteForConditionalGeneration._from_config(config, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def test_multimodal_class_runs_its_text_and_refuses_media():
    model = _multimodal()
    prompts = prompts_for()[2:]  # 23 and 50 tokens, none of them a placeholder (249, 250, 251)
    want_tokens, want_logits = transformers_greedy(model, prompts)
    attach(model, num_pages=40, page_size=8)
    try:
        _check_equal(model, prompts, want_tokens, want_logits)
        for tok, name in ((249, "image_token_id"), (250, "video_token_id"), (251, "audio_token_id")):
            with pytest.raises(ValueError, match=rf"prompts\[0\]: holds token {tok} \({name}\)"):
                generate(model, [[1, tok]], 2)
        with pytest.raises(ValueError, match="input_features: Dots3NoteForConditionalGeneration is attached to openmla for text"):
            model(input_ids=torch.tensor([[1, 251]]), input_features=torch.zeros(1, 16, 8))
    finally:
        detach(model)
    assert not model._forward_pre_hooks


def test_refuses_what_it_does_not_reproduce(reference):
    model = reference[0]
    originals = [layer.self_attn for layer in model.model.layers]
    attn = model.model.layers[0].self_attn
    attn.sliding_window = 8  # not the window transformers' mask uses
    try:
        with pytest.raises(ValueError, match=r"Dots3NoteForCausalLM: model.layers.0.self_attn.sliding_window is 8, the config's"):
            attach(model, num_pages=4)
    finally:
        attn.sliding_window = WINDOW
    types = model.config.layer_types
    model.config.layer_types = ["sliding_attention", "full_attention"]  # use_dsa=False: not among the tested kinds
    try:
        with pytest.raises(ValueError, match=r"Dots3NoteForCausalLM: layer_types \['full_attention', 'sliding_attention'\]"):
            attach(model, num_pages=4)
    finally:
        model.config.layer_types = types
    with pytest.raises(ValueError, match="cache_dtype: "):  # NVFP4 records hold L=512 only: the sliding layers' L=1024 is refused
        attach(model, num_pages=4, cache_dtype="nvfp4_ds_mla")
    assert [layer.self_attn for layer in model.model.layers] == originals and not is_attached(model)


def test_no_longer_refused():
    assert "Dots3NoteForCausalLM" not in REFUSED and "Dots3NoteForConditionalGeneration" not in REFUSED
