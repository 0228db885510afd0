"""Suffix decoding (arXiv 2411.04975, ArcticInference's algorithm): a depth-bounded suffix trie with counts.

What it stores. For a set of token sequences and a depth D, every *entry* (sequence q, start i) is the
string q[i : i+D] (shorter at the end of q). Every string s of length <= D that occurs has a count:
the number of entries it is a prefix of, i.e. its number of occurrences. The trie is stored
compressed in one way only, which keeps memory linear in practice:

- an *explicit* node exists for the root and for every string with count >= 2;
- a string with count 1 whose parent is explicit is a *leaf* node; it carries a reference
  (sequence, end position) to its one occurrence, and the strings below it (its *chain*, count 1
  each) are read from that sequence instead of being stored;
- every node also keeps the reference of the most recent entry through it, which is what lets
  eviction turn a node whose count falls to 1 back into a leaf without searching for its survivor.

This layout is canonical (a function of the sequences only), so appending token by token, building
at once, and adding-then-evicting all give the same tree (the tests compare dumps).

Worked example, D = 3, one sequence [a b a b], max_spec_factor 2: counts a:2, b:2, ab:2, ba:1, bab:1, aba:1, ...;
explicit nodes root, a, b, ab; leaves ba (chain "b", via its occurrence ending at position 2) and
aba (under ab). A draft after context "..a": a -> best child b (2/2 = 1.0) -> ab has one child,
aba (1/2 = 0.5) -> its chain ends at depth 3: draft [b, a], probabilities [1.0, 0.5], score 1.5.

Drafting (``tree_speculate``), as ArcticInference's path speculation: for each match length m =
1..min(D, n), find the node of the context's last m tokens (stop at the first m that does not
occur); from it follow the most frequent child (ties: smallest token id) while the running
probability (product of child count / parent count) stays >= min_token_prob, for at most
min(k, floor(max_spec_factor * m)) tokens. Score = sum of the drafted tokens' probabilities; the
best score wins, a later (longer) match on a tie.

Storage is flat numpy arrays (numba, allocation free): ``nd`` [capacity, NCOL] int32 node records,
an open-addressing hash (``hk`` keys (parent << 31) | token, ``hv`` node ids) for child lookup, a
first-child / sibling list for child enumeration, and the token ``pool`` of the sequences. Kernels
stop and return early when free nodes or hash room run low; ``SuffixTree`` (the thin Python owner
of the arrays) grows them and calls again. One sequence may grow at a time per tree (its active
suffixes are kept in ``act``); eviction removes the oldest complete sequence (FIFO).

What it does not know: requests, slots, local vs global trees (``specctl/runtime/proposers/suffix.py``).

``python benchmarks/suffix_tree.py`` prints the proposal latency at an 8k-token context with 1,000 cached
responses.
"""

from __future__ import annotations

from collections import deque

import numpy as np
from numba import njit

from specctl.kernels.suffix_store import (BEST, CHILD, CNT, DEP, DIRTY, M_FREE, M_HFILL, M_HIGH, M_LIVE,  # noqa: F401
                                          M_NFREE, NCOL, NEXT, NMETA, PAR, PREV, ROOT, RPOS, RSEQ, TOK, _EMPTY,
                                          _hdelete, _hfind, _hinsert, _key, _slot, rehash)


# ------------------------------------------------------------------------------ nodes


@njit(cache=True)
def _new_node(nd, meta, hk, hv, parent, tok, depth, rseq, rpos):
    x = meta[M_FREE]
    if x >= 0:
        meta[M_FREE] = nd[x, NEXT]
        meta[M_NFREE] -= 1
    else:
        x = meta[M_HIGH]
        meta[M_HIGH] += 1
    nd[x, TOK] = tok
    nd[x, PAR] = parent
    nd[x, CNT] = 1
    nd[x, DEP] = depth
    nd[x, CHILD] = -1
    nd[x, RSEQ] = rseq
    nd[x, RPOS] = rpos
    nd[x, BEST] = -1
    head = nd[parent, CHILD]
    nd[x, NEXT] = head
    nd[x, PREV] = -1
    if head >= 0:
        nd[head, PREV] = x
    nd[parent, CHILD] = x
    meta[M_LIVE] += 1
    _hinsert(hk, hv, meta, _key(parent, tok), x)
    _offer_best(nd, parent, x)
    return x


