"""The root command: fast --help, --version, usage errors exit 2."""

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


def test_unknown_option_is_usage_error():
    r = subprocess.run([sys.executable, "-m", "specctl.cli", "bench", "--no-such-flag"], capture_output=True, text=True)
    assert r.returncode == 2
