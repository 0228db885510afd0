"""Adaptive draft length: speculate only as far as it pays, per request.

A step that verifies d draft tokens costs c(d) plain-step units and emits on average
E(d) = 1 + p_1 + p_1 p_2 + ... + p_1 ... p_d tokens (accepted drafts plus the recovered/bonus
token). The controller picks the d in [0, k] that maximises E(d) / c(d); d = 0 means "do not draft
this step".

  p_i  : the rate at which draft position i is accepted when positions < i were: decayed counts
         per position, each shrunk by a couple of pseudo-observations toward p_(i-1) (p_1 toward
         the pooled per-token rate ``alpha``, accepted / tried positions); positions never tried
         take the last one's rate. Per position because acceptance
         comes in runs (a draft that got position 1 right tends to get position 2 right): a single
         geometric rate undervalues long drafts exactly where they pay (code editing).
  c(d) : (v(d+1) + d q) / v(1). v(T) is the time of the target forward (and verification) over T
         tokens: the plain step's own measurement v(1) (an exponential moving average), plus a
         slope fitted through the averages measured at every T > 1, so the noise of rarely seen
         T does not decide alone. In a batch of B requests (``draft_len(batch=B)``) T counts the
         rows of the whole forward and a request's step is its share of it: v(T) = a + b T, the
         weights' read a shared by the B requests, so c_B(d) = (a/B + b (1 + d) + d q) / (a/B + b).
         As B grows, verification stops being free and d shrinks. q is the measured drafting time per draft token (a draft
         model's forwards, an EAGLE head's; ~0 for n-gram lookup). Kept apart, a rare slow draft
         (the draft model catching up on a long prompt) moves q, which every d shares; a draft
         observation is capped at twice the current q, so one outlier cannot switch drafting
         off. Unmeasured costs are taken as optimistic, so they get measured; until drafting is
         measured, q is the proposer's hint (``Proposer.draft_cost``: a draft model's weights over
         the target's) times the request's share of a plain step, so a batch whose verification is
         already costly does not start a draft model it cannot pay for (and skips reading prompts).

When drafting is off it probes again after ``probe_every`` steps (a short draft), so acceptance
that rises later (a repetitive stretch of output) is noticed; each probe that does not turn drafting
back on doubles the wait before the next (up to ``max_probe_every``), so a draft that never pays
costs a few probes, not one every few steps. A probe that would first have the draft catch up on
context it skipped (a draft model that stopped reading the request) for longer than
``PROBE_CATCH_UP`` plain steps is skipped: a draft that was switched off then costs nothing more.
In a batch the probes fall on multiples of the wait of a clock the requests share, so they probe in
the same steps and share one drafting forward. Greedy output does not depend on any of this: the
verifier keeps it lossless whatever d is chosen.

In a batch the per-request model can be wrong in ways it cannot see (a shared draft forward
whose cost grows with the batch, attention over long contexts in the verify rows): ``BatchGuard``
watches the outcome instead. Per batch size it keeps the measured throughput (tokens emitted by the
whole batch per second) of steps that drafted and of steps that did not; while drafting measures
slower than not drafting, the batch decodes plainly and tries drafting again after a wait that
doubles each time it still loses. So a batch never settles below plain decoding by more than its
probes cost.

Pure bookkeeping: no torch; the decode loop calls ``draft_len()`` before and ``observe()`` after
each step (and ``BatchGuard.drafts()`` / ``observe()`` around a batched step).
"""

from __future__ import annotations

from dataclasses import dataclass, field

