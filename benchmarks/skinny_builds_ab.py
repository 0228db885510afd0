"""Two builds of the skinny bf16 linear, differing in compiler flags or in revision, alternated in one process over
every linear of a model (its projections and LM head, one pass each), by row count.

    python benchmarks/skinny_builds_ab.py --model qwen2.5-coder-1.5b \\
        --a=-DSPECCTL_PF_HINT=_MM_HINT_T0 --b=-DSPECCTL_PF_HINT=_MM_HINT_T1 --rounds 7
    python benchmarks/skinny_builds_ab.py --a-rev d55ae36 --a= --rows 24 --rows 256   # a revision against this tree

The machines here are shared and their read bandwidth drifts (35 to 62 GB/s within minutes on an AMD EPYC), so
two runs minutes apart do not compare; here each round times both builds back to back at every row count
(the order swapped every other round), and the ratio b / a is taken within a round. Prints, per row count,
each build's median time of the pass, its GB/s of weights, its cost against one row, and the median and range
of b / a over rounds. The outputs of the two builds are checked to be the same bits first (both are the kernel
specctl runs: csrc/skinny_gemm.h).
"""

from __future__ import annotations

import specctl

specctl.process_defaults()  # OpenMP settings (GOMP_SPINCOUNT) before torch loads

import argparse
import statistics as S
import time

import torch

from specctl.kernels import skinny_linear
from specctl.kernels._build import build
from specctl.kernels.cpu import name as cpu_name


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--a", default="-DSPECCTL_PF_HINT=_MM_HINT_T0", help="build a's extra compiler flags (space-separated)")
    ap.add_argument("--b", default="", help="build b's extra compiler flags (default: none, the kernel as it ships)")
    ap.add_argument("--a-rev", help="build a from this git revision's specctl/kernels/csrc (headers included)")
    ap.add_argument("--rows", type=int, action="append", help="row counts (default 1 2 5 8 9 16)")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()

    from specctl.models import resolve_model
    from specctl.runtime.loading import load_model

    path = skinny_linear.vector_path()
    if path is None:
        raise SystemExit("this CPU runs no skinny linear build (needs AVX2 at least)")
    m = load_model(resolve_model(args.model), "bfloat16").model
    ws = [l.weight for b in m.layers for l in (b.qkv, b.o, b.gate_up, b.down)] + [m.head_weight]
    nbytes = sum(w.numel() * w.element_size() for w in ws)
    name, src, needs, flags = skinny_linear.spec(path)
    ext, label = {}, {"a": args.a, "b": args.b}
    for key, extra in (("a", args.a), ("b", args.b)):
        tag = "".join(c if c.isalnum() else "_" for c in extra)[-40:] or "shipped"
        if key == "a" and args.a_rev:
            from block_ab import sources  # a revision's specctl/kernels/csrc in a temporary folder

            folder, rev = sources(args.a_rev)
            label["a"] = f"{rev} {extra}".strip()
            ext[key] = build(f"{name}_ab_{rev}_{tag}", src, needs, flags + extra.split(), csrc=folder)
        else:
            ext[key] = build(f"{name}_ab_{tag}", src, needs, flags + extra.split())
        if ext[key] is None:
            raise SystemExit(f"build {key} ({extra!r}) did not compile")
    rows = args.rows or [1, 2, 5, 8, 9, 16]
    xs = {M: {K: torch.randn(M, K).bfloat16() for K in {w.shape[1] for w in ws}} for M in rows}
    for M in rows:  # the same bits from both
        for w in ws[:4] + ws[-1:]:
            x = xs[M][w.shape[1]]
            assert torch.equal(ext["a"].skinny_linear(x, w, None), ext["b"].skinny_linear(x, w, None)), (M, w.shape)
    print(f"{args.model}: {cpu_name()}, {torch.get_num_threads()} threads, {path} build, {nbytes / 1e9:.2f} GB of "
          f"weights a pass; a: {label['a'] or '(shipped)'}; b: {label['b'] or '(shipped)'}; {args.rounds} rounds", flush=True)

    def one(e, M: int) -> float:
        t = time.perf_counter()
        for w in ws:
            e.skinny_linear(xs[M][w.shape[1]], w, None)
        return time.perf_counter() - t

    res = {(k, M): [] for k in ext for M in rows}
    for rnd in range(args.rounds):
        for M in rows:
            for k in ("a", "b") if rnd % 2 == 0 else ("b", "a"):
                res[k, M].append(one(ext[k], M))
    one_row = {k: S.median(res[k, rows[0]]) for k in ext}
    for M in rows:
        a, b = S.median(res["a", M]), S.median(res["b", M])
        r = [y / x for x, y in zip(res["a", M], res["b", M])]
        print(f"  {M:2d} rows: a {a * 1e3:6.1f} ms ({nbytes / a / 1e9:4.1f} GB/s, {a / one_row['a']:.2f}x {rows[0]} row)   "
              f"b {b * 1e3:6.1f} ms ({nbytes / b / 1e9:4.1f} GB/s, {b / one_row['b']:.2f}x)   b / a {S.median(r):.2f} "
              f"[{min(r):.2f}-{max(r):.2f}]", flush=True)


if __name__ == "__main__":
    main()
