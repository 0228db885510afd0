"""The adaptive draft-length controller on synthetic traces."""

from __future__ import annotations

import pytest

from specctl.runtime.controller import DRAFT, BatchGuard, DraftLengthController, PooledAcceptance


def costs_flat(k: int) -> dict[int, float]:
    """Verifying k tokens costs about one decode step (bf16 on CPU, a big model)."""
    return {t: 0.1 * (1 + 0.02 * (t - 1)) for t in range(1, k + 2)}


def costs_steep(k: int) -> dict[int, float]:
    """Each extra token costs 30% of a decode step (fp32 on CPU, a small model)."""
    return {t: 0.1 * (1 + 0.3 * (t - 1)) for t in range(1, k + 2)}


def run_trace(c: DraftLengthController, accept_prob_per_token: float, steps: int) -> list[int]:
    """Feed steps where each drafted token is accepted deterministically at the given rate."""
    lens = []
    for _ in range(steps):
        d = c.draft_len()
        lens.append(d)
        n = int(round(accept_prob_per_token * d)) if accept_prob_per_token < 1 else d
        c.observe(d, n, d + 1, c.costs.get(d + 1, 0.1))
    return lens


def test_first_step_measures_plain_cost():
    c = DraftLengthController(k=8)
    assert c.draft_len() == 0  # c(1) unknown: take a plain step first


def test_high_acceptance_cheap_verify_drafts_long():
    c = DraftLengthController(k=10, costs=costs_flat(10))
    lens = run_trace(c, 1.0, 20)
    assert lens[-1] == 10


def test_backs_off_on_low_acceptance_with_costly_verify():
    c = DraftLengthController(k=10, costs=costs_steep(10), probe_every=1000)
    for _ in range(10):
        d = c.draft_len()
        c.observe(d, 0, d + 1, c.costs[d + 1]) if d else c.observe(0, 0, 1, 0.1)
    lens = [c.draft_len() for _ in range(7)]
    assert c.alpha < 0.5  # fell from the prior (0.6, kept in as two pseudo-observations)
    assert all(d == 0 for d in lens)  # off


def test_probes_while_off_and_recovers_when_acceptance_rises():
    c = DraftLengthController(k=10, costs=costs_steep(10), probe_every=4)
    for _ in range(12):  # bad stretch
        d = c.draft_len()
        c.observe(d, 0, d + 1, c.costs[d + 1])
    assert c.best_len() == 0
    probes = 0
    lens = []
    for _ in range(40):  # good stretch: every drafted token accepted
        d = c.draft_len()
        probes += d > 0
        c.observe(d, d, d + 1, c.costs[d + 1])
        lens.append(d)
    assert probes > 0
    assert lens[-1] >= 4  # recovered to long drafts


def test_cost_interpolation_and_relative():
    c = DraftLengthController(k=8, costs={1: 0.1, 5: 0.2})
    assert c.cost(1) == 1.0
    assert abs(c.cost(3) - 1.5) < 1e-9
    assert abs(c.cost(5) - 2.0) < 1e-9
    assert c.cost(9) == 2.0  # beyond the measured range: the last measured cost


def test_expected_tokens_geometric():
    c = DraftLengthController(k=4, alpha=0.5)
    assert abs(c.expected_tokens(0) - 1.0) < 1e-9
    assert abs(c.expected_tokens(2) - 1.75) < 1e-9


