"""ngram (prompt-lookup) drafting: find the longest suffix n-gram earlier in the sequence.

Algorithm (vLLM's): reverse the token sequence, so the suffix we want to match becomes a prefix;
one KMP pass computes, for every position i of the reversed sequence, the length of the longest
prefix of the reversed sequence that ends at i (capped at max_n). The longest such length >= min_n
is the longest suffix n-gram that occurred earlier; among equally long ones the earliest occurrence
in the original order wins (the largest i in the reversed order, hence ``>=``). The draft is the up
to k tokens that followed that occurrence.

Worked example, tokens [1 2 3 9 1 2 3], min_n 1, max_n 3, k 2: reversed [3 2 1 9 3 2 1]; the prefix
[3 2 1] recurs ending at reversed index 6, so n = 3 and the match starts at original index
7-1-6 = 0; the draft is the tokens after it: [9 1].

The LPS table only needs max_n entries: once a match reaches max_n it falls back like KMP would,
so the pass is O(len) with O(max_n) memory. Everything here is numba-compiled and allocation free.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def ngram_match(tokens, num_tokens, min_n, max_n, k, lps):
    """tokens: int32 [>= num_tokens]; lps: int32 scratch [max_n].

    Returns (start, count): the draft is tokens[start:start+count] (count 0 = no draft).
    """
    if num_tokens < min_n or k <= 0:
        return 0, 0
    longest = 0
    position = 0
    prev = 0
    last = num_tokens - 1
    for j in range(max_n):
        lps[j] = 0
    i = 1
    while i < num_tokens:
        # reversed[x] == tokens[last - x]
        if tokens[last - prev] == tokens[last - i]:
            prev += 1
            if prev >= longest:
                longest = prev
                position = i
            if i < max_n:
                lps[i] = prev
            if prev == max_n:
                prev = lps[max_n - 1]
            i += 1
        elif prev != 0:
            prev = lps[prev - 1]
        else:
            i += 1
    if longest < min_n:
        return 0, 0
    start = num_tokens - 1 - position + longest
    count = min(k, num_tokens - start)
    return start, count


@njit(cache=True, nogil=True)
def ngram_propose_batch(tokens, num_tokens, min_n, max_n, k, max_model_len, out_draft, out_num):
    """Batched drafting over requests.

    tokens: int32 [B, L] (row b valid up to num_tokens[b]); out_draft: int32 [B, k] (filled, -1
    padded); out_num: int32 [B]. A request never drafts past max_model_len.
    """
    lps = np.zeros(max(max_n, 1), dtype=np.int32)
    for b in range(tokens.shape[0]):
        n = num_tokens[b]
        kb = min(k, max_model_len - n)
        start, count = ngram_match(tokens[b], n, min_n, max_n, kb, lps)
        for j in range(k):
            out_draft[b, j] = tokens[b, start + j] if j < count else -1
        out_num[b] = count
