"""Compile a C++ kernel in ``specctl/kernels/csrc`` once per machine (torch cpp_extension, cached).

``build(name, source, needs, cflags)`` returns the extension module, or None where it cannot
run here: the CPU lacks one of ``needs`` (as /proc/cpuinfo names them, see ``specctl.kernels.cpu``), or there is no
compiler; callers then keep torch's path. Every kernel is built with OpenMP: ATen's
``at::parallel_for`` is a header template, and without -fopenmp it silently runs on one thread.
"""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path

from specctl.kernels import cpu

CSRC = Path(__file__).parent / "csrc"


# Every build's own functions stay inside its .so (-fvisibility=hidden; pybind11 still exports PyInit).
# Without it the headers' inline functions and templates (skinny_gemm.h, gguf_q8.h, ...) are exported as
# weak symbols, and the dynamic linker binds every later-loaded build to the first-loaded build's copy
# (seen: quant_linear's builds and the quantized block's shared gguf_q8.h's 57 such functions, the skinny
# linear and the AVX512-BF16 block skinny_gemm.h's 23; an A/B of two revisions' builds in one process,
# as benchmarks/quant_linear_ab.py runs, timed the first-loaded revision's kernels twice).
CFLAGS = ["-O3", "-fopenmp", "-std=c++17", "-fvisibility=hidden"]

STALE_LOCK_S = 600  # a kernel builds in 1-2 minutes; a lock this old was left by a build that was killed


def clear_stale_lock(build_dir: Path, max_age_s: float = STALE_LOCK_S) -> bool:
    """Remove ``build_dir/lock`` if it is older than ``max_age_s``: torch takes the lock while it builds an
    extension and waits, silently and forever, while it exists, so a build interrupted once (Ctrl-C, a
    killed job) would hang every later run. Returns whether a lock was removed."""
    lock = build_dir / "lock"
    try:
        if time.time() - lock.stat().st_mtime < max_age_s:
            return False
        lock.unlink()
    except OSError:  # no lock (the usual case), or another process just took it away
        return False
    print(f"specctl: removed a stale build lock left by an interrupted build ({lock})", file=sys.stderr)
    return True


_built: dict[str, object] = {}  # extension name -> its module or None: each build compiled (or found wanting) once


def build(name: str, source: str, needs: tuple[str, ...], cflags: list[str], csrc: Path = CSRC):
    """The extension ``name`` compiled from ``source`` in ``csrc`` (once per process: a cache of built modules, not
    a choice of kernels; which build a model runs is its ``specctl.kernels.select.KernelSet``), or None where this
    CPU (as ``cpu.flags()`` sees it now) lacks one of ``needs`` or it cannot build. ``csrc`` is another folder of
    the same sources only for an A/B against a git revision's kernels (benchmarks/skinny_builds_ab.py)."""
    missing = [f for f in needs if f not in cpu.flags()]
    if missing:
        return None
    if name not in _built:
        _built[name] = _compile(name, source, cflags, csrc)
    return _built[name]


def _compile(name: str, source: str, cflags: list[str], csrc: Path):
    # torch's own build folder (a private helper): a torch without it only loses the stale-lock check
    with contextlib.suppress(Exception):
        from torch.utils.cpp_extension import _get_build_directory

        clear_stale_lock(Path(_get_build_directory(name, verbose=False)))
    try:
        from torch.utils.cpp_extension import load as load_ext

        return load_ext(name=name, sources=[str(csrc / source)], extra_include_paths=[str(csrc)],
                        extra_cflags=[*CFLAGS, *cflags], extra_ldflags=["-fopenmp"],
                        verbose=False)
    except Exception as e:  # noqa: BLE001 - any build failure means: use torch's path
        print(f"specctl: kernel {name} unavailable ({type(e).__name__}: {str(e)[:200]}); using torch's path",
              file=sys.stderr)
        return None
