"""Adaptive draft length: speculate only as far as it pays, per request.

A step that verifies d draft tokens costs c(d) plain-step units and emits, with a per-token
acceptance rate a, on average E(d) = (1 - a^(d+1)) / (1 - a) tokens (accepted drafts plus the
recovered/bonus token). The controller picks the d in [0, k] that maximises E(d) / c(d); d = 0
means "do not draft this step".

  a    : accepted positions / tried positions (accepted + the first rejected), decayed
         over recent drafting steps: the per-token acceptance rate
  c(d) : (v(d+1) + d q) / v(1), where v(T) is the exponential moving average of the measured time
         of the target forward (and verification) over T tokens, and q the measured drafting time
         per draft token (a draft model's forwards, an EAGLE head's; ~0 for n-gram lookup). Kept
         apart, a rare slow draft (the draft model catching up on a long prompt) moves q, which
         every d shares, instead of freezing one c(d) that is then never tried again; a draft
         observation is capped at twice the current q, so one outlier cannot switch drafting off.
         Unmeasured v(T) are interpolated; an unmeasured cost is taken as optimistic so it gets
         measured.

When drafting is off it probes again after ``probe_every`` steps (a short draft), so acceptance
that rises later (a repetitive stretch of output) is noticed; each probe that does not turn drafting
back on doubles the wait before the next (up to ``max_probe_every``), so a draft that never pays
costs a few probes, not one every few steps. Greedy output does not depend on any of this: the
verifier keeps it lossless whatever d is chosen.

Pure bookkeeping: no torch; the decode loop calls ``draft_len()`` before and ``observe()`` after
each step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DRAFT = 0  # costs[DRAFT]: drafting seconds per draft token (costs[T], T >= 1: a T-token forward)


@dataclass
class DraftLengthController:
    k: int  # the most draft tokens a step may verify
    alpha: float = 0.6  # prior acceptance rate
    ema: float = 0.3  # weight of the newest observation
    probe_every: int = 8  # steps between probes while drafting is off (doubles after each failed probe)
    max_probe_every: int = 64
    probe_len: int = 2
    costs: dict[int, float] = field(default_factory=dict)  # T -> seconds (EMA); DRAFT -> per draft token
    _off_steps: int = 0
    _gap: int = 0  # the current wait between probes (0: probe_every)

    def verify_cost(self, T: int) -> float:
        """v(T) / v(1): a target forward over T tokens against a one-token step; 1.0 while unmeasured."""
        one = self.costs.get(1)
        if one is None or one <= 0:
            return 1.0
        if T in self.costs:
            return max(self.costs[T] / one, 1.0)
        lo = max((t for t in self.costs if 0 < t < T), default=None)
        hi = min((t for t in self.costs if t > T), default=None)
        if lo is None or hi is None:
            return max(self.costs[lo] / one, 1.0) if lo is not None else 1.0
        f = (T - lo) / (hi - lo)
        return max((self.costs[lo] * (1 - f) + self.costs[hi] * f) / one, 1.0)

    def cost(self, T: int) -> float:
        """c = the relative cost of a step that forwards T tokens, T - 1 of them drafted."""
        one = self.costs.get(1)
        q = self.costs.get(DRAFT, 0.0) / one if one else 0.0
        return self.verify_cost(T) + (T - 1) * q

    _succ: float = 0.0  # decayed counts of accepted positions / tried positions
    _tried: float = 0.0

    def expected_tokens(self, d: int) -> float:
        a = min(max(self.alpha, 0.0), 0.999)
        return (1 - a ** (d + 1)) / (1 - a)

    def best_len(self) -> int:
        """argmax over d in [0, k] of E(d) / cost(d + 1)."""
        best_d, best_v = 0, 1.0
        for d in range(1, self.k + 1):
            v = self.expected_tokens(d) / self.cost(d + 1)
            if v > best_v * 1.02:  # a 2% margin: ties go to drafting less
                best_d, best_v = d, v
        return best_d

    def draft_len(self) -> int:
        """The number of draft tokens to ask for this step (0: plain decoding step)."""
        if 1 not in self.costs:
            return 0  # measure a plain step first: every cost is relative to it
        d = self.best_len()
        if d > 0:
            self._off_steps, self._gap = 0, 0
            return d
        self._off_steps += 1
        gap = self._gap or self.probe_every
        if self._off_steps >= gap:
            self._off_steps = 0
            self._gap = min(2 * gap, self.max_probe_every)  # kept if this probe does not turn drafting on
            return min(self.probe_len, self.k)
        return 0

    def observe(self, num_draft: int, num_accepted: int, tokens_forwarded: int, seconds: float,
                draft_seconds: float | None = None) -> None:
        """After a step: drafts verified, drafts accepted, tokens in the forward, its wall time, and
        of that the time spent drafting (None: not measured apart, the whole step counts as v(T))."""
        if num_draft > 0:
            # positions tried: the accepted ones, plus the first rejected one if any
            tried = num_accepted + (1 if num_accepted < num_draft else 0)
            self._succ = (1 - self.ema) * self._succ + num_accepted
            self._tried = (1 - self.ema) * self._tried + tried
            self.alpha = self._succ / self._tried if self._tried > 0 else self.alpha
        if draft_seconds is not None and num_draft > 0:
            seconds = max(seconds - draft_seconds, 1e-9)
            per = draft_seconds / num_draft
            q = self.costs.get(DRAFT)
            self.costs[DRAFT] = per if q is None else q + self.ema * (min(per, 2 * q) - q)
        old = self.costs.get(tokens_forwarded)
        self.costs[tokens_forwarded] = seconds if old is None else old + self.ema * (seconds - old)
