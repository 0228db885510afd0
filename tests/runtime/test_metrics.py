"""SpecStats: counters under vLLM's names, merge, and the derived rates."""

from __future__ import annotations

import pytest

from specctl.runtime.metrics import SpecStats


def test_observe_counts_and_rates():
    s = SpecStats()
    s.observe(4, 4)  # all accepted: 5 tokens emitted (bonus)
    s.observe(4, 1)
    s.observe(2, 0)  # a shorter draft, rejected at position 0
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (3, 10, 5)
    assert s.num_accepted_tokens_per_pos == [2, 1, 1, 1]
    assert s.acceptance_rate == pytest.approx(5 / 10)
    # mean acceptance length counts the bonus/recovered token: tokens emitted per drafting step
    assert s.mean_acceptance_length == pytest.approx((5 + 2 + 1) / 3)
    assert s.acceptance_rate_per_pos == pytest.approx([2 / 3, 1 / 3, 1 / 3, 1 / 3])


def test_steps_without_drafts_are_not_counted():
    s = SpecStats()
    s.observe(0, 0)
    assert s == SpecStats()
    assert s.acceptance_rate == 0.0 and s.mean_acceptance_length == 1.0 and s.acceptance_rate_per_pos == []


def test_mean_acceptance_length_is_tokens_per_step():
    s = SpecStats()
    emitted = 0
    for nd, na in [(3, 3), (3, 0), (5, 2), (1, 1)]:
        s.observe(nd, na)
        emitted += na + 1
    assert s.mean_acceptance_length == pytest.approx(emitted / 4)
    assert s.mean_acceptance_length >= 1.0


def test_merge_sums_and_pads_per_position():
    a, b = SpecStats(), SpecStats()
    a.observe(2, 2)
    b.observe(5, 3)
    b.observe(1, 0)
    m = a.merge(b)
    assert (m.num_drafts, m.num_draft_tokens, m.num_accepted_tokens) == (3, 8, 5)
    assert m.num_accepted_tokens_per_pos == [2, 2, 1, 0, 0]
    assert m.to_dict() == b.merge(a).to_dict()
    # merging returns a new object; the inputs are untouched
    assert a.num_accepted_tokens_per_pos == [1, 1] and b.num_drafts == 2
    # merge == observing everything into one
    one = SpecStats()
    for nd, na in [(2, 2), (5, 3), (1, 0)]:
        one.observe(nd, na)
    assert one.to_dict() == m.to_dict()
    assert SpecStats().merge(SpecStats()) == SpecStats()


def test_to_dict_uses_vllm_names():
    s = SpecStats()
    s.observe(3, 2)
    d = s.to_dict()
    assert d == {
        "num_drafts": 1,
        "num_draft_tokens": 3,
        "num_accepted_tokens": 2,
        "num_accepted_tokens_per_pos": [1, 1, 0],
        "acceptance_rate": pytest.approx(2 / 3),
        "mean_acceptance_length": pytest.approx(3.0),
        "acceptance_rate_per_pos": pytest.approx([1.0, 1.0, 0.0]),
    }
    d["num_accepted_tokens_per_pos"].append(9)  # a copy, not the live list
    assert s.num_accepted_tokens_per_pos == [1, 1, 0]
