"""HybridProposer (method "hybrid", specctl's extension): several proposers behind one, per step.

    {"method": "hybrid", "policy": "first", "hybrid_min_match": 2,
     "proposers": [{"method": "suffix"}, {"method": "eagle3", "model": "DRAFT", "num_speculative_tokens": 4}]}

The seed's roadmap (unified proposers, "ngram as the fallback + model drafting"): pattern matching
is free and nearly always right when it fires (code edits, agentic loops, quoting the prompt); a
model draft pays on new text. Policies:

- ``first``: the sub-proposers are asked in order; the first draft of at least ``hybrid_min_match``
  tokens is the step's draft (the last one's at any length).
- ``score`` (the default): each part is weighed as the draft-length controller weighs one proposer
  (``DraftLengthController``, one per part): its measured per-position acceptance, the measured time
  of a verification over T tokens, and its own drafting time per step, plus what it must catch up on
  first (``Proposer.backlog``: context tokens it has not read, at its measured seconds per token).
  The parts whose best draft beats a plain step are asked best first, by expected accepted tokens per
  second; the first with a draft wins. A part whose controller probes (its drafting off, the wait between
  probes doubling) is asked before them, so that a part written off early is measured again; a probe that
  found nothing to draft is due again at the next step. None beats a plain step: no draft. A part that
  has not drafted yet is asked first, to be measured (a model part has read its request's prompt in the
  prefill, so this costs no catching up). The free parts (FREE_METHODS) that were not asked draft anyway,
  unverified, and ``credit`` scores those drafts against the emitted tokens.
- ``tree``: every sub-proposer drafts and the drafts are merged into one token tree (shared
  prefixes once), verified in one forward (greedy requests; sampled ones take ``first``).

Every sub-proposer follows every request's verifications (its context, the target's hidden states), which
costs a lazy draft nothing; a part that reads prompts with a model of its own (a draft model) reads a new
request's prompt only while it pays (``score``: its controller would draft now), or while it is unmeasured, one
request at a time and where that reading is expected to pay back, so a draft model that sits out costs nothing,
and catches up from the cache it kept if the choice turns to it (that catching up counted in its score).
Lossless like any proposer: a chain is one sub-proposer's draft, with its probabilities when it samples; a tree
is verified greedily.

In a batch, the parts are asked in rounds: every request's first choice in one call per part (a draft
model drafts all of them in one batched forward per drafting step), then the requests still without a
draft their next choice; each request's draft is the one it would get alone.

``credit(slot, ...)`` splits a verified step among the parts that drafted it, so the decoder counts
drafts and acceptance per sub-proposer (bench's rows, /metrics' ``proposer`` label).
"""

from __future__ import annotations

import time

import torch

from specctl.config import SpecConfig
from specctl.runtime.controller import PROBE_CATCH_UP, READ_PRIOR, DraftLengthController
from specctl.runtime.proposers.base import Draft, DraftBatch, DraftRequest, Proposer


def sub_labels(configs: list[SpecConfig]) -> list[str]:
    """A name per sub-proposer: its method, numbered where one repeats (ngram, ngram#2)."""
    seen: dict[str, int] = {}
    out = []
    for c in configs:
        seen[c.method] = seen.get(c.method, 0) + 1
        out.append(c.method if seen[c.method] == 1 else f"{c.method}#{seen[c.method]}")
    return out


def paths(d: Draft) -> list[list[int]]:
    """Every node's token path from the root (a chain: its prefixes) of a draft."""
    n, toks = len(d), d.ids
    if d.parents is None:
        return [toks[:i + 1] for i in range(n)]
    out: list[list[int]] = []
    for i in range(n):
        p = d.parents[i]
        out.append((out[p] if p >= 0 else []) + [toks[i]])
    return out


