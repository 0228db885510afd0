"""The quantized linear kernel of this working tree against the same kernel at a git revision, in one run.

    python benchmarks/quant_linear_ab.py [--rev HEAD] [--rows 1 4 8 9] [--rounds 5]

Builds specctl/kernels/csrc/quant_linear.cpp twice (the avx512_vnni path: the one bf16 x takes on VNNI CPUs), from
the revision's specctl/kernels/csrc (``git show REV:...``, headers included) and from the working tree, and times
both on Qwen2.5-Coder-1.5B's shapes (gate|up
[8960, 1536] Q4_K, down [1536, 8960] Q6_K; random blocks with small scales) at each row count, calls of the
two builds alternated in rounds (this machine is shared and noisy: each figure is the median over rounds
of a round's lower quartile). Checks that both give the same outputs bit for bit, and prints the CPU,
each build's time and their ratio.
"""

from __future__ import annotations

import specctl

specctl.process_defaults()  # OpenMP settings (GOMP_SPINCOUNT) before torch loads

import argparse
import time
from pathlib import Path

import torch

from specctl.kernels.cpu import name as cpu_name

ROOT = Path(__file__).resolve().parents[1]


def build(name: str, source: Path):
    """``source`` built against the headers beside it (a revision's own gguf_q8.h, not the tree's)."""
    from torch.utils.cpp_extension import load

    from specctl.kernels import quant_linear as ql
    from specctl.kernels._build import CFLAGS

    return load(name=name, sources=[str(source)], extra_include_paths=[str(source.parent)],
                extra_cflags=[*CFLAGS, *ql._FLAGS["avx512_vnni"], "-ffp-contract=off"],
                extra_ldflags=["-fopenmp"])


def blocks(qtype: str, N: int, K: int, g: torch.Generator) -> torch.Tensor:
    from specctl.kernels import quant_linear as ql

    w = torch.randint(0, 256, (N, ql.row_bytes(qtype, K)), dtype=torch.uint8, generator=g)
    v = w.view(N, -1, ql.TYPES[qtype][2])
    small = torch.tensor([0, 0x1C], dtype=torch.uint8)  # fp16 2^-8: finite, modest outputs
    if qtype == "Q4_K":
        v[:, :, 0:2], v[:, :, 2:4] = small, small
    else:
        v[:, :, 208:210] = small
    return w


def main() -> None:
    from specctl.kernels import cpu
    from specctl.kernels import quant_linear as ql

    ap = argparse.ArgumentParser()
    ap.add_argument("--rev", default="HEAD", help="the git revision to compare against")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 9])
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    if any(not cpu.has(f) for f in ql.NEEDS["avx512_vnni"]):
        raise SystemExit("this CPU lacks AVX512-VNNI: the int8 path does not run here")
    from block_ab import sources  # beside this script

    tmp, rev = sources(a.rev)  # the revision's specctl/kernels/csrc, headers included
    exts = {rev: build(f"specctl_ql_ab_{rev}", tmp / "quant_linear.cpp"),
            "tree": build("specctl_ql_ab_tree", ROOT / "specctl/kernels/csrc/quant_linear.cpp")}
    g = torch.Generator().manual_seed(0)
    cases = [("Q4_K", 8960, 1536), ("Q6_K", 1536, 8960)]
    ws = {c: blocks(c[0], c[1], c[2], g) for c in cases}
    times: dict[tuple, list[float]] = {}
    for _ in range(a.rounds):
        for qtype, N, K in cases:
            for M in a.rows:
                x = torch.randn(M, K, generator=g).bfloat16()
                args = ([ws[(qtype, N, K)]], [ql.TYPES[qtype][0]], K, None, False)
                ys = []
                for name, ext in exts.items():
                    for _ in range(3):
                        ext.quant_linear(x, *args)
                    ts = []
                    for _ in range(16):
                        t = time.perf_counter()
                        ext.quant_linear(x, *args)
                        ts.append(time.perf_counter() - t)
                    times.setdefault((qtype, M, name), []).append(sorted(ts)[4])
                    ys.append(ext.quant_linear(x, *args))
                if not torch.equal(ys[0], ys[1]):
                    raise SystemExit(f"{qtype} at {M} rows: the two builds differ")
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    print(f"# {cpu_name()}, {torch.get_num_threads()} threads; quant_linear avx512_vnni at {rev} vs the working tree; "
          f"outputs equal bit for bit")
    for qtype, N, K in cases:
        for M in a.rows:
            o, n = med[(qtype, M, rev)], med[(qtype, M, "tree")]
            print(f"  {qtype} [{M}, {K}] x [{N}, {K}]: {rev} {o * 1e6:7.0f} us  tree {n * 1e6:7.0f} us  "
                  f"{rev}/tree {o / n:.2f}x   (tree: {M} rows / 1 row {n / med[(qtype, a.rows[0], 'tree')]:.2f})")


if __name__ == "__main__":
    main()