PROBE_CATCH_UP = 0.25  # a probe that would catch up for longer than this (in plain steps) is skipped
# before a draft's reading is measured: a context token read as this fraction of its draft token hint. Measured on
# 2 cores of an AMD EPYC (Zen 4, 2026-12-06): Qwen2.5-Coder-0.5B read a ~400-token code-editing prompt in 1.28 s
# more than the 1.5B target's own prefill, 15 of the target's plain steps (84 ms): 0.038 a token, its hint 0.32
# times 0.12. 1/16 had it explore such prompts alone, where they cost the hybrid 8 % of the request's time.
READ_PRIOR = 1 / 8
DRAFT = 0  # costs[DRAFT]: drafting seconds per draft token (costs[T], T >= 1: a T-token forward)
# costs[-d]: drafting seconds of a step that drafted d tokens; over three or more d they give the
# drafting cost as q0 + q d (q0: what a drafting step pays whatever d is, e.g. a draft model's
# catch-up forward on the tokens it has not read yet)


def positions_tried(num_draft: int, num_accepted: int) -> int:
    """Draft positions a verification tried: the accepted ones, plus the first rejected one if any."""
    return num_accepted + (1 if num_accepted < num_draft else 0)


@dataclass
class PooledAcceptance:
    """A pooled acceptance rate: decayed counts of accepted / tried draft positions, with ``default``
    kept in as ``prior_weight`` pseudo-observations (one bad step does not zero it). A request's
    controller keeps one (its ``alpha``); the decoder keeps one over all its requests, the prior a new
    request's controller starts from: a draft that has been rejected for every earlier request does
    not get each new request's first steps to prove it again."""

    default: float = 0.6
    decay: float = 0.02  # weight of the newest observation
    prior_weight: float = 2.0
    _succ: float = 0.0
    _tried: float = 0.0

    def observe(self, num_draft: int, num_accepted: int) -> None:
        if num_draft <= 0:
            return
        tried = positions_tried(num_draft, num_accepted)
        keep = 1 - self.decay
        self._succ = keep * self._succ + num_accepted
        self._tried = keep * self._tried + tried

    def prior(self) -> float:
        return (self._succ + self.prior_weight * self.default) / (self._tried + self.prior_weight)

    @property
    def tried(self) -> float:
        """Draft positions tried so far (decayed): how much evidence the rate rests on."""
        return self._tried


