"""A request as the decode loop holds it: how it samples (``SamplingParams``, vLLM's names), its state
in flight (``DecodeState``: its runner, context buffer, output, counters) and its result.

What it does not know: how a step runs (``specctl.runtime.decoder``), scheduling.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from specctl.runtime.controller import DraftLengthController
from specctl.runtime.metrics import SpecStats
from specctl.runtime.proposers.base import DraftRequest
from specctl.runtime.runner import TargetRunner


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_k: int | None = None
    top_p: float | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    record_margins: bool = False  # greedy only: keep the top-1 minus top-2 logit gap of each token

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass
class GenerationResult:
    token_ids: list[int]  # the new tokens
    finish_reason: str  # "stop" or "length"
    stats: SpecStats = field(default_factory=SpecStats)
    prefill_s: float = 0.0  # prompt forward + first token
    decode_s: float = 0.0  # every later token
    num_steps: int = 0  # target forwards after prefill
    margins: list[float] = field(default_factory=list)  # [len(token_ids)] when record_margins
    by_proposer: dict[str, SpecStats] = field(default_factory=dict)  # hybrid: stats per sub-proposer

    @property
    def decode_tokens_per_s(self) -> float:
        n = len(self.token_ids) - 1
        return n / self.decode_s if self.decode_s > 0 and n > 0 else 0.0


@dataclass
class DecodeState:
    """One request in flight: its runner (KV cache), token buffer, output and counters."""

    runner: TargetRunner
    slot: int
    params: SamplingParams
    generator: torch.Generator | None
    ctx: np.ndarray  # [1, max_len] int32: prompt + emitted tokens, for the proposer
    n_ctx: int
    stop: set
    last: int = -1  # emitted, not yet in the KV cache
    out: list[int] = field(default_factory=list)
    margins: list[float] = field(default_factory=list)
    stats: SpecStats = field(default_factory=SpecStats)
    finish: str | None = None
    steps: int = 0
    pace: float = 1.0  # tokens a step emits (EMA): its steps left are about (max_new_tokens - len(out)) / pace
    t_start: float = 0.0
    t_first: float = 0.0
    controller: DraftLengthController | None = None
    hidden: torch.Tensor | None = None  # [1, H] target's final hidden state at the position that produced `last`
    error: BaseException | None = None  # what ended it, when a step failed (finish is then "error")
    n_prefilled: int = 0  # prompt tokens already in the KV cache (the prompt is n_ctx until the first token)
    undrafted: bool = False  # its draft declined to read its prompt (it would not pay back): it never drafts
    by_proposer: dict[str, SpecStats] = field(default_factory=dict)  # hybrid: stats per sub-proposer
    key: int = 0  # sampling: the seed that keys each position's draw (rejection.keyed_uniforms)
    # what its steps counted since it was last reported (``take_unreported``): the engine's metrics add these
    unreported: SpecStats = field(default_factory=SpecStats)
    unreported_parts: dict[str, SpecStats] = field(default_factory=dict)

    def count(self, num_draft: int, num_accepted: int, parts: dict[str, tuple[int, int]]) -> None:
        """One verified step: its draft and acceptance (and a hybrid's parts'), into the totals and the
        not-yet-reported deltas alike."""
        self.stats.observe(num_draft, num_accepted)
        self.unreported.observe(num_draft, num_accepted)
        for name, (d, a) in parts.items():
            self.by_proposer.setdefault(name, SpecStats()).observe(d, a)
            self.unreported_parts.setdefault(name, SpecStats()).observe(d, a)

    def take_unreported(self) -> tuple[SpecStats, dict[str, SpecStats]]:
        """What its steps counted since the last call (its stats, a hybrid's parts'), and start again."""
        out = (self.unreported, self.unreported_parts)
        self.unreported, self.unreported_parts = SpecStats(), {}
        return out

    @property
    def room(self) -> int:
        """Tokens it may still emit (``max_new_tokens`` less its output)."""
        return self.params.max_new_tokens - len(self.out)

    @property
    def prefilling(self) -> bool:
        return not self.out and self.finish is None

    def draft_request(self) -> DraftRequest:
        """What its proposer is asked to draft from: its slot, its context, the target's last state."""
        return DraftRequest(self.slot, self.ctx[0], self.n_ctx, self.hidden)

    def result(self) -> GenerationResult:
        t_end = time.perf_counter()
        return GenerationResult(self.out, self.finish or "length", self.stats, self.t_first - self.t_start,
                                t_end - self.t_first, self.steps, self.margins[: len(self.out)], self.by_proposer)
