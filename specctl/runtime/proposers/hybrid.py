"""HybridProposer (method "hybrid", specctl's extension): several proposers behind one, per step.

    {"method": "hybrid", "policy": "first", "hybrid_min_match": 2,
     "proposers": [{"method": "suffix"}, {"method": "eagle3", "model": "DRAFT", "num_speculative_tokens": 4}]}

The seed's roadmap (unified proposers, "ngram as the fallback + model drafting"): pattern matching
is free and nearly always right when it fires (code edits, agentic loops, quoting the prompt); a
model draft pays on new text. Policy ``first``: the sub-proposers are asked in order, and the first
draft of at least ``hybrid_min_match`` tokens is the step's draft (the last one's at any length).

Every sub-proposer follows every request whether or not it drafted (start, sampling, the target's
hidden states, each verification), so one that falls behind catches up from the state it kept:
a draft model's cache extends over the tokens it missed in one forward, an EAGLE head keeps every
target feature. Lossless like any proposer: the step's draft is one sub-proposer's draft, with its
probabilities when it samples, verified as that proposer's would be.

``draft_source(slot)`` names the sub-proposer behind a slot's latest draft, so the decoder counts
drafts and acceptance per sub-proposer (bench's rows, /metrics' ``proposer`` label).
"""

from __future__ import annotations

from specctl.config import SpecConfig
from specctl.runtime.proposers.base import DraftOutput, Proposer


def sub_labels(configs: list[SpecConfig]) -> list[str]:
    """A name per sub-proposer: its method, numbered where one repeats (ngram, ngram#2)."""
    seen: dict[str, int] = {}
    out = []
    for c in configs:
        seen[c.method] = seen.get(c.method, 0) + 1
        out.append(c.method if seen[c.method] == 1 else f"{c.method}#{seen[c.method]}")
    return out


class HybridProposer(Proposer):
    method = "hybrid"

    def __init__(self, config: SpecConfig, *, target=None, max_model_len: int):
        from specctl.runtime.proposers import build_proposer

        subs = config.sub_configs()
        self.subs = [build_proposer(c, max_model_len, target=target) for c in subs]
        self.ks = [int(c.num_speculative_tokens) for c in subs]  # each drafts at most its own k
        self.names = sub_labels(subs)
        self.policy = config.policy or "first"
        self.min_match = int(config.hybrid_min_match or 2)
        self.needs_hidden_states = any(p.needs_hidden_states for p in self.subs)
        self.learns_across_requests = any(p.learns_across_requests for p in self.subs)
        self._source: dict[int, str] = {}  # slot -> the sub-proposer of its latest draft

    # ------------------------------------------------------------------ every sub-proposer follows
    def start_request(self, slot, prompt_ids) -> None:
        for p in self.subs:
            p.start_request(slot, prompt_ids)

    def set_sampling(self, slot, params, generator=None) -> None:
        for p in self.subs:
            p.set_sampling(slot, params, generator)

    def on_target_hidden(self, slot, hidden, aux) -> None:
        for p in self.subs:
            if p.needs_hidden_states:
                p.on_target_hidden(slot, hidden, aux)

    def on_verified(self, slot, num_accepted, emitted) -> None:
        for p in self.subs:
            p.on_verified(slot, num_accepted, emitted)

    def end_request(self, slot) -> None:
        self._source.pop(slot, None)
        for p in self.subs:
            p.end_request(slot)

    def draft_source(self, slot: int) -> str | None:
        return self._source.get(slot)

    # ------------------------------------------------------------------ drafting
    def propose(self, token_ids, num_tokens, k, hidden_states=None, slots=None) -> DraftOutput:
        if token_ids.shape[0] != 1:
            raise ValueError("the hybrid proposer drafts for one request per call (the decoder's way)")
        slot = 0 if slots is None else int(slots[0])
        last = len(self.subs) - 1
        d = None
        for i, p in enumerate(self.subs):
            d = p.propose(token_ids, num_tokens, min(k, self.ks[i]), hidden_states, slots=slots)
            n = int(d.num_tokens[0])
            if n >= self.min_match or (i == last and n > 0):
                self._source[slot] = self.names[i]
                return d
        self._source.pop(slot, None)
        return d


PROPOSERS = {"hybrid": HybridProposer}
