"""The suffix trie's flat storage (``specctl.kernels.suffix``): the node record's columns, the meta
entries, and the open-addressing hash that finds a node's child by (parent, token), as numba kernels.
"""

from __future__ import annotations

import numpy as np
from numba import njit

# node record columns
TOK, PAR, CNT, DEP, CHILD, NEXT, PREV, RSEQ, RPOS, BEST = range(10)
NCOL = 10
DIRTY = -2  # BEST of a node whose children's counts fell (eviction): recomputed when next needed
# meta entries
M_HIGH, M_FREE, M_NFREE, M_LIVE, M_HFILL = range(5)
NMETA = 8
ROOT = 0
_EMPTY = np.int64(-1)


# ------------------------------------------------------------------------------ hash of children


@njit(cache=True, inline="always")
def _key(parent, tok):
    return (np.int64(parent) << 31) | np.int64(tok)


@njit(cache=True, inline="always")
def _slot(key, mask):
    h = np.uint64(key) * np.uint64(0x9E3779B97F4A7C15)
    return np.int64((h ^ (h >> np.uint64(29))) & np.uint64(mask))


@njit(cache=True)
def _hfind(hk, hv, key):
    mask = hk.shape[0] - 1
    i = _slot(key, mask)
    while hk[i] != -1:
        if hk[i] == key:
            return hv[i]
        i = (i + 1) & mask
    return -1


@njit(cache=True)
def _hinsert(hk, hv, meta, key, val):
    mask = hk.shape[0] - 1
    i = _slot(key, mask)
    while hk[i] != -1:
        i = (i + 1) & mask
    hk[i] = key
    hv[i] = val
    meta[M_HFILL] += 1


@njit(cache=True)
def _hdelete(hk, hv, meta, key):
    """Linear probing with backward-shift deletion (no tombstones)."""
    mask = hk.shape[0] - 1
    i = _slot(key, mask)
    while hk[i] != key:
        if hk[i] == -1:
            return
        i = (i + 1) & mask
    j = i
    while True:
        j = (j + 1) & mask
        if hk[j] == -1:
            break
        home = _slot(hk[j], mask)
        # move hk[j] into the hole at i unless its home lies cyclically in (i, j]
        if (j > i and (home <= i or home > j)) or (j < i and home <= i and home > j):
            hk[i] = hk[j]
            hv[i] = hv[j]
            i = j
    hk[i] = -1
    meta[M_HFILL] -= 1


@njit(cache=True)
def rehash(nd, meta, hk, hv):
    """Rebuild the child hash from the node records into empty (hk = -1) tables."""
    meta[M_HFILL] = 0
    for x in range(1, meta[M_HIGH]):
        if nd[x, CNT] > 0:
            _hinsert(hk, hv, meta, _key(nd[x, PAR], nd[x, TOK]), x)
