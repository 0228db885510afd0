"""The kernel set a model runs on (``KernelSet``, resolved once per model), and a way to hide CPU features.

``resolve(mode)`` asks the kernel modules (``amx_linear``, ``skinny_linear``, ``decode_attention``,
``decode_layer``) which builds run on this CPU, as ``specctl.kernels.cpu`` sees it now, and returns them as
one value: the model keeps it (``Transformer.kernels``, each ``Block.kernels``, its typed linears), so what
a model computes with is decided when it loads and never changes under it. ``hidden(*names)`` makes the
CPU look as if it lacked ``names`` for a while (tests and benchmarks resolve the AVX512-BF16, AVX2 and torch
paths on one machine); a model resolved inside keeps that CPU's kernels after. Above the kernel modules,
which ask only ``specctl.kernels.cpu``.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from specctl.kernels import cpu, skinny_linear


@dataclass(frozen=True)
class KernelSet:
    """The C++ builds one model's bf16 CPU forward uses (None: torch's op instead).

    ``path``: "amx" (AMX tiles for every projection, packed at load), "avx512_bf16", "avx512", "avx2" (the
    skinny kernel on row-major weights; the last two its FMA forms, bit for bit the first's results) or
    "torch"; every path but "torch" computes each row as if alone (specctl/kernels/cpu.py)."""

    path: str = "torch"
    linear: Any = None  # skinny_linear's build: every dense bf16 projection (the vector paths)
    amx: Any = None  # amx_linear's build: the AMX-packed projections and LM head
    attention: Any = None  # decode_attention's build: row-independent attention for decode and verify rows
    block: Any = None  # decode_layer's dense build: one call per block for a few rows

    @property
    def exact(self) -> bool:
        """Whether every row is computed as if alone (a row-independent path)."""
        return self.path != "torch"

    def dense(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        """F.linear(x, w, b) for a row-major w [N, K]: through the skinny kernel for bf16 CPU rows where this set
        has it, else torch's."""
        if (self.linear is not None and x.dtype is torch.bfloat16 and x.device.type == "cpu" and x.numel() > 0
                and w.is_contiguous()):
            return skinny_linear.run(self.linear, x, w, b)
        return F.linear(x, w, b)


TORCH = KernelSet()


def resolve(mode: str = "auto") -> KernelSet:
    """The kernels a bf16 CPU model loaded now runs on: ``mode`` "torch" gives torch's; "auto" and "fused"
    the row-independent builds this CPU runs (AMX, else the vector path; torch's where there is none, which
    "fused" callers refuse)."""
    from specctl.kernels import amx_linear, decode_attention, decode_layer

    if mode == "torch":
        return TORCH
    amx = amx_linear.load()
    if amx is not None:
        return KernelSet("amx", amx=amx, attention=decode_attention.load(), block=decode_layer.load())
    linear = skinny_linear.load()
    if linear is None:
        return TORCH
    return KernelSet(skinny_linear.build_path(linear), linear=linear, attention=decode_attention.load(),
                     block=decode_layer.load())


def bf16_path() -> str:
    """"amx", "avx512_bf16", "avx512", "avx2" or "torch": the bf16 path that the CPU's features select (and the
    compiler allows: a kernel that cannot build counts as absent)."""
    return resolve().path


@contextmanager
def hidden(*names: str):
    """Within the block, the CPU looks as if it lacked ``names`` (e.g. ``"amx_bf16"``): kernel sets resolved
    inside (and so models loaded inside) take that CPU's path, and keep it after. Restored on exit."""
    before = set(cpu._hidden)
    cpu._hidden.update(names)
    try:
        yield
    finally:
        cpu._hidden.clear()
        cpu._hidden.update(before)
