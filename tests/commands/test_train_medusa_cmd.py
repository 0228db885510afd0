"""`specctl train-medusa` end to end on the tiny model: self-distils, trains, checkpoints, exports the
vLLM layout, prints a JSON summary on stdout; the heads then serve in `specctl bench` with outputs
equal to the baseline; bad data is one line on stderr with its line number (exit 1), usage errors exit 2;
a finished run resumed is exported again; a Ctrl-C is one line naming the checkpoint to resume from (exit 130).

The end-to-end run is in-process (typer's CliRunner: no second torch import); the error format,
which ``specctl.cli.main`` produces, is checked through a real subprocess.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from typer.testing import CliRunner

from specctl.cli import app
from specctl.errors import UsageError
from specctl.training.checkpoints import checkpoint_dirs


def test_help_has_an_example():
    r = CliRunner().invoke(app, ["train-medusa", "--help"])
    assert r.exit_code == 0
    assert "Examples:" in r.stdout and "specctl train-medusa --model" in r.stdout and "--self-distill" in r.stdout


def test_train_then_bench(tiny_model_dir, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": s}) + "\n" for i, s in enumerate(
        ["abc abc abc", "the cat sat", "xyz", "hello hello", "one two", "b c d"])))
    out = tmp_path / "heads"
    r = CliRunner().invoke(app, [
        "train-medusa", "--model", str(tiny_model_dir), "--self-distill", str(prompts), "--num-heads", "2",
        "--output", str(out), "--steps", "8", "--save-every", "4", "--batch-size", "2", "--seq-len", "96",
        "--distill-max-new-tokens", "16", "--eval-split", "0.34", "--dtype", "float32", "--json"])
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    assert s["steps"] == 8 and s["mode"] == "medusa-1" and s["final_loss"] < s["first_loss"]
    assert len(s["eval"]["top1_per_head"]) == 2 and s["eval"]["acceptance_length"] >= 1.0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "medusa" and cfg["num_heads"] == 2
    acc = cfg["specctl"]["rank_accuracy"]  # held-out accuracy of each head's top-10, for "auto" trees
    assert acc == s["eval"]["rank_accuracy"] and len(acc) == 2 and all(len(row) == 10 for row in acc)
    assert [row[0] for row in acc] == s["eval"]["top1_per_head"] and all(0 <= sum(row) <= 1.0001 for row in acc)
    assert (out / "training_config.json").is_file() and (out / "data" / "self_distill.jsonl").is_file()
    assert (out / "checkpoints" / "step-0000004" / "training_config.json").is_file()
    assert (out / "checkpoints" / "step-0000008" / "optimizer.pt").is_file()

    spec = json.dumps({"method": "medusa", "model": str(out), "num_speculative_tokens": 2,
                       "speculative_token_tree": "auto", "speculative_num_draft_tokens": 4})
    b = CliRunner().invoke(app, ["bench", "--model", str(tiny_model_dir), "--dtype", "float32", "--speculative-config",
                                 spec, "-w", str(prompts), "-n", "2", "--max-new-tokens", "12", "--json"])
    assert b.exit_code == 0, b.output
    rows = {row["method"]: row for row in json.loads(b.stdout)["results"]}
    assert rows["medusa"]["identical_to_baseline"] == 2 and rows["medusa"]["num_drafts"] > 0


def test_usage_error_before_anything_loads(tmp_path):
    r = CliRunner().invoke(app, ["train-medusa", "--model", "x", "--output", str(tmp_path / "o")])
    assert isinstance(r.exception, UsageError) and r.exception.exit_code == 2 and "no training data" in str(r.exception)


def test_bad_data_line_is_one_line_on_stderr(tiny_model_dir, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "response": "b"}\n{"prompt": "no answer"}\n')
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("SPECCTL_DEBUG", None)
    r = subprocess.run([sys.executable, "-m", "specctl.cli", "train-medusa", "--model", str(tiny_model_dir), "--data",
                        str(bad), "--output", str(tmp_path / "o"), "--dtype", "float32"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 1
    assert r.stderr.strip().count("\n") == 0 and r.stderr.startswith("Error: ") and "bad.jsonl, line 2" in r.stderr
    assert not (tmp_path / "o").exists()  # nothing was written


def small_data(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"add {i}", "response": f"x + {i} == {i} + x"}) + "\n" for i in range(6)))
    return data


def quiet_env() -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("SPECCTL_DEBUG", None)
    return env


def test_a_finished_run_resumed_is_exported_again(tiny_model_dir, tmp_path):
    """A run that had reached its steps, resumed (its export cut short by a Ctrl-C): it printed the export,
    then "TypeError: unsupported format string passed to NoneType.__format__" (final_loss None), rc 1."""
    out = tmp_path / "run"
    args = ["train-medusa", "--model", str(tiny_model_dir), "--data", str(small_data(tmp_path)), "--num-heads", "2",
            "--output", str(out), "--steps", "3", "--save-every", "2", "--batch-size", "2", "--seq-len", "48",
            "--eval-split", "0.34", "--dtype", "float32"]
    first = CliRunner().invoke(app, [*args, "--json"])
    assert first.exit_code == 0, first.output
    loss = json.loads(first.stdout)["final_loss"]
    for f in ("README.md", "training_config.json", "train_summary.json"):  # only config.json, model.safetensors left
        (out / f).unlink()
    r = CliRunner().invoke(app, [*args, "--resume"], terminal_width=200)
    assert r.exit_code == 0, r.output
    assert f"→ {loss:.4f}" in r.stdout and "steps" in r.stdout
    assert json.loads((out / "train_summary.json").read_text())["final_loss"] == loss
    assert (out / "training_config.json").is_file() and (out / "README.md").is_file()


def test_truncated_vocab_over_the_vocab_is_a_usage_error(tiny_model_dir, tmp_path):
    """--truncated-vocab-size above the target's 128 tokens exported a full-vocabulary head, silently."""
    r = CliRunner().invoke(app, ["train-medusa", "--model", str(tiny_model_dir), "--data", str(small_data(tmp_path)),
                                 "--output", str(tmp_path / "o"), "--truncated-vocab-size", "1000", "--shared-lm-head",
                                 "--dtype", "float32"])
    assert isinstance(r.exception, UsageError) and r.exception.exit_code == 2, r.output
    assert "--truncated-vocab-size 1000 is more than the target's vocabulary (128 tokens)" in str(r.exception)
    assert not (tmp_path / "o" / "model.safetensors").exists()


