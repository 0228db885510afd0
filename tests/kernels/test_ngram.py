"""specctl.kernels.ngram against a plain-Python reference of the algorithm, plus hand cases.

Reference semantics (vLLM's prompt lookup): among the suffix n-grams of the sequence with
min_n <= n <= max_n, take the longest that also occurs earlier (an occurrence ending before the
last token; it may overlap the suffix); among its occurrences the earliest wins; the draft is the
up to k tokens that follow it, never past the end of the sequence nor past max_model_len.
"""

from __future__ import annotations

import numpy as np
import pytest

from specctl.kernels.ngram import ngram_match, ngram_propose_batch


def reference(tokens: list[int], min_n: int, max_n: int, k: int, max_model_len: int = 1 << 30) -> list[int]:
    L = len(tokens)
    k = min(k, max_model_len - L)
    if L < min_n or k <= 0:
        return []
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = tokens[L - n:]
        for j in range(0, L - n):  # occurrences starting at j < L - n, i.e. ending before the last token
            if tokens[j:j + n] == suffix:
                start = j + n
                return tokens[start:start + min(k, L - start)]
    return []


def propose(rows: list[list[int]], min_n: int, max_n: int, k: int, max_model_len: int = 1 << 20, width=None):
    """Run the kernel on rows of different lengths (one padded int32 matrix); returns lists."""
    width = width or max(len(r) for r in rows) + 3
    tokens = np.full((len(rows), width), 99, dtype=np.int32)  # junk beyond each row's length
    for b, r in enumerate(rows):
        tokens[b, :len(r)] = r
    num = np.array([len(r) for r in rows], dtype=np.int32)
    draft = np.full((len(rows), k), -7, dtype=np.int32)
    count = np.full(len(rows), -7, dtype=np.int32)
    ngram_propose_batch(tokens, num, min_n, max_n, k, max_model_len, draft, count)
    out = []
    for b in range(len(rows)):
        c = int(count[b])
        assert (draft[b, c:] == -1).all(), "draft must be -1 padded past its count"
        out.append(draft[b, :c].tolist())
    return out


def test_docstring_worked_example():
    assert propose([[1, 2, 3, 9, 1, 2, 3]], 1, 3, 2) == [[9, 1]]
    assert reference([1, 2, 3, 9, 1, 2, 3], 1, 3, 2) == [9, 1]


def test_no_match():
    assert propose([[1, 2, 3, 4, 5]], 1, 3, 4) == [[]]
    # the last token recurs but only as a 1-gram and min_n is 2
    assert propose([[5, 1, 2, 3, 5]], 2, 3, 4) == [[]]
    assert propose([[5, 1, 2, 3, 5]], 1, 3, 4) == [[1, 2, 3, 5]]


def test_sequence_shorter_than_min_n():
    assert propose([[7, 7]], 3, 4, 4) == [[]]
    assert propose([[7]], 1, 4, 4) == [[]]  # a single token has nothing earlier


def test_k_capped_by_max_model_len():
    seq = [1, 2, 3, 4, 5, 6, 1, 2]
    assert propose([seq], 1, 2, 5) == [[3, 4, 5, 6, 1]]
    assert propose([seq], 1, 2, 5, max_model_len=len(seq) + 2) == [[3, 4]]
    assert propose([seq], 1, 2, 5, max_model_len=len(seq)) == [[]]


def test_k_capped_by_tokens_after_the_match():
    assert propose([[1, 2, 3, 1, 2]], 1, 3, 5) == [[3, 1, 2]]
    # an overlapping occurrence: [7 7] at index 0 overlaps the suffix; one token follows it
    assert propose([[7, 7, 7]], 1, 3, 5) == [[7]]


def test_longest_ngram_wins_over_earlier_shorter_one():
    # suffix [2 3]: the 1-gram [3] occurs first at index 0 (-> 8), the 2-gram [2 3] at 3 (-> 9)
    assert propose([[3, 8, 0, 2, 3, 9, 2, 3]], 1, 3, 1) == [[9]]
    assert propose([[3, 8, 0, 2, 3, 9, 2, 3]], 1, 1, 1) == [[8]]  # max_n 1: only 1-grams


def test_earliest_occurrence_wins_on_ties():
    assert propose([[4, 5, 1, 4, 5, 2, 4, 5]], 2, 2, 1) == [[1]]


def test_match_longer_than_max_n_is_capped():
    seq = [1, 2, 3, 4, 5, 9, 9, 1, 2, 3, 4, 5]
    assert propose([seq], 2, 3, 3) == [[9, 9, 1]]
    assert reference(seq, 2, 3, 3) == [9, 9, 1]


def test_k_zero():
    assert propose([[1, 2, 1]], 1, 2, 0) == [[]]


def test_batch_rows_of_different_lengths():
    rows = [[1, 2, 3, 9, 1, 2, 3], [5, 6], [4, 4, 4, 4, 4, 4, 4, 4, 4], [8, 1, 8], [1, 2, 3, 4]]
    got = propose(rows, 1, 3, 3, width=12)
    assert got == [reference(r, 1, 3, 3) for r in rows]
    assert got == [[9, 1, 2], [], [4, 4, 4], [1, 8], []]


def test_ngram_match_returns_start_and_count():
    tokens = np.array([1, 2, 3, 9, 1, 2, 3], dtype=np.int32)
    lps = np.zeros(3, dtype=np.int32)
    assert tuple(ngram_match(tokens, 7, 1, 3, 2, lps)) == (3, 2)


@pytest.mark.parametrize("alphabet", [2, 3, 5])
def test_matches_reference_on_random_sequences(alphabet):
    rng = np.random.default_rng(alphabet)
    rows, params = [], []
    for _ in range(300):
        L = int(rng.integers(0, 40))
        rows.append(rng.integers(0, alphabet, L).tolist())
        min_n = int(rng.integers(1, 5))
        params.append((min_n, int(rng.integers(min_n, 7)), int(rng.integers(1, 8))))
    for row, (min_n, max_n, k) in zip(rows, params):
        mml = int(rng.integers(len(row), len(row) + 6))
        assert propose([row], min_n, max_n, k, mml) == [reference(row, min_n, max_n, k, mml)], (row, min_n, max_n, k, mml)
    # the same rows as one batch (one parameter set per batch call)
    for min_n, max_n, k in [(1, 3, 4), (2, 5, 3), (3, 3, 6)]:
        assert propose(rows, min_n, max_n, k) == [reference(r, min_n, max_n, k) for r in rows]
