"""Offline generation: many prompts answered together through the batched engine, as vLLM's ``LLM``
is used (the trainers' self-distillation, the benchmarks' references).

What it does not know: serving, drafting (plain decoding only), where prompts come from.
"""

from __future__ import annotations

import torch

from specctl.modeling import Transformer
from specctl.runtime.decoder import SamplingParams, SpecDecoder
from specctl.runtime.runner import TargetRunner
from specctl.runtime.scheduler import Request, Scheduler


def generate_batch(model: Transformer, prompts: list[list[int]], rooms: list[int], *, temperature: float = 0.0,
                   stop_token_ids=(), generator: torch.Generator | None = None,
                   max_num_batched_tokens: int | None = 256) -> list[tuple[list[int], str]]:
    """Answers to prompts of different lengths, decoded together by the continuous-batching
    scheduler (one target forward per step for every row; ``specctl.runtime.scheduler``).

    Each row computes what it would alone (bit for bit on the row-independent CPU paths), and on a
    CPU a step reads the weights once for all rows, so n answers cost little more than one. Row i
    stops at a stop token or after ``rooms[i]`` tokens; returns [(answer ids, "stop" | "length")].
    Greedy at temperature 0, else sampled from the temperature-scaled distribution, each row with a
    generator seeded from ``generator`` (the same generator state, the same answers)."""
    seeds: list[int | None] = [None] * len(prompts)
    if temperature > 0:
        g = generator
        if g is None:
            g = torch.Generator()
            g.seed()
        seeds = [int(torch.randint(0, 2**62, (1,), generator=g, device=g.device)) for _ in prompts]
    live = [i for i, r in enumerate(rooms) if r > 0]
    out: list[tuple[list[int], str]] = [([], "length") for _ in prompts]
    if not live:
        return out
    max_len = max(len(prompts[i]) + rooms[i] for i in live) + 1
    runners = [TargetRunner(model, max_len) for _ in live]
    sched = Scheduler(SpecDecoder(runners[0]), runners, max_num_batched_tokens=max_num_batched_tokens)
    reqs = [Request(list(prompts[i]), SamplingParams(max_new_tokens=rooms[i], temperature=temperature,
                                                     stop_token_ids=tuple(stop_token_ids)), seeds[i]) for i in live]
    for i, res in zip(live, sched.run(reqs)):
        out[i] = (res.token_ids, res.finish_reason)
    return out
