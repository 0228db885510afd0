"""specctl.kernels.suffix against a brute-force reference, plus hand-built cases with known drafts.

Reference semantics (ArcticInference's suffix tree, path speculation): every string s of length
<= D has count(s) = its number of occurrences over the stored sequences. For match lengths
m = 1..min(D, len(context)), stopping at the first context suffix that does not occur: from the
matched string follow the most frequent one-token extension (ties: smallest token id) while the
running product of count(child) / count(parent) stays >= min_prob, for at most
min(k, floor(factor * m)) tokens; score = sum of the running products; the best score wins, a
longer match on a tie.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from specctl.kernels.suffix import BEST, CHILD, CNT, DIRTY, NEXT, TOK, SuffixTree

# ------------------------------------------------------------------------------ reference


def ref_counts(seqs: list[list[int]], D: int) -> dict[tuple[int, ...], int]:
    c: Counter = Counter()
    for s in seqs:
        for i in range(len(s)):
            for j in range(1, min(D, len(s) - i) + 1):
                c[tuple(s[i:i + j])] += 1
    return dict(c)


def ref_layout(counts: dict, D: int) -> dict:
    """The nodes the tree stores: every string with count >= 2, and count-1 strings under those (leaves)."""
    return {s: v for s, v in counts.items() if v >= 2 or len(s) == 1 or counts[s[:-1]] >= 2}


def ref_draft(counts: dict, D: int, ctx: list[int], k: int, factor: float, min_prob: float):
    best = ([], 0.0, 0)
    vocab = {s[-1] for s in counts}
    for m in range(1, min(D, len(ctx)) + 1):
        s = tuple(ctx[len(ctx) - m:])
        if counts.get(s, 0) == 0:
            break
        limit, prob, out, score = min(k, int(m * factor + 1e-6)), 1.0, [], 0.0
        while len(out) < limit and len(s) < D:
            kids = [(counts[s + (x,)], -x) for x in vocab if counts.get(s + (x,), 0) > 0]
            if not kids:
                break
            c, neg = max(kids)
            prob *= c / counts[s]
            if prob < min_prob:
                break
            out.append(-neg)
            score += prob
            s = s + (-neg,)
        if score >= best[1]:
            best = (out, score, m)
    return best


def build(seqs, D, chunk_rng=None, **kw) -> SuffixTree:
    t = SuffixTree(D, max_seqs=max(len(seqs), 1), **kw)
    for s in seqs:
        t.start_seq()
        i = 0
        while i < len(s):
            j = len(s) if chunk_rng is None else i + int(chunk_rng.integers(1, 5))
            t.extend(s[i:j])
            i = j
        t.end_seq()
    return t


def draft(t: SuffixTree, ctx, k, factor=1.0, min_prob=0.1):
    out, scratch = np.zeros(max(k, 1), np.int32), np.zeros(max(k, 1), np.int32)
    n, score, m = t.speculate(np.asarray(ctx, np.int32), len(ctx), k, factor, min_prob, out, scratch)
    return out[:n].tolist(), score, m


def check_best_cache(t: SuffixTree) -> None:
    """Every node's cached best child is the true argmax (count, then smallest token), or marked dirty."""
    nd = t.nd
    for x in range(int(t.meta[0])):
        if x and nd[x, CNT] == 0:
            continue
        if nd[x, BEST] == DIRTY:
            continue
        kids, c = [], nd[x, CHILD]
        while c >= 0:
            kids.append(int(c))
            c = nd[c, NEXT]
        expected = max(kids, key=lambda c: (nd[c, CNT], -nd[c, TOK])) if kids else -1
        assert nd[x, BEST] == expected


def random_seqs(rng, n, vocab, max_len=30):
    return [rng.integers(0, vocab, int(rng.integers(1, max_len))).tolist() for _ in range(n)]


# ------------------------------------------------------------------------------ hand-built


def test_module_docstring_example():
    t = build([[1, 2, 1, 2]], D=3)  # a b a b
    assert t.dump() == {(1,): 2, (2,): 2, (1, 2): 2, (2, 1): 1, (1, 2, 1): 1}  # explicit + leaves
    assert t.dump(expand=True) == ref_counts([[1, 2, 1, 2]], 3)  # (2, 1, 2) lives in the leaf's chain
    assert t.num_nodes == 6
    toks, score, m = draft(t, [9, 1], k=8, factor=2.0)
    assert (toks, score, m) == ([2, 1], 1.5, 1)  # b at 2/2, then a at 1 * 1/2
    assert draft(t, [9, 1], k=8, factor=1.0)[0] == [2]  # at most floor(1.0 * 1) tokens for a 1-token match


