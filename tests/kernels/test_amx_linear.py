"""The AMX bf16 linear: correct to bf16 rounding, pack/unpack round trip, rows independent bit for bit."""

from __future__ import annotations

import pytest
import torch

from specctl.kernels import amx_linear, cpu

needs_amx = pytest.mark.skipif(not amx_linear.available(), reason=cpu.why_not(cpu.AMX, built=False))


def test_pack_unpack_round_trip():
    w = torch.randn(48, 96).bfloat16()
    wp = amx_linear.pack(w)
    assert wp.shape == (3, 3, 16, 16, 2)
    assert torch.equal(amx_linear.unpack(wp), w)
    # element (nb, kb, kp, n, j) = w[16 nb + n, 32 kb + 2 kp + j]
    assert wp[1, 2, 5, 7, 1] == w[16 + 7, 64 + 10 + 1]
    assert amx_linear.packable(w) and not amx_linear.packable(torch.randn(40, 96).bfloat16())


@needs_amx
@pytest.mark.parametrize("bias", [False, True])
def test_matches_fp32_reference(bias):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 96, generator=g).bfloat16()
    b = torch.randn(64, generator=g).bfloat16() if bias else None
    x = torch.randn(3, 5, 96, generator=g).bfloat16()
    y = amx_linear.linear(amx_linear.load(), x, amx_linear.pack(w), b)
    ref = x.float() @ w.float().T + (b.float() if bias else 0)
    assert y.shape == (3, 5, 64) and y.dtype == torch.bfloat16
    assert ((y.float() - ref).abs() <= ref.abs() * 2 ** -7 + 1e-3).all()


@needs_amx
def test_rows_are_independent_bit_for_bit():
    g = torch.Generator().manual_seed(1)
    wp = amx_linear.pack(torch.randn(160, 320, generator=g).bfloat16())
    b = torch.randn(160, generator=g).bfloat16()
    x = torch.randn(40, 320, generator=g).bfloat16()
    full = amx_linear.linear(amx_linear.load(), x, wp, b)
    alone = torch.cat([amx_linear.linear(amx_linear.load(), x[i:i + 1], wp, b) for i in range(40)])
    assert torch.equal(full, alone)
    for m in (2, 11, 16, 17, 33):
        assert torch.equal(amx_linear.linear(amx_linear.load(), x[:m], wp, b), full[:m])


def test_arena_hands_out_aligned_views_of_one_buffer():
    """Arena: views at 64-byte offsets of one buffer of exactly the asked size (ordinary pages below
    HUGE_MIN: no spare huge page for a small total); asking past its end is refused."""
    shapes = [(3, 5), (16, 40), (1,)]
    arena = amx_linear.Arena(sum(amx_linear.Arena.size(s) for s in shapes))
    views = [arena.take(s) for s in shapes]
    assert [tuple(v.shape) for v in views] == shapes
    assert all(v.data_ptr() % amx_linear.ALIGN == 0 for v in views)
    assert {v.untyped_storage().data_ptr() for v in views} == {arena.buf.untyped_storage().data_ptr()}
    assert arena.buf.untyped_storage().nbytes() == arena.nbytes == 64 + 640 + 64
    for v, s in zip(views, shapes):
        v.fill_(len(s))
    assert views[0].sum() == 30 and views[1].unique().tolist() == [2]
    with pytest.raises(ValueError, match="spent"):
        arena.take((1,))
