"""openmla.hf on Hunyuan V4 VL (``HYV4VLForConditionalGeneration``), text only, against transformers.

Its text model is Hunyuan V4's attention with interleaved rope and multimodal rope (M-RoPE: time,
height and width position streams, their frequencies interleaved by ``mrope_section``). For token
ids transformers gives all three streams the token's 1-D position, and the rotary module's output
is then the 1-D rope table openmla reads from it. A tiny random float32 model (Hunyuan V4's MLA
dims, 2 layers: one with a top-8 indexer, one reusing its picks; a MoE; a tiny vision tower):
greedy tokens equal ``model.generate(do_sample=False)`` for 4 prompts (16 new tokens) in one
continuous batch and one at a time, logits within 1e-4, parameters shared. What is not text
(pixel values, placeholder tokens in a prompt, position streams that differ) is a ValueError.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from openmla.hf import attach, attachment, detach, generate  # noqa: E402
from openmla.hf import presets  # noqa: E402
from openmla.hf.families import REFUSED  # noqa: E402
from test_hf_generate import attached_text_model, assert_serves_like_transformers, prompts_for, transformers_greedy  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    m = presets.build("hy_v4_vl", "test")
    assert m.config.text_config.rope_parameters["mrope_section"] == [12, 10, 10]  # Hy4's: 32 frequencies of R=64
    return m


def test_text_tokens_equal_transformers(model):
    prompts = prompts_for()
    want_tokens, want_logits = transformers_greedy(model, prompts)
    with attached_text_model(model, num_pages=40, page_size=8) as cache:
        assert_serves_like_transformers(model, cache, prompts, want_tokens, want_logits)
    assert not model._forward_pre_hooks  # the text-only guard went with detach


def test_rope_table_is_mrope_with_equal_streams(model):
    """The table openmla reads equals the rotary module fed three equal streams (what transformers feeds text)."""
    attach(model, num_pages=4, page_size=8)
    try:
        table = attachment(model).rope.table(64, torch.device("cpu"))[:64]
        pos = torch.arange(64)
        cos, sin = model.model.language_model.rotary_emb(torch.zeros(1), pos.view(1, 1, -1).expand(3, 1, -1))
        half = cos.shape[-1] // 2
        assert torch.equal(table, torch.stack((cos[0, :, :half], sin[0, :, :half]), -1).reshape(64, -1))
    finally:
        detach(model)


def test_not_text_is_refused(model):
    model.config.image_token_id, model.config.video_token_id = 7, 9  # placeholder ids inside the tiny vocab
    attach(model, num_pages=8, page_size=8)
    try:
        for tok, name in ((7, "image_token_id"), (9, "video_token_id")):
            with pytest.raises(ValueError, match=rf"prompts\[1\]: holds token {tok} \({name}\)"):
                generate(model, [[1, 2], [3, tok, 5]], 2)
        ids = torch.tensor([[1, 2, 3]])
        with pytest.raises(ValueError, match="pixel_values: HYV4VLForConditionalGeneration is attached to openmla for text only"):
            model(input_ids=ids, pixel_values=torch.zeros(4, 48), image_grid_thw=torch.tensor([[1, 2, 2]]))
        streams = torch.arange(3).view(1, 1, 3).repeat(3, 1, 1)
        streams[1, 0, 2] = 5  # an image token's height position
        with pytest.raises(ValueError, match="position_ids: its 3 position streams differ"):
            model(input_ids=ids, position_ids=streams)
        assert attachment(model).cache.num_free_pages == 8
    finally:
        detach(model)
        model.config.image_token_id, model.config.video_token_id = 120120, 120124


def test_no_longer_refused():
    assert "HYV4VLForConditionalGeneration" not in REFUSED
