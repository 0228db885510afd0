"""bf16 linear on Intel AMX with weights packed once at load (decode, verification and prefill).

``pack(w)`` turns w [N, K] into AMX B tiles [N/16, K/32, 16, 16, 2] (N % 16 == 0, K % 32 == 0);
``linear(ext, x, wp, b)`` computes F.linear(x, w, b) for bf16 x of any number of rows. Each output is
accumulated in a fixed order whatever the row count, so the rows of a verification forward equal,
bit for bit, the same rows decoded one at a time. ``load()`` compiles ``csrc/amx_linear.cpp`` once
(torch cpp_extension, cached) and returns None where AMX cannot run (no amx_bf16 CPU, no compiler,
kernel refused the tile state): callers then keep plain weights and F.linear.
"""

from __future__ import annotations

import math
import mmap
import sys

import torch

from specctl.kernels._build import build

FLAGS = ["-mamx-tile", "-mamx-bf16", "-mavx512f", "-mavx512bf16", "-mavx512vl"]
# (extension name, source, CPU features, compiler flags): what load() builds (specctl.kernels.prebuild builds it ahead)
SPEC = ("specctl_amx_linear", "amx_linear.cpp", ("amx_bf16", "amx_tile", "avx512_bf16"), FLAGS)


def load():
    """The compiled extension with AMX tile state granted, or None where AMX cannot run here."""
    ext = build(*SPEC)
    if ext is not None and not ext.amx_init():  # asks the OS for tile state (again: a no-op once granted)
        print("specctl: the OS refused AMX tile state; using torch's linear", file=sys.stderr)
        return None
    return ext


def available() -> bool:
    return load() is not None


def packable(w: torch.Tensor) -> bool:
    return w.dim() == 2 and w.shape[0] % 16 == 0 and w.shape[1] % 32 == 0 and w.dtype == torch.bfloat16


_HUGE = 2 << 20  # a transparent huge page


def huge_empty(shape: tuple[int, ...], dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """An uninitialised CPU tensor on transparent huge pages (where the kernel grants them).

    Weights streamed once per token want huge pages: one TLB entry per 2 MiB instead of per 4 KiB,
    so the page walks do not interrupt the stream (the kernel reads ~28 GB/s from them here, a few
    GB/s more than from 4 KiB pages). A private anonymous mapping with MADV_HUGEPAGE; the tensor
    keeps the mapping alive."""
    numel = 1
    for s in shape:
        numel *= s
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    mm = mmap.mmap(-1, nbytes + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mm, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass  # THP off: ordinary pages, same results
    raw = torch.frombuffer(mm, dtype=torch.uint8)  # holds a reference to mm
    off = (-raw.data_ptr()) % _HUGE
    return raw[off:off + nbytes].view(dtype).view(shape)


ALIGN = 64  # bytes: each Arena view starts on a cache line (torch.empty's alignment; the kernels' weight loads are unaligned)
HUGE_MIN = 32 * _HUGE  # an Arena this size or more goes on huge pages: the mapping's one spare huge page is <= 3 %


class Arena:
    """One buffer of ``nbytes`` that many weight tensors share as views (``take``), each at an ``ALIGN``-byte
    offset: a model's parts in one huge-page mapping (``huge_empty``) instead of one mapping each.

    A mapping of its own per tensor costs a whole huge page past the tensor's end (and ``huge_empty`` maps
    one spare page for alignment): SmolLM2-135M's 211 quantized parts held 117 MiB of data in 539 MiB of
    storage that way. Here the spare is one page for the whole model, and a total under ``HUGE_MIN`` takes
    ordinary pages (torch.empty) so a small model's storage stays its data. Sized by the caller up front
    (``size``)."""

    def __init__(self, nbytes: int):
        self.nbytes, self.used = int(nbytes), 0
        self.buf = huge_empty((self.nbytes,), torch.uint8) if self.nbytes >= HUGE_MIN else \
            torch.empty(self.nbytes, dtype=torch.uint8)  # [nbytes]

    @staticmethod
    def size(shape: tuple[int, ...], dtype: torch.dtype = torch.uint8) -> int:
        """Bytes a ``take(shape, dtype)`` uses, its alignment padding included."""
        n = torch.empty((), dtype=dtype).element_size()
        for s in shape:
            n *= s
        return n + -n % ALIGN

    def take(self, shape: tuple[int, ...], dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """An uninitialised view of the next ``size(shape, dtype)`` bytes."""
        n = self.size(shape, dtype)
        if self.used + n > self.nbytes:
            raise ValueError(f"the arena's {self.nbytes} bytes are spent ({self.used} used, {n} asked)")
        view = self.buf[self.used:self.used + n]  # n: a multiple of ALIGN, so of the dtype's size
        self.used += n
        return view.view(dtype)[:math.prod(shape)].view(shape)


def packed_shape(N: int, K: int) -> tuple[int, int, int, int, int]:
    """``pack``'s output shape for a weight [N, K] (as many elements as the weight)."""
    return (N // 16, K // 32, 16, 16, 2)


def pack(w: torch.Tensor, huge: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """w [N, K] -> [N/16, K/32, 16, 16, 2]: element (nb, kb, kp, n, j) = w[16 nb + n, 32 kb + 2 kp + j].

    ``out``: the packed copy's place (``packed_shape``, w's dtype; a model's weights share one huge-page
    ``Arena``). ``huge``: a huge-page mapping of its own (a whole spare huge page: for one large tensor only)."""
    N, K = w.shape
    tiles = w.view(N // 16, 16, K // 32, 16, 2).permute(0, 2, 3, 1, 4)
    if out is None and not huge:
        return tiles.contiguous()
    if out is None:
        out = huge_empty(tuple(tiles.shape), w.dtype)
    elif tuple(out.shape) != packed_shape(N, K) or out.dtype != w.dtype:
        raise ValueError(f"pack's out is {w.dtype} {list(packed_shape(N, K))}, not {out.dtype} {list(out.shape)}")
    out.copy_(tiles)
    return out


def unpack(wp: torch.Tensor) -> torch.Tensor:
    nb, kb = wp.shape[:2]
    return wp.permute(0, 3, 1, 2, 4).reshape(nb * 16, kb * 32)


def linear(ext, x: torch.Tensor, wp: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] bf16 on CPU, wp packed -> [..., N], through build ``ext`` (``load()``'s)."""
    K = x.shape[-1]
    y = ext.amx_linear(x.reshape(-1, K), wp, b)
    return y.view(*x.shape[:-1], y.shape[-1])
