"""What a bench run measured: a ``MethodRun`` per method x workload (totals, acceptance, where outputs
first differed from the baseline's) and the ``BenchReport`` over them (its JSON rows, the best k).

What it does not know: how the runs were made (``specctl.bench.suite``), how they are drawn
(``specctl.bench.report``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from statistics import median

from specctl.bench.draft_timer import DraftTiming
from specctl.bench.labels import peer_engine
from specctl.runtime.decoder import GenerationResult
from specctl.runtime.metrics import SpecStats

BASELINE = "baseline"


@dataclass
class MethodRun:
    """Totals of one method on one workload."""

    method: str
    workload: str
    k: int
    config: dict
    new_tokens: int = 0
    decode_tokens: int = 0
    decode_s: float = 0.0
    prefill_s: float = 0.0
    steps: int = 0
    num_requests: int = 0
    identical: int = 0  # outputs equal to the baseline's
    first_divergence: list = field(default_factory=list)  # per request: index or None
    divergence_margins: list = field(default_factory=list)  # baseline's top-1 - top-2 logit gap there
    stats: SpecStats = field(default_factory=SpecStats)
    by_proposer: dict = field(default_factory=dict)  # hybrid: sub-proposer name -> SpecStats
    rep_tokens: dict = field(default_factory=dict)  # repetition -> decode tokens
    rep_s: dict = field(default_factory=dict)  # repetition -> decode seconds
    rep_new: dict = field(default_factory=dict)  # repetition -> new tokens (the first included)
    rep_request_s: dict = field(default_factory=dict)  # repetition -> prefill + decode seconds
    error: str | None = None  # a peer that failed: why (its row has no figures)
    draft: DraftTiming | None = None  # with time_drafts: the draft's own time and steps (not in rows())

    @property
    def rep_rates(self) -> list[float]:
        return sorted(v for v in map(self.rep_rate, self.rep_tokens) if v is not None)

    def rep_rate(self, rep) -> float | None:
        """Decode tokens / decode seconds of one repetition (None: not measured there)."""
        s = self.rep_s.get(rep, 0.0)
        return self.rep_tokens[rep] / s if s > 0 else None

    def speedup_over(self, base: MethodRun) -> float | None:
        """Median over repetitions of this run's rate / the base's rate in the same repetition: every
        method runs each prompt in turn within a repetition, so a drift of the machine's speed between
        repetitions falls on both sides of each ratio (the ratio of medians would carry it)."""
        return self._median_ratio(base, MethodRun.rep_rate)

    def _median_ratio(self, base: MethodRun, rate) -> float | None:
        """Median over repetitions of rate(self, rep) / rate(base, rep), where both are measured."""
        ratios = [a / b for a, b in ((rate(self, r), rate(base, r)) for r in self.rep_tokens) if a is not None and b]
        return median(ratios) if ratios else None

    def request_rate(self, rep) -> float | None:
        """New tokens / (prefill + decode seconds) of one repetition: each request's whole time, its
        prompt's reading included (a draft model's reading of the prompt falls in the prefill)."""
        s = self.rep_request_s.get(rep, 0.0)
        return self.rep_new[rep] / s if s > 0 else None

    def request_speedup_over(self, base: MethodRun) -> float | None:
        """``speedup_over`` by ``request_rate``: what a client waiting for the whole answer sees."""
        return self._median_ratio(base, MethodRun.request_rate)

    @property
    def tokens_per_s(self) -> float:
        """Median over repetitions of (decode tokens / decode seconds) summed over the prompts."""
        rates = self.rep_rates
        return median(rates) if rates else 0.0

    def add(self, res: GenerationResult, baseline: GenerationResult | None, rep: int = 0,
            draft: DraftTiming | None = None) -> None:
        self.rep_tokens[rep] = self.rep_tokens.get(rep, 0) + max(len(res.token_ids) - 1, 0)
        self.rep_s[rep] = self.rep_s.get(rep, 0.0) + res.decode_s
        self.rep_new[rep] = self.rep_new.get(rep, 0) + len(res.token_ids)
        self.rep_request_s[rep] = self.rep_request_s.get(rep, 0.0) + res.prefill_s + res.decode_s
        self.new_tokens += len(res.token_ids)
        self.decode_tokens += max(len(res.token_ids) - 1, 0)
        self.decode_s += res.decode_s
        self.prefill_s += res.prefill_s
        self.steps += res.num_steps
        self.num_requests += 1
        self.stats = self.stats.merge(res.stats)
        for name, s in getattr(res, "by_proposer", {}).items():
            self.by_proposer[name] = self.by_proposer.get(name, SpecStats()).merge(s)
        if baseline is not None:
            div = first_divergence(baseline.token_ids, res.token_ids)
            self.first_divergence.append(div)
            self.identical += div is None
            if div is not None and div < len(baseline.margins):
                self.divergence_margins.append(baseline.margins[div])
        if draft is not None:
            self.draft = draft if self.draft is None else self.draft.merge(draft)


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token, or None when the sequences are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@dataclass
class BenchReport:
    header: dict
    runs: list[MethodRun]
    memory: dict = field(default_factory=dict)  # method label -> its proposer's extra bytes (bench/memory.py)

    def rows(self) -> list[dict]:
        """One dict per row (the JSON's results). ``identical_to_baseline`` is None where outputs were
        not compared (sampling: no token-for-token baseline to equal)."""
        base = {r.workload: r for r in self.runs if r.method == BASELINE}
        peer_base = {(peer_engine(r.method), r.workload): r for r in self.runs if r.method.endswith(":plain")}
        out = []
        for r in self.runs:
            # specctl methods against specctl's plain decoding; a peer's against its own plain (hf:plain, ...)
            eng = peer_engine(r.method)
            b = base.get(r.workload) if eng is None else peer_base.get((eng, r.workload))
            speedup = r.speedup_over(b) if b and r.error is None else None
            request_speedup = r.request_speedup_over(b) if b and r.error is None else None
            out.append({
                "workload": r.workload, "method": r.method, "k": r.k, "config": r.config,
                "requests": r.num_requests, "new_tokens": r.new_tokens,
                "tokens_per_s": r.tokens_per_s, "tokens_per_s_min": min(r.rep_rates, default=0.0),
                "tokens_per_s_max": max(r.rep_rates, default=0.0), "runs": len(r.rep_rates),
                "tokens_per_s_by_run": [r.rep_rate(k) for k in sorted(r.rep_tokens)], "speedup": speedup,
                "speedup_vs_specctl_baseline": (r.speedup_over(base[r.workload]) if r.workload in base else None),
                "ttft_s": r.prefill_s / max(r.num_requests, 1),
                "request_speedup": request_speedup,
                "request_tokens_per_s_by_run": [r.request_rate(k) for k in sorted(r.rep_new)],
                "target_forwards": r.steps,
                "identical_to_baseline": (r.num_requests if r.method == BASELINE
                                          else r.identical if r.first_divergence else None),
                "first_divergence": r.first_divergence,
                "divergence_margins": r.divergence_margins,
                "error": r.error,
                "extra_memory_mib": (self.memory[r.method] / 2**20 if r.method in self.memory else None),
                "by_proposer": {n: s.to_dict() for n, s in r.by_proposer.items()},
                **r.stats.to_dict(),
            })
        return out

    def best_k(self) -> dict[str, dict[str, dict]]:
        """method -> workload -> the fastest k there: {"k", "tokens_per_s", "speedup", "mean_acceptance_length",
        "by_k": {k: tokens_per_s}}. specctl methods only (peers and the baseline have no k to choose)."""
        out: dict[str, dict[str, dict]] = {}
        for r in self.rows():
            if r["method"] == BASELINE or peer_engine(r["method"]) is not None:
                continue
            cell = out.setdefault(r["method"], {}).setdefault(r["workload"], {"by_k": {}})
            cell["by_k"][r["k"]] = r["tokens_per_s"]
            if "k" not in cell or r["tokens_per_s"] > cell["tokens_per_s"]:
                cell.update(k=r["k"], tokens_per_s=r["tokens_per_s"], speedup=r["speedup"],
                            mean_acceptance_length=r["mean_acceptance_length"])
        return out