@njit(cache=True)
def _free_node(nd, meta, hk, hv, x):
    parent = nd[x, PAR]
    _hdelete(hk, hv, meta, _key(parent, nd[x, TOK]))
    prev, nxt = nd[x, PREV], nd[x, NEXT]
    if prev >= 0:
        nd[prev, NEXT] = nxt
    else:
        nd[parent, CHILD] = nxt
    if nxt >= 0:
        nd[nxt, PREV] = prev
    nd[parent, BEST] = DIRTY
    nd[x, CNT] = 0
    nd[x, CHILD] = -1
    nd[x, NEXT] = meta[M_FREE]
    meta[M_FREE] = x
    meta[M_NFREE] += 1
    meta[M_LIVE] -= 1


@njit(cache=True, inline="always")
def _better(nd, a, b):
    """Child a beats child b: a higher count, or the same count and a smaller token id."""
    return nd[a, CNT] > nd[b, CNT] or (nd[a, CNT] == nd[b, CNT] and nd[a, TOK] < nd[b, TOK])


@njit(cache=True)
def _offer_best(nd, parent, c):
    """Child c was created or counted once more: the best child is now c or unchanged."""
    b = nd[parent, BEST]
    if b != DIRTY and (b < 0 or (b != c and _better(nd, c, b))):
        nd[parent, BEST] = c


@njit(cache=True)
def _best_child(nd, node):
    """The most frequent child (ties: smallest token id), cached in BEST; -1 if none."""
    b = nd[node, BEST]
    if b != DIRTY:
        return b
    c = nd[node, CHILD]
    while c >= 0:
        if b < 0 or _better(nd, c, b):
            b = c
        c = nd[c, NEXT]
    nd[node, BEST] = b
    return b


@njit(cache=True)
def _free_descendants(nd, meta, hk, hv, top):
    """Free every node below ``top`` (post-order, no stack: descend to a leaf, free it, step back)."""
    x = top
    while True:
        c = nd[x, CHILD]
        if c >= 0:
            x = c
            continue
        if x == top:
            return
        p = nd[x, PAR]
        _free_node(nd, meta, hk, hv, x)
        x = p


@njit(cache=True)
def _room(nd, meta, need):
    """True when ``need`` more nodes fit (the hash has 2x the node capacity: at most half full)."""
    return nd.shape[0] - meta[M_HIGH] + meta[M_NFREE] >= need


# ------------------------------------------------------------------------------ append


@njit(cache=True)
def tree_extend(nd, meta, hk, hv, pool, seq_off, seq_len, act, depth, seq, tokens, start):
    """Append ``tokens[start:]`` to the growing sequence ``seq``; returns the index reached.

    Per token t at position n (the sequence had n tokens), every active suffix s = q[n-L:n],
    L = min(n, D-1) .. 0 (longest first), gains the string s+t:
      - s has count 1 (a leaf, or inside a leaf's chain): its one occurrence is this one, and the
        chain reads t from the sequence: nothing to store;
      - otherwise look up child s+t: create a leaf (count 1), or count it once more; a leaf that
        reaches count 2 becomes explicit, and its earlier occurrence's next token (if any) becomes
        a new leaf below it.
    ``act[L]`` holds the node of q[n-L:n], or -1 when it is inside a chain. The pool must already
    have room for the tokens (the owner checks); returns early when nodes or hash room run low.
    """
    D = depth
    need = 2 * D + 2
    base = seq_off[seq]
    i = start
    while i < tokens.shape[0]:
        if not _room(nd, meta, need):
            return i
        t = tokens[i]
        n = seq_len[seq]
        pool[base + n] = t
        seq_len[seq] = n + 1
        nd[ROOT, CNT] += 1
        act[0] = ROOT
        for L in range(min(n, D - 1), -1, -1):
            s = act[L]
            if s < 0 or (s != ROOT and nd[s, CNT] == 1):
                act[L + 1] = -1
                continue
            c = _hfind(hk, hv, _key(s, t))
            if c < 0:
                c = _new_node(nd, meta, hk, hv, s, t, L + 1, seq, n)
            else:
                nd[c, CNT] += 1
                _offer_best(nd, s, c)
                if nd[c, CNT] == 2 and nd[c, CHILD] < 0 and L + 1 < D:
                    rq, rp = nd[c, RSEQ], nd[c, RPOS] + 1
                    if rq >= 0 and rp < seq_len[rq]:
                        m = _new_node(nd, meta, hk, hv, c, pool[seq_off[rq] + rp], L + 2, rq, rp)
                        if rq == seq and rp == n:
                            act[L + 2] = m  # that occurrence is this sequence's suffix of length L+2
                nd[c, RSEQ] = seq
                nd[c, RPOS] = n
            act[L + 1] = c
        i += 1
    return i


