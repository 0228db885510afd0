"""specctl: a toolkit for speculative decoding.

One lossless runtime (``specctl.runtime``) shared by every draft method, and the commands built on
it (``specctl.cli``). Heavy dependencies (torch, transformers) are imported lazily by the modules
that need them, so ``import specctl`` and ``specctl --help`` stay fast.
"""

import os as _os

__version__ = "0.1.0"

_set_by_specctl: dict[str, str] = {}


def process_defaults() -> None:
    """Settings for a process that runs specctl's engine; call it before torch loads (the CLI's
    ``main`` and the benchmark scripts do; importing specctl changes nothing).

    OpenMP's worker threads spin after each parallel region by default; on a CPU shared with other
    processes they take the cores from the threads that have work (measured here: 1.5B decode 616 ->
    235 ms/token, SmolLM2 decode 2x faster). Sleeping workers cost a wake-up per region instead.
    A user's own setting wins."""
    if "OMP_WAIT_POLICY" not in _os.environ:
        _os.environ["OMP_WAIT_POLICY"] = _set_by_specctl["OMP_WAIT_POLICY"] = "PASSIVE"


def user_environ() -> dict[str, str]:
    """The environment as the user gave it, without what ``process_defaults`` added: a peer engine
    runs with its own defaults, not specctl's."""
    return {k: v for k, v in _os.environ.items() if _set_by_specctl.get(k) != v}
