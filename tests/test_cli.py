"""The three commands run end to end on tiny settings (the real runs are make demo / make bench)."""

import json

from openmla.cli import main


def test_check_passes_on_the_torch_backend(capsys):
    assert main(["check", "--backend", "torch", "--seed", "7"]) == 0
    assert "all checks passed" in capsys.readouterr().out


def test_demo_serves_every_request_and_frees_the_cache(capsys):
    rc = main(["demo", "--heads", "2", "--requests", "5", "--max-running", "3", "--prompt-min", "7", "--prompt-max", "40",
               "--gen-min", "2", "--gen-max", "5", "--page-size", "16", "--cache-dtype", "fp8_ds_mla"])
    out = " ".join(capsys.readouterr().out.split())  # rich wraps lines at the terminal width
    assert rc == 0, out
    assert "requests served" in out and "0 in use at the end" in out and "pass" in out


def test_bench_writes_json_and_png(tmp_path, capsys):
    rc = main(["bench", "--heads", "2", "--contexts", "64", "--batch", "2", "--repeats", "1", "--out", str(tmp_path)])
    assert rc == 0
    data = json.loads((tmp_path / "bench.json").read_text())
    impls = {r["impl"] for r in data["rows"]}
    assert {"openmla", "eager"} <= impls and all(r["seconds"] > 0 for r in data["rows"])
    assert (tmp_path / "bench.png").stat().st_size > 1000
