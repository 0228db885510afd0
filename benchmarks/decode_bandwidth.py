"""Plain decode against the machine's memory bandwidth, both measured in this run.

    python benchmarks/decode_bandwidth.py [--model qwen2.5-coder-1.5b] [--steps 48] [--rounds 6] [--llama-gguf F.gguf]

Bandwidth: two independent plain reads of a 2 GiB buffer, torch's sum and specctl/kernels/csrc/membw.cpp (all
threads, 4 streams each, prefetch, huge pages), the faster counting. Decode: one-token forwards after a
256-token prompt; bytes per step = every weight read once (projections, norms, the LM head; the
embedding row read is negligible) plus the KV cache read. Reads and decode steps alternate in rounds,
and each round's decode is held against that round's read: on a shared machine the bandwidth drifts
(seen on an AMD EPYC: 37 to 63 GB/s between runs minutes apart). Prints GB/s of each, their ratio
(median and range over rounds), and the 2-, 8- and 11-token forward costs against one token (each round's
against that round's one token: a forward over many rows costs more against one row when memory is fast).

``--llama-gguf``: a GGUF of the same weights (e.g. bf16, llama.cpp's convert_hf_to_gguf.py) decoded by
llama.cpp in every round too (llama-cpp-python, as ``bench --peer llama.cpp`` runs it: this Python or
SPECCTL_LLAMA_CPP_PYTHON), an independent reader of the same bytes: where llama.cpp's decode reads
faster than the probe, the probe is weak, and the decode's ratio is held against llama.cpp's figure.
"""

from __future__ import annotations

import specctl

specctl.process_defaults()  # OpenMP settings (GOMP_SPINCOUNT) before torch loads

import argparse
import time
from pathlib import Path

import torch

from specctl.kernels.cpu import name as cpu_name


def readers(gib: float = 2.0):
    """Two independent plain reads of a 2 GiB buffer, each a function that returns its GB/s: torch's sum
    over fp32, and specctl/kernels/csrc/membw.cpp (all threads, 4 streams each, prefetch, huge pages; an AVX-512
    or an AVX2 build; None where neither builds). Decode is judged against the faster of them, measured in the same rounds."""
    from specctl.kernels._build import build
    from specctl.kernels.amx_linear import huge_empty

    buf = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
    buf.sum()

    def timed(fn, nbytes):
        def run() -> float:
            t = time.perf_counter()
            fn()
            return nbytes / (time.perf_counter() - t) / 1e9
        return run

    torch_sum = timed(buf.sum, buf.numel() * 4)
    ext = (build("specctl_membw", "membw.cpp", ("avx512f",), ["-mavx512f"])
           or build("specctl_membw_avx2", "membw.cpp", ("avx2", "fma"), ["-mavx2", "-mfma"]))
    if ext is None:
        return torch_sum, None
    raw = huge_empty((int(gib * 2**30),), torch.uint8)
    raw.fill_(1)
    ext.stream_read(raw)
    return torch_sum, timed(lambda: ext.stream_read(raw), raw.numel())