def test_adaptive_decoding_stays_lossless(tiny_model_factory):
    import torch

    from specctl.config import SpecConfig
    from specctl.runtime.decoder import SamplingParams, SpecDecoder
    from specctl.modeling import load_transformer
    from specctl.runtime.proposers import build_proposer
    from specctl.runtime.runner import TargetRunner

    folder = tiny_model_factory("qwen2", initializer_range=0.05, hidden_size=128, intermediate_size=256)
    runner = TargetRunner(load_transformer(folder, torch.float32), 256)
    cfg = SpecConfig(method="ngram", num_speculative_tokens=8, prompt_lookup_min=1).validated()
    plain = SpecDecoder(runner)
    adaptive = SpecDecoder(runner, build_proposer(cfg, 256), 8, adaptive=True)
    g = torch.Generator().manual_seed(5)
    drafted = 0
    for _ in range(10):
        prompt = (torch.randint(0, 128, (6,), generator=g).tolist() * 3)[:16]
        want = plain.generate(prompt, SamplingParams(max_new_tokens=40)).token_ids
        got = adaptive.generate(prompt, SamplingParams(max_new_tokens=40))
        assert got.token_ids == want
        drafted += got.stats.num_draft_tokens
    assert drafted > 0 and adaptive._costs.get(1)  # it measured plain steps and did draft


def test_failed_probes_back_off_exponentially_and_a_good_probe_resets_the_wait():
    """A draft that never pays (each step that drafts costs 2x a plain step: a big draft model)
    is probed rarely: waits of 8, 16, 32, 64, 64, ... steps; accepted probes turn drafting on."""
    costs = {1: 0.1, 2: 0.2, 3: 0.2, 4: 0.2, 5: 0.2}
    c = DraftLengthController(k=4, costs=dict(costs), alpha=0.0, probe_every=8, max_probe_every=64)
    probes_at = []
    for step in range(300):
        d = c.draft_len()
        if d:
            probes_at.append(step)
        c.observe(d, 0, d + 1, costs[d + 1])
    gaps = [b - a for a, b in zip(probes_at, probes_at[1:])]
    assert probes_at[0] == 7 and gaps[:3] == [16, 32, 64] and all(g == 64 for g in gaps[3:])
    assert len(probes_at) <= 7  # a fixed wait of 8 would have probed 33 times
    # acceptance returns: the next probe is fully accepted, drafting turns on and the wait resets
    while c.draft_len() == 0:
        c.observe(0, 0, 1, costs[1])
    c.observe(2, 2, 3, costs[3])
    c.observe(2, 2, 3, costs[3])
    assert c.draft_len() > 0 and c._gap == 0


def test_a_probe_that_found_nothing_to_draft_is_due_again_without_a_longer_wait():
    """An n-gram lookup probed where it had no match showed nothing: the next step probes again (the wait not
    doubled); the probe that does draft, and fails, doubles it as before."""
    costs = {1: 0.1, 2: 0.2, 3: 0.2, 4: 0.2, 5: 0.2}
    c = DraftLengthController(k=4, costs=dict(costs), alpha=0.0, probe_every=8, max_probe_every=64)
    steps = 0
    while not c.draft_len():
        steps += 1
    c.probe_unused()  # no match: nothing drafted
    c.probe_unused()  # a second call without a probe in between changes nothing
    assert c.draft_len() > 0 and c._gap == 16  # due again at once; the wait as after the first probe (8, then 16)
    c.observe(2, 0, 3, costs[3])  # drafted and rejected: the wait doubles
    waited = 0
    while not c.draft_len():
        waited += 1
    assert waited == 15 and c._gap == 32


def test_drafting_time_is_kept_apart_and_an_outlier_does_not_switch_drafting_off():
    # a draft model: each draft token costs 35% of a target step; verification is flat (AMX bf16)
    c = DraftLengthController(k=4, costs={1: 0.1}, probe_every=1000)
    c.alpha = 0.6

    def step(d, accepted, draft_s):
        c.observe(d, accepted, d + 1, 0.1 * (1 + 0.02 * d) + draft_s, draft_s)

    step(2, 1, 2 * 0.035)
    assert abs(c.cost(2) - (1.0 + 0.35)) < 0.05  # measured with d=2, applied to every d
    assert abs(c.cost(5) - (1.0 + 4 * 0.35)) < 0.05  # v(5) unmeasured: the last measured v
    # at a = 0.6: E(1)/c(2) = 1.6/1.37 beats E(2)/c(3) = 1.96/1.74 and E(4)/c(5) = 2.31/2.44
    assert c.best_len() == 1
    # one slow drafting step (the draft catching up on a long prompt, 10x its usual time) moves q by
    # at most a doubling's share, so drafting stays on
    step(1, 1, 10 * 0.035)
    assert c.best_len() >= 1
    assert c.costs[0] < 2 * 0.035


