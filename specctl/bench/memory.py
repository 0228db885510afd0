"""A draft method's extra memory, measured: the bytes of every tensor its proposer holds.

The seed's §4.1 "extra memory" row: draft weights plus the draft's own KV cache and buffers. Walks
the proposer's attributes (modules, dicts, lists, slot objects) and adds up the distinct storages
it reaches, leaving out the target's own tensors (a Medusa head or MTP module that reuses the
target's LM head costs nothing extra for it) and the target runner's KV cache.
"""

from __future__ import annotations

import torch


def _storages(obj, seen: set[int], out: dict[int, int], depth: int = 0) -> None:
    if depth > 8 or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
        return
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        st = obj.untyped_storage()
        out[st.data_ptr()] = st.nbytes()
        return
    if isinstance(obj, torch.nn.Module):
        for t in list(obj.parameters()) + list(obj.buffers()):
            _storages(t, seen, out, depth + 1)
    if isinstance(obj, dict):
        for v in obj.values():
            _storages(v, seen, out, depth + 1)
    elif isinstance(obj, (list, tuple, set)):
        for v in obj:
            _storages(v, seen, out, depth + 1)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        for v in vars(obj).values():
            _storages(v, seen, out, depth + 1)


def tensor_bytes(obj, exclude=()) -> int:
    """Bytes of the distinct tensor storages reachable from ``obj``, less those reachable from any
    of ``exclude`` (e.g. the target model and its runner)."""
    got: dict[int, int] = {}
    _storages(obj, set(), got)
    skip: dict[int, int] = {}
    for e in exclude:
        _storages(e, set(), skip)
    return sum(n for p, n in got.items() if p not in skip and p != 0)
