"""``openmla generate`` on a tiny checkpoint folder, ``openmla models``, and ``openmla demo --model tiny-<family>``."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from openmla_tools.cli import main  # noqa: E402
from openmla.hf import attach, generate, presets  # noqa: E402
from openmla.hf.families import FAMILIES, REFUSED  # noqa: E402
from test_hf_generate import load, save_tiny  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def flat(text: str) -> str:
    return " ".join(text.split())  # rich wraps lines at the terminal width


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    save_tiny(path, "v3", q_lora=True, moe=True, yarn=True)
    return path


def test_generate_prints_the_library_tokens_and_a_rate(folder, capsys):
    prompts = [[5, 17, 3, 99, 4], [8, 1]]
    model = load(folder)
    attach(model, num_pages=8, page_size=16)
    want = generate(model, prompts, 5)
    rc = main(["generate", str(folder), "--prompt-ids", "5,17,3,99,4", "--prompt-ids", "8 1", "--max-new-tokens", "5", "--dtype", "fp32"])
    out = flat(capsys.readouterr().out)
    assert rc == 0, out
    for ids in want:
        assert " ".join(map(str, ids)) in out
    assert "10 tokens generated" in out and "tokens/s" in out and "no tokenizer" in out


def test_generate_from_a_prompts_file(folder, tmp_path, capsys):
    f = tmp_path / "prompts.txt"
    f.write_text("1 2 3\n\n4,5\n7\n")
    rc = main(["generate", str(folder), "--prompts-file", str(f), "--max-new-tokens", "3", "--temperature", "0.8", "--seed", "1",
               "--page-size", "4", "--max-batch-tokens", "4"])
    out = flat(capsys.readouterr().out)
    assert rc == 0, out
    assert "9 tokens generated" in out


def test_generate_with_the_folder_tokenizer(tmp_path, capsys):
    tokenizers = pytest.importorskip("tokenizers")
    save_tiny(tmp_path, "v3", q_lora=False, moe=False, yarn=False)
    vocab = {w: i for i, w in enumerate(["<unk>"] + [f"w{i}" for i in range(255)])}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.decoder = tokenizers.decoders.WordPiece()  # joins the words with spaces
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(tmp_path)
    rc = main(["generate", str(tmp_path), "--prompt", "w1 w2 w3", "--max-new-tokens", "4", "--dtype", "fp32"])
    out = flat(capsys.readouterr().out)
    assert rc == 0, out
    assert "4 tokens generated" in out and "no tokenizer" not in out
    assert out.count(" w") >= 4  # the generated ids are printed as words


def test_generate_bad_input_is_an_error_line(folder, tmp_path, capsys):
    assert main(["generate", str(folder), "--prompt-ids", "1,x"]) == 2
    assert "--prompt-ids #1" in capsys.readouterr().out
    assert main(["generate", str(tmp_path), "--prompt-ids", "1"]) == 2
    assert "no config.json" in capsys.readouterr().out
    assert main(["generate", str(folder), "--prompt", "hello"]) == 2
    assert "tokenizer" in capsys.readouterr().out
    assert main(["generate", str(folder), "--prompt-ids", "1,2", "--num-pages", "1", "--page-size", "4", "--max-new-tokens", "8"]) == 2
    assert "cache holds 4" in flat(capsys.readouterr().out)


def test_generate_loads_the_class_config_json_names(tmp_path, capsys):
    """Mistral 4's class is not AutoModelForCausalLM's: the folder's architectures pick it."""
    model = presets.build("mistral4", "test")
    model.save_pretrained(tmp_path)
    attach(model, num_pages=8, page_size=16)
    want = generate(model, [[5, 17, 3]], 4)[0]
    rc = main(["generate", str(tmp_path), "--prompt-ids", "5,17,3", "--max-new-tokens", "4", "--dtype", "fp32", "--ignore-eos"])
    out = flat(capsys.readouterr().out)
    assert rc == 0, out
    assert "Mistral4ForCausalLM" in out and " ".join(map(str, want)) in out


def test_models_lists_every_family_with_its_dims(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    for family in FAMILIES:
        assert family.name in out and family.model_classes[0] in out
    assert "H=40 L=256 R=32 Dn=64 Dv=64 q_lora 768" in out  # MiniCPM3
    assert "H=20 L=512 R=64 Dn=192 Dv=256 q_lora 768" in out  # GLM-4.7-Flash
    for gap in REFUSED.values():
        assert gap.family in out


@pytest.mark.parametrize("model,cache", [("tiny-v3", "same"), ("tiny-v32", "same"), ("tiny-v3", "fp8_ds_mla"),
                                         ("tiny-kimi-k25", "same")])
def test_demo_tiny_model_serves_every_request(capsys, model, cache):
    torch.manual_seed(0)
    rc = main(["demo", "--model", model, "--requests", "3", "--prompt-min", "8", "--prompt-max", "40", "--gen-max", "3",
               "--max-running", "2", "--page-size", "16", "--cache-dtype", cache])
    out = flat(capsys.readouterr().out)
    assert rc == 0, out
    assert "0 in use at the end" in out and "pass" in out and "9 tokens" in out
    assert ("fp8 latent cache" in out) == (cache != "same")
    assert "attention layers" in out
    assert ("the fastest of transformers' implementations" in out) == (model != "tiny-v32")  # V3.2's demo has no MoE