def test_without_draft_time_the_whole_step_counts():
    c = DraftLengthController(k=4, costs={1: 0.1})
    c.observe(2, 2, 3, 0.2)
    assert abs(c.cost(3) - 2.0) < 1e-9 and 0 not in c.costs


def test_acceptance_per_position_sees_runs():
    # drafts that are right all the way or wrong from the start (acceptance comes in runs): the first
    # position is accepted half the time, the later ones always once the first was
    c = DraftLengthController(k=4, costs={1: 0.1})
    for i in range(40):
        c.observe(4, 4 if i % 2 else 0, 5, 0.1)
    assert abs(c.rate(0) - 0.5) < 0.15 and min(c.rate(i) for i in (1, 2, 3)) > 0.85  # (shrunk toward the pooled 0.8)
    assert abs(c.expected_tokens(4) - 3.0) < 0.3  # 1 + 0.5 * 4
    assert abs(c.expected_tokens(1) - 1.5) < 0.15


def test_verify_cost_is_a_fit_so_one_noisy_t_does_not_decide():
    # flat verification (AMX bf16) measured at several T, one of them on a noisy step
    c = DraftLengthController(k=10, costs={1: 0.1, 3: 0.1, 5: 0.1, 9: 0.1, 11: 0.16})
    assert c.verify_cost(11) < 1.4  # not the raw 1.6
    assert abs(c.verify_cost(2) - 1.0) < 0.05
    c.alpha = 0.8
    assert c.best_len() >= 7  # long drafts still pay


def test_drafting_backs_off_as_the_batch_grows():
    """v(T) = a + b T over the whole forward's rows (a: reading the weights, shared by the batch;
    b: a row's compute). Alone, verifying drafts is nearly free and the controller drafts long; in
    a batch of 16, a request's share of a is small, its draft rows cost their full b, and drafting
    at this acceptance stops paying: it drafts nothing."""
    a, b = 0.10, 0.01
    costs = {t: a + b * t for t in (1, 8, 16, 24, 40)}
    c = DraftLengthController(k=6, costs=dict(costs), alpha=0.6)
    alone, four, sixteen = c.best_len(1), c.best_len(4), c.best_len(16)
    assert alone >= 3 and 0 < four < alone and sixteen == 0
    assert c.draft_len(16) == 0 and c.draft_len(1) == alone
    # a cheaper row (memory bound even at 16 requests) keeps drafting on in the batch
    flat = DraftLengthController(k=6, costs={t: a + 0.0005 * t for t in (1, 8, 16, 40)}, alpha=0.6)
    assert flat.best_len(16) > 0
    # in a batch no one-row forward is measured: the line through the batch sizes seen stands in
    batch_only = DraftLengthController(k=6, costs={t: a + b * t for t in (16, 24, 40)}, alpha=0.6)
    assert batch_only.best_len(16) == 0 and batch_only.draft_len(16) == 0
    assert abs(batch_only._slope()[1] - b) < 1e-9


def test_a_fixed_drafting_cost_per_step_is_seen():
    """A draft model that catches up on the step's new tokens before it drafts pays q0 whatever d is:
    drafting seconds measured at three or more d give q0 + q d, and a one-token draft is no longer
    judged nearly free. Here (q0 = a whole target step) no draft length pays at this acceptance."""
    c = DraftLengthController(k=4, costs={1: 0.1}, probe_every=1000)
    c.alpha = 0.6
    for _ in range(5):
        for d in (1, 2, 3, 4):
            c.observe(d, 1, d + 1, 0.1 + 0.1 + 0.01 * d, 0.1 + 0.01 * d)
    q0, q = c._draft_cost()
    assert abs(q0 - 0.1) < 0.01 and abs(q - 0.01) < 0.005
    assert abs(c.cost(2) - (1.0 + 1.1)) < 0.05
    assert c.best_len() == 0


