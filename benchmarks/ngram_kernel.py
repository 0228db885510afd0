"""Time the ngram proposer per request per call at an 8k-token context (issue 2: < 100 us).

    python benchmarks/ngram_kernel.py [--context 8192] [--batch 8]

Three contexts: random tokens (no long match: the whole KMP pass runs), a repetitive one (long
matches), and real code tokens-like (small alphabet). Prints microseconds per request per call.
"""

from __future__ import annotations

import specctl

specctl.process_defaults()  # OpenMP settings (GOMP_SPINCOUNT) before torch loads

import argparse
import time

import numpy as np

from specctl.kernels.ngram import ngram_propose_batch


def per_request_us(tokens: np.ndarray, lens: np.ndarray, k: int, reps: int) -> float:
    B = tokens.shape[0]
    draft = np.empty((B, k), dtype=np.int32)
    num = np.empty(B, dtype=np.int32)
    ngram_propose_batch(tokens, lens, 2, 5, k, 1 << 30, draft, num)  # compile / warm
    best = float("inf")
    for _ in range(5):  # best of 5 blocks: the machine is shared and noisy
        t = time.perf_counter()
        for _ in range(reps):
            ngram_propose_batch(tokens, lens, 2, 5, k, 1 << 30, draft, num)
        best = min(best, (time.perf_counter() - t) / reps / B * 1e6)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--reps", type=int, default=50)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    L, B = a.context, a.batch
    cases = {
        "random (vocab 150k)": rng.integers(0, 150_000, (B, L)),
        "small alphabet (vocab 50)": rng.integers(0, 50, (B, L)),
        "repetitive (period 300)": np.tile(rng.integers(0, 150_000, (B, 300)), (1, L // 300 + 1))[:, :L],
    }
    print(f"ngram proposer, context {L} tokens, batch {B}, k {a.k}, n in [2, 5]")
    worst = 0.0
    for name, toks in cases.items():
        us = per_request_us(np.ascontiguousarray(toks, dtype=np.int32), np.full(B, L, np.int32), a.k, a.reps)
        worst = max(worst, us)
        print(f"  {name:28s} {us:8.1f} us per request per call")
    print(f"worst case {worst:.1f} us (target < 100 us): {'PASS' if worst < 100 else 'FAIL'}")


if __name__ == "__main__":
    main()
