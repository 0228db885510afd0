"""``import specctl`` changes no environment; ``process_defaults`` (the CLI, the benchmarks) does,
and peer engines get the user's environment without it."""

from __future__ import annotations

import os
import subprocess
import sys


def _run(code: str, **env) -> str:
    base = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    return subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_import_sets_nothing_process_defaults_does_and_peers_do_not_inherit_it():
    code = ("import os, specctl; a = os.environ.get('OMP_WAIT_POLICY'); specctl.process_defaults(); "
            "print(a, os.environ.get('OMP_WAIT_POLICY'), specctl.user_environ().get('OMP_WAIT_POLICY'))")
    assert _run(code) == "None PASSIVE None"
    assert _run(code, OMP_WAIT_POLICY="ACTIVE") == "ACTIVE ACTIVE ACTIVE"  # a user's own setting wins, and passes on