def merge_tree(drafts: list[Draft]) -> tuple[list[int], list[int]]:
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
    """A sub-proposer's measured record (``score``): a draft-length controller of its own (its acceptance
    per position pooled over every request, the verification's time over T tokens, its drafting time per
    step), for a lookup one per request beside it (``of``: that request's own acceptance, as the decoder
    keeps one per request, the costs shared), and its seconds per context token caught up.

    Per request for a lookup (``per_request``): whether n-gram or suffix drafts pay is a property of the
    request's text (does its answer repeat its prompt), so one request's misses must not ride on the
    others' hits. A draft model's acceptance is the two models' agreement, alike across requests, and a
    request gives it few draws: pooled, it is not re-learnt (each draft a forward) on every request."""

    def __init__(self, k: int, draft_hint: float, per_request: bool = False):
        self.acceptance = DraftLengthController(k, decay=0.1, draft_hint=draft_hint)
        self.per_request = per_request
        self.requests: dict[int, DraftLengthController] = {}  # slot -> its own acceptance (the costs shared)
        self.draft_hint = draft_hint
        self.draft_s: float | None = None  # seconds of a call (EMA)
        self.won: int | None = None  # the hybrid's step at which its draft was last the step's draft
        self.explorer: int | None = None  # unmeasured: the slot whose prompt it reads to be measured on

    def observe(self, num_draft: int, num_accepted: int, slot: int | None = None) -> None:
        """A verified (or shadow) draft of this part: pooled, and the request's own where ``slot`` is given (its
        controller made on its first draft, with the pooled rate as its prior)."""
        if num_draft <= 0:
            return
        if slot is not None and self.per_request:
            c = self.requests.get(slot)
            if c is None:
                c = self.requests[slot] = DraftLengthController(self.acceptance.k, alpha=self.acceptance.alpha,
                                                                costs=self.acceptance.costs, draft_hint=self.draft_hint)
            c.observe_acceptance(num_draft, num_accepted)
        self.acceptance.observe_acceptance(num_draft, num_accepted)

    def of(self, slot: int) -> DraftLengthController:
        """The controller that decides this request's drafts: its own once one of this part's drafts for it was
        scored, else the pooled one (a request's first drafts follow what the others showed). A request
        whose text does not repeat stops being drafted for by a part that pays on the others, and the
        other way round."""
        return self.requests.get(slot, self.acceptance)

    def expected_tokens(self, k: int) -> float:
        """1 + p_1 + p_1 p_2 + ...: tokens a k-token draft of this part emits on average."""
        return self.acceptance.expected_tokens(k)

    def timed(self, seconds: float, backlog: int) -> None:
        """A call took ``seconds`` with ``backlog`` context tokens to read first: one with little to read
        times its drafting (catching up is the part's own measurement, ``catch_up_seconds``)."""
        if backlog <= CATCH_UP_MIN:
            self.draft_s = seconds if self.draft_s is None else self.draft_s + 0.2 * (seconds - self.draft_s)

    def value(self, slot: int, backlog: int, catch_up_s: float | None, batch: int = 1,
              clock: int | None = None) -> tuple[int, float, float]:
        """(d, expected tokens per plain-step time, catching up in plain steps) of its best draft now for the
        request ``slot`` (``of``) among ``batch`` requests, with ``catch_up_s`` seconds to read its ``backlog``
        first (None: unmeasured); d = 0: it does not draft now (its controller also schedules probes: d > 0
        with a value below a plain step's 1.0; ``clock``: the hybrid's step count, so a batch probes together)."""
        c = self.of(slot)
        d = c.draft_len(batch, clock)
        if d <= 0:
            return 0, 0.0, 0.0
        extra = self.catch_up_steps(backlog, catch_up_s, batch)
        return d, c.expected_tokens(d) / (c.cost(d + 1, batch) + extra), extra

    def catch_up_steps(self, backlog: int, catch_up_s: float | None, batch: int = 1) -> float:
        """Catching up on ``backlog`` context tokens, in the request's plain steps among ``batch`` (a / B + b: the
        stall holds up the whole step): ``catch_up_s`` as measured, else estimated (a quarter of a drafting call's
        per-token time, or before any draft READ_PRIOR of the cost hint); inf unmeasured, past CATCH_UP_MIN tokens."""
        if backlog <= 0:
            return 0.0
        fit = self.acceptance._slope()
        one = fit[0] if fit else 0.0
        if one <= 0:
            return 0.0 if backlog <= CATCH_UP_MIN else float("inf")
        if catch_up_s is None:
            catch_up_s = (self.draft_s / (4 * self.acceptance.k) * backlog if self.draft_s is not None
                          else self.acceptance.reading_estimate(backlog))
        return catch_up_s / (self.acceptance.plain_step_s(batch) or one)

    def pays(self) -> bool:
        """Whether it would draft now with nothing to catch up (unmeasured: yes, so it gets measured)."""
        c = self.acceptance
        return not c.costs or (c.may_pay() and c.best_len() > 0)