def test_requests_of_a_batch_probe_together_on_a_shared_clock():
    """Drafting off for two requests of a batch that started at different times: with the shared
    clock they probe in the same steps (one drafting forward for both), on multiples of their wait;
    without it each probes on its own count."""
    costs = {1: 0.1, 2: 0.3, 3: 0.3, 4: 0.3, 5: 0.3}

    def probes(clocked: bool) -> list[list[int]]:
        cs = [DraftLengthController(k=4, costs=dict(costs), alpha=0.0, probe_every=8) for _ in range(2)]
        at: list[list[int]] = [[], []]
        for clock in range(1, 200):
            for i, c in enumerate(cs):
                if i == 1 and clock < 5:  # the second request joins 4 steps later
                    continue
                d = c.draft_len(batch=2, clock=clock if clocked else None)
                if d:
                    at[i].append(clock)
                c.observe(d, 0, d + 1, costs[d + 1])
        return at

    together = probes(True)
    assert together[0] and together[0] == together[1]
    assert all(t % 8 == 0 for t in together[0])
    apart = probes(False)
    assert apart[0] != apart[1]


def run_batch(g: BatchGuard, steps: int, spec_rate: float, plain_rate: float, batch: int = 8) -> list[bool]:
    """Feed the guard steps of one second whose throughput is spec_rate when drafting, else plain_rate."""
    out = []
    for _ in range(steps):
        d = g.drafts(batch)
        g.observe(batch, d, int(spec_rate if d else plain_rate), 1.0)
        out.append(d)
    return out


def test_batch_guard_keeps_drafting_that_pays_and_refreshes_plain_rarely():
    g = BatchGuard()
    seq = run_batch(g, 300, spec_rate=130, plain_rate=100)
    assert seq[0] is True and seq[1] is False  # drafting measured, then plain measured once
    assert 0 < seq[2:].count(False) <= 300 // g.refresh_every + 1  # a refresh every refresh_every steps
    assert all(seq[2:g.refresh_every + 2])


def test_batch_guard_turns_drafting_off_where_it_loses_and_probes_with_backoff():
    g = BatchGuard()
    seq = run_batch(g, 300, spec_rate=80, plain_rate=100)
    probes = [i for i, d in enumerate(seq) if d][1:]  # after the first measurement
    assert len(probes) <= 8  # 8, 16, 32, 64, 64, ...: a draft that loses costs a few probes
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps == sorted(gaps) and gaps[-1] <= g.max_probe_every + 1
    # throughput over the run: within what the probes cost of plain decoding
    total = sum(80 if d else 100 for d in seq)
    assert total >= 0.95 * 100 * len(seq)


def test_batch_guard_notices_when_drafting_starts_to_pay():
    g = BatchGuard()
    run_batch(g, 100, spec_rate=80, plain_rate=100)
    seq = run_batch(g, 300, spec_rate=150, plain_rate=100)
    assert seq[-50:].count(True) >= 45  # back to drafting (its probes raised the measured rate)


def test_batch_guard_keeps_batch_sizes_apart():
    g = BatchGuard()
    run_batch(g, 100, spec_rate=80, plain_rate=100, batch=8)
    assert run_batch(g, 20, spec_rate=200, plain_rate=100, batch=2).count(True) >= 18
    assert run_batch(g, 4, spec_rate=80, plain_rate=100, batch=8).count(True) <= 1


def test_batch_guard_says_whether_a_joining_request_should_read_its_prompt():
    g = BatchGuard()
    assert g.drafts_likely(8)  # unmeasured: drafting is on
    run_batch(g, 40, spec_rate=80, plain_rate=100)
    assert not g.drafts_likely(8) and g.drafts_likely(4)
    before = dict(g._off)
    g.drafts_likely(8)
    assert g._off == before  # a query: it does not count as a step


