"""Timing a draft inside the measuring loop: ``DraftTimer`` wraps a proposer and counts the seconds of
the draft's own work and the (drafted, accepted) of every step, from which ``specctl recommend
--probe`` estimates acceptance alpha and the cost ratio rho (``run_bench(time_drafts=True)``).

What it does not know: what a proposer computes, how the loop runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class DraftTiming:
    """The draft's share of decoding: seconds in its own work, the k it was asked for in total, and
    (drafted, accepted) of every step that drafted."""

    draft_s: float = 0.0
    k_asked: int = 0
    steps: list[tuple[int, int]] = field(default_factory=list)

    def merge(self, other: DraftTiming) -> DraftTiming:
        return DraftTiming(self.draft_s + other.draft_s, self.k_asked + other.k_asked, self.steps + other.steps)


class DraftTimer:
    """Wraps a Proposer: times the draft's work during decoding and records (drafted, accepted) per step.

    Draft work is ``propose()`` plus the hooks a stateful draft computes in (``on_target_hidden``:
    EAGLE/MTP feed the target's states; ``on_verified``: rollback), counted from the request's first
    ``propose`` on, so that prefill-time work stays out, as it stays out of the decode time.
    ``take()`` hands over what was counted since the last ``take()``.
    """

    def __init__(self, inner):
        self.inner = inner
        self._timing = DraftTiming()
        self._pending: dict[int, int] = {}  # slot -> tokens of its last draft, until they are verified
        self._decoding = False

    def take(self) -> DraftTiming:
        out, self._timing = self._timing, DraftTiming()
        return out

    @property
    def needs_hidden_states(self) -> bool:
        return self.inner.needs_hidden_states

    def _timed(self, fn, *args):
        if not self._decoding:
            return fn(*args)
        t = time.perf_counter()
        out = fn(*args)
        self._timing.draft_s += time.perf_counter() - t
        return out

    def start_request(self, slot, prompt_ids):
        self._decoding = False
        self.inner.start_request(slot, prompt_ids)

    def set_sampling(self, slot, params, generator=None):
        self.inner.set_sampling(slot, params, generator)

    def on_target_hidden(self, slot, hidden, aux):
        self._timed(self.inner.on_target_hidden, slot, hidden, aux)

    def propose(self, requests, ks):
        self._decoding = True
        d = self._timed(self.inner.propose, requests, ks)
        self._timing.k_asked += sum(ks)
        for r, draft in zip(requests, d.drafts):
            self._pending[r.slot] = len(draft)
        return d

    def on_verified(self, slot, num_accepted, emitted):
        n = self._pending.pop(slot, 0)
        if n > 0:
            self._timing.steps.append((n, int(num_accepted)))
        self._timed(self.inner.on_verified, slot, num_accepted, emitted)

    def end_request(self, slot):
        self._decoding = False
        self.inner.end_request(slot)

    def __getattr__(self, name):  # anything else goes to the wrapped proposer
        return getattr(self.inner, name)
