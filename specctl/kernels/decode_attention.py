"""Row-independent bf16 attention for decode and verification forwards (AVX-512 CPUs, with or without BF16, and AVX2).

``attention(ext, q, k_cache, v_cache, start)`` (``ext``: ``load()``'s build, held by the model's kernel set) with q [B, nh, T, hd] (rows at positions start..start+T-1)
returns [B, T, nh * hd]: row i attends to cache positions [0, start + i], computed exactly as a
one-row call at that position would (``csrc/decode_attention.cpp``). With ``tree``, the rows are a
draft tree and each attends to the prefix and its own ancestors, again as a decode of its path would. ``supports(...)`` says whether
the kernel covers a shape; callers fall back to torch's SDPA otherwise (and for fp32, CUDA, or where
the kernel cannot be built).
"""

from __future__ import annotations

import math

import torch

from specctl.kernels import skinny_linear
from specctl.kernels._build import build


def spec(p: str) -> tuple[str, str, tuple[str, ...], list[str]]:
    """(extension name, source, CPU features, compiler flags) of the build for the skinny linear's path ``p``
    (the same features and flags: "avx512" and "avx2" are its FMA forms)."""
    name, needs, flags = skinny_linear.BUILDS[p]
    return name.replace("skinny_linear", "decode_attention"), "decode_attention.cpp", needs, flags


def load():
    """The build for this CPU's vector path (None: none runs here)."""
    p = skinny_linear.vector_path()
    return None if p is None else build(*spec(p))


def supports(q: torch.Tensor, num_kv_heads: int) -> bool:
    hd = q.shape[-1]
    nh = q.shape[1]
    return (q.dtype is torch.bfloat16 and q.device.type == "cpu" and hd % 32 == 0 and hd <= 256
            and nh % num_kv_heads == 0 and nh // num_kv_heads <= 16)


def attention(ext, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start: int,
              scale: float | None = None, tree: torch.Tensor | None = None) -> torch.Tensor:
    """``tree`` [T, W] bool (T <= W <= start + T): the rows are a draft tree written at slots
    start..start+T-1, and column c of the mask is slot start + T - W + c (the W - T columns before the
    rows are earlier tree nodes already in the cache). Row i sees the prefix [0, start + T - W) and
    the slots c with tree[i, c] (its ancestors and itself, parents first), in that order: bit for
    bit what a one-row decode of its path computes."""
    hd = q.shape[-1]
    return ext.decode_attention(q, k_cache, v_cache, start, scale if scale is not None else 1.0 / math.sqrt(hd), tree)
