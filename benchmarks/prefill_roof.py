"""Prefill against the compute roof of the same CPU, and against llama.cpp's prefill, in one run.

    python benchmarks/prefill_roof.py [--model qwen2.5-coder-1.5b] [--tokens 512 --tokens 2048] [--rounds 3]
        [--llama-bench ~/llama.cpp/build/bin/llama-bench --llama-gguf Q15-bf16.gguf]

Roof: specctl/kernels/csrc/flops.cpp, the most bf16 dot products per second all threads do with the
arithmetic the bf16 kernels use (vdpbf16ps on AVX512-BF16; two fp32 FMAs per pair on AVX-512 or AVX2),
from registers alone. Prefill: one forward over a prompt of T tokens (random ids: the cost does not depend
on them) into an empty cache, logits of the last row only, as the engine prefills a prompt that fits one
chunk. Its FLOPs: 2 per weight of every projection per token, the attention's QK^T and PV over the causal
triangle (2 * 2 * heads * head_dim * T (T + 1) / 2 per layer), and the LM head once. llama.cpp: its own
``llama-bench -p T -n 0`` on a GGUF of the same weights (bf16: convert_hf_to_gguf.py --outtype bf16), 2
threads and its defaults otherwise, as its users run it (docs/bench.md: building it).

Decode (``--decode N``, default 64): N one-token forwards from an empty cache, against ``llama-bench -n N``.
Each round measures the roof, then specctl and llama.cpp at every T (and decode) in turn, so the machine's
drift hits all alike; figures are medians over rounds, ratios taken within a round.
"""

from __future__ import annotations

import specctl

specctl.process_defaults()  # OpenMP settings (GOMP_SPINCOUNT) before torch loads

import argparse
import json
import subprocess
import time
from pathlib import Path

import torch

from specctl.kernels.cpu import name as cpu_name


def roof_probe():
    """A function returning the bf16 dot-product GFLOP/s of all threads now, and the build's name (None, None
    where no vector build runs here)."""
    from specctl.kernels import skinny_linear
    from specctl.kernels._build import build

    p = skinny_linear.vector_path()
    if p is None:
        return None, None
    _, needs, flags = skinny_linear.BUILDS[p]
    ext = build(f"specctl_flops_{p}", "flops.cpp", needs, flags)
    if ext is None:
        return None, None
    ext.dot_peak(2_000_000)
    return (lambda: max(ext.dot_peak(50_000_000) for _ in range(2))), p


def prefill_flops(m, T: int) -> float:
    """FLOPs of a prefill over T tokens: the projections, the causal attention, the LM head on the last row."""
    a = m.args
    linear = sum(p.numel() for n, p in m.named_parameters()
                 if p.dim() == 2 and not n.startswith(("embed", "lm_head")))
    attn = 2 * 2 * a.num_heads * a.head_dim * T * (T + 1) / 2 * a.num_layers
    return 2 * linear * T + attn + 2 * m.head_weight.numel()