def test_probabilities_min_prob_and_spec_factor():
    # after "1": 12 x3, 15 x1 -> p(2) = 3/4; after "12": 123 x2, 124 x1 -> p(3) = 3/4 * 2/3 = 1/2
    t = build([[1, 2, 3], [1, 2, 3], [1, 2, 4], [1, 5, 6]], D=8)
    assert draft(t, [1], k=8, factor=4.0) == ([2, 3], 1.25, 1)
    assert draft(t, [1], k=8, factor=4.0, min_prob=0.6) == ([2], 0.75, 1)  # 1/2 < 0.6 stops
    assert draft(t, [1], k=8, factor=4.0, min_prob=0.5)[0] == [2, 3]  # >= keeps it
    assert draft(t, [1], k=1, factor=4.0)[0] == [2]  # k bounds it
    assert draft(t, [1], k=8, factor=1.0)[0] == [2]  # floor(1.0 x 1 matched token)
    assert draft(t, [7, 1], k=8, factor=4.0)[0] == [2, 3]  # "7 1" does not occur: the 1-token match
    # a 2-token match "1 5" is followed by 6 with certainty: score 1 < 1.25, the 1-token match still wins
    assert draft(t, [1, 5], k=8, factor=4.0) == ([6], 1.0, 2)
    assert draft(t, [8], k=8) == ([], 0.0, 0)  # nothing matches


def test_ties_prefer_the_smallest_token_then_the_longer_match():
    t = build([[7, 9], [7, 8]], D=4)
    assert draft(t, [7], k=4, factor=2.0) == ([8], 0.5, 1)
    # [3 4 5] twice: after "4", match 1 gives [5] (1.0); match 2 "3 4" also [5] (1.0): the longer wins
    t = build([[3, 4, 5], [3, 4, 5]], D=4)
    assert draft(t, [3, 4], k=4, factor=1.0) == ([5], 1.0, 2)


def test_depth_bounds_the_draft():
    seq = list(range(10, 30))
    t = build([seq], D=5)
    # a 1-token match at depth 1 can draft up to depth 5: 4 tokens
    assert draft(t, [12], k=16, factor=16.0)[0] == [13, 14, 15, 16]
    # "11 12" sits at depth 2, so its own draft stops at 3 tokens; the 1-token match's 4 score higher
    assert draft(t, [11, 12], k=16, factor=16.0) == ([13, 14, 15, 16], 4.0, 1)
    assert draft(t, [10, 11, 12, 13, 14], k=16, factor=16.0)[0] == [15, 16, 17, 18]  # from the 1-token match


def test_chain_of_a_growing_sequence_follows_its_appends():
    t = SuffixTree(6)
    t.start_seq()
    t.extend([5, 6, 7])
    assert draft(t, [5], k=4, factor=4.0)[0] == [6, 7]
    t.extend([8])
    assert draft(t, [5], k=4, factor=4.0)[0] == [6, 7, 8]  # the leaf's chain reads the new token
    t.extend([5, 6])
    assert draft(t, [5, 6], k=4, factor=4.0)[0] == [7, 8, 5, 6]


# ------------------------------------------------------------------------------ against the reference


@pytest.mark.parametrize("seed", range(4))
def test_counts_layout_and_drafts_match_the_reference(seed):
    rng = np.random.default_rng(seed)
    for _ in range(40):
        D, vocab = int(rng.integers(1, 8)), int(rng.integers(2, 6))
        seqs = random_seqs(rng, int(rng.integers(1, 5)), vocab)
        t = build(seqs, D, chunk_rng=rng, node_capacity=8, pool_capacity=4)  # forces growth on the way
        counts = ref_counts(seqs, D)
        assert t.dump(expand=True) == counts
        assert t.dump() == ref_layout(counts, D)
        check_best_cache(t)
        for _ in range(6):
            ctx = rng.integers(0, vocab, int(rng.integers(1, 12))).tolist()
            k = int(rng.integers(1, 8))
            factor, min_prob = float(rng.choice([0.5, 1.0, 2.5])), float(rng.choice([0.0, 0.1, 0.4]))
            toks, score, m = draft(t, ctx, k, factor, min_prob)
            r_toks, r_score, r_m = ref_draft(counts, D, ctx, k, factor, min_prob)
            assert (toks, m) == (r_toks, r_m)
            assert score == pytest.approx(r_score)


