"""``import specctl`` changes no environment; ``process_defaults`` (the CLI, the benchmarks) does,
and peer engines get the user's environment without it."""

from __future__ import annotations

import os
import subprocess
import sys


def _run(code: str, **env) -> str:
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    return subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_import_sets_nothing_process_defaults_does_and_peers_do_not_inherit_it():
    code = ("import os, specctl; e = lambda d: [d.get(k) for k in ('OMP_WAIT_POLICY', 'GOMP_SPINCOUNT')]; "
            "a = e(os.environ); specctl.process_defaults(); print(a, e(os.environ), e(specctl.user_environ()))")
    assert _run(code) == "[None, None] [None, '10000'] [None, None]"
    # a user's own setting wins, and passes on
    assert _run(code, OMP_WAIT_POLICY="ACTIVE") == "['ACTIVE', None] ['ACTIVE', None] ['ACTIVE', None]"
    assert _run(code, GOMP_SPINCOUNT="5") == "[None, '5'] [None, '5'] [None, '5']"


IDLE = """
import os, time, specctl
specctl.process_defaults()
import torch
torch.set_num_threads(2)
x = torch.ones(1 << 22)
for _ in range(20):
    x.sum()  # parallel regions: the workers exist and have waited for work

def busy():  # ns on a CPU of every thread but this one (/proc schedstat: run time first)
    me = str(__import__("threading").get_native_id())
    return sum(int(open(f"/proc/self/task/{t}/schedstat").read().split()[0])
               for t in os.listdir("/proc/self/task") if t != me)

a = busy(); time.sleep(0.4); print((busy() - a) / 1e9)
"""


def test_idle_openmp_workers_sleep_between_steps():
    """specctl's workers spin a short while, then sleep: an idle process holds no core (a spinning one
    took a concurrent process's cores). The control, OMP_WAIT_POLICY=ACTIVE, shows that the measure sees
    a spinning worker."""
    if not os.path.exists(f"/proc/{os.getpid()}/schedstat"):
        import pytest

        pytest.skip("no /proc schedstat on this system")
    assert float(_run(IDLE)) < 0.1  # CPU seconds the workers ran in 0.4 s idle
    assert float(_run(IDLE, OMP_WAIT_POLICY="ACTIVE")) > 0.2