def test_a_truncated_vocab_needs_the_shared_head_vllm_loads(tiny_model_dir, tmp_path):
    """One LM head per head beside a token_map: vLLM 0.32 sizes those heads to the whole vocabulary, cuts the
    loaded ones to the map and fails (the recipe's Medusa did); refused up front, the fix named."""
    r = CliRunner().invoke(app, ["train-medusa", "--model", str(tiny_model_dir), "--data", str(small_data(tmp_path)),
                                 "--output", str(tmp_path / "o"), "--truncated-vocab-size", "64", "--dtype", "float32"])
    assert isinstance(r.exception, UsageError) and r.exception.exit_code == 2, r.output
    assert "--truncated-vocab-size needs --shared-lm-head" in str(r.exception)
    assert "add --shared-lm-head" in r.exception.fix
    assert not (tmp_path / "o").exists()


def test_ctrl_c_says_how_to_resume(tiny_model_dir, tmp_path):
    """A SIGINT while training: rc 130 with nothing on stderr (typer turns it into a silent exit 130); now
    one line naming the checkpoint and --resume. The signal comes from Python: a shell's & job ignores it."""
    out = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "-m", "specctl.cli", "train-medusa", "--model", str(tiny_model_dir), "--data",
                          str(small_data(tmp_path)), "--num-heads", "2", "--output", str(out), "--steps", "100000",
                          "--save-every", "1", "--batch-size", "2", "--seq-len", "48", "--dtype", "float32"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=quiet_env())
    try:
        deadline = time.monotonic() + 240
        while not checkpoint_dirs(out) and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert checkpoint_dirs(out), "no checkpoint was written"
        p.send_signal(signal.SIGINT)
        stdout, stderr = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130, stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("Interrupted. The newest checkpoint is ") and str(out / "checkpoints") in last
    assert last.endswith("resume with the same command plus --resume.") and "Traceback" not in stderr
    assert stdout == ""
