"""Which bf16 path the kernels add up to on this CPU, and a way to hide CPU features for a while.

``bf16_path()`` asks the kernel modules (``amx_linear``, ``skinny_linear``) whether they load here;
``hidden(*names)`` makes the CPU look as if it lacked ``names`` (tests and benchmarks run the
AVX512-BF16, AVX2 and torch paths on one machine). Above the kernel modules, which ask only
``specctl.kernels.cpu``.
"""

from __future__ import annotations

from contextlib import contextmanager

from specctl.kernels import cpu


def bf16_path() -> str:
    """"amx", "avx512_bf16", "avx512", "avx2" or "torch": the bf16 path that the CPU's features select (and the
    compiler allows: a kernel that cannot build counts as absent)."""
    from specctl.kernels import amx_linear, skinny_linear

    if amx_linear.available():
        return "amx"
    return skinny_linear.path() or "torch"


def _kernel_modules():
    from specctl.kernels import amx_linear, decode_attention, decode_layer, skinny_linear

    return (amx_linear, decode_attention, decode_layer, skinny_linear)


@contextmanager
def hidden(*names: str):
    """Within the block, the CPU looks as if it lacked ``names`` (e.g. ``"amx_bf16"``): the kernel
    loaders answer again, and models loaded inside take that CPU's path. Restored on exit."""
    mods = _kernel_modules()
    saved = [(m, m._ext, m._tried) for m in mods]
    from specctl.kernels import skinny_linear

    enabled, before = skinny_linear.ENABLED, set(cpu._hidden)
    cpu._hidden.update(names)
    for m in mods:
        m._ext, m._tried = None, False
    try:
        yield
    finally:
        cpu._hidden.clear()
        cpu._hidden.update(before)
        for m, ext, tried in saved:
            m._ext, m._tried = ext, tried
        skinny_linear.ENABLED = enabled
