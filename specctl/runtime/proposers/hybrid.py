"""HybridProposer (method "hybrid", specctl's extension): several proposers behind one, per step.

    {"method": "hybrid", "policy": "first", "hybrid_min_match": 2,
     "proposers": [{"method": "suffix"}, {"method": "eagle3", "model": "DRAFT", "num_speculative_tokens": 4}]}

The seed's roadmap (unified proposers, "ngram as the fallback + model drafting"): pattern matching
is free and nearly always right when it fires (code edits, agentic loops, quoting the prompt); a
model draft pays on new text. Policies:

- ``first``: the sub-proposers are asked in order; the first draft of at least ``hybrid_min_match``
  tokens is the step's draft (the last one's at any length).
- ``score``: the sub-proposers are asked best first by expected accepted tokens per second, each
  from its own measured per-position acceptance and drafting time and the measured time of a
  verification step (unmeasured ones are tried first, optimistically); the first with a draft wins.
- ``tree``: every sub-proposer drafts and the drafts are merged into one token tree (shared
  prefixes once), verified in one forward (greedy requests; sampled ones take ``first``).

Every sub-proposer follows every request whether or not it drafted (start, sampling, the target's
hidden states, each verification), so one that falls behind catches up from the state it kept: a
draft model's cache extends over the tokens it missed in one forward, an EAGLE head keeps every
target feature. Lossless like any proposer: a chain is one sub-proposer's draft, with its
probabilities when it samples; a tree is verified greedily.

``credit(slot, ...)`` splits a verified step among the parts that drafted it, so the decoder counts
drafts and acceptance per sub-proposer (bench's rows, /metrics' ``proposer`` label).
"""

from __future__ import annotations

import time

import torch

from specctl.config import SpecConfig
from specctl.runtime.controller import DraftLengthController
from specctl.runtime.proposers.base import DraftOutput, Proposer


def sub_labels(configs: list[SpecConfig]) -> list[str]:
    """A name per sub-proposer: its method, numbered where one repeats (ngram, ngram#2)."""
    seen: dict[str, int] = {}
    out = []
    for c in configs:
        seen[c.method] = seen.get(c.method, 0) + 1
        out.append(c.method if seen[c.method] == 1 else f"{c.method}#{seen[c.method]}")
    return out


def paths(d: DraftOutput) -> list[list[int]]:
    """Every node's token path from the root (a chain: its prefixes) of a one-row draft."""
    n = int(d.num_tokens[0])
    toks = d.token_ids[0, :n].tolist()
    if d.parents is None:
        return [toks[:i + 1] for i in range(n)]
    out: list[list[int]] = []
    for i in range(n):
        p = d.parents[i]
        out.append((out[p] if p >= 0 else []) + [toks[i]])
    return out


def merge_tree(drafts: list[DraftOutput]) -> tuple[list[int], list[int]]:
    """The drafts as one token trie: (tokens, parents), parents first, -1 for the root's children."""
    index: dict[tuple[int, ...], int] = {}
    tokens, parents = [], []
    for d in drafts:
        for path in paths(d):
            key = tuple(path)
            if key not in index:
                index[key] = len(tokens)
                tokens.append(path[-1])
                parents.append(index[key[:-1]] if len(key) > 1 else -1)
    return tokens, parents


