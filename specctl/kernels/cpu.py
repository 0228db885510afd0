"""What this CPU offers specctl's kernels (a leaf: the kernel modules ask it; ``specctl.kernels.select``
names the path they add up to).

``flags()`` is /proc/cpuinfo's feature set; ``select.bf16_path()`` names the path a bf16 CPU model runs on:

- ``"amx"``: AMX tiles (amx_bf16) for every linear and the fused decode block;
- ``"avx512_bf16"``: the AVX512-BF16 skinny kernel for every linear, the row-independent attention;
- ``"avx512"``: AVX-512 without BF16 (Intel Skylake-SP, Cascade Lake, Ice Lake): the same kernels with
  vdpbf16ps's arithmetic in fp32 FMAs, bit for bit the ``"avx512_bf16"`` path's results (csrc/bf16.h);
- ``"avx2"``: AVX2 and FMA alone (AMD Zen 2/3, Intel Haswell to Comet Lake): those kernels again, each
  zmm operation as two ymm ones, bit for bit the same results (csrc/vec16.h);
- ``"torch"``: none of these, so torch's own kernels, where a row's rounding can depend on how many rows
  share its forward (bf16 greedy speculation then matches plain decoding except at near-ties).

The first four are row-independent: a row forwarded among any number of others (a verify block, a
draft tree, a batch) equals, bit for bit, the same row forwarded alone.

``select.hidden(*names)`` hides features for a while, as if the CPU lacked them: the kernel loaders then
take the path such a CPU takes (tests run the AVX512-BF16 and torch paths on an AMX machine).
``SPECCTL_CPU_HIDE=amx_bf16,amx_tile`` does the same for a whole process (the test suite as an AMD
EPYC runs it: with ``ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16`` torch's own kernels follow suit).
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

AMX = ("amx_bf16", "amx_tile", "avx512_bf16")
AVX512_BF16 = ("avx512_bf16",)
AVX512 = ("avx512f", "avx512bw", "avx512vl")
AVX2 = ("avx2", "fma")
_hidden: set[str] = {f for f in os.environ.get("SPECCTL_CPU_HIDE", "").split(",") if f}


@lru_cache(maxsize=1)
def _cpuinfo_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


@lru_cache(maxsize=1)
def name() -> str:
    """The CPU's model name as /proc/cpuinfo gives it ("AMD EPYC", "Intel(R) Xeon(R) ..."): every figure a
    benchmark prints names it (the machines are of one kind, not of one CPU model)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "unknown CPU"


def flags() -> set[str]:
    return set(_cpuinfo_flags()) - _hidden


def has(*names: str) -> bool:
    return all(n in flags() for n in names)


def why_not(features: tuple[str, ...], built: bool = True) -> str:
    """A skip reason naming what is missing: the CPU features, else the kernel's build."""
    missing = [f for f in features if not has(f)]
    if missing:
        return f"needs the CPU feature{'s' if len(missing) > 1 else ''} {', '.join(missing)}, which this CPU lacks"
    if not built:
        return f"the kernel for {', '.join(features)} did not build here (no C++ compiler?)"
    return ""
