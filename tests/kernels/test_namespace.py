"""Our top-level ``kernels`` package must never be mistaken for the Hugging Face Hub ``kernels`` package.

transformers enables hub kernels when ``is_kernels_available()`` (a version check on the
distribution that provides ``kernels``) says so; with specctl installed that distribution is
specctl itself, whose version is outside transformers' accepted range, so the check is False.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import kernels

REPO = Path(__file__).resolve().parents[2]


def test_kernels_is_this_repositorys_package():
    path = Path(kernels.__file__).resolve()
    assert path == REPO / "kernels" / "__init__.py"
    ngram = importlib.import_module("kernels.ngram")
    assert Path(ngram.__file__).resolve().parent == REPO / "kernels"


def test_transformers_does_not_see_hub_kernels_in_process():
    from transformers.utils import import_utils

    check = import_utils.is_kernels_available
    if hasattr(check, "cache_clear"):
        check.cache_clear()
    assert check() is False


def test_transformers_does_not_see_hub_kernels_in_a_fresh_interpreter():
    code = (
        "import kernels, pathlib\n"
        "from transformers.utils.import_utils import is_kernels_available\n"
        "print(pathlib.Path(kernels.__file__).resolve())\n"
        "print(is_kernels_available())\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", timeout=60)
    assert res.returncode == 0, res.stderr
    file_line, available = res.stdout.strip().splitlines()[-2:]
    assert Path(file_line) == REPO / "kernels" / "__init__.py"  # importable from anywhere, not via cwd
    assert available == "False"