@dataclass
class DraftLengthController:
    k: int  # the most draft tokens a step may verify
    alpha: float = 0.6  # the pooled per-token acceptance rate (its prior until a draft is verified)
    ema: float = 0.3  # weight of the newest cost observation
    decay: float = 0.15  # weight of the newest acceptance observation
    prior_weight: float = 2.0  # pseudo-observations of the pooled rate behind each position's rate
    probe_every: int = 8  # steps between probes while drafting is off (doubles after each failed probe)
    max_probe_every: int = 64
    probe_len: int = 2
    costs: dict[int, float] = field(default_factory=dict)  # T -> seconds (EMA); DRAFT -> per draft token
    draft_hint: float = 0.0  # a draft token's cost in plain steps until drafting is measured (Proposer.draft_cost)
    tree_rows: dict[int, int] = field(default_factory=dict)  # depth d -> the rows a tree of that depth forwards
    tree_costs: dict[int, float] = field(default_factory=dict)  # depth d -> a tree step over a plain step (EMA)
    _off_steps: int = 0
    _gap: int = 0  # the current wait between probes (0: probe_every)
    _probe_gap: int = 0  # the wait before the probe the last draft_len fired (0: it fired none)
    _prior: float = -1.0  # alpha as given: the prior of the pooled rate
    _pool: PooledAcceptance | None = None  # the pooled rate over all positions (alpha)
    _pos_succ: list[float] = field(default_factory=list)  # the same per draft position
    _pos_tried: list[float] = field(default_factory=list)

    def __post_init__(self):
        if self._prior < 0:
            self._prior = self.alpha
        self._pool = PooledAcceptance(self._prior, self.decay, self.prior_weight)

    def _slope(self) -> tuple[float, float, int] | None:
        """(v(1), b, the largest measured T) of the fitted v(T) = v(1) + b (T - 1), or None unmeasured.

        Anchored at the measured v(1) where there is one (a request decoding alone); in a batch,
        where one-row forwards are rare, a least-squares line through every measured T (one point:
        a flat line, so drafting is tried and measured)."""
        pts = [(t, v) for t, v in self.costs.items() if t >= 1]
        if not pts:
            return None
        one = self.costs.get(1)
        more = [(t, v) for t, v in pts if t > 1]
        t_max = max(t for t, _ in pts)
        if one is not None and one > 0:
            if not more:
                return one, 0.0, 1
            b = max(sum((t - 1) * (v - one) for t, v in more) / sum((t - 1) ** 2 for t, _ in more), 0.0)
            return one, b, t_max
        if len(pts) == 1:
            return pts[0][1], 0.0, t_max
        n = len(pts)
        mt, mv = sum(t for t, _ in pts) / n, sum(v for _, v in pts) / n
        b = max(sum((t - mt) * (v - mv) for t, v in pts) / sum((t - mt) ** 2 for t, _ in pts), 0.0)
        v1 = mv - b * (mt - 1)
        if v1 <= 0:  # a line through noise: keep the weights' read positive
            b, v1 = 0.0, mv
        return v1, b, t_max

    def verify_cost(self, T: int) -> float:
        """v(T) / v(1): a target forward over T tokens against a one-token step; 1.0 while unmeasured.

        v(1) + b (T - 1), b >= 0 the least-squares slope through the measured v(t), t > 1, anchored
        at v(1); beyond the largest measured T, v of that T (optimistic: it gets measured)."""
        return _relative_verify(T, self._slope())

    def _draft_cost(self) -> tuple[float, float] | None:
        """(q0, q): a drafting step's seconds q0 + q d. A line through the seconds measured at three
        or more draft lengths; before that q0 = 0 and q the per-token average; None while unmeasured
        (the step cost then takes ``draft_hint``)."""
        pts = [(-d, v) for d, v in self.costs.items() if d < 0]
        if len(pts) < 3:
            return (0.0, self.costs[DRAFT]) if DRAFT in self.costs else None
        n = len(pts)
        md, mv = sum(d for d, _ in pts) / n, sum(v for _, v in pts) / n
        q = max(sum((d - md) * (v - mv) for d, v in pts) / sum((d - md) ** 2 for d, _ in pts), 0.0)
        q0 = mv - q * md
        if q0 < 0:  # through the origin instead
            q0, q = 0.0, sum(d * v for d, v in pts) / sum(d * d for d, _ in pts)
        return q0, q

    def cost(self, T: int, batch: int = 1) -> float:
        """c = the relative cost of a step that forwards T tokens, T - 1 of them drafted."""
        return _step_cost(T, self._slope(), self._draft_cost(), batch, self.draft_hint)

    def row_price(self, batch: int = 1) -> float | None:
        """One more verified row's cost in this request's plain steps (among ``batch`` requests, its share
        of one): the fitted v(T)'s slope over a plain step. None while no forward of several rows is
        measured (a draft tree is then verified whole, and measured)."""
        fit = self._slope()
        if fit is None or fit[1] <= 0:
            return None
        one, b, _ = fit
        base = one if batch <= 1 else max(one - b, 0.0) / batch + b
        return b / base if base > 0 else None

    def _cost_d(self, d: int, fit, q, batch: int = 1) -> float:
        """The relative cost of a step drafting to depth d: a chain's from the fit (d + 1 rows, d draft
        tokens); a tree's as its steps at that depth were measured against a plain step (``tree_costs``:
        its drafting level by level and its forward over every node, a cost no chain line predicts), else
        as a chain over the rows it was seen to forward (``tree_rows``) or of d: optimistic, so it gets
        tried and measured."""
        if d in self.tree_costs:
            return self.tree_costs[d]
        return _step_cost(self.tree_rows.get(d, d + 1), fit, q, batch, self.draft_hint)

    def _rates(self, n: int) -> list[float]:
        """[p_1 .. p_n]: position i accepted, given positions < i were. Each position's counts are
        shrunk toward the position before it (the first toward the pooled rate): runs make the later
        rates alike, and a position rarely tried then inherits what is known nearer."""
        p = min(max(self.alpha, 0.0), 0.999)
        out = []
        for j in range(n):
            if j < len(self._pos_tried):
                p = min((self._pos_succ[j] + self.prior_weight * p) / (self._pos_tried[j] + self.prior_weight), 0.999)
            out.append(p)
        return out

    def rate(self, i: int) -> float:
        """p_(i+1): position i (0-based) accepted, given positions < i were (see ``_rates``)."""
        return self._rates(i + 1)[-1]

    def expected_tokens(self, d: int) -> float:
        e, p = 1.0, 1.0
        for r in self._rates(d):
            p *= r
            e += p
        return e

    def best_len(self, batch: int = 1) -> int:
        """argmax over d in [0, k] of E(d) / cost(d + 1): one pass, E(d) built up as d grows."""
        fit, q = self._slope(), self._draft_cost()
        best_d, best_v, e, p = 0, 0.0, 1.0, 1.0
        for d, r in enumerate(self._rates(self.k), start=1):
            p *= r
            e += p
            v = e / self._cost_d(d, fit, q, batch)
            if v > best_v:
                best_d, best_v = d, v
        # drafting must beat a plain step by 2% (no flapping on and off at break-even); among draft
        # lengths the best wins outright: where drafting is nearly free (n-gram lookup, flat
        # verification) long drafts cost nothing and win big on the runs that match
        return best_d if best_v > 1.02 else 0

    def best_value(self, batch: int = 1) -> float:
        """Expected tokens per plain-step time of the best draft now (``best_len``'s), 1.0 where none beats a
        plain step; pure (no probe bookkeeping)."""
        d = self.best_len(batch)
        return self.expected_tokens(d) / self._cost_d(d, self._slope(), self._draft_cost(), batch) if d > 0 else 1.0

    def plain_step_s(self, batch: int = 1) -> float | None:
        """Seconds of a request's plain step among ``batch`` requests (its share of the forward: a / B + b,
        with v(T) = a + b T); None while unmeasured."""
        fit = self._slope()
        if fit is None:
            return None
        one, b, _ = fit
        return one if batch <= 1 else max(one - b, 0.0) / batch + b

    def reading_estimate(self, tokens: int) -> float | None:
        """Seconds a draft would take to read ``tokens`` context tokens, before its reading is measured: a
        token read as READ_PRIOR of a drafted token's cost hint, in plain steps (a prompt goes through the
        draft many rows to a forward, a draft token one); None while a plain step is unmeasured."""
        one = self.plain_step_s(1)
        return None if one is None else tokens * READ_PRIOR * self.draft_hint * one

    def reading_weighed(self, read_s: float | None, tokens: int, new_tokens: int, batch: int,
                        against: float = 1.0) -> bool | None:
        """``reading_pays`` for ``tokens`` unread context tokens, their reading ``read_s`` as measured or, before
        the draft has read anything (None), ``reading_estimate``'s; None while a plain step is unmeasured
        (nothing to weigh the reading by)."""
        if read_s is None:
            read_s = self.reading_estimate(tokens)
        if read_s is None or self.plain_step_s(batch) is None:
            return None
        return self.reading_pays(read_s, new_tokens, batch, against)

    def reading_pays(self, read_s: float | None, new_tokens: int, batch: int = 1, against: float = 1.0) -> bool:
        """Whether a draft should read a new request's prompt, ``read_s`` seconds of the draft's own measured
        reading: the seconds its drafts are expected to save over the request's ``new_tokens``, at its best
        value against the alternative's (``against`` tokens per plain-step time: 1.0 plain decoding, or
        another part's value), exceed that reading. Unmeasured (the reading or a plain step): True, so the
        draft gets measured. In a batch both sides are wall time: the reading stalls every request of the
        step, and the saving is the request's share of the steps it no longer needs."""
        step = self.plain_step_s(batch)
        if read_s is None or read_s <= 0 or step is None:
            return True
        v = self.best_value(batch)
        if v <= against:
            return False
        return new_tokens * step * (1.0 / against - 1.0 / v) > read_s

    def may_pay(self, batch: int = 1) -> bool:
        """Whether drafting could beat a plain step even with every draft accepted, by the proposer's cost
        hint (a verification unmeasured costs a plain step): False for a draft whose tokens each cost about
        a plain step (a draft model as big as the target). Once drafting is timed, True: measured costs
        are noisy, and the probes (which re-measure them) decide."""
        if self._draft_cost() is not None:
            return True
        fit = self._slope()
        for d in range(1, self.k + 1):
            c = self._cost_d(d, fit, None, batch) if fit is not None else 1.0 + self.draft_hint * d
            if (d + 1) / c > 1.02:  # best_len's margin
                return True
        return False

    def draft_len(self, batch: int = 1, clock: int | None = None, catch_up_s: float = 0.0) -> int:
        """The number of draft tokens to ask for this step (0: plain decoding step), for a request
        that steps among ``batch`` requests (one target forward for all). ``clock``: a step count
        shared by the batch's requests; in a batch, a request whose drafting is off probes only on a
        multiple of its wait, so requests probe together: a draft that costs a forward of its own
        (a draft model, sparse_attn) is then run once for all of them, not once per request.
        ``catch_up_s``: seconds the draft would read context first (``Proposer.catch_up_seconds``): a
        probe that would catch up for longer than ``PROBE_CATCH_UP`` of the request's plain steps at
        ``batch`` (``plain_step_s``) is skipped."""
        if self._slope() is None or (batch == 1 and 1 not in self.costs):
            return 0  # measure a plain step first: every cost is relative to it
        if not self.may_pay(batch):
            return 0  # not even at full acceptance: no probes either (a probe would only pay the draft's cost)
        self._probe_gap = 0
        d = self.best_len(batch)
        if d > 0:
            self._off_steps, self._gap = 0, 0
            return d
        self._off_steps += 1
        gap = self._gap or self.probe_every
        # alone: after ``gap`` steps off; in a batch: on the shared clock's multiples of ``gap``
        due = clock % gap == 0 if clock is not None and batch > 1 else self._off_steps >= gap
        if due:
            self._off_steps = 0
            self._gap = min(2 * gap, self.max_probe_every)  # kept if this probe does not turn drafting on
            # catching up would cost more than the probe could show: skipped (the wait doubles). In a batch the
            # reading stalls every request of the step: it weighs in the request's share of a plain step there
            if catch_up_s > PROBE_CATCH_UP * (self.plain_step_s(batch) or float("inf")):
                return 0
            self._probe_gap = gap
            return min(self.probe_len, self.k)
        return 0

    def probe_unused(self) -> None:
        """The probe the last ``draft_len`` asked for came back empty (an n-gram lookup that found no match):
        it showed nothing, so it is due again at the next step, its wait not doubled. A no-op where that
        call fired no probe."""
        if self._probe_gap:
            self._gap, self._off_steps, self._probe_gap = self._probe_gap, self._probe_gap, 0

    @property
    def fresh(self) -> bool:
        """No draft of this request has been verified yet."""
        return self._pool.tried == 0

    def restart_prior(self, alpha: float) -> None:
        """A request that has not drafted yet takes ``alpha`` (the acceptance pooled over the requests
        that have) as its prior: requests that arrived together do not each prove a bad draft again."""
        if self.fresh:
            self._prior = self.alpha = alpha
            self._pool = PooledAcceptance(alpha, self.decay, self.prior_weight)

    def observe_acceptance(self, num_draft: int, num_accepted: int) -> None:
        """A verified draft of ``num_draft`` tokens, ``num_accepted`` of them kept: the pooled and
        per-position acceptance counts (decayed)."""
        if num_draft <= 0:
            return
        self._pool.observe(num_draft, num_accepted)
        self.alpha = self._pool.prior()
        tried, keep = positions_tried(num_draft, num_accepted), 1 - self.decay
        while len(self._pos_tried) < tried:
            self._pos_tried.append(0.0)
            self._pos_succ.append(0.0)
        for i in range(len(self._pos_tried)):
            self._pos_tried[i] = keep * self._pos_tried[i] + (i < tried)
            self._pos_succ[i] = keep * self._pos_succ[i] + (i < num_accepted)

    def observe(self, num_draft: int, num_accepted: int, tokens_forwarded: int, seconds: float,
                draft_seconds: float | None = None, tree_nodes: int | None = None, batch: int = 1) -> None:
        """After a step: drafts verified, drafts accepted, tokens in the forward (every request's,
        in a batch), its wall time, and of that the time spent drafting (None: not measured apart,
        the whole step counts as v(T)). ``tree_nodes``: the step verified a tree of that many nodes
        and depth ``num_draft``, among ``batch`` requests; its seconds (drafting included) are kept
        against a plain step of that batch, apart from the chain costs' fit."""
        self.observe_acceptance(num_draft, num_accepted)
        if tree_nodes is None or num_draft <= 0:
            self.observe_costs(num_draft, tokens_forwarded, seconds, draft_seconds)
            return
        d = num_draft
        if draft_seconds is not None:  # its forward alone prices a row (``row_price``), as a chain's would
            self.observe_costs(0, tokens_forwarded, max(seconds - draft_seconds, 1e-9))
        self.tree_rows[d] = tree_nodes + 1
        plain = self.costs.get(batch)
        if plain is None and (fit := self._slope()) is not None:
            plain = fit[0] + fit[1] * (batch - 1)
        if plain:
            rel, old = seconds / plain, self.tree_costs.get(d)
            self.tree_costs[d] = rel if old is None else old + self.ema * (rel - old)

    def observe_costs(self, num_draft: int, tokens_forwarded: int, seconds: float,
                      draft_seconds: float | None = None) -> None:
        """``observe``'s timing half: a step's forward over ``tokens_forwarded`` tokens, ``num_draft`` of
        them drafted in ``draft_seconds`` (None: not measured apart), ``seconds`` in all."""
        if draft_seconds is not None and num_draft > 0:
            seconds = max(seconds - draft_seconds, 1e-9)
            per = draft_seconds / num_draft
            q = self.costs.get(DRAFT)
            self.costs[DRAFT] = per if q is None else q + self.ema * (min(per, 2 * q) - q)
            q0, qd = self._draft_cost() or (0.0, 0.0)
            pred, old = q0 + qd * num_draft, self.costs.get(-num_draft)
            obs = min(draft_seconds, 2 * pred) if pred > 0 else draft_seconds  # one outlier moves it a doubling at most
            self.costs[-num_draft] = obs if old is None else old + self.ema * (obs - old)
        old = self.costs.get(tokens_forwarded)
        self.costs[tokens_forwarded] = seconds if old is None else old + self.ema * (seconds - old)