def read_bandwidth(gib: float = 2.0, passes: int = 5) -> tuple[float, float]:
    """(torch's sum, the best plain read) in GB/s, best of ``passes`` (benchmarks/quant_decode.py)."""
    torch_sum, membw = readers(gib)
    ts = max(torch_sum() for _ in range(passes))
    return ts, max(ts, max(membw() for _ in range(passes))) if membw else ts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--steps", type=int, default=48, help="decode steps of each size, over all rounds")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--llama-gguf", help="a GGUF of the same weights: llama.cpp decodes it in every round too")
    a = ap.parse_args()

    from specctl.models import resolve_model
    from specctl.runtime.loading import load_model
    from specctl.runtime.runner import TargetRunner

    loaded = load_model(resolve_model(a.model), "bfloat16")
    m = loaded.model
    # every projection and norm once, plus the LM head once (tied or not, packed copy or not)
    weight_bytes = sum(p.numel() * p.element_size() for n, p in m.named_parameters()
                       if not n.startswith(("embed", "lm_head")))
    weight_bytes += m.head_weight.numel() * m.head_weight.element_size()
    runner = TargetRunner(m, 1024)
    runner.forward(torch.randint(0, 1000, (1, 256)))
    base = runner.length

    def steps(T: int, n: int) -> list[float]:
        ts = []
        for _ in range(n):
            x = torch.randint(0, 1000, (1, T))
            t = time.perf_counter()
            runner.forward(x)
            ts.append(time.perf_counter() - t)
            runner.rollback(base)
        return ts

    # rounds of (both reads, decode steps of 1, 2, 8 and 11 tokens): this machine's bandwidth drifts by
    # 1.5x over minutes (other tenants), so decode is compared with the reads of its own round
    torch_sum, membw = readers()
    steps(1, 4)
    per = max(1, a.steps // a.rounds)
    kv_bytes = 2 * m.args.num_layers * m.args.num_kv_heads * m.args.head_dim * base * 2
    llama = llama_reader(a.llama_gguf, per) if a.llama_gguf else None
    rows, llama_s = [], []
    try:
        for _ in range(a.rounds):
            bw_sum = max(torch_sum(), torch_sum())
            bw_raw = max(membw(), membw()) if membw else 0.0
            one = steps(1, per)
            t1, t2, t8, t11 = (sorted(steps(T, per) if T > 1 else one)[per // 4] for T in (1, 2, 8, 11))
            rows.append((bw_sum, max(bw_sum, bw_raw), t1, t2, t8, t11))
            if llama:  # its mean time a token, held against specctl's mean step of this round
                llama_s.append((llama(), sum(one) / len(one)))
    finally:
        if llama:
            llama.close()

    def med(i: int) -> float:
        return sorted(r[i] for r in rows)[len(rows) // 2]

    ratio = sorted((weight_bytes + kv_bytes) / r[2] / 1e9 / r[1] for r in rows)
    t1 = med(2)
    decode_gbs = (weight_bytes + kv_bytes) / t1 / 1e9
    print(f"{loaded.path.name}: {weight_bytes / 1e9:.2f} GB of weights per step, {torch.get_num_threads()} threads, "
          f"{cpu_name()}, bf16 path {getattr(m, 'cpu_kernels', None)}; {a.rounds} rounds of reads and decode steps")
    print(f"  memory read bandwidth of 2 GiB (median of rounds): {med(1):6.1f} GB/s best plain read "
          f"(torch's sum alone: {med(0):.1f} GB/s); range over rounds {min(r[1] for r in rows):.1f}-{max(r[1] for r in rows):.1f}")
    print(f"  plain decode: {t1 * 1e3:6.1f} ms/token = {1 / t1:5.2f} tok/s = {decode_gbs:6.1f} GB/s; against the "
          f"same round's read: median {ratio[len(ratio) // 2]:.0%} (rounds {ratio[0]:.0%}-{ratio[-1]:.0%})")
    costs = []
    for i, T in ((3, 2), (4, 8), (5, 11)):
        c = sorted(r[i] / r[2] for r in rows)
        costs.append(f"{T} tokens {c[len(c) // 2]:.2f} (rounds {c[0]:.2f}-{c[-1]:.2f})")
    print(f"  cost of a forward against one token: {'; '.join(costs)}")
    if llama_s:  # llama.cpp reads the same weights (and its KV cache, a few MB): its GB/s per round
        lgbs = [(weight_bytes + kv_bytes) / t / 1e9 for t, _ in llama_s]
        vs_probe = sorted(g / r[1] for g, r in zip(lgbs, rows))
        vs_llama = sorted(t / mine for t, mine in llama_s)  # llama.cpp's mean time a token / specctl's
        print(f"  llama.cpp decoding {Path(a.llama_gguf).name} (an independent reader of the same weights): "
              f"{sorted(lgbs)[len(lgbs) // 2]:6.1f} GB/s, {vs_probe[len(vs_probe) // 2]:.0%} of the same round's read "
              f"(rounds {vs_probe[0]:.0%}-{vs_probe[-1]:.0%}); specctl's plain decode is "
              f"{vs_llama[len(vs_llama) // 2]:.2f}x its speed (rounds {vs_llama[0]:.2f}-{vs_llama[-1]:.2f})")
        if vs_probe[len(vs_probe) // 2] > 1:
            print("  the probe reads slower than llama.cpp decodes: it is weak here, and the ratio above flatters")


def llama_reader(gguf: str, tokens: int):
    """A function that decodes ``tokens`` tokens with llama.cpp (plain, one prompt) and returns the seconds
    a token of decoding took; ``.close()`` ends its worker. The worker and its environment are bench's."""
    from specctl.bench.peers import ExternalPeers

    g = ExternalPeers("llama.cpp", gguf, torch.bfloat16, 1024)
    plain = g.peers[0]
    prompt = list(range(100, 356))  # a 256-token prompt, as specctl's steps have
    g.run(plain, prompt, 8, [])  # loads, warms up

    def run() -> float:
        res = g.run(plain, prompt, tokens + 1, [])
        return res.decode_s / max(1, len(res.token_ids) - 1)

    run.close = g.close
    return run


if __name__ == "__main__":
    main()