def test_batch_guard_without_probes_stays_off_where_drafting_lost():
    g = BatchGuard(probe=False)
    seq = run_batch(g, 200, spec_rate=80, plain_rate=100)
    assert seq.count(True) == 1  # the first measurement only
    assert run_batch(g, 5, spec_rate=200, plain_rate=100, batch=2)[0]  # other batch sizes still measured


def test_pooled_acceptance_is_the_prior_of_the_next_request():
    p = PooledAcceptance()
    assert p.prior() == p.default
    for _ in range(60):
        p.observe(4, 0)  # every draft rejected at its first position
    assert p.prior() < 0.05
    for _ in range(300):
        p.observe(4, 4)  # then every draft accepted: the memory is decayed, not forever
    assert p.prior() > 0.9


def test_a_draft_rejected_for_earlier_requests_starts_the_next_one_off(tiny_model):
    """The decoder pools acceptance over its requests: after requests whose drafts were all
    rejected, a new request's controller starts pessimistic and does not draft its first step."""
    import numpy as np

    from specctl.runtime.decoder import SamplingParams, SpecDecoder
    from specctl.runtime.proposers.base import Draft, Proposer
    from specctl.runtime.runner import TargetRunner

    class Wrong(Proposer):
        method = "wrong"

        def draft_one(self, r, k):
            return Draft([0] * k)

    dec = SpecDecoder(TargetRunner(tiny_model, 128), Wrong(), 4, adaptive=True)
    plain = SpecDecoder(TargetRunner(tiny_model, 128))
    g = np.random.default_rng(0)
    for _ in range(6):
        p = g.integers(6, 128, 8).tolist()
        assert dec.generate(p, SamplingParams(max_new_tokens=24)).token_ids == \
            plain.generate(p, SamplingParams(max_new_tokens=24)).token_ids
    assert dec._pooled.prior() < 0.2
    st = dec.start(g.integers(6, 128, 8).tolist(), SamplingParams(max_new_tokens=8))
    assert st.controller.alpha < 0.2
    # Whether it drafts then depends on measured forward times, which on a tiny model are all overhead (a
    # 5-token forward timed as a 1-token one makes even a 0.2 draft pay), so the decision is checked on a
    # fixed cost model: verifying d tokens costs 1 + 0.3 d plain steps. There a fresh request (the default
    # prior) drafts, and this one, starting from the pooled rejections, does not.
    costs = {t: 1.0 + 0.3 * (t - 1) for t in range(1, 6)}
    st.controller.costs = dict(costs)
    assert st.controller.best_len(1) == 0
    assert DraftLengthController(k=4, costs=dict(costs)).best_len(1) > 0


def test_a_draft_cost_hint_stands_in_until_drafting_is_measured():
    """Before any draft is timed, a draft model's cost is its hint (its weights over the target's)
    times the request's share of a plain step: in a batch of 8 whose verify rows are costly (the
    forward compute bound), a draft of a third of the target's cost does not pay, where a free one
    (hint 0, n-gram lookup) would be tried; alone, the same draft pays. Once drafting is timed, the
    measurement decides, not the hint."""
    a, b = 0.1, 0.004  # v(T) = a + b T seconds
    costs = {t: a + b * t for t in (1, 8, 40, 257)}
    hinted = DraftLengthController(k=4, costs=dict(costs), alpha=0.6, draft_hint=0.33)
    free = DraftLengthController(k=4, costs=dict(costs), alpha=0.6)
    assert hinted.best_len(8) == 0 and free.best_len(8) > 0
    assert hinted.best_len(1) > 0
    assert hinted.cost(2, batch=8) > free.cost(2, batch=8)
    cheap = DraftLengthController(k=4, costs={**costs, DRAFT: 1e-6}, alpha=0.6, draft_hint=0.33)
    assert cheap.best_len(8) > 0


