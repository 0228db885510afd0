"""Skinny bf16 linear (decode / verification GEMV) for x86 CPUs with AVX-512 or AVX2.

``run(ext, x, w, b)`` computes F.linear for bf16 inputs of any number of rows with the C++ kernel in
``csrc/skinny_linear.cpp`` (compiled once with torch's cpp_extension, cached in torch's extension
dir); ``load()`` gives the build for this CPU, None on a CPU without AVX2 and FMA, or without a compiler
(``KernelSet.dense`` then takes F.linear, as for other dtypes and CUDA). ``available()`` says whether it
runs, ``path()`` which build: ``"avx512_bf16"``
(vdpbf16ps); on a CPU with AVX-512 but no AVX512-BF16 (Intel Skylake-SP to Ice Lake) ``"avx512"``: the
same arithmetic in fp32 FMAs, equal to the first bit for bit under flush-to-zero (csrc/bf16.h); on a
CPU with AVX2 alone (AMD Zen 2/3, Intel Haswell to Comet Lake) ``"avx2"``: that FMA form with every
zmm operation as two ymm ones (csrc/vec16.h), again bit for bit.

Why it exists: decode is memory bound, and torch's bf16 GEMV on CPU reads weights well below the
memory bandwidth; and each output is reduced in an order independent of the row count, so a row
verified among k+1 rows (or batched with other requests, or in a draft tree of any size) is
bit-identical to that row decoded alone (lossless greedy in bf16). Every row count takes the kernel:
a row-count threshold would hand larger forwards to torch's GEMM, whose rounding differs. For
prefill the kernel runs within ~15 % of oneDNN's AVX512-BF16 GEMM (benchmarks/linear_rows.py); the AVX2 build
takes 20 rows and more through a blocked GEMM with the same bits (csrc/gemm_avx2.h).
A model runs it where its kernel set (``specctl.kernels.select.KernelSet``, resolved at load from the CPU and
``--kernels``) holds this build: its bf16 projections are then ``DenseLinear`` modules reading it.
"""

from __future__ import annotations

import torch

from specctl.kernels import cpu
from specctl.kernels._build import build

FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512bf16"]
FLAGS_AVX512 = ["-mavx512f", "-mavx512bw", "-mavx512vl"]  # no -mavx512bf16: csrc/bf16.h's FMA form
# no AVX-512 at all: csrc/vec16.h's two-ymm form of every zmm operation (no contraction of a * b + c into an
# FMA that the AVX-512 builds would not make)
FLAGS_AVX2 = ["-mavx2", "-mfma", "-ffp-contract=off"]
# path -> (extension name, CPU features, compiler flags), in order of preference
BUILDS = {"avx512_bf16": ("specctl_skinny_linear", cpu.AVX512_BF16, FLAGS),
          "avx512": ("specctl_skinny_linear_avx512f", cpu.AVX512, FLAGS_AVX512),
          "avx2": ("specctl_skinny_linear_avx2", cpu.AVX2, FLAGS_AVX2)}


def spec(p: str) -> tuple[str, str, tuple[str, ...], list[str]]:
    """(extension name, source, CPU features, compiler flags) of path ``p``'s build."""
    name, needs, flags = BUILDS[p]
    return name, "skinny_linear.cpp", needs, flags


def vector_path() -> str | None:
    """The row-major kernels' build this CPU takes ("avx512_bf16", "avx512", "avx2"), by its features alone."""
    return next((p for p, (_, needs, _) in BUILDS.items() if cpu.has(*needs)), None)


def load():
    """The compiled extension for this CPU's features now, or None where none can run here (compiled at most
    once per build: ``specctl.kernels._build``)."""
    p = vector_path()
    return None if p is None else build(*spec(p))


def available() -> bool:
    return load() is not None


def path() -> str | None:
    """"avx512_bf16", "avx512" or "avx2": the build that runs (None: none can run here)."""
    ext = load()
    return None if ext is None else build_path(ext)


def build_path(ext) -> str:
    """The path ("avx512_bf16", "avx512", "avx2") a build of this kernel is for."""
    return next(p for p, b in BUILDS.items() if ext.__name__ == b[0])


def run(ext, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, b) through build ``ext`` (bf16 CPU x [..., K] with at least one row, w [N, K] contiguous)."""
    rows = x.numel() // x.shape[-1]
    y = ext.skinny_linear(x.reshape(rows, x.shape[-1]), w, b)
    return y.view(*x.shape[:-1], w.shape[0])
