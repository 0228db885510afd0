"""`specctl train-eagle`: help with an example, a short run on the tiny model (summary on stdout as
JSON, the draft exported where vLLM expects it), one-line usage errors (EAGLE-3 options with --version 1
among them), and bad data found before the model loads."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from specctl.cli import app
from specctl.errors import DataError, UsageError

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
    # the held-out answers decoded through the proposer: a chain of --replay-k (3) and the tree
    replay = s["final"]["replay"]
    assert replay["chain"]["k"] == 3 and replay["tree"]["speculative_num_draft_tokens"] == 16
    for r in replay.values():
        assert r["steps"] > 0 and r["mean_acceptance_length"] == pytest.approx(1 + r["accepted_tokens"] / r["steps"])


def test_replay_lines_and_skipping_it(tiny_model_dir, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"add {i}"},
                                                       {"role": "assistant", "content": f"x + {i} == {i} + x"}]})
                              for i in range(10)) + "\n")
    args = ["train-eagle", "--model", str(tiny_model_dir), "--data", str(data), "--steps", "2", "--batch-size", "4",
            "--seq-len", "48", "--draft-vocab-size", "64", "--ttt-steps", "2", "--eval-split", "0.2"]
    r = runner.invoke(app, [*args, "--output", str(tmp_path / "a")])
    assert r.exit_code == 0, r.output
    assert "with a chain of 3" in r.stdout and "with a tree of at most 16 nodes, 5 deep" in r.stdout
    r = runner.invoke(app, [*args, "--output", str(tmp_path / "b"), "--replay-k", "0", "--json"])
    assert r.exit_code == 0, r.output
    assert "replay" not in json.loads(r.stdout)["final"]


def test_usage_errors(tiny_model_dir, tmp_path):
    r = runner.invoke(app, ["train-eagle", "--model", str(tiny_model_dir), "--output", str(tmp_path), "--data", "x.jsonl",
                            "--version", "2"])
    assert isinstance(r.exception, UsageError) and r.exception.exit_code == 2
    assert "--version must be 3 or 1" in str(r.exception)
    r = runner.invoke(app, ["train-eagle", "--model", str(tiny_model_dir), "--output", str(tmp_path)])
    assert isinstance(r.exception, UsageError) and "no training data" in str(r.exception)


@pytest.mark.parametrize("args", [["--aux-layers", "1,2,3"], ["--draft-vocab-size", "1000"], ["--fc-init", "last"]])
def test_eagle3_options_with_version_1_are_usage_errors(args, tmp_path):
    """EAGLE-1 has no aux layers, no draft vocabulary and no fc init choice: they were accepted and
    ignored (the summary even printed the --aux-layers given)."""
    r = runner.invoke(app, ["train-eagle", "--model", "m", "--output", str(tmp_path / "o"), "--data", "x.jsonl",
                            "--version", "1", *args])
    assert isinstance(r.exception, UsageError) and r.exception.exit_code == 2, r.output
    assert f"{args[0]} is an EAGLE-3 option" in str(r.exception) and "--version 3" in str(r.exception)


def test_a_draft_vocab_over_the_targets_is_a_usage_error(tiny_model_dir, tmp_path):
    r = runner.invoke(app, ["train-eagle", "--model", str(tiny_model_dir), "--output", str(tmp_path / "o"), "--data",
                            "x.jsonl", "--draft-vocab-size", "1000"])
    assert isinstance(r.exception, DataError), r.output  # x.jsonl is read first: bad data before the model loads
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "a", "response": "b"}\n')
    r = runner.invoke(app, ["train-eagle", "--model", str(tiny_model_dir), "--output", str(tmp_path / "o"), "--data",
                            str(data), "--draft-vocab-size", "1000"])
    assert isinstance(r.exception, UsageError) and r.exception.exit_code == 2, r.output
    assert "--draft-vocab-size 1000 is more than the target's vocabulary (128 tokens)" in str(r.exception)


def test_bad_data_fails_before_the_model_loads(tmp_path, monkeypatch):
    monkeypatch.setattr("specctl.runtime.loading.load_model", lambda *a, **k: pytest.fail("the target was loaded"))
    monkeypatch.setattr("specctl.models.resolve_model", lambda *a, **k: pytest.fail("the target was resolved"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "response": "b"}\n{"prompt": "no answer"}\n')
    r = runner.invoke(app, ["train-eagle", "--model", "m", "--output", str(tmp_path / "o"), "--data", str(bad)])
    assert isinstance(r.exception, DataError) and "bad.jsonl, line 2" in str(r.exception), r.output


def test_a_missing_eval_data_file_is_named_as_eval_data_before_the_model_loads(tmp_path, monkeypatch):
    """The error said "check the path given to --data", and came after the model had loaded."""
    monkeypatch.setattr("specctl.runtime.loading.load_model", lambda *a, **k: pytest.fail("the target was loaded"))
    monkeypatch.setattr("specctl.models.resolve_model", lambda *a, **k: pytest.fail("the target was resolved"))
    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "a", "response": "b"}\n')
    r = runner.invoke(app, ["train-eagle", "--model", "m", "--output", str(tmp_path / "o"), "--data", str(good),
                            "--eval-data", str(tmp_path / "nope.jsonl")])
    assert isinstance(r.exception, DataError), r.output
    assert str(r.exception) == f"data file {tmp_path / 'nope.jsonl'} does not exist. check the path given to --eval-data"
