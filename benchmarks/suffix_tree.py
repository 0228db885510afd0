"""The suffix trees' proposal latency, decode-like: an 8k-token context, 1,000 cached responses.

    python benchmarks/suffix_tree.py
"""

from __future__ import annotations

import numpy as np

from specctl.kernels.suffix import SuffixTree


def _code_tokens(limit: int) -> np.ndarray:
    """Standard-library source split into words and symbols, hashed into a 50k vocabulary."""
    import re
    import sysconfig
    from pathlib import Path
    from zlib import crc32

    words: list[int] = []
    for p in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        for w in re.findall(r"\w+|[^\w\s]|\n\s*", p.read_text(encoding="utf-8", errors="replace")):
            words.append(crc32(w.encode()) % 50_000)
        if len(words) >= limit:
            break
    return np.array(words[:limit], dtype=np.int32)


def bench(context: int = 8192, responses: int = 1000, response_len: int = 256, steps: int = 2000, k: int = 16) -> None:
    """Decode-like: propose at the end of the context (local + global tree), then append one token."""
    import time

    toks = _code_tokens(context + steps + responses * response_len)
    cached = toks[context + steps:]
    t0 = time.perf_counter()
    glob = SuffixTree(24, max_seqs=responses)
    for r in range(responses):
        glob.start_seq()
        glob.extend(cached[r * response_len:(r + 1) * response_len])
        glob.end_seq()
    t1 = time.perf_counter()
    local = SuffixTree(24)
    local.start_seq()
    local.extend(toks[:context])
    t2 = time.perf_counter()
    out, scratch = np.zeros(k, np.int32), np.zeros(k, np.int32)
    times, drafted, appends = [], 0, 0.0
    for n in range(context, context + steps):
        s = time.perf_counter()
        a = local.speculate(toks, n, k, 1.0, 0.1, out, scratch)
        b = glob.speculate(toks, n, k, 1.0, 0.1, out, scratch)
        m = time.perf_counter()
        local.extend(toks[n:n + 1])
        appends += time.perf_counter() - m
        times.append(m - s)
        drafted += a[0] if a[1] >= b[1] else b[0]
    us = np.array(times[10:]) * 1e6
    print(f"global tree: {responses} responses x {response_len} tokens, {glob.num_nodes} nodes, "
          f"{glob.nbytes() / 2**20:.1f} MiB, built in {t1 - t0:.2f} s")
    print(f"local tree: {context}-token context, {local.num_nodes} nodes, built in {(t2 - t1) * 1e3:.1f} ms")
    print(f"proposal latency (local + global tree, k={k}) over {len(us)} steps: mean {us.mean():.1f} us, "
          f"p50 {np.percentile(us, 50):.1f} us, p99 {np.percentile(us, 99):.1f} us, max {us.max():.1f} us; "
          f"mean draft {drafted / steps:.2f} tokens")
    print(f"append: {appends / steps * 1e6:.1f} us per token")
    s = time.perf_counter()
    for r in range(100):  # a full cache: each new response evicts the oldest
        glob.remove_oldest()
        glob.start_seq()
        glob.extend(toks[r * response_len:(r + 1) * response_len])
        glob.end_seq()
    print(f"evict + insert one {response_len}-token response at {responses} cached: "
          f"{(time.perf_counter() - s) / 100 * 1e3:.2f} ms; {glob.num_nodes} nodes after")


if __name__ == "__main__":
    bench()
