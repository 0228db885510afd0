"""Build every C++ kernel this CPU can run, ahead of the first model load, several at a time.

    python -m specctl.kernels.prebuild [--jobs N] [--only-selected]

Each kernel otherwise compiles the first time a model needs it (20-40 s each, one core); in a fresh
container or CI job that is minutes spent one build at a time. Here every build the loaders could ask for on
this CPU (its own path and, for tests that hide features, the paths of CPUs with fewer) is compiled by
torch's cpp_extension exactly as the loader would compile it (same name, source and flags, so the loader
later finds it in torch's extension cache), ``--jobs`` at a time. ``--only-selected``: just the builds this
CPU's own paths load. The test suite starts it in the background when it runs in several processes
(pytest -n), so the workers find the kernels built instead of waiting on one build after another.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed

Spec = tuple[str, str, tuple[str, ...], list[str]]  # (extension name, source, CPU features, compiler flags)


def specs(only_selected: bool = False) -> list[Spec]:
    """The builds this CPU can run, the ones its own paths load first (then every other path's)."""
    from specctl.kernels import (
        amx_linear,
        cpu,
        decode_attention,
        decode_layer,
        quant_linear,
        skinny_linear,
    )

    vector = skinny_linear.vector_path()
    own: list[Spec] = [amx_linear.SPEC]
    if vector is not None:
        own += [skinny_linear.spec(vector), decode_attention.spec(vector)]
    amx = cpu.has(*amx_linear.SPEC[2])
    kinds = ["amx"] if amx else [vector] if vector else []  # the fused block's build, as decode_layer.load()
    own += [decode_layer.spec(k) for k in kinds]
    qbest = next((p for p in quant_linear.PATHS if cpu.has(*quant_linear.NEEDS[p])), None)
    if qbest is not None:
        own.append(quant_linear.spec(qbest))
        if qbest in ("avx512_vnni", "amx_int8"):
            own.append(decode_layer.spec(qbest))
    rest: list[Spec] = []
    if not only_selected:
        for p in skinny_linear.BUILDS:
            rest += [skinny_linear.spec(p), decode_attention.spec(p)]
        rest += [decode_layer.spec(k) for k in ("amx", *skinny_linear.BUILDS, "avx512_vnni", "amx_int8")]
        rest += [quant_linear.spec(p) for p in quant_linear.PATHS]
    seen: set[str] = set()
    out = []
    for s in own + rest:
        if s[0] not in seen and cpu.has(*s[2]):
            seen.add(s[0])
            out.append(s)
    return out


def _build_one(spec: Spec) -> tuple[str, bool, float]:
    from specctl.kernels._build import build

    t0 = time.perf_counter()
    ok = build(*spec) is not None
    return spec[0], ok, time.perf_counter() - t0


def build_all(jobs: int, only_selected: bool = False, log=None) -> list[tuple[str, bool, float]]:
    """Builds ``specs()``, ``jobs`` processes at a time; returns (name, built, seconds) in the order they finish."""
    done = []
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        for f in as_completed([pool.submit(_build_one, s) for s in specs(only_selected)]):
            done.append(f.result())
            if log:
                log(*done[-1])
    return done


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specctl.kernels.prebuild", description=__doc__.split("\n\n")[0],
                                 epilog="example: python -m specctl.kernels.prebuild --jobs 2")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="builds at a time (default: the CPU count)")
    ap.add_argument("--only-selected", action="store_true", help="only the builds this CPU's own paths load")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    done = build_all(max(1, a.jobs), a.only_selected,
                     log=lambda n, ok, s: print(f"{'built' if ok else 'FAILED'} {n} ({s:.0f} s)", file=sys.stderr, flush=True))
    failed = [n for n, ok, _ in done if not ok]
    print(f"{len(done) - len(failed)}/{len(done)} kernels ready in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