def llama_bench(binary: str, gguf: str, T: int, decode: int = 0) -> float:
    """llama.cpp's prefill tokens/s over T tokens, or with ``decode`` its decode tokens/s over that many tokens
    from an empty context (its llama-bench, one repetition, 2 threads)."""
    p, n = (0, decode) if decode else (T, 0)
    out = subprocess.run([binary, "-m", gguf, "-p", str(p), "-n", str(n), "-t", str(torch.get_num_threads()),
                          "-r", "1", "-o", "json"], capture_output=True, text=True, check=True,
                         env=specctl.user_environ())
    rows = json.loads(out.stdout)
    return float(rows[0]["avg_ts"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--tokens", type=int, action="append", help="prompt lengths (default 512 and 2048)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--llama-bench", help="llama.cpp's llama-bench binary")
    ap.add_argument("--llama-gguf", help="a GGUF of the same weights for llama-bench")
    ap.add_argument("--decode", type=int, default=64,
                    help="also plain decode of this many tokens from an empty context, as llama-bench -n does (0: none)")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    a = ap.parse_args()
    lengths = a.tokens or [512, 2048]
    if bool(a.llama_bench) != bool(a.llama_gguf):
        ap.error("--llama-bench and --llama-gguf go together")

    from specctl.models import resolve_model
    from specctl.runtime.loading import load_model
    from specctl.runtime.runner import TargetRunner

    roof, build = roof_probe()
    loaded = load_model(resolve_model(a.model), "bfloat16")
    m = loaded.model
    runner = TargetRunner(m, max(lengths) + 16)
    g = torch.Generator().manual_seed(0)
    prompts = {T: torch.randint(100, m.args.vocab_size - 100, (1, T), generator=g) for T in lengths}

    def prefill(T: int) -> float:
        runner.reset()
        t = time.perf_counter()
        runner.run(prompts[T], logits="last")
        return time.perf_counter() - t

    def decode(n: int) -> float:
        """Seconds of n one-token forwards from an empty cache."""
        runner.reset()
        tok = prompts[min(lengths)][:, :1]
        t = time.perf_counter()
        for _ in range(n):
            runner.run(tok, logits="last")
        return time.perf_counter() - t

    prefill(min(lengths))  # warm: kernels built, buffers sized
    rounds = []
    for _ in range(a.rounds):
        r = {"roof": roof() if roof else None}
        for T in lengths:
            r[T] = prefill(T)
            if a.llama_bench:
                r[("llama", T)] = llama_bench(a.llama_bench, a.llama_gguf, T)
        if a.decode:
            r["decode"] = a.decode / decode(a.decode)
            if a.llama_bench:
                r[("llama", "decode")] = llama_bench(a.llama_bench, a.llama_gguf, 0, a.decode)
        rounds.append(r)

    def med(xs):
        xs = sorted(xs)
        return xs[len(xs) // 2]

    res = {"model": loaded.path.name, "cpu": cpu_name(), "threads": torch.get_num_threads(),
           "bf16_path": getattr(m, "cpu_kernels", None), "roof_build": build,
           "roof_gflops": med([r["roof"] for r in rounds]) if roof else None, "prompts": []}
    for T in lengths:
        flops = prefill_flops(m, T)
        row = {"tokens": T, "tokens_per_s": med([T / r[T] for r in rounds]),
               "gflops": med([flops / r[T] / 1e9 for r in rounds])}
        if roof:
            row["fraction_of_roof"] = med([flops / r[T] / 1e9 / r["roof"] for r in rounds])
        if a.llama_bench:
            row["llama_cpp_tokens_per_s"] = med([r[("llama", T)] for r in rounds])
            row["vs_llama_cpp"] = med([T / r[T] / r[("llama", T)] for r in rounds])
        res["prompts"].append(row)
    if a.decode:
        res["decode"] = {"tokens": a.decode, "tokens_per_s": med([r["decode"] for r in rounds])}
        if a.llama_bench:
            res["decode"]["llama_cpp_tokens_per_s"] = med([r[("llama", "decode")] for r in rounds])
            res["decode"]["vs_llama_cpp"] = med([r["decode"] / r[("llama", "decode")] for r in rounds])
    if a.json:
        print(json.dumps(res))
        return
    print(f"{res['model']}: {res['cpu']}, {res['threads']} threads, bf16 path {res['bf16_path']}; "
          f"{a.rounds} rounds, medians")
    if roof:
        print(f"  compute roof ({build} dot products, registers only): {res['roof_gflops']:.0f} GFLOP/s")
    for row in res["prompts"]:
        line = f"  prefill {row['tokens']:>5} tokens: {row['tokens_per_s']:7.1f} tok/s  {row['gflops']:6.0f} GFLOP/s"
        if roof:
            line += f"  {row['fraction_of_roof']:.0%} of the roof"
        if a.llama_bench:
            line += (f"; llama.cpp {row['llama_cpp_tokens_per_s']:7.1f} tok/s, specctl {row['vs_llama_cpp']:.2f}x "
                     f"({Path(a.llama_gguf).name})")
        print(line)
    if a.decode:
        d = res["decode"]
        line = f"  plain decode of {a.decode} tokens: {d['tokens_per_s']:7.2f} tok/s"
        if a.llama_bench:
            line += f"; llama.cpp {d['llama_cpp_tokens_per_s']:7.2f} tok/s, specctl {d['vs_llama_cpp']:.2f}x"
        print(line)


if __name__ == "__main__":
    main()
