"""A CPU path's fused block and linear kernels of this working tree against the same at a git revision, in one run.

    python benchmarks/block_ab.py --path avx512_bf16 [--rev HEAD] [--model qwen2.5-coder-1.5b] [--rows 1 8]
    python benchmarks/block_ab.py --path amx_int8 --gguf Qwen2.5-Coder-1.5B-Instruct.gguf [--rows 1 9]

Paths: ``amx``, ``avx512_bf16``, ``avx512`` and ``avx2`` (a bf16 model: specctl/kernels/csrc/decode_layer.cpp's build for it and the
linear kernel the LM head takes, amx_linear.cpp or skinny_linear.cpp), ``amx_int8`` and ``avx512_vnni`` (a
GGUF file run as it is: the quantized block's build and quant_linear.cpp's). Both sets are built from their
sources (the revision's from ``git show REV:specctl/kernels/csrc/...``, headers included), the model is loaded once,
and forwards of each row count (one token after a 256-token prompt, or a verify forward of several) run
with the two sets' calls alternated in rounds, checked equal bit for bit. Prints the CPU, each set's time
(the lower quartile of its steps), their ratio, and each set's cost of a forward against one row.
``avx512_bf16`` on a CPU with AMX hides the AMX features (SPECCTL_CPU_HIDE) so that the model runs the path
an AMD EPYC runs; its figures are still this CPU's.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PATHS = ("amx", "avx512_bf16", "avx512", "avx2", "amx_int8", "avx512_vnni")


def args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--path", choices=PATHS, required=True)
    ap.add_argument("--rev", default="HEAD", help="the git revision to hold the working tree against")
    ap.add_argument("--model", default="qwen2.5-coder-1.5b", help="a bf16 model (amx, avx512_bf16)")
    ap.add_argument("--gguf", type=Path, help="a GGUF file (amx_int8, avx512_vnni)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    a = ap.parse_args()
    if a.path in ("amx_int8", "avx512_vnni") and (a.gguf is None or not a.gguf.is_file()):
        ap.error(f"--path {a.path} runs a GGUF file: give it with --gguf FILE")
    return a


def sources(rev: str) -> tuple[Path, str]:
    """The revision's specctl/kernels/csrc (kernels/csrc before the package moved under specctl/) in a
    temporary folder, and its short hash."""
    src = Path(tempfile.mkdtemp(prefix="block_ab_"))
    git = ["git", "-C", str(ROOT)]
    files = []
    for folder in ("specctl/kernels/csrc/", "kernels/csrc/"):
        files = subprocess.run([*git, "ls-tree", "--name-only", rev, folder], capture_output=True, text=True,
                               check=True).stdout.split()
        if files:
            break
    for f in files:
        (src / Path(f).name).write_bytes(subprocess.run([*git, "show", f"{rev}:{f}"], capture_output=True,
                                                        check=True).stdout)
    return src, subprocess.run([*git, "rev-parse", "--short", rev], capture_output=True, text=True,
                               check=True).stdout.strip()


def main() -> None:
    a = args()
    if a.path == "avx512_bf16" and "SPECCTL_CPU_HIDE" not in os.environ and \
            " amx_bf16" in Path("/proc/cpuinfo").read_text():  # before specctl.kernels.cpu reads it
        os.environ["SPECCTL_CPU_HIDE"] = "amx_bf16,amx_tile,amx_int8"
    import specctl

    specctl.process_defaults()  # OpenMP settings (GOMP_SPINCOUNT) before torch loads
    import torch
    from torch.utils.cpp_extension import load

    from specctl.kernels import amx_linear, decode_layer, quant_linear, skinny_linear
    from specctl.kernels._build import CFLAGS
    from specctl.kernels.cpu import name as cpu_name
    from specctl.runtime.runner import TargetRunner

    quant = a.path in ("amx_int8", "avx512_vnni")
    if quant:
        from specctl.runtime.quant import load_gguf_transformer

        m = load_gguf_transformer(a.gguf, torch.bfloat16, quant_path=a.path)
        label = a.gguf.name
    else:
        from specctl.models import resolve_model
        from specctl.runtime.loading import load_model

        m = load_model(resolve_model(a.model), "bfloat16").model
        label = a.model
    kind = m.cpu_kernels.removeprefix("gguf-")
    if kind != a.path:
        raise SystemExit(f"this CPU runs the model on {m.cpu_kernels}, not {a.path}")

    # each set: (the block's build, the head's linear build); installed into the modules (and QuantLinears)
    heads = [mod for mod in m.modules() if getattr(mod, "quantized", False) and hasattr(mod, "_ext")]
    if quant:
        tree = (decode_layer.load_quant(a.path), quant_linear.load(a.path))
        head = ("quant_linear.cpp", f"specctl_quant_linear_{a.path}", [*quant_linear._FLAGS[a.path], "-ffp-contract=off"])
    elif a.path == "amx":
        tree = (decode_layer.load(), amx_linear.load())
        head = ("amx_linear.cpp", "specctl_amx_linear", amx_linear.FLAGS)
    else:
        tree = (decode_layer.load(), skinny_linear.load())
        name, _, flags = skinny_linear.BUILDS[a.path]
        head = ("skinny_linear.cpp", name, flags)
    src, tag = sources(a.rev)

    def built(source: str, name: str, flags: list[str]):
        print(f"building {a.rev}'s {source} ...", file=sys.stderr, flush=True)
        return load(name=f"{name}_ab_{tag}", sources=[str(src / source)], extra_include_paths=[str(src)],
                    extra_cflags=[*CFLAGS, *flags], extra_ldflags=["-fopenmp"])

    block_name, _, block_flags = decode_layer.build_spec(a.path)
    rev = (built("decode_layer.cpp", block_name, block_flags), built(*head))
    if a.path == "amx" and not rev[1].amx_init():
        raise SystemExit("the OS refused AMX tile state")

    def use(s) -> None:
        """The model's blocks and linears onto one set of builds (each module holds the build it runs)."""
        from dataclasses import replace

        from specctl.modeling import AmxLinear, DenseLinear

        block, lin = s
        for b in m.layers:
            b.fused_ext = block
        if quant:
            for h in heads:
                h._ext = lin
            return
        m.kernels = replace(m.kernels, block=block, **({"amx": lin} if a.path == "amx" else {"linear": lin}))
        for mod in m.modules():
            if isinstance(mod, AmxLinear):
                mod.ext = lin
            elif isinstance(mod, DenseLinear):
                mod.kernels = m.kernels

    sets = {"rev": rev, "tree": tree}
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

    times = {k: {T: [] for T in a.rows} for k in sets}
    try:
        for r in range(a.rounds):
            for T in a.rows:
                x = torch.randint(0, 1000, (1, T), generator=g)
                outs = {}
                for k in (("rev", "tree") if r % 2 else ("tree", "rev")):
                    use(sets[k])
                    step(x)
                    for _ in range(3):
                        dt, outs[k] = step(x)
                        times[k][T].append(dt)
                if not torch.equal(outs["rev"], outs["tree"]):
                    raise SystemExit(f"the two sets' logits differ at {T} rows")
    finally:
        use(tree)
    q = {k: {T: sorted(v)[len(v) // 4] for T, v in d.items()} for k, d in times.items()}
    hidden = os.environ.get("SPECCTL_CPU_HIDE")
    print(f"{cpu_name()}, {label}, path {m.cpu_kernels}{f' (hidden: {hidden})' if hidden else ''}, "
          f"{torch.get_num_threads()} threads; {a.rev} vs the working tree, {a.rounds} rounds; logits equal")
    for T in a.rows:
        print(f"  {T:>2} rows: {a.rev} {q['rev'][T] * 1e3:7.2f} ms, tree {q['tree'][T] * 1e3:7.2f} ms, "
              f"tree {q['rev'][T] / q['tree'][T]:.3f}x as fast")
    if len(a.rows) > 1:
        lo = a.rows[0]
        print(f"  cost against {lo} row(s): " + "; ".join(
            f"{T} rows {a.rev} {q['rev'][T] / q['rev'][lo]:.2f}, tree {q['tree'][T] / q['tree'][lo]:.2f}"
            for T in a.rows[1:]))


if __name__ == "__main__":
    main()
