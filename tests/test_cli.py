"""The three commands run end to end on tiny settings (the real runs are make demo / make bench)."""

import json

import pytest

from openmla_tools.cli import main


def test_check_passes_on_the_torch_backend(capsys):
    assert main(["check", "--backend", "torch", "--seed", "7"]) == 0
    assert "all checks passed" in capsys.readouterr().out


def test_demo_serves_every_request_and_frees_the_cache(capsys):
    rc = main(["demo", "--heads", "2", "--requests", "5", "--max-running", "3", "--prompt-min", "7", "--prompt-max", "40",
               "--gen-min", "2", "--gen-max", "5", "--page-size", "16", "--cache-dtype", "fp8_ds_mla"])
    out = " ".join(capsys.readouterr().out.split())  # rich wraps lines at the terminal width
    assert rc == 0, out
    assert "requests served" in out and "0 in use at the end" in out and "pass" in out
    assert "of roofline" in out and ("memory" in out or "compute" in out) and "copy bandwidth" in out


def test_bench_writes_json_and_png(tmp_path, capsys):
    rc = main(["bench", "--heads", "2", "--contexts", "64", "--batch", "2", "--repeats", "1", "--out", str(tmp_path)])
    assert rc == 0
    data = json.loads((tmp_path / "bench.json").read_text())
    impls = {r["impl"] for r in data["rows"]}
    assert {"openmla", "eager"} <= impls and all(r["seconds"] > 0 for r in data["rows"])
    assert (tmp_path / "bench.png").stat().st_size > 1000


def test_accuracy_measures_each_format_against_float64_and_bf16(tmp_path, capsys):
    out = tmp_path / "acc"
    args = ["accuracy", "--formats", "fp8_ds_mla,nvfp4_fp8rope", "--contexts", "96", "--seeds", "0", "--batch", "1",
            "--queries", "2", "--heads", "2", "--model-tokens", "4", "--out", str(out)]
    assert main(args) == 0
    result = json.loads((tmp_path / "acc.json").read_text())
    assert result["formats"] == ["bf16", "fp8_ds_mla", "nvfp4_fp8rope"]  # bf16 always: the baseline
    err = {f: result["attention"]["all"][f]["rel_f64"]["median"] for f in result["formats"]}
    assert 0 < err["bf16"] < err["fp8_ds_mla"] < err["nvfp4_fp8rope"] < 1  # fewer bits, larger error
    assert result["attention"]["all"]["bf16"]["rel_bf16"]["max"] == 0
    assert set(result["model"]["formats"]) == {"fp32", "bf16", "fp8_ds_mla", "nvfp4_fp8rope"}
    assert "| nvfp4_fp8rope | 352 |" in (tmp_path / "acc.md").read_text()
    assert main(["accuracy", "--formats", "fp6"]) == 2 and "formats: unknown ['fp6']" in capsys.readouterr().out


def test_compile_report_is_a_subcommand(capsys):
    """``openmla compile-report`` takes the compile report's arguments (openmla_tools.compile_report)."""
    with pytest.raises(SystemExit):
        main(["compile-report", "--help"])
    assert "--select" in capsys.readouterr().out
    assert main(["compile-report", "--summary", "x.json", "--select", "ci"]) == 2  # --summary takes the full report
    assert "--summary takes the full report" in capsys.readouterr().out