def _relative_verify(T: int, fit: tuple[float, float, int] | None) -> float:
    """v(T) / v(1) from ``DraftLengthController._slope()``'s fit (1.0 while unmeasured)."""
    if fit is None:
        return 1.0
    one, b, t_max = fit
    return 1.0 + b * (min(T, t_max) - 1) / one


def _step_cost(T: int, fit: tuple[float, float, int] | None, q: tuple[float, float] | None, batch: int = 1,
               hint: float = 0.0) -> float:
    """A request's step forwarding T tokens, T - 1 = d of them drafted, in its plain steps: alone,
    v(T) / v(1) + draft(d) / v(1); among ``batch`` requests, its share of the forward:
    (a / B + b T + draft(d)) / (a / B + b) with v(T) = a + b T; draft(d) = q0 + q d (0 at d = 0).
    Drafting unmeasured (q None): each draft token costs ``hint`` times the request's share of a
    plain step (a draft model's forward shares its weights' read across the batch as the target's does)."""
    if fit is None:
        return 1.0
    one, b, _ = fit
    d = T - 1
    base = one if batch <= 1 else max(one - b, 0.0) / batch + b
    if d <= 0:
        draft = 0.0
    elif q is None:
        draft = hint * d * base
    else:
        draft = q[0] + q[1] * d
    if batch <= 1:
        return _relative_verify(T, fit) + draft / one
    return (base + b * d + draft) / base if base > 0 else 1.0