def test_incremental_append_equals_building_at_once():
    rng = np.random.default_rng(7)
    for _ in range(30):
        D = int(rng.integers(1, 10))
        seq = rng.integers(0, int(rng.integers(2, 8)), int(rng.integers(1, 80))).tolist()
        at_once = build([seq], D)
        one_by_one = SuffixTree(D)
        one_by_one.start_seq()
        for tok in seq:
            one_by_one.extend([tok])
        chunked = build([seq], D, chunk_rng=rng)
        high = int(at_once.meta[0])
        for other in (one_by_one, chunked):
            assert other.dump(expand=True) == at_once.dump(expand=True)
            assert int(other.meta[0]) == high and np.array_equal(other.nd[:high], at_once.nd[:high])
        for _ in range(5):
            ctx = seq[: int(rng.integers(1, len(seq) + 1))]
            assert draft(one_by_one, ctx, 6, 2.0) == draft(at_once, ctx, 6, 2.0)


# ------------------------------------------------------------------------------ eviction


def test_fifo_eviction_keeps_exactly_the_newest_sequences():
    rng = np.random.default_rng(3)
    for _ in range(25):
        D, cap = int(rng.integers(1, 7)), int(rng.integers(1, 4))
        seqs = random_seqs(rng, 8, int(rng.integers(2, 5)))
        t = SuffixTree(D, max_seqs=cap, node_capacity=8, pool_capacity=4)
        for i, s in enumerate(seqs):
            if len(t.live) == cap:
                t.remove_oldest()
            t.start_seq()
            t.extend(s)
            t.end_seq()
            kept = seqs[max(0, i + 1 - cap): i + 1]
            fresh = build(kept, D)
            counts = ref_counts(kept, D)
            assert t.dump(expand=True) == counts
            assert t.dump() == ref_layout(counts, D)  # canonical again: no stale nodes left behind
            assert t.num_nodes == fresh.num_nodes  # node count back to that of a tree never holding the evicted
            check_best_cache(t)
            ctx = rng.integers(0, 5, 6).tolist()
            assert draft(t, ctx, 5, 2.0) == draft(fresh, ctx, 5, 2.0)
        while t.live:
            t.remove_oldest()
        assert t.num_nodes == 1 and t.nd[0, CNT] == 0 and t.pool_used == 0 and t.dump() == {}


def test_memory_stays_bounded_over_many_evictions():
    rng = np.random.default_rng(0)
    t = SuffixTree(24, max_seqs=20)
    base = [rng.integers(0, 500, 200) for _ in range(30)]
    sizes = []
    for r in range(300):
        seq = base[r % 30].copy()
        seq[rng.integers(0, 200, 5)] = rng.integers(0, 500, 5)  # small variations of recurring responses
        if len(t.live) == 20:
            t.remove_oldest()
        t.start_seq()
        t.extend(seq)
        t.end_seq()
        sizes.append((t.num_nodes, t.nd.shape[0], t.pool.size))
    assert len(t.live) == 20 and t.num_tokens == 20 * 200
    assert t.num_nodes <= 24 * t.num_tokens + 1
    assert sizes[-1][1:] == sizes[100][1:]  # arrays stopped growing once the cache was full
    assert max(s[0] for s in sizes[100:]) <= 1.2 * min(s[0] for s in sizes[100:])


def test_removal_needs_a_complete_oldest_sequence():
    t = SuffixTree(4, max_seqs=2)
    with pytest.raises(RuntimeError):
        t.remove_oldest()
    t.start_seq()
    t.extend([1, 2])
    with pytest.raises(RuntimeError):
        t.remove_oldest()  # it is still growing
    with pytest.raises(RuntimeError):
        t.start_seq()
    t.end_seq()
    t.start_seq()
    t.end_seq()
    with pytest.raises(RuntimeError):
        t.start_seq()  # both slots in use
    with pytest.raises(ValueError):
        SuffixTree(0)
