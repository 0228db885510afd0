"""The decode loop: prefill, then [propose -> verify -> rollback -> observe] until a stop.

    prompt ─► prefill ─► [ propose(k) ─► forward(last + draft) ─► verify ─► rollback ─► stats ]*

With no proposer it is plain decoding through the very same path (a draft of length 0), which is
the no-speculation baseline bench compares against. One request at a time per SpecDecoder (the
proposer and verifier are batched; the runner's rows advance together).

Index arithmetic of one step, worked: the cache holds L tokens; ``last`` (emitted, not yet in the
cache) and d drafts are fed at positions L..L+d, giving d+1 target distributions. If n drafts are
accepted, positions L..L+n hold valid keys, so the cache is rolled back to L+1+n and the step's
final token (recovered or bonus) becomes the next ``last``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from specctl.runtime.metrics import SpecStats
from specctl.runtime.proposers.base import Proposer
from specctl.runtime.rejection import greedy_verify, logits_to_probs, rejection_sample
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

    @property
    def decode_tokens_per_s(self) -> float:
        n = len(self.token_ids) - 1
        return n / self.decode_s if self.decode_s > 0 and n > 0 else 0.0


class SpecDecoder:
    """Runs requests through one TargetRunner with an optional Proposer (None = plain decoding)."""

    def __init__(self, runner: TargetRunner, proposer: Proposer | None = None, num_speculative_tokens: int = 0):
        self.runner = runner
        self.proposer = proposer
        self.k = num_speculative_tokens if proposer is not None else 0
        self._ctx = np.zeros((1, runner.max_len), dtype=np.int32)  # token ids so far, for proposers

    def generate(self, prompt_ids: list[int], params: SamplingParams,
                 generator: torch.Generator | None = None) -> GenerationResult:
        runner, ctx = self.runner, self._ctx
        T = len(prompt_ids)
        if T == 0:
            raise ValueError("empty prompt")
        if T + params.max_new_tokens > runner.max_len:
            from specctl.errors import UsageError

            raise UsageError(
                f"prompt ({T} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds the max model length {runner.max_len}",
                "lower --max-new-tokens or raise --max-model-len",
            )
        stop = set() if params.ignore_eos else set(params.stop_token_ids)
        stats = SpecStats()
        out: list[int] = []
        runner.reset()
        ctx[0, :T] = prompt_ids
        n_ctx = T
        if self.proposer is not None:
            self.proposer.start_request(0, ctx[0, :T])

        t0 = time.perf_counter()
        prompt = torch.tensor([prompt_ids], dtype=torch.long)
        logits = runner.forward(prompt, logits="last")  # [1, 1, V]
        last = self._sample_one(logits[0, -1], params, generator)
        margins: list[float] = []
        if params.record_margins:
            margins.extend(_margins(logits[0]))
        t1 = time.perf_counter()
        out.append(last)
        ctx[0, n_ctx] = last
        n_ctx += 1
        finish = "stop" if last in stop else None
        steps = 0
        empty = torch.empty((1, 0), dtype=torch.long)
        zero = torch.zeros(1, dtype=torch.long)

        while finish is None:
            room = params.max_new_tokens - len(out)
            if room <= 0:
                finish = "length"
                break
            k = min(self.k, room - 1)
            draft_ids, num_draft, draft_probs = empty, zero, None
            if k > 0:
                d = self.proposer.propose(ctx, np.array([n_ctx], dtype=np.int32), k,
                                          runner.last_hidden[:, -1] if self.proposer.needs_hidden_states else None)
                nd = int(d.num_tokens[0])
                if nd > 0:
                    draft_ids, num_draft = d.token_ids[:, :nd], d.num_tokens
                    draft_probs = None if d.probs is None else d.probs[:, :nd]
            nd = draft_ids.shape[1]
            base = runner.length
            inp = torch.cat([torch.tensor([[last]], dtype=torch.long), draft_ids], 1)  # [1, 1+nd]
            logits = runner.forward(inp)  # [1, 1+nd, V]
            if params.greedy:
                out_ids, n_emit = greedy_verify(draft_ids, num_draft, logits.argmax(-1))
            else:
                probs = logits_to_probs(logits, params.temperature, params.top_k, params.top_p)
                out_ids, n_emit = rejection_sample(draft_ids, num_draft, draft_probs, probs, generator)
            n = int(n_emit[0])
            emitted = out_ids[0, :n].tolist()
            if params.record_margins:
                margins.extend(_margins(logits[0, :n]))
            runner.rollback(base + n)  # last + (n-1) accepted drafts are valid
            stats.observe(nd, n - 1)
            if self.proposer is not None:
                self.proposer.on_verified(0, n - 1, emitted)
            steps += 1
            for tok in emitted[:room]:
                out.append(tok)
                ctx[0, n_ctx] = tok
                n_ctx += 1
                if tok in stop:
                    finish = "stop"
                    break
            last = out[-1]
        t2 = time.perf_counter()
        if self.proposer is not None:
            self.proposer.end_request(0)
        return GenerationResult(out, finish, stats, t1 - t0, t2 - t1, steps, margins[: len(out)])

    @staticmethod
    def _sample_one(logits: torch.Tensor, params: SamplingParams, generator) -> int:
        """logits: [V] -> one token id (argmax when greedy)."""
        if params.greedy:
            return int(logits.argmax())
        probs = logits_to_probs(logits, params.temperature, params.top_k, params.top_p)
        return int(torch.multinomial(probs, 1, generator=generator))


def _margins(logits: torch.Tensor) -> list[float]:
    """logits: [T, V] -> top-1 minus top-2 logit per row: how close each greedy choice was to a tie."""
    top2 = logits.float().topk(2, dim=-1).values
    return (top2[:, 0] - top2[:, 1]).tolist()
