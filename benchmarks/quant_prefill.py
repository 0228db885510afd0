"""Prefill of a GGUF model run quantized, on each quant_linear path, alternated in one run.

    python benchmarks/quant_prefill.py [--model qwen2.5-coder-1.5b] [--tokens 512] [--rounds 4]
                                       [--paths amx_int8 avx512_vnni]

The catalogue model's GGUF (``specctl models pull MODEL --keep-quant``) is loaded once per path (every
projection forced to it; a packed path packs at load); each round runs one forward over the same
``--tokens`` random prompt tokens (last logits only) on every path in turn. Prints the CPU and each path's
tok/s per round, and whether the paths agree on the top token.
"""

from __future__ import annotations

import specctl

specctl.process_defaults()  # OpenMP settings (GOMP_SPINCOUNT) before torch loads

import argparse
import time

import torch

from specctl.kernels.cpu import name as cpu_name


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--paths", nargs="+", default=["amx_int8", "avx512_vnni"])
    a = ap.parse_args()
    from specctl.fetch import cache_dir
    from specctl.kernels import quant_linear as ql
    from specctl.models import CATALOGUE
    from specctl.runtime.quant import load_gguf_transformer
    from specctl.runtime.runner import TargetRunner

    entry = CATALOGUE[a.model]
    found = sorted(cache_dir().rglob(entry.gguf_name))
    if not found:
        raise SystemExit(f"no {entry.gguf_name} under {cache_dir()}: run `specctl models pull {a.model} --keep-quant`")
    paths = [p for p in a.paths if ql.load(p) is not None]
    models = {p: load_gguf_transformer(found[0], torch.bfloat16, quant_path=p) for p in paths}
    prompt = torch.randint(0, 1000, (1, a.tokens), generator=torch.Generator().manual_seed(0))
    rates: dict[str, list[float]] = {p: [] for p in paths}
    top: dict[str, int] = {}
    for _ in range(a.rounds):
        for p, m in models.items():
            runner = TargetRunner(m, a.tokens + 16)
            t = time.perf_counter()
            top[p] = int(runner.forward(prompt, logits="last").argmax())
            rates[p].append(a.tokens / (time.perf_counter() - t))
    print(f"# {cpu_name()}, {torch.get_num_threads()} threads; {a.model} ({found[0].name}), {a.tokens}-token prefill, "
          f"{a.rounds} rounds alternated (skipped, not runnable here: {sorted(set(a.paths) - set(paths)) or 'none'})")
    for p, v in rates.items():
        print(f"  gguf-{p:12s} " + " ".join(f"{x:6.1f}" for x in v) + " tok/s")
    print(f"  same top token on every path: {len(set(top.values())) == 1}")


if __name__ == "__main__":
    main()
