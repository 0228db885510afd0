"""How much of a draft tree is worth verifying: each node's chance of being accepted against what its
row costs the target's forward.

A step that verifies a tree emits one token per accepted level plus the target's own, and the accepted
nodes are one per level, so E[tokens] = 1 + sum over nodes of P(node accepted). On a CPU the forward's
rows are not free: verifying n nodes costs about 1 + r n plain steps, r the price of one more row (the
draft-length controller's measured slope, ``DraftLengthController.row_price``). Tokens per unit of
time, (1 + sum p) / (1 + r n), is best for a prefix of the nodes in order of probability: node n + 1
is worth its row while p_{n+1} > r (1 + p_1 + .. + p_n) / (1 + r n), and no node below r ever is, so
a tree stops growing a branch whose probability fell below r (it saves the draft's forwards too).

P(node accepted) is the draft's own probability of the node's path, calibrated on the nodes verified so
far (``NodeCalibration``): a draft that is sure and wrong learns to keep fewer nodes.

What it does not know: how a tree is drafted (the proposers) or verified (``specctl.runtime.verify``).
"""

from __future__ import annotations

import math

BINS = 12  # probability bins by powers of two: [1/2, 1], [1/4, 1/2), .. below 2^-11 the last
PRIOR = 4.0  # pseudo-observations at the draft's own probability, per bin
CAP = 4096.0  # a bin's counts are halved past this: it follows a draft whose requests change


def _bin(p: float) -> int:
    return BINS - 1 if p <= 0 else min(int(-math.log2(min(p, 1.0))), BINS - 1)


class NodeCalibration:
    """P(a verified node is accepted) as a function of the draft's probability for its path: counts by
    probability bin, shrunk toward the probability itself, made monotone (a likelier path is never
    rated below a less likely one), so a tree's children are never rated above their parents."""

    def __init__(self):
        self.tried = [0.0] * BINS
        self.accepted = [0.0] * BINS
        self._rates: list[float] | None = None

    def observe(self, probs: list[float], accepted: list[bool]) -> None:
        """One verified tree: each node's draft probability and whether it was on the accepted path."""
        for p, a in zip(probs, accepted):
            i = _bin(p)
            self.tried[i] += 1.0
            self.accepted[i] += float(a)
            if self.tried[i] > CAP:
                self.tried[i] /= 2
                self.accepted[i] /= 2
        self._rates = None

    def rates(self) -> list[float]:
        """Per bin (likeliest first): the calibrated acceptance, non-increasing."""
        if self._rates is None:
            mid = [0.75 * 2.0 ** -i for i in range(BINS)]
            w = [self.tried[i] + PRIOR for i in range(BINS)]
            r = [(self.accepted[i] + PRIOR * mid[i]) / w[i] for i in range(BINS)]
            self._rates = _non_increasing(r, w)
        return self._rates

    def __call__(self, p: float) -> float:
        return self.rates()[_bin(p)]

    def observe_tree(self, tree: tuple[list[int], list[int], list[float]], emitted: list[int], num_accepted: int) -> None:
        """One verified tree (ids, parents, each node's draft probability) and the step's emitted tokens."""
        ids, parents, probs = tree
        self.observe(probs, accepted_nodes(ids, parents, emitted, num_accepted))


def _non_increasing(values: list[float], weights: list[float]) -> list[float]:
    """The weighted least-squares non-increasing fit (pool adjacent violators): a bin with little
    evidence that rates above a likelier one is pooled with it, weighted by their counts."""
    blocks: list[list[float]] = []  # [mean, weight, bins]
    for v, w in zip(values, weights):
        blocks.append([v, w, 1])
        while len(blocks) > 1 and blocks[-2][0] < blocks[-1][0]:
            v2, w2, n2 = blocks.pop()
            v1, w1, n1 = blocks.pop()
            blocks.append([(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    return [v for v, _, n in blocks for _ in range(int(n))]


def worth(probs: list[float], price: float | None) -> int:
    """How many of the nodes (calibrated acceptance ``probs``, likeliest first) to verify at ``price``
    plain steps a row (None or 0: all of them): the prefix with the most tokens per unit of time."""
    if not price or price <= 0:
        return len(probs)
    total, n = 1.0, 0
    for p in probs:
        if p <= price * total / (1.0 + price * n):
            break
        total += p
        n += 1
    return n


def with_ancestors(chosen, parents) -> set[int]:
    """The ``chosen`` nodes and every ancestor of theirs (``parents[i]``, -1 for a root's child): a
    connected tree."""
    keep = set(chosen)
    for c in list(keep):
        a = parents[c]
        while a >= 0 and a not in keep:
            keep.add(a)
            a = parents[a]
    return keep


def accepted_nodes(ids: list[int], parents: list[int], emitted: list[int], num_accepted: int) -> list[bool]:
    """Which nodes of a verified tree (``ids``, ``parents``: -1 for the root's children) lie on the
    accepted path, the first ``num_accepted`` of the ``emitted`` tokens."""
    on = [False] * len(ids)
    cur = -1
    for tok in emitted[:num_accepted]:
        nxt = next((i for i in range(len(ids)) if parents[i] == cur and ids[i] == tok), None)
        if nxt is None:
            break
        on[nxt] = True
        cur = nxt
    return on
