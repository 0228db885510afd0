"""specctl: a toolkit for speculative decoding.

One lossless runtime (``specctl.runtime``) shared by every draft method, and the commands built on
it (``specctl.cli``). Heavy dependencies (torch, transformers) are imported lazily by the modules
that need them, so ``import specctl`` and ``specctl --help`` stay fast.
"""

import os as _os

__version__ = "0.1.0"

_set_by_specctl: dict[str, str] = {}
SPIN = 10000  # GOMP_SPINCOUNT: iterations a worker spins before it sleeps (see process_defaults)


def process_defaults() -> None:
    """Settings for a process that runs specctl's engine; call it before torch loads (the CLI's
    ``main`` and the benchmark scripts do; importing specctl changes nothing).

    OpenMP's workers (GNU OpenMP, torch's and specctl's kernels') wait for the next parallel region by
    spinning, then sleeping. A step runs many regions back to back (a quantized 1.5B step: ~200), so
    workers that sleep at once pay a wake-up per region: on an AMD EPYC (5 rounds of processes
    alternated) such a step took 47-65 ms (median 54) with ``OMP_WAIT_POLICY=PASSIVE``, 34-50 ms
    (median 35) with this default and 32-36 ms with ``ACTIVE``. Workers that spin
    for long hold the cores while the process idles between steps (between requests, or while a peer
    engine runs in bench): GNU OpenMP's default spins ~10 ms here, ``ACTIVE`` for ever, and a spinning
    idle specctl took the cores of a concurrent process (1.5B decode 616 vs 235 ms/token, the llama.cpp
    peer 0.37 tok/s). So workers spin ``SPIN`` iterations of a pause, about 0.4 ms (a pause took 38 ns
    on that EPYC; Intel gives ~140 cycles since Skylake), longer than the gaps between a step's regions,
    then sleep (where there are more threads than CPUs, GNU OpenMP spins 100 at most). With
    ``OMP_WAIT_POLICY=PASSIVE`` beside it, GNU OpenMP does not spin at all (measured), so specctl
    sets only ``GOMP_SPINCOUNT``. A user's own OMP_WAIT_POLICY or GOMP_SPINCOUNT wins."""
    if "OMP_WAIT_POLICY" in _os.environ or "GOMP_SPINCOUNT" in _os.environ:
        return
    _os.environ["GOMP_SPINCOUNT"] = _set_by_specctl["GOMP_SPINCOUNT"] = str(SPIN)


def user_environ() -> dict[str, str]:
    """The environment as the user gave it, without what ``process_defaults`` added: a peer engine
    runs with its own defaults, not specctl's."""
    return {k: v for k, v in _os.environ.items() if _set_by_specctl.get(k) != v}
