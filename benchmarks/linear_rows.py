"""The AVX512-BF16 skinny linear against torch's bf16 GEMM, by row count, measured in one run.

    python benchmarks/linear_rows.py                     # this CPU as it is
    ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 python benchmarks/linear_rows.py   # torch as on a CPU without AMX

Exact bf16 mode on a CPU without AMX sends every linear through specctl/kernels/csrc/skinny_linear.cpp, for
any row count (a row-count threshold would make a row's rounding depend on its forward's size).
This prints, for Qwen2.5-Coder-1.5B's shapes and 1..1024 rows, the best of 5 runs of each and the
ratio kernel / torch: decode rows (1-16) should be below 1, prefill (hundreds of rows) near 1 when
torch is held to AVX512-BF16 as on an AMD EPYC (on an AMX CPU torch's GEMM uses AMX tiles, and
specctl packs its weights for its own AMX kernel instead, so this kernel is not used there).
"""

from __future__ import annotations

import specctl

specctl.process_defaults()  # OpenMP settings (GOMP_SPINCOUNT) before torch loads

import time

import torch
import torch.nn.functional as F

from specctl.kernels import skinny_linear
from specctl.kernels.cpu import name as cpu_name


def best(fn, reps: int = 5) -> float:
    fn()
    t_min = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        t_min = min(t_min, time.perf_counter() - t)
    return t_min


def main() -> None:
    ext = skinny_linear.load()
    if ext is None:
        raise SystemExit("this CPU has no avx512_bf16 (or no compiler): the skinny kernel does not run here")
    import os

    print(f"CPU: {cpu_name()}; torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA', '(unset)')}")
    print(f"{'N x K':>12} {'rows':>5} {'kernel ms':>10} {'torch ms':>10} {'kernel/torch':>13}")
    g = torch.Generator().manual_seed(0)
    for n, k in [(17920, 1536), (1536, 8960), (2048, 1536)]:  # gate|up, down, q|k|v of the 1.5B
        w = torch.randn(n, k, generator=g).bfloat16()
        for rows in (1, 8, 16, 17, 64, 256, 1024):
            x = torch.randn(rows, k, generator=g).bfloat16()
            a = best(lambda: ext.skinny_linear(x, w, None))
            b = best(lambda: F.linear(x, w))
            print(f"{f'{n}x{k}':>12} {rows:>5} {a * 1e3:>10.2f} {b * 1e3:>10.2f} {a / b:>13.2f}", flush=True)


if __name__ == "__main__":
    main()
