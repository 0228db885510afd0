"""Compile a C++ kernel in ``kernels/csrc`` once per machine (torch cpp_extension, cached).

``build(name, source, needs, cflags)`` returns the extension module, or None where it cannot
run here: the CPU lacks one of ``needs`` (as /proc/cpuinfo names them, see ``kernels.cpu``), or there is no
compiler; callers then keep torch's path. Every kernel is built with OpenMP: ATen's
``at::parallel_for`` is a header template, and without -fopenmp it silently runs on one thread.
"""

from __future__ import annotations

import sys
from pathlib import Path

from kernels import cpu

CSRC = Path(__file__).parent / "csrc"


def build(name: str, source: str, needs: tuple[str, ...], cflags: list[str]):
    missing = [f for f in needs if f not in cpu.flags()]
    if missing:
        return None
    try:
        from torch.utils.cpp_extension import load as load_ext

        return load_ext(name=name, sources=[str(CSRC / source)], extra_include_paths=[str(CSRC)],
                        extra_cflags=["-O3", "-fopenmp", "-std=c++17", *cflags], extra_ldflags=["-fopenmp"],
                        verbose=False)
    except Exception as e:  # noqa: BLE001 - any build failure means: use torch's path
        print(f"specctl: kernel {name} unavailable ({type(e).__name__}: {str(e)[:200]}); using torch's path",
              file=sys.stderr)
        return None