# ------------------------------------------------------------------------------ eviction


@njit(cache=True)
def tree_remove(nd, meta, hk, hv, pool, seq_off, seq_len, depth, seq, path):
    """Remove the entries of the complete sequence ``seq`` (counts down, nodes left at 0 freed).

    A node whose count falls to 1 becomes a leaf again: what is below it is freed, and its
    reference (the most recent entry through it) already points at the survivor, because entries
    leave oldest first: ``seq`` must be the oldest sequence (FIFO), none may be growing, and its
    entries go in order of start; the survivor is then newer than every entry removed so far.
    path: int32 scratch [D].
    """
    D = depth
    base = seq_off[seq]
    n = seq_len[seq]
    for i in range(n):
        end = min(i + D, n)
        node = ROOT
        plen = 0
        j = i
        while j < end:
            if node != ROOT and nd[node, CNT] == 1:
                break  # a leaf: the rest of the entry is its chain
            c = _hfind(hk, hv, _key(node, pool[base + j]))
            if c < 0:
                break  # cannot happen in a consistent tree
            path[plen] = c
            plen += 1
            node = c
            j += 1
        nd[ROOT, CNT] -= 1
        for p in range(plen):
            nd[path[p], CNT] -= 1
            nd[nd[path[p], PAR], BEST] = DIRTY
        for p in range(plen):
            x = path[p]
            if nd[x, CNT] <= 1:
                _free_descendants(nd, meta, hk, hv, x)
                if nd[x, CNT] == 0:
                    _free_node(nd, meta, hk, hv, x)
                break


# ------------------------------------------------------------------------------ drafting


@njit(cache=True)
def _match(nd, hk, hv, pool, seq_off, seq_len, D, ctx, lo, hi):
    """Locate ctx[lo:hi] -> (node, off): off tokens into the node's chain; node -1 if absent."""
    node = ROOT
    off = 0
    for j in range(lo, hi):
        x = ctx[j]
        if off == 0 and (node == ROOT or nd[node, CNT] >= 2):
            node = _hfind(hk, hv, _key(node, x))
            if node < 0:
                return -1, 0
        else:
            rq, p = nd[node, RSEQ], nd[node, RPOS] + off + 1
            if nd[node, DEP] + off + 1 > D or rq < 0 or p >= seq_len[rq] or pool[seq_off[rq] + p] != x:
                return -1, 0
            off += 1
    return node, off


@njit(cache=True)
def _walk(nd, pool, seq_off, seq_len, D, node, off, max_tokens, min_prob, out):
    """Follow the most frequent child from (node, off); returns (num tokens, score)."""
    prob = 1.0
    score = 0.0
    cnt = 0
    while cnt < max_tokens:
        if node != ROOT and nd[node, CNT] == 1:  # a leaf's chain: count ratio 1
            rq, p = nd[node, RSEQ], nd[node, RPOS] + off + 1
            if nd[node, DEP] + off + 1 > D or rq < 0 or p >= seq_len[rq]:
                break
            out[cnt] = pool[seq_off[rq] + p]
            off += 1
        else:
            best = _best_child(nd, node)
            if best < 0:
                break
            prob *= nd[best, CNT] / nd[node, CNT]
            if prob < min_prob:
                break
            out[cnt] = nd[best, TOK]
            node = best
            off = 0
        score += prob
        cnt += 1
    return cnt, score


