"""The AVX512-BF16 path (no AMX) of this working tree against the same path at a git revision, in one run.

    python benchmarks/skinny_ab.py [--rev HEAD] [--model qwen2.5-coder-1.5b] [--rounds 8] [--rows 1 8]

Builds kernels/csrc/decode_layer.cpp (the fused block's AVX512-BF16 build) and skinny_linear.cpp (every
other bf16 linear, the LM head among them) from the revision's kernels/csrc (``git show REV:...``, headers
included), loads the model once with the working tree's builds, and times forwards of each row count
(one token after a 256-token prompt, or a verify forward of several) with the two builds' calls
alternated in rounds, checking that both give the same logits bit for bit. Prints the CPU, each build's
time (the lower quartile of its steps) and their ratio. On a CPU with AMX, the AMX features are hidden (SPECCTL_CPU_HIDE) so that the model runs
the path an AMD EPYC runs; the figures are this CPU's, not an EPYC's.
"""

from __future__ import annotations

import os
from pathlib import Path

# before kernels.cpu reads it: an AMX CPU runs the path a CPU without AMX takes
if "SPECCTL_CPU_HIDE" not in os.environ and " amx_bf16" in Path("/proc/cpuinfo").read_text():
    os.environ["SPECCTL_CPU_HIDE"] = "amx_bf16,amx_tile,amx_int8"

import specctl

specctl.process_defaults()  # OpenMP settings (GOMP_SPINCOUNT) before torch loads

import argparse
import subprocess
import tempfile
import time

import torch

ROOT = Path(__file__).resolve().parents[1]


def build_rev(rev: str):
    """(decode_layer's AVX512-BF16 build, skinny_linear's build) from the revision's sources."""
    from torch.utils.cpp_extension import load

    from kernels._build import CFLAGS
    from kernels.decode_layer import AVX512

    src = Path(tempfile.mkdtemp(prefix="skinny_ab_"))
    names = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", rev, "kernels/csrc/"],
                           capture_output=True, text=True, check=True).stdout.split()
    for f in names:
        (src / Path(f).name).write_bytes(subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{f}"],
                                                        capture_output=True, check=True).stdout)
    tag = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", rev], capture_output=True, text=True,
                         check=True).stdout.strip()

    def one(name: str, source: str, flags: list[str]):
        return load(name=f"{name}_ab_{tag}", sources=[str(src / source)], extra_include_paths=[str(src)],
                    extra_cflags=[*CFLAGS, *flags], extra_ldflags=["-fopenmp"])

    return (one("specctl_decode_layer_avx512", "decode_layer.cpp", ["-DSPECCTL_SKINNY", *AVX512]),
            one("specctl_skinny_linear", "skinny_linear.cpp", ["-mavx512f", "-mavx512bw", "-mavx512bf16"]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rev", default="HEAD", help="the git revision to hold the working tree against")
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    a = ap.parse_args()

    from kernels import decode_layer, skinny_linear
    from kernels.cpu import name as cpu_name
    from specctl.models import resolve_model
    from specctl.runtime.runner import TargetRunner, load_model

    m = load_model(resolve_model(a.model), "bfloat16").model
    if decode_layer.kind() != "avx512_bf16" or m.cpu_kernels != "avx512_bf16":
        raise SystemExit(f"this CPU does not run the AVX512-BF16 path (bf16 path {m.cpu_kernels})")
    builds = {"rev": build_rev(a.rev), "tree": (decode_layer._ext, skinny_linear._ext)}
    runner = TargetRunner(m, 1024)
    runner.forward(torch.randint(0, 1000, (1, 256)))
    base = runner.length
    g = torch.Generator().manual_seed(0)

    def step(x: torch.Tensor) -> tuple[float, torch.Tensor]:
        t = time.perf_counter()
        out = runner.forward(x)
        dt = time.perf_counter() - t
        runner.rollback(base)
        return dt, out[0] if isinstance(out, tuple) else out

    times = {k: {T: [] for T in a.rows} for k in builds}
    try:
        for r in range(a.rounds):
            for T in a.rows:
                x = torch.randint(0, 1000, (1, T), generator=g)
                outs = {}
                for k in (("rev", "tree") if r % 2 else ("tree", "rev")):
                    decode_layer._ext, skinny_linear._ext = builds[k]
                    step(x)
                    for _ in range(3):
                        dt, outs[k] = step(x)
                        times[k][T].append(dt)
                if not torch.equal(outs["rev"], outs["tree"]):
                    raise SystemExit(f"the two builds' logits differ at {T} rows")
    finally:
        decode_layer._ext, skinny_linear._ext = builds["tree"]
    q = {k: {T: sorted(v)[len(v) // 4] for T, v in d.items()} for k, d in times.items()}
    print(f"{cpu_name()}, {a.model}, bf16 path avx512_bf16 (hidden: {os.environ.get('SPECCTL_CPU_HIDE') or 'none'}), "
          f"{torch.get_num_threads()} threads; {a.rev} vs the working tree, {a.rounds} rounds; logits equal")
    for T in a.rows:
        print(f"  {T:>2} rows: {a.rev} {q['rev'][T] * 1e3:7.1f} ms, tree {q['tree'][T] * 1e3:7.1f} ms, "
              f"tree {q['rev'][T] / q['tree'][T]:.2f}x as fast")
    if len(a.rows) > 1:
        lo = a.rows[0]
        print("  cost against " + f"{lo} row(s): " + "; ".join(
            f"{T} rows {a.rev} {q['rev'][T] / q['rev'][lo]:.2f}, tree {q['tree'][T] / q['tree'][lo]:.2f}"
            for T in a.rows[1:]))


if __name__ == "__main__":
    main()
