"""specctl's kernels live in ``specctl.kernels``: a top-level ``kernels`` is the Hugging Face Hub package,
which transformers (>= 5.25) installs as a dependency and which took the import name from specctl's own
top-level ``kernels`` package in a fresh environment (every C++ and numba kernel was then missing)."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

from specctl import kernels

REPO = Path(__file__).resolve().parents[2]


def test_the_kernels_are_this_repositorys_package_from_anywhere():
    assert Path(kernels.__file__).resolve() == REPO / "specctl" / "kernels" / "__init__.py"
    ngram = importlib.import_module("specctl.kernels.ngram")
    assert Path(ngram.__file__).resolve().parent == REPO / "specctl" / "kernels"
    code = "import pathlib, specctl.kernels.cpu as c; print(pathlib.Path(c.__file__).resolve())"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", timeout=60)
    assert res.returncode == 0, res.stderr
    assert Path(res.stdout.strip()) == REPO / "specctl" / "kernels" / "cpu.py"


def test_nothing_imports_a_top_level_kernels_package():
    """A top-level ``kernels`` is the Hub's (or nothing): no module of specctl, its tests or benchmarks imports it."""
    bad = []
    for top in ("specctl", "tests", "benchmarks"):
        for p in (REPO / top).rglob("*.py"):
            for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else []
                bad += [f"{p.relative_to(REPO)}: {n}" for n in names if n == "kernels" or n.startswith("kernels.")]
    assert not bad, bad