@njit(cache=True)
def tree_speculate(nd, hk, hv, pool, seq_off, seq_len, depth, ctx, n, max_spec, factor, min_prob, out, scratch):
    """Best draft for the context ctx[:n] -> (num tokens, score, match length); tokens in ``out``.

    out, scratch: int32 [>= max_spec].
    """
    best_n, best_score, best_m = 0, 0.0, 0
    for m in range(1, min(depth, n) + 1):
        node, off = _match(nd, hk, hv, pool, seq_off, seq_len, depth, ctx, n - m, n)
        if node < 0:
            break
        limit = min(max_spec, int(m * factor + 1e-6))
        cnt, score = _walk(nd, pool, seq_off, seq_len, depth, node, off, limit, min_prob, scratch)
        if score >= best_score:
            best_n, best_score, best_m = cnt, score, m
            for j in range(cnt):
                out[j] = scratch[j]
    return best_n, best_score, best_m


# ------------------------------------------------------------------------------ owner


class SuffixTree:
    """A suffix trie of depth ``max_depth`` over up to ``max_seqs`` sequences (FIFO), in flat arrays.

    ``start_seq`` opens a new sequence that ``extend`` grows; ``end_seq`` closes it; ``remove_oldest``
    evicts the oldest closed one; ``speculate`` drafts. Capacity grows on demand (doubling).
    """

    def __init__(self, max_depth: int, max_seqs: int = 1, node_capacity: int = 1024, pool_capacity: int = 1024):
        if max_depth < 1 or max_seqs < 1:
            raise ValueError("max_depth and max_seqs must be >= 1")
        self.depth = int(max_depth)
        cap = max(int(node_capacity), 4 * self.depth + 8)
        self.nd = np.zeros((cap, NCOL), dtype=np.int32)  # [capacity, NCOL] node records
        self.nd[ROOT] = (-1, -1, 0, 0, -1, -1, -1, -1, -1, -1)
        self.meta = np.zeros(NMETA, dtype=np.int64)
        self.meta[M_HIGH], self.meta[M_FREE], self.meta[M_LIVE] = 1, -1, 1
        self.hk = np.full(_pow2(2 * cap), -1, dtype=np.int64)  # [H] child keys, H >= 2 x capacity
        self.hv = np.zeros(self.hk.shape[0], dtype=np.int32)  # [H] child node ids
        self.pool = np.zeros(max(int(pool_capacity), 16), dtype=np.int32)  # tokens of the sequences
        self.pool_used = 0
        self.seq_off = np.zeros(max_seqs, dtype=np.int64)  # [max_seqs] start of each sequence in pool
        self.seq_len = np.zeros(max_seqs, dtype=np.int64)  # [max_seqs]
        self.act = np.full(self.depth + 2, -1, dtype=np.int32)  # active suffix nodes of the growing sequence
        self._path = np.zeros(self.depth, dtype=np.int32)
        self._free_seqs = list(range(max_seqs - 1, -1, -1))
        self.live: deque[int] = deque()  # sequence ids, oldest first
        self.growing = -1

    # ---- sequences
    def start_seq(self) -> int:
        if self.growing >= 0:
            raise RuntimeError("a sequence is already growing; end_seq() it first")
        if not self._free_seqs:
            raise RuntimeError("every sequence slot is in use; remove_oldest() first")
        seq = self._free_seqs.pop()
        self.seq_off[seq], self.seq_len[seq] = self.pool_used, 0
        self.live.append(seq)
        self.growing = seq
        self.act[:] = -1
        self.act[0] = ROOT
        return seq

    def extend(self, tokens) -> None:
        """Append tokens to the growing sequence (incremental: same tree as building at once)."""
        if self.growing < 0:
            raise RuntimeError("no growing sequence; start_seq() first")
        tokens = np.ascontiguousarray(tokens, dtype=np.int32)
        if tokens.size == 0:
            return
        if tokens.min() < 0:
            raise ValueError("token ids must be >= 0")
        self._reserve_pool(tokens.size)
        i = 0
        while i < tokens.size:
            i = tree_extend(self.nd, self.meta, self.hk, self.hv, self.pool, self.seq_off, self.seq_len, self.act,
                            self.depth, self.growing, tokens, i)
            if i < tokens.size:
                self._grow_nodes()
        self.pool_used = int(self.seq_off[self.growing] + self.seq_len[self.growing])

    def end_seq(self) -> None:
        self.growing = -1

    def remove_oldest(self) -> None:
        """Evict the oldest complete sequence: its counts go, nodes left with no occurrence are freed."""
        if self.growing >= 0:
            raise RuntimeError("cannot remove while a sequence grows in the same tree; end_seq() it first")
        if not self.live:
            raise RuntimeError("no sequence to remove")
        seq = self.live.popleft()
        tree_remove(self.nd, self.meta, self.hk, self.hv, self.pool, self.seq_off, self.seq_len, self.depth, seq,
                    self._path)
        self.seq_len[seq] = 0
        self._free_seqs.append(seq)
        if not self.live:
            self.pool_used = 0

    # ---- drafting
    def speculate(self, ctx: np.ndarray, n: int, max_spec: int, factor: float, min_prob: float,
                  out: np.ndarray, scratch: np.ndarray) -> tuple[int, float, int]:
        """Draft for ctx[:n] (int32) into out[:num] -> (num, score, match_len)."""
        if max_spec <= 0 or n <= 0:
            return 0, 0.0, 0
        return tree_speculate(self.nd, self.hk, self.hv, self.pool, self.seq_off, self.seq_len, self.depth,
                              ctx, n, max_spec, float(factor), float(min_prob), out, scratch)

    # ---- sizes and inspection
    @property
    def num_nodes(self) -> int:
        """Live nodes, the root included."""
        return int(self.meta[M_LIVE])

    @property
    def num_tokens(self) -> int:
        return int(sum(self.seq_len[s] for s in self.live))

    def tokens(self, seq: int) -> np.ndarray:
        return self.pool[self.seq_off[seq]: self.seq_off[seq] + self.seq_len[seq]]

    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.nd, self.hk, self.hv, self.pool, self.seq_off, self.seq_len))

    def dump(self, expand: bool = False) -> dict[tuple[int, ...], int]:
        """{string: count} of every stored node (``expand``: also every string in the leaves' chains)."""
        out: dict[tuple[int, ...], int] = {}
        stack = [(ROOT, ())]
        while stack:
            x, s = stack.pop()
            if x != ROOT:
                out[s] = int(self.nd[x, CNT])
                if expand and self.nd[x, CNT] == 1:
                    rq, rp, d = int(self.nd[x, RSEQ]), int(self.nd[x, RPOS]), int(self.nd[x, DEP])
                    toks = self.tokens(rq) if rq >= 0 else ()
                    tail = s
                    for p in range(rp + 1, min(len(toks), rp + 1 + self.depth - d)):
                        tail = tail + (int(toks[p]),)
                        out[tail] = 1
            c = int(self.nd[x, CHILD])
            while c >= 0:
                stack.append((c, s + (int(self.nd[c, TOK]),)))
                c = int(self.nd[c, NEXT])
        return out

    # ---- capacity
    def _reserve_pool(self, extra: int) -> None:
        if self.pool_used + extra <= self.pool.size:
            return
        # live sequences are contiguous (FIFO) from the oldest one's offset: slide them to 0 first
        lo = int(self.seq_off[self.live[0]]) if self.live else 0
        used = self.pool_used - lo
        if lo > 0:
            self.pool[:used] = self.pool[lo:self.pool_used].copy()
            self.seq_off[list(self.live)] -= lo
            self.pool_used = used
        if used + extra > self.pool.size:
            bigger = np.zeros(_pow2(2 * (used + extra)), dtype=np.int32)
            bigger[:used] = self.pool[:used]
            self.pool = bigger

    def _grow_nodes(self) -> None:
        """Double the node records and rebuild the hash at twice the new capacity."""
        cap = self.nd.shape[0]
        nd = np.zeros((2 * cap, NCOL), dtype=np.int32)
        nd[:cap] = self.nd
        self.nd = nd
        self.hk = np.full(_pow2(4 * cap), -1, dtype=np.int64)
        self.hv = np.zeros(self.hk.shape[0], dtype=np.int32)
        rehash(self.nd, self.meta, self.hk, self.hv)


def _pow2(x: int) -> int:
    return 1 << max(int(x) - 1, 1).bit_length()