@dataclass
class BatchGuard:
    """Whether a batch of B requests drafts this step, from the throughput measured at that B (see the
    module docstring). ``drafts(B, clock)`` before a step, ``observe(B, drafted, tokens, seconds)`` after
    it (steps that also carried a prefill chunk are not observed: their time is the prompt's)."""

    ema: float = 0.25  # weight of the newest throughput observation
    margin: float = 0.98  # drafting is kept while it measures at least this share of plain's throughput
    probe_every: int = 8  # steps of plain decoding before drafting is tried again (doubles per lost probe)
    max_probe_every: int = 64
    refresh_every: int = 64  # a plain step at least this often while drafting, to keep plain measured
    probe: bool = True  # False: once drafting loses at a batch size it stays off there (a probe would cost a
    # draft model's reading of every prompt it skipped)
    _spec: dict[int, float] = field(default_factory=dict)  # B -> tokens/s of steps that drafted (EMA)
    _plain: dict[int, float] = field(default_factory=dict)  # B -> tokens/s of steps that did not
    _since_plain: dict[int, int] = field(default_factory=dict)  # B -> steps since its last plain step
    _gap: dict[int, int] = field(default_factory=dict)  # B -> the current wait between probes
    _off: dict[int, int] = field(default_factory=dict)  # B -> plain steps since drafting lost

    def drafts_likely(self, batch: int) -> bool:
        """Whether drafting is on at this batch size (unmeasured counts as on); no side effects. A
        request admitted while it is off has its draft skip reading the prompt (a draft model's
        prefill), and catches up only if drafting turns on."""
        spec, plain = self._spec.get(batch), self._plain.get(batch)
        return spec is None or plain is None or spec >= self.margin * plain

    def drafts(self, batch: int) -> bool:
        spec, plain = self._spec.get(batch), self._plain.get(batch)
        if spec is None:
            return True  # drafting unmeasured at this size: measure it
        if plain is None or self._since_plain.get(batch, 0) >= self.refresh_every:
            return False  # measure (or re-measure) plain decoding at this size
        if spec >= self.margin * plain:
            return True
        self._off[batch] = self._off.get(batch, 0) + 1
        if self.probe and self._off[batch] >= self._gap.get(batch, self.probe_every):
            self._off[batch] = 0
            self._gap[batch] = min(2 * self._gap.get(batch, self.probe_every), self.max_probe_every)
            return True  # a probe: its outcome re-enters the spec average
        return False

    def observe(self, batch: int, drafted: bool, tokens: int, seconds: float) -> None:
        if seconds <= 0:
            return
        rate, book = tokens / seconds, (self._spec if drafted else self._plain)
        old = book.get(batch)
        book[batch] = rate if old is None else old + self.ema * (rate - old)
        self._since_plain[batch] = self._since_plain.get(batch, 0) + 1 if drafted else 0
        if drafted and self._plain.get(batch) is not None and book[batch] >= self.margin * self._plain[batch]:
            self._gap.pop(batch, None)  # drafting pays again: the next loss waits probe_every steps
