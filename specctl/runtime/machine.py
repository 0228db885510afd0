"""The machine's roofline numbers, measured with the runtime's own forwards (``specctl.roofline.Machine``:
the weights' read bandwidth, the linears' and attention's compute rates, the KV read's bandwidth).

What it does not know: what the numbers predict (``specctl.roofline``), the CLI.
"""

from __future__ import annotations

import statistics
import time

import torch

from specctl.roofline import Machine, Shapes
from specctl.runtime.runner import TargetRunner


def measure_machine(model, context: int = 4096, rows: int = 32, repeats: int = 5) -> Machine:
    """BW, F_lin, F_att and the KV read's bandwidth, from forwards of ``model`` (a specctl
    Transformer) as decoding runs them: one row at a short context (the weights' read), ``rows`` rows
    (the linears' compute), and one row and a verify block of 5 rows at ``context`` over the same at a
    short context (the attention: one row is bound by reading the KV cache, several by computing over
    it; the two points fit both rates). Each is the median of ``repeats`` timings."""
    s = Shapes.of(model)
    runner = TargetRunner(model, context + rows + 8)
    ids = torch.randint(0, model.args.vocab_size, (1, rows))

    def timed(length: int, n: int) -> float:
        out = []
        for _ in range(repeats + 1):
            runner.length = length
            t = time.perf_counter()
            runner.forward(ids[:, :n])
            out.append(time.perf_counter() - t)
        return statistics.median(out[1:])

    runner.forward(ids[:, :8])  # something in the cache
    t1, t5 = timed(8, 1), timed(8, 5)
    tr = timed(8, rows)
    tc1, tc5 = timed(context, 1), timed(context, 5)
    bw = s.weight_bytes / t1
    lin = rows * s.linear_flops_per_row / max(tr, t1 * 1.0001)
    kv_bw = context * s.kv_bytes_per_position / max(tc1 - t1, 1e-9)
    att = 5 * context * s.attention_flops_per_position / max(tc5 - t5, 1e-9)
    return Machine(bw, lin, att, kv_bandwidth=kv_bw)
