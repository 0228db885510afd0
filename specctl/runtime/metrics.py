"""SpecStats: speculative decoding counters under vLLM's metric names.

  num_drafts                  steps that verified at least one draft token
  num_draft_tokens            draft tokens proposed (and verified)
  num_accepted_tokens         draft tokens accepted
  num_accepted_tokens_per_pos accepted count at draft position i (0-based)
  acceptance_rate             = num_accepted_tokens / num_draft_tokens
  mean_acceptance_length      = 1 + num_accepted_tokens / num_drafts  (counts the bonus/recovered token)
bench, serve (/metrics) and recommend all read these same names (they are vLLM's Prometheus names,
prefixed ``vllm:spec_decode_``).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """Record one verification step of one request (num_accepted <= num_draft_tokens)."""
        if num_draft_tokens <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        per_pos = self.num_accepted_tokens_per_pos
        if len(per_pos) < num_draft_tokens:
            per_pos.extend([0] * (num_draft_tokens - len(per_pos)))
        for i in range(num_accepted):
            per_pos[i] += 1

    def copy(self) -> "SpecStats":
        return SpecStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                         list(self.num_accepted_tokens_per_pos))

    def merge(self, other: "SpecStats") -> "SpecStats":
        """Sum of two stats (e.g. over requests); returns a new SpecStats."""
        n = max(len(self.num_accepted_tokens_per_pos), len(other.num_accepted_tokens_per_pos))
        a = self.num_accepted_tokens_per_pos + [0] * (n - len(self.num_accepted_tokens_per_pos))
        b = other.num_accepted_tokens_per_pos + [0] * (n - len(other.num_accepted_tokens_per_pos))
        return SpecStats(
            self.num_drafts + other.num_drafts,
            self.num_draft_tokens + other.num_draft_tokens,
            self.num_accepted_tokens + other.num_accepted_tokens,
            [x + y for x, y in zip(a, b)],
        )

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def acceptance_rate_per_pos(self) -> list[float]:
        """Fraction of drafting steps whose position i was accepted (vLLM's per-position rate)."""
        return [c / self.num_drafts for c in self.num_accepted_tokens_per_pos] if self.num_drafts else []

    def to_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "acceptance_rate_per_pos": self.acceptance_rate_per_pos,
        }
