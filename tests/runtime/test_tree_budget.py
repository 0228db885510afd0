"""specctl.runtime.tree_budget: how many of a tree's nodes pay for their rows, the calibration of the
draft's probabilities, and which nodes a verification accepted."""

from __future__ import annotations

import numpy as np

from specctl.runtime.tree_budget import NodeCalibration, accepted_nodes, worth


def _ratio(ps, price, n):
    return (1 + sum(ps[:n])) / (1 + price * n)


def test_worth_is_the_prefix_with_the_most_tokens_per_unit_of_time():
    rng = np.random.default_rng(0)
    for _ in range(200):
        ps = sorted(rng.uniform(0, 1, int(rng.integers(1, 20))).tolist(), reverse=True)
        price = float(rng.uniform(0.001, 1.0))
        n = worth(ps, price)
        best = max(_ratio(ps, price, m) for m in range(len(ps) + 1))
        assert abs(_ratio(ps, price, n) - best) < 1e-12, (ps, price, n)
        assert all(p > price for p in ps[:n])  # no node below the price is ever worth its row
    assert worth([0.5, 0.1], None) == worth([0.5, 0.1], 0.0) == 2  # unpriced: the whole tree
    assert worth([0.5, 0.1], 0.6) == 0


def test_calibration_follows_what_was_accepted_and_stays_monotone():
    c = NodeCalibration()
    assert abs(c(0.9) - 0.75) < 1e-9 and c(0.9) >= c(0.3) >= c(0.01)  # before evidence: about the draft's own
    for _ in range(300):  # a draft sure of itself (0.9) and right one time in ten; its 0.3s right half the time
        c.observe([0.9] * 10, [True] + [False] * 9)
        c.observe([0.3] * 2, [True, False])
    # out of order (the surer bin right less often): pooled, weighted by their counts, 600 right of 3600
    assert c(0.9) == c(0.3) and abs(c(0.9) - 600 / 3600) < 0.01
    for _ in range(300):
        c.observe([0.3] * 10, [False] * 10)
    assert abs(c(0.9) - 0.1) < 0.01 and abs(c(0.3) - 300 / 3600) < 0.01  # in order again: each its own


def test_accepted_nodes_follow_the_emitted_path():
    # root's children 7 (0) and 8 (1); 0's children 9 (2) and 7 (3); 3's child 5 (4)
    ids, parents = [7, 8, 9, 7, 5], [-1, -1, 0, 0, 3]
    assert accepted_nodes(ids, parents, [7, 7, 5, 2], 3) == [True, False, False, True, True]
    assert accepted_nodes(ids, parents, [8, 4], 1) == [False, True, False, False, False]
    assert accepted_nodes(ids, parents, [3], 0) == [False] * 5
