"""benchmarks/suffix_tree.py runs (a small size) and prints what it measures."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_latency_benchmark_runs(capsys):
    spec = importlib.util.spec_from_file_location("suffix_tree", ROOT / "benchmarks" / "suffix_tree.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.bench(context=512, responses=20, response_len=64, steps=50, k=8)
    out = capsys.readouterr().out
    assert "proposal latency" in out and "us" in out and "evict + insert" in out