class _Part:
    """A sub-proposer's measured record: its acceptance per draft position (the draft-length
    controller's model of it) and its drafting seconds per call."""

    def __init__(self, k: int):
        self.acceptance = DraftLengthController(k, decay=0.1)
        self.draft_s: float | None = None

    def observe(self, num_draft: int, num_accepted: int) -> None:
        self.acceptance.observe_acceptance(num_draft, num_accepted)

    def expected_tokens(self, k: int) -> float:
        """1 + p_1 + p_1 p_2 + ...: tokens a k-token draft of this part emits on average."""
        return self.acceptance.expected_tokens(k)


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
        self.reads_prompt = any(p.reads_prompt for p in self.subs)
        self.aux_layers = tuple(sorted({l for p in self.subs for l in p.aux_layers}))  # every part's, once
        self.learns_across_requests = any(p.learns_across_requests for p in self.subs)
        self.parts = [_Part(k) for k in self.ks]
        self._greedy: dict[int, bool] = {}  # slot -> its request is greedy (trees are verified greedily)
        self._drafted: dict[int, list[tuple[int, list[list[int]]]]] = {}  # slot -> [(part, its paths)] this step
        self._last_propose: dict[int, float] = {}  # slot -> when it last drafted
        self.verify_s: float | None = None  # a step's time outside drafting (EMA), for ``score``

    # ------------------------------------------------------------------ every sub-proposer follows
    def start_request(self, slot, prompt_ids) -> None:
        self._drafted.pop(slot, None)
        self._last_propose.pop(slot, None)
        for p in self.subs:
            p.start_request(slot, prompt_ids)

    def set_sampling(self, slot, params, generator=None) -> None:
        self._greedy[slot] = float(params.temperature) <= 0
        for p in self.subs:
            p.set_sampling(slot, params, generator)

    def bind_target(self, slot, runner) -> None:
        for p in self.subs:
            p.bind_target(slot, runner)

    def on_prefill(self, slot, upto) -> None:
        for p in self.subs:
            p.on_prefill(slot, upto)

    def on_target_hidden(self, slot, hidden, aux) -> None:
        for p in self.subs:
            if p.needs_hidden_states:
                p.on_target_hidden(slot, hidden, self._aux_for(p, aux))

    def _aux_for(self, p: Proposer, aux):
        """The part's own layers out of the union the target returned ([1, T, A*H], ascending)."""
        if aux is None or not p.aux_layers or p.aux_layers == self.aux_layers:
            return aux if p.aux_layers else None
        H = aux.shape[-1] // len(self.aux_layers)
        return torch.cat([aux[..., self.aux_layers.index(l) * H:(self.aux_layers.index(l) + 1) * H]
                          for l in p.aux_layers], dim=-1)

    def on_verified(self, slot, num_accepted, emitted) -> None:
        for p in self.subs:
            p.on_verified(slot, num_accepted, emitted)

    def end_request(self, slot) -> None:
        self._drafted.pop(slot, None)
        self._last_propose.pop(slot, None)
        for p in self.subs:
            p.end_request(slot)

    def credit(self, slot: int, num_draft: int, num_accepted: int, emitted: list[int]) -> dict[str, tuple[int, int]]:
        """Each part that drafted this step: (its draft tokens, how many of them were accepted): its
        chain's (or tree's deepest path's) agreement with the accepted tokens."""
        out = {}
        accepted = emitted[:num_accepted]
        for i, ps in self._drafted.pop(slot, []):
            best = max((len(p) for p in ps if p == accepted[:len(p)]), default=0)
            depth = max(len(p) for p in ps)
            self.parts[i].observe(depth, best)
            out[self.names[i]] = (depth, best)
        return out

    # ------------------------------------------------------------------ drafting
    def _ask(self, i: int, token_ids, num_tokens, k, hidden_states, slots) -> DraftOutput:
        t = time.perf_counter()
        d = self.subs[i].propose(token_ids, num_tokens, min(k, self.ks[i]), hidden_states, slots=slots)
        dt = time.perf_counter() - t
        part = self.parts[i]
        part.draft_s = dt if part.draft_s is None else part.draft_s + 0.2 * (dt - part.draft_s)
        return d

    def _order(self, k: int) -> list[int]:
        """``score``: parts by expected tokens per second of a step with their draft, best first."""
        v = self.verify_s or 0.0

        def score(i: int) -> float:
            d = self.parts[i].draft_s
            if d is None:
                return float("inf")  # never measured: try it
            return self.parts[i].expected_tokens(min(k, self.ks[i])) / max(v + d, 1e-9)

        return sorted(range(len(self.subs)), key=score, reverse=True)

    def propose(self, token_ids, num_tokens, k, hidden_states=None, slots=None) -> DraftOutput:
        if token_ids.shape[0] != 1:
            raise ValueError("the hybrid proposer drafts for one request per call (the decoder's way)")
        slot = 0 if slots is None else int(slots[0])
        t0 = time.perf_counter()
        last = self._last_propose.get(slot)
        if last is not None:  # the time since its last draft, less drafting: one verification step
            drafted = sum(self.parts[i].draft_s or 0.0 for i, _ in self._drafted.get(slot, []))
            gap = max(t0 - last - drafted, 0.0)
            self.verify_s = gap if self.verify_s is None else self.verify_s + 0.2 * (gap - self.verify_s)
        self._last_propose[slot] = t0
        self._drafted[slot] = []
        empty = DraftOutput(torch.full((1, max(k, 0)), -1, dtype=torch.long), torch.zeros(1, dtype=torch.long))
        if self.policy == "tree" and self._greedy.get(slot, True):
            drafts = []
            for i in range(len(self.subs)):
                d = self._ask(i, token_ids, num_tokens, k, hidden_states, slots)
                if int(d.num_tokens[0]) > 0:
                    drafts.append(d)
                    self._drafted[slot].append((i, paths(d)))
            if not drafts:
                return empty
            if len(drafts) == 1:
                return drafts[0]
            tokens, parents = merge_tree(drafts)
            return DraftOutput(torch.tensor([tokens], dtype=torch.long), torch.tensor([len(tokens)]), None, parents)
        order = self._order(k) if self.policy == "score" else range(len(self.subs))
        order = list(order)
        for j, i in enumerate(order):
            d = self._ask(i, token_ids, num_tokens, k, hidden_states, slots)
            n = int(d.num_tokens[0])
            need = self.min_match if self.policy == "first" else 1
            if n >= need or (j == len(order) - 1 and n > 0):
                self._drafted[slot] = [(i, paths(d))]
                return d
        return empty


PROPOSERS = {"hybrid": HybridProposer}
