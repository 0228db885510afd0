"""Plain decode against the machine's memory bandwidth, both measured in this run.

    python benchmarks/decode_bandwidth.py [--model qwen2.5-coder-1.5b] [--steps 32]

Bandwidth: the best of several passes of the fastest plain read this machine does over a 2 GiB
buffer (kernels/csrc/membw.cpp: all threads, 4 streams each, prefetch, huge pages; torch's sum is
printed beside it and reads slower). Decode: one-token forwards after a 256-token prompt; bytes per step =
every weight read once (projections, norms, the LM head; the embedding row read is negligible)
plus the KV cache read. Prints GB/s of each and their ratio, and the one-token vs two-token cost.
"""

from __future__ import annotations

import specctl

specctl.process_defaults()  # OMP_WAIT_POLICY before torch loads

import argparse
import time

import torch


def read_bandwidth(gib: float = 2.0, passes: int = 5) -> tuple[float, float]:
    """(torch's sum over a 2 GiB buffer, the best plain read: kernels/csrc/membw.cpp over huge pages)
    in GB/s, best of ``passes``. Decode is judged against the larger."""
    from kernels._build import build
    from kernels.amx_linear import huge_empty

    buf = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
    buf.sum()

    def best(fn, nbytes):
        t_min = float("inf")
        for _ in range(passes):
            t = time.perf_counter()
            fn()
            t_min = min(t_min, time.perf_counter() - t)
        return nbytes / t_min / 1e9

    torch_sum = best(buf.sum, buf.numel() * 4)
    del buf
    ext = build("specctl_membw", "membw.cpp", ("avx512f",), ["-mavx512f"])
    if ext is None:
        return torch_sum, torch_sum
    raw = huge_empty((int(gib * 2**30),), torch.uint8)
    raw.fill_(1)
    ext.stream_read(raw)
    return torch_sum, max(torch_sum, best(lambda: ext.stream_read(raw), raw.numel()))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--steps", type=int, default=32)
    a = ap.parse_args()

    from specctl.models import resolve_model
    from specctl.runtime.runner import TargetRunner, load_model

    loaded = load_model(resolve_model(a.model), "bfloat16")
    m = loaded.model
    # every projection and norm once, plus the LM head once (tied or not, packed copy or not)
    weight_bytes = sum(p.numel() * p.element_size() for n, p in m.named_parameters()
                       if not n.startswith(("embed", "lm_head")))
    weight_bytes += m.head_weight.numel() * m.head_weight.element_size()
    runner = TargetRunner(m, 1024)
    runner.forward(torch.randint(0, 1000, (1, 256)))
    base = runner.length

    def step_time(T: int) -> float:
        ts = []
        for _ in range(a.steps):
            x = torch.randint(0, 1000, (1, T))
            t = time.perf_counter()
            runner.forward(x)
            ts.append(time.perf_counter() - t)
            runner.rollback(base)
        return sorted(ts)[len(ts) // 4]  # lower quartile: the machine is shared and noisy

    t1, t2, t11 = step_time(1), step_time(2), step_time(11)
    kv_bytes = 2 * m.args.num_layers * m.args.num_kv_heads * m.args.head_dim * base * 2
    decode_gbs = (weight_bytes + kv_bytes) / t1 / 1e9
    bw_sum, bw = read_bandwidth()
    print(f"{loaded.path.name}: {weight_bytes / 1e9:.2f} GB of weights per step, {torch.get_num_threads()} threads, "
          f"AMX {'on' if m.head_packed is not None else 'off'}")
    print(f"  memory read bandwidth, best plain read of 2 GiB: {bw:6.1f} GB/s (torch's sum: {bw_sum:.1f} GB/s)")
    print(f"  plain decode: {t1 * 1e3:6.1f} ms/token = {1 / t1:5.2f} tok/s = {decode_gbs:6.1f} GB/s "
          f"({decode_gbs / bw:.0%} of the measured bandwidth)")
    print(f"  cost of a forward over 2 tokens / 1 token: {t2 / t1:.2f}; over 11 tokens / 1 token: {t11 / t1:.2f}")


if __name__ == "__main__":
    main()