def test_a_draft_as_costly_as_the_target_never_drafts_probes_or_reads_the_prompt(tiny_model):
    """A draft whose every token costs about a plain step (a draft model as big as its target: hint 1.0)
    cannot pay even at full acceptance: no probes, and its reading of the prompt is skipped (a user saw
    such a draft run 0.67x of plain with no draft made: the draft's prefill doubled the prompt's cost).
    A draft at half the target's cost still reads the prompt and drafts."""
    import numpy as np

    from specctl.runtime.decoder import SamplingParams, SpecDecoder
    from specctl.runtime.proposers.base import Draft, Proposer
    from specctl.runtime.runner import TargetRunner

    assert not DraftLengthController(k=4, draft_hint=1.0).may_pay()
    assert DraftLengthController(k=4, draft_hint=0.5).may_pay()
    c = DraftLengthController(k=4, costs=costs_flat(4), alpha=0.99, draft_hint=1.0)
    assert run_trace(c, 1.0, 200) == [0] * 200  # off, and never probed

    class Counting(Proposer):
        method = "counting"

        def __init__(self, cost):
            self.draft_cost, self.prefills, self.proposals = cost, 0, 0

        def on_prefill(self, slot, upto, batch=1):
            self.prefills += 1

        def draft_one(self, r, k):
            self.proposals += 1
            return Draft([0] * k)

    plain = SpecDecoder(TargetRunner(tiny_model, 128))
    p = np.random.default_rng(1).integers(6, 128, 12).tolist()
    want = plain.generate(p, SamplingParams(max_new_tokens=40)).token_ids
    for cost, used in ((1.0, False), (0.5, True)):
        prop = Counting(cost)
        dec = SpecDecoder(TargetRunner(tiny_model, 128), prop, 4, adaptive=True)
        assert dec.generate(p, SamplingParams(max_new_tokens=40)).token_ids == want
        assert (prop.prefills > 0) == used and (prop.proposals > 0) == used, (cost, prop.prefills, prop.proposals)


def test_a_probe_that_would_catch_up_for_long_is_skipped():
    """Drafting off, a probe due: it runs when the draft has little to read first, and is skipped (the
    wait still doubles) when reading its backlog would cost more than PROBE_CATCH_UP plain steps."""
    from specctl.runtime.controller import PROBE_CATCH_UP

    def off():
        c = DraftLengthController(4, alpha=0.0, probe_every=2, costs={1: 0.1, 5: 0.2, DRAFT: 0.05})
        assert c.best_len() == 0
        return c

    c = off()
    assert [c.draft_len(catch_up_s=0.1 * PROBE_CATCH_UP * 0.9) for _ in range(2)] == [0, 2]
    c = off()
    assert [c.draft_len(catch_up_s=0.1 * PROBE_CATCH_UP * 1.1) for _ in range(6)] == [0] * 6
    assert c._gap == 8  # skipped probes back off as failed ones do


def test_in_a_batch_a_probe_weighs_its_catching_up_in_the_request_s_share_of_a_step():
    """Among 8 requests the draft's reading stalls every request of the step, and the request's own plain step
    is its share of the forward (a / B + b): a catch-up a request alone would risk for a probe (0.9 of
    PROBE_CATCH_UP plain steps) is skipped there. Before, the bar was a whole one-row step, which a batch of
    8 never measures (so every probe ran, each reading a backlog that grew with the wait: MTP at 8 requests)."""
    from specctl.runtime.controller import PROBE_CATCH_UP

    def off():
        c = DraftLengthController(4, alpha=0.0, probe_every=2, costs={1: 0.1, 5: 0.2, DRAFT: 0.05})
        assert c.best_len(8) == 0
        return c

    catch_up = 0.1 * PROBE_CATCH_UP * 0.9
    c = off()
    assert [c.draft_len(1, catch_up_s=catch_up) for _ in range(2)] == [0, 2]
    c = off()
    assert c.plain_step_s(8) < 0.1 / 2 and [c.draft_len(8, clock=t, catch_up_s=catch_up) for t in (1, 2, 3, 4)] == [0] * 4
    c = off()
    assert [c.draft_len(8, clock=t, catch_up_s=0.0) for t in (1, 2)] == [0, 2]  # nothing to read: it probes


