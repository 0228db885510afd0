"""The root command: fast --help, --version, usage errors exit 2, a Ctrl-C is one line and exit 130."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from specctl import __version__


def test_help_is_fast_and_lists_commands():
    env = {**os.environ}
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "specctl.cli", "--help"], capture_output=True, text=True, env=env)
    elapsed = time.perf_counter() - t
    assert r.returncode == 0
    assert "bench" in r.stdout and "models" in r.stdout
    assert elapsed < 10  # generous bound for a loaded CI machine; the real check is the import below


def test_help_imports_no_torch():
    code = "import sys; from specctl.cli import app; print('torch' in sys.modules, 'transformers' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.stdout.strip() == "False False"


def test_bench_help_has_example():
    r = subprocess.run([sys.executable, "-m", "specctl.cli", "bench", "--help"], capture_output=True, text=True,
                       env={**os.environ, "COLUMNS": "200"})
    assert r.returncode == 0 and "specctl bench --method ngram" in r.stdout


def test_version():
    r = subprocess.run([sys.executable, "-m", "specctl.cli", "--version"], capture_output=True, text=True)
    assert r.stdout.strip() == __version__


def test_usage_errors_are_one_line_exit_2():
    """A missing, unknown or malformed option: one line naming it and the command's --help (click's own is a
    box of several lines); no arguments at all: the help."""
    for args, needle in ((["bench", "--no-such-flag"], "No such option: --no-such-flag"),
                         (["bench", "-n", "abc"], "Invalid value for '--num-prompts'"),
                         (["train-eagle", "--model", "x"], "Missing option '--output'"),
                         (["nosuch"], "No such command 'nosuch'")):
        r = subprocess.run([sys.executable, "-m", "specctl.cli", *args], capture_output=True, text=True)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and needle in lines[0] and "--help" in lines[0], (args, r.stderr)
    r = subprocess.run([sys.executable, "-m", "specctl.cli"], capture_output=True, text=True)
    assert "Usage:" in r.stdout + r.stderr and "bench" in r.stdout + r.stderr


INTERRUPTED = """
import sys
from pathlib import Path

import specctl.models
import specctl.training.medusa


def interrupt(*a, **k):
    raise KeyboardInterrupt


def interrupt_after_a_checkpoint(cfg, **k):
    ck = Path(cfg.output) / "checkpoints" / "step-0000003"
    ck.mkdir(parents=True, exist_ok=True)
    (ck / "trainer_state.json").write_text("{}")
    raise KeyboardInterrupt


specctl.models.list_models = interrupt
specctl.training.medusa.train = interrupt_after_a_checkpoint
from specctl.cli import main

sys.argv = ["specctl", *sys.argv[1:]]
main()
"""


def test_ctrl_c_is_one_line_and_exit_130(tmp_path):
    """Typer turns a KeyboardInterrupt into a silent exit 130; main says so, with a trainer's resume hint.
    (A real SIGINT during training: tests/commands/test_train_medusa_cmd.py.)"""
    def run(*args):
        return subprocess.run([sys.executable, "-c", INTERRUPTED, *args], capture_output=True, text=True, cwd=tmp_path,
                              check=False)

    r = run("models", "list")
    assert r.returncode == 130 and r.stderr == "Interrupted.\n" and r.stdout == ""
    r = run("train-medusa", "--model", "m", "--data", "x.jsonl", "--output", "run")
    assert r.returncode == 130 and r.stdout == ""
    assert r.stderr == ("Interrupted. The newest checkpoint is run/checkpoints/step-0000003: resume with the same "
                        "command plus --resume.\n")
    r = run("train-medusa", "--model", "m", "--data", "x.jsonl", "--output", "run", "--resume")
    assert r.returncode == 130 and r.stderr.endswith("step-0000003: run the same command again.\n")
