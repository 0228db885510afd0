"""`specctl train-eagle`: help with an example, a short run on the tiny model (summary on stdout as
JSON, the draft exported where vLLM expects it), and one-line usage errors."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from specctl.cli import app
from specctl.errors import UsageError

runner = CliRunner()


def test_help_has_an_example():
    r = runner.invoke(app, ["train-eagle", "--help"])
    assert r.exit_code == 0
    assert "specctl train-eagle --model" in r.output and "--ttt-steps" in r.output and "--cache-hidden-states" in r.output


def test_short_run_json(tiny_model_dir, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"add {i}"},
                                                       {"role": "assistant", "content": f"x + {i} == {i} + x"}]})
                              for i in range(10)) + "\n")
    out = tmp_path / "run"
    r = runner.invoke(app, ["train-eagle", "--model", str(tiny_model_dir), "--data", str(data), "--output", str(out),
                            "--steps", "3", "--batch-size", "4", "--seq-len", "48", "--draft-vocab-size", "64",
                            "--ttt-steps", "2", "--eval-split", "0.2", "--json"])
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    assert s["version"] == 3 and s["steps"] == 3 and s["draft_vocab_size"] == 64
    export = out / f"{tiny_model_dir.name}-eagle3"
    assert s["export"] == str(export) and "eagle3" in export.name
    cfg = json.loads((export / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 64
    ck = out / "checkpoints" / "step-0000003"
    assert (ck / "model.safetensors").exists() and (ck / "training_config.json").exists()
    assert len(s["final"]["acceptance_per_position"]) == 2


def test_usage_errors(tiny_model_dir, tmp_path):
    r = runner.invoke(app, ["train-eagle", "--model", str(tiny_model_dir), "--output", str(tmp_path), "--data", "x.jsonl",
                            "--version", "2"])
    assert isinstance(r.exception, UsageError) and r.exception.exit_code == 2
    assert "--version must be 3 or 1" in str(r.exception)
    r = runner.invoke(app, ["train-eagle", "--model", str(tiny_model_dir), "--output", str(tmp_path)])
    assert isinstance(r.exception, UsageError) and "no training data" in str(r.exception)