def test_reading_a_prompt_pays_only_where_the_drafts_save_more_than_it_costs():
    """A draft reads a new prompt where its expected saving over the request's new tokens (a plain step's
    seconds times 1/against - 1/value per token) exceeds the reading; against a part as good as it, or
    over too few tokens, it does not; unmeasured, it reads (and gets measured). In a batch a request's
    share of a plain step is smaller, so the same reading needs more tokens to pay back."""
    c = DraftLengthController(4, costs={1: 0.1, 5: 0.104, DRAFT: 0.01})
    for _ in range(50):
        c.observe_acceptance(4, 4)
    v = c.best_value()
    assert v == pytest.approx(c.expected_tokens(4) / c.cost(5)) and v > 2.5
    per_token = 0.1 * (1 - 1 / v)
    assert c.reading_pays(0.9 * 100 * per_token, 100) and not c.reading_pays(1.1 * 100 * per_token, 100)
    assert not c.reading_pays(1e-6, 100, against=v)  # another part as good: nothing to save
    assert c.reading_pays(1e-6, 100, against=1.5) and not c.reading_pays(0.6 * 100 * per_token, 100, against=1.5)
    assert c.reading_pays(None, 1) and DraftLengthController(4).reading_pays(10.0, 1)  # unmeasured: read
    c.costs.update({8: 0.11, 40: 0.15})  # a batch of 8: a request's plain step is its share, ~0.022 s
    assert c.plain_step_s(8) < 0.1 / 3
    assert c.reading_pays(0.9 * 100 * per_token, 100, batch=1) and not c.reading_pays(0.9 * 100 * per_token, 100, batch=8)
    for _ in range(50):
        c.observe_acceptance(4, 0)  # it stopped paying: no reading at any price
    assert c.best_value() == 1.0 and not c.reading_pays(1e-9, 10_000)


def tree_trace(c: DraftLengthController, nodes: dict[int, int], step_s, steps: int) -> list[int]:
    """Greedy tree steps: a tree of depth d has nodes[d] nodes, its step (drafting level by level, then the
    forward over 1 + nodes rows) takes step_s(d) seconds, and one draft token is accepted each step."""
    lens = []
    for _ in range(steps):
        d = c.draft_len()
        lens.append(d)
        if d == 0:
            c.observe(0, 0, 1, 0.1)
        else:
            c.observe(d, 1, nodes[d] + 1, step_s(d), None, nodes[d])
    return lens


def test_a_tree_is_weighed_by_the_rows_it_forwards_and_the_drafting_in_its_step():
    """EAGLE-2's tree of 16 nodes at depth 3 forwards 17 rows, not 4: weighed as a chain of 3, it looked
    like 2 tokens for 1.3 plain steps and was kept at 2.8 (0.68x plain, measured on an AMD EPYC). Weighed by
    what its depth was seen to cost, the controller settles on the depth that pays (a depth-1 tree: 2 tokens
    for 1.6 plain steps), and on plain decoding where no depth does."""
    nodes = {1: 4, 2: 10, 3: 16}
    c = DraftLengthController(k=3, costs={1: 0.1}, probe_every=1000)
    lens = tree_trace(c, nodes, lambda d: 0.1 * (1 + 0.6 * d), 30)
    assert lens[0] == 3 and c.tree_rows == {1: 5, 2: 11, 3: 17} and c.tree_costs[3] == pytest.approx(2.8)
    assert 3 not in lens[1:] and lens[5:].count(1) >= 0.75 * len(lens[5:])  # depth 2 re-tried now and then
    c = DraftLengthController(k=3, costs={1: 0.1}, probe_every=1000)
    assert tree_trace(c, nodes, lambda d: 0.1 * (1.5 + 0.6 * d), 30)[-10:] == [0] * 10