FREE_METHODS = ("ngram", "suffix")  # parts whose drafting is a lookup: they draft unverified in the shadow (``credit``)
FOLLOW_STEPS = 64  # a part that reads prompts stops reading new ones when it has not won for this many steps
CATCH_UP_MIN = 16  # a call with more context tokens than this to read first is not timed as drafting
EXPLORE_CATCH_UP = 4.0  # a part that has not drafted yet is tried where catching up costs at most this (plain steps)
EXPLORE_READ = 0.1  # alone, before anything is measured: the most a prompt's reading may be of the request (``_first_look``)


class HybridProposer(Proposer):
    method = "hybrid"

    def __init__(self, config: SpecConfig, *, target=None, max_model_len: int, clock=time.perf_counter):
        """``clock``: seconds, for timing the parts' calls (tests give a deterministic one)."""
        from specctl.runtime.proposers import build_proposer

        subs = config.sub_configs()
        self.subs = [build_proposer(c, max_model_len, target=target) for c in subs]
        self.ks = [int(c.num_speculative_tokens) for c in subs]  # each drafts at most its own k
        self.names = sub_labels(subs)
        self.policy = config.policy or "score"
        self.min_match = int(config.hybrid_min_match or 2)
        self.needs_hidden_states = any(p.needs_hidden_states for p in self.subs)
        self.reads_prompt = any(p.reads_prompt for p in self.subs)
        self.aux_layers = tuple(sorted({l for p in self.subs for l in p.aux_layers}))  # every part's, once
        self.attention_scores = any(p.attention_scores for p in self.subs)
        self.learns_across_requests = any(p.learns_across_requests for p in self.subs)
        self.chooses_draft_length = self.policy == "score"  # its parts' controllers do, not the decoder's
        self.parts = [_Part(k, p.draft_cost, p.method in FREE_METHODS) for k, p in zip(self.ks, self.subs)]
        self.clock = clock
        self._greedy: dict[int, bool] = {}  # slot -> its request is greedy (trees are verified greedily)
        self._drafted: dict[int, list[tuple[int, list[list[int]]]]] = {}  # slot -> [(part, its paths)] this step
        self._step_draft_s: dict[int, dict[int, float]] = {}  # slot -> {part: seconds drafting} this step
        self._last_drafted: dict[int, list] = {}  # slot -> what credit() counted, for observe_step
        self._batch: dict[int, int] = {}  # slot -> requests in its last step's forward
        self._last_batch = 1  # requests in the last step's forward (a new request's batch until it steps)
        self._new_tokens: dict[int, int] = {}  # slot -> its max_tokens (what a part's reading must pay back over)
        self._steps = 0  # drafting calls so far (every request's): the clock of ``_Part.won``
        self._clock = 0  # propose calls so far (one a decode step): the parts' probes fall on its multiples
        self._probing: set[tuple[int, int]] = set()  # (slot, part) whose controller probes this step
        self._shadow: dict[int, list[tuple[int, list[int]]]] = {}  # slot -> [(free part, its unverified draft)]
        self.adaptive = True  # the decoder adapts draft lengths (``set_adaptive``): ``score`` weighs the parts

    # ------------------------------------------------------------------ every sub-proposer follows
    def start_request(self, slot, prompt_ids) -> None:
        self._drafted.pop(slot, None)
        for p in self.subs:
            p.start_request(slot, prompt_ids)

    def set_sampling(self, slot, params, generator=None) -> None:
        self._greedy[slot] = float(params.temperature) <= 0
        self._new_tokens[slot] = int(params.max_new_tokens)
        for p in self.subs:
            p.set_sampling(slot, params, generator)

    def bind_target(self, slot, runner) -> None:
        for p in self.subs:
            p.bind_target(slot, runner)

    def on_prefill(self, slot, upto, batch: int = 1) -> None:
        """Every part reads along, but a part with a prompt of its own to read only until it is measured
        and then while it pays (``score``): a draft model sitting out reads nothing, and catches up if
        it is chosen later."""
        for p, part in zip(self.subs, self.parts):
            if not p.reads_prompt or self.policy != "score" or not self.adaptive or self._follows(part, slot, batch):
                p.on_prefill(slot, upto, batch)

    def _follows(self, part: "_Part", slot: int, batch: int = 1) -> bool:
        """A part that reads prompts reads one request's while it is unmeasured (it has never drafted: read in
        the prefill, its first draft costs no catching up, so it gets tried and measured; the requests that
        arrive with it wait for that evidence) and then only while it
        pays: it won a step lately (within FOLLOW_STEPS), its controller would still draft, and the seconds
        its drafts are expected to save over the request's max_tokens against the best other part exceed
        its measured reading of the prompt (``DraftLengthController.reading_pays``). A measured part that
        stopped winning reads nothing; if the choice turns to it, it catches up then (``backlog``), which
        its score counts.

        ``batch``: the requests in flight that this one will decode among. The unmeasured part must first be expected
        to pay its reading back (its size's estimate of the reading, its prior's value); until a plain step is measured,
        in a batch it reads nothing, alone a prompt whose reading is a small share of the request (``_first_look``)."""
        unmeasured = part.acceptance._draft_cost() is None
        if unmeasured and (part.explorer == slot or (part.explorer is None and batch <= 1 and self._first_look(part, slot))):
            part.explorer = slot
            return True
        if not unmeasured and (part.won is None or self._steps - part.won > FOLLOW_STEPS or not part.pays()):
            return False
        if slot not in self._new_tokens:
            return not unmeasured  # its length unknown (no sampling parameters): nothing to weigh the reading against
        # the reading pays back over the request: against the best other part, at the batch size
        i, batch = self.parts.index(part), self._batch.get(slot, max(batch, self._last_batch))
        against = max([1.0] + [q.acceptance.best_value(batch) for q in self.parts if q is not part])
        sub, new = self.subs[i], self._new_tokens.get(slot, 0)
        if not unmeasured:
            return part.acceptance.reading_pays(sub.catch_up_seconds(slot), new, batch, against)
        if part.explorer is not None:
            return False  # another request is measuring it
        if not part.acceptance.reading_weighed(sub.catch_up_seconds(slot), sub.backlog(slot), new, batch, against):
            return False  # it would not pay back, or nothing is measured yet to weigh it by
        part.explorer = slot
        return True

    def _first_look(self, part: "_Part", slot: int) -> bool:
        """Whether an unmeasured part, alone, reads this prompt to be measured on it, unweighed: where the request's
        length is unknown; not once a plain step is measured (``_follows`` weighs it then, as in a batch); else where
        its size's estimate of the reading is at most EXPLORE_READ of the request's plain decoding (a 3,000-token
        document cost a 0.5B ~6 s on 2 CPU cores, in the time to first token, to draft twice)."""
        new, c = self._new_tokens.get(slot), part.acceptance
        if new is None:
            return True
        if c.plain_step_s(1) is not None:
            return False
        unread = self.subs[self.parts.index(part)].backlog(slot)
        return unread * READ_PRIOR * c.draft_hint <= EXPLORE_READ * new

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
        self._step_draft_s.pop(slot, None)
        self._last_drafted.pop(slot, None)
        self._shadow.pop(slot, None)
        self._batch.pop(slot, None)
        self._new_tokens.pop(slot, None)
        for part in self.parts:
            part.requests.pop(slot, None)
            if part.explorer == slot:
                part.explorer = None  # unmeasured still: the next request's prompt is read instead
        for p in self.subs:
            p.end_request(slot)

    def backlog(self, slot: int) -> int:
        return min(p.backlog(slot) for p in self.subs)

    def catch_up_seconds(self, slot: int) -> float | None:
        return min((s for s in (p.catch_up_seconds(slot) for p in self.subs) if s is not None), default=None)

    def credit(self, slot: int, num_draft: int, num_accepted: int, emitted: list[int]) -> dict[str, tuple[int, int]]:
        """Each part that drafted this step: (its draft tokens, how many of them were accepted): its
        chain's (or tree's deepest path's) agreement with the accepted tokens."""
        out = {}
        accepted = emitted[:num_accepted]
        self._last_drafted[slot] = drafted = self._drafted.pop(slot, [])
        for i, ps in drafted:
            best = max((len(p) for p in ps if p == accepted[:len(p)]), default=0)
            depth = max(len(p) for p in ps)
            self.parts[i].observe(depth, best, slot)
            out[self.names[i]] = (depth, best)
        for i, ids in self._shadow.pop(slot, []):  # a free part's unverified draft, scored on the emitted tokens
            n = next((j for j, (a, b) in enumerate(zip(ids, emitted)) if a != b), min(len(ids), len(emitted)))
            if n < min(len(ids), len(emitted)):
                self.parts[i].observe(len(ids), n, slot)  # rejected at n + 1
            else:
                self.parts[i].observe(n, n, slot)  # every token known matched (the rest unknown: a draft of n, all accepted)
        return out

    def set_adaptive(self, on: bool) -> None:
        self.adaptive = on

    def observe_step(self, slot: int, num_draft: int, rows: int, seconds: float | None, draft_seconds: float,
                     batch: int = 1) -> None:
        """Each part's controller learns the verification's time over ``rows`` tokens (a part that did not
        draft saw a step it was not charged for), and the part that drafted its own drafting time (its
        acceptance was counted in ``credit``)."""
        self._batch[slot] = self._last_batch = batch
        spent = self._step_draft_s.pop(slot, {})
        drafted = {i for i, _ in self._drafted.get(slot, [])} | {i for i, _ in self._last_drafted.pop(slot, [])}
        if seconds is None:  # the forward read prompt chunks too: nothing learned of a verification's cost
            return
        verify = max(seconds - draft_seconds, 1e-9)
        for i, part in enumerate(self.parts):
            if i in drafted and num_draft > 0:
                part.acceptance.observe_costs(num_draft, rows, verify + spent.get(i, 0.0), spent.get(i, 0.0))
            else:
                part.acceptance.observe_costs(0, rows, verify)

    # ------------------------------------------------------------------ drafting
    def _ask(self, i: int, requests: list[DraftRequest], ks: list[int]) -> list[Draft]:
        """Part i drafts for every request given, in one call (a draft model: one batched forward per
        drafting step for all of them); each request is charged its share of the call's time."""
        backlogs, t = [self.subs[i].backlog(r.slot) for r in requests], self.clock()
        got = self.subs[i].propose(requests, [min(k, self.ks[i]) for k in ks])
        self._read += got.read_seconds  # its reading of context is priced apart, not as drafting
        share = max(self.clock() - t - got.read_seconds, 0.0) / len(requests)
        for r, backlog in zip(requests, backlogs):
            self.parts[i].timed(share, backlog)
            self._step_draft_s.setdefault(r.slot, {})[i] = share
        return got.drafts

    def _order(self, k: int, slot: int) -> list[tuple[int, int]]:
        """``score``: (part, its draft length) of the parts whose draft beats a plain step now, best
        expected tokens per second first. A part that has not drafted yet comes first of all (so it gets
        measured), once a plain step is measured and where catching up first costs at most
        EXPLORE_CATCH_UP plain steps: a long prompt's reading is not risked on a draft not known to pay
        (it is measured on a shorter one). A request's acceptance is its own once a part's draft for it
        was scored (``_Part.of``). A part that costs a forward a draft (a draft model) must beat, beside a
        plain step, what the request's own lookups have been giving it: where n-gram has been quoting the
        request's prompt and finds nothing this step, the plain step it leaves is followed by its next
        quote, and a draft model's tokens now would only take those over, at a forward's cost."""
        scored = []
        batch = self._batch.get(slot, 1)
        for i, part in enumerate(self.parts):
            c, sub = part.acceptance, self.subs[i]
            if not self.adaptive:  # a fixed k: every part, the unmeasured, then the best measured first
                v = c.expected_tokens(self.ks[i]) / c.cost(self.ks[i] + 1) if c.costs else float("inf")
                scored.append((v, i, min(k, self.ks[i])))
                continue
            if c._draft_cost() is None:
                # tried once a plain step is measured (every cost is relative to it: in a batch whose steps all
                # carry prompt chunks, nothing is, and a draft tried there would be weighed by nothing)
                if (c._slope() is not None and part.catch_up_steps(sub.backlog(slot), sub.catch_up_seconds(slot),
                                                                   batch) <= EXPLORE_CATCH_UP):
                    scored.append((float("inf"), i, min(k, self.ks[i])))
                continue
            d, v, extra = part.value(slot, sub.backlog(slot), sub.catch_up_seconds(slot), batch, self._clock)
            if d <= 0:
                continue
            # a probe (its controller's, not a draft that pays) goes first: after another part that always drafts
            # it would never be asked, and a part written off early (n-gram's first draft rejected) would stay
            # written off; it is asked where catching up first costs little. Otherwise the draft must beat a plain
            # step (a model part: and the request's lookups)
            probe = part.of(slot).best_len(batch) == 0
            if probe and extra <= PROBE_CATCH_UP:
                self._probing.add((slot, i))
                scored.append((float("inf"), i, min(d, k, self.ks[i])))
            elif not probe and v > (1.0 if part.per_request else self._lookups_value(slot, batch)):
                scored.append((v, i, min(d, k, self.ks[i])))
        scored.sort(key=lambda x: -x[0])
        return [(i, d) for _, i, d in scored]

    def _lookups_value(self, slot: int, batch: int) -> float:
        """What the request's own lookups have been giving it: their best value on its own record (1.0, a plain
        step, where none has one)."""
        return max([1.0] + [q.of(slot).best_value(batch) for q in self.parts if q.per_request and slot in q.requests])

    def propose(self, requests: list[DraftRequest], ks: list[int]) -> DraftBatch:
        """Each request's draft by the policy, asked in rounds: every request's first choice of part in
        one call per part, then those still without a draft their next choice, and so on; the parts
        that drafted a request are remembered for ``credit``. A request's draft is the one it would get
        alone (each part drafts each request as alone); only the calls are shared."""
        out = [Draft() for _ in requests]
        orders: dict[int, list[tuple[int, int]]] = {}
        trees: list[int] = []
        self._probing.clear()
        self._clock, self._read = self._clock + 1, 0.0  # _read: this call's reading of context (its parts')
        for b, (r, k) in enumerate(zip(requests, ks)):
            self._drafted[r.slot], self._step_draft_s[r.slot] = [], {}
            self._shadow.pop(r.slot, None)
            if k <= 0:
                continue
            self._steps += 1
            if self.policy == "tree" and self._greedy.get(r.slot, True):
                trees.append(b)
            else:  # none of the parts beats a plain step (``score``): no draft
                order = self._order(k, r.slot) if self.policy == "score" else [(i, k) for i in range(len(self.subs))]
                if order:
                    orders[b] = order
        if trees:
            self._tree_drafts(requests, ks, trees, out)
        need = self.min_match if self.policy == "first" else 1
        j, asked = 0, {}  # asked: request -> the parts asked for it this step
        while orders:  # round j: each request still without a draft asks its j-th part
            by_part: dict[int, list[int]] = {}
            for b, order in orders.items():
                by_part.setdefault(order[j][0], []).append(b)
                asked.setdefault(b, set()).add(order[j][0])
            for i, bs in by_part.items():
                for b, d in zip(bs, self._ask(i, [requests[b] for b in bs], [orders[b][j][1] for b in bs])):
                    if not len(d) and (requests[b].slot, i) in self._probing:
                        self.parts[i].of(requests[b].slot).probe_unused()  # it found nothing to draft: due again
                    last = j == len(orders[b]) - 1
                    if len(d) >= need or (last and len(d) > 0):
                        self._drafted[requests[b].slot] = [(i, paths(d))]
                        self.parts[i].won = self._steps
                        out[b] = d
            j += 1
            orders = {b: o for b, o in orders.items() if not len(out[b]) and j < len(o)}
        if self.policy == "score" and self.adaptive:
            self._shadow_drafts(requests, ks, asked)
        return DraftBatch(out, self._read)

    def _shadow_drafts(self, requests: list[DraftRequest], ks: list[int], asked: dict[int, set[int]]) -> None:
        """The free parts (pattern lookups: FREE_METHODS) that were not asked for a request this step draft for
        it anyway, unverified: ``credit`` scores that draft against the tokens the step emits. A lookup costs
        microseconds, and so its acceptance stays measured while another part wins every step (without it,
        one rejected first draft wrote n-gram off on code editing for good, behind a draft model that
        always drafted)."""
        for i, sub in enumerate(self.subs):
            if sub.method not in FREE_METHODS:
                continue
            bs = [b for b, k in enumerate(ks) if k > 0 and i not in asked.get(b, ())]
            if not bs:
                continue
            drafts = sub.propose([requests[b] for b in bs], [min(ks[b], self.ks[i]) for b in bs]).drafts
            for b, d in zip(bs, drafts):
                if len(d) and d.parents is None:
                    self._shadow.setdefault(requests[b].slot, []).append((i, list(d.ids)))

    def _tree_drafts(self, requests: list[DraftRequest], ks: list[int], trees: list[int], out: list[Draft]) -> None:
        """``tree``: every part drafts for every greedy request (one call per part), each request's drafts
        merged into one tree."""
        per: dict[int, list[Draft]] = {b: [] for b in trees}
        for i in range(len(self.subs)):
            for b, d in zip(trees, self._ask(i, [requests[b] for b in trees], [ks[b] for b in trees])):
                if len(d) > 0:
                    per[b].append(d)
                    self._drafted[requests[b].slot].append((i, paths(d)))
        for b, drafts in per.items():
            if len(drafts) == 1:
                out[b] = drafts[0]
            elif drafts:
                tokens, parents = merge_tree(drafts)
                out[b] = Draft(tokens, None, parents)


PROPOSERS = {"hybrid": HybridProposer}
