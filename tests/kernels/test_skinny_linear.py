"""The skinny bf16 linear kernel: correct to bf16 rounding, and row-independent (bit for bit)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import skinny_linear

needs_kernel = pytest.mark.skipif(not skinny_linear.available(), reason="no avx512_bf16 CPU or no compiler here")


@needs_kernel
@pytest.mark.parametrize("K", [64, 576, 1000])  # 1000: a tail that is not a multiple of 32
@pytest.mark.parametrize("bias", [False, True])
def test_matches_fp32_reference(K, bias):
    g = torch.Generator().manual_seed(K)
    N = 300
    w = torch.randn(N, K, generator=g).bfloat16()
    b = torch.randn(N, generator=g).bfloat16() if bias else None
    for M in (1, 3, 11, 16):
        x = torch.randn(M, K, generator=g).bfloat16()
        y = skinny_linear._ext.skinny_linear(x, w, b)
        ref = x.float() @ w.float().T + (b.float() if bias else 0)
        # one bf16 rounding of an fp32 sum: within 2 ulp of bf16 (fp32 summation order differs)
        tol = ref.abs() * 2 ** -7 + 1e-3
        assert y.dtype == torch.bfloat16 and y.shape == (M, N)
        assert ((y.float() - ref).abs() <= tol).all()


@needs_kernel
def test_rows_are_independent_bit_for_bit():
    """A row computed among M rows equals the same row computed alone: verification == decode."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(517, 1536, generator=g).bfloat16()
    b = torch.randn(517, generator=g).bfloat16()
    x = torch.randn(16, 1536, generator=g).bfloat16()
    alone = torch.cat([skinny_linear._ext.skinny_linear(x[i:i + 1], w, b) for i in range(16)])
    for M in range(1, 17):
        assert torch.equal(skinny_linear._ext.skinny_linear(x[:M], w, b), alone[:M])


def test_linear_falls_back_outside_its_domain():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(40, 64, generator=g)
    x = torch.randn(2, 5, 64, generator=g)
    torch.testing.assert_close(skinny_linear.linear(x, w), F.linear(x, w))  # fp32: torch's path
    xb, wb = torch.randn(32, 64, generator=g).bfloat16(), w.bfloat16()
    assert torch.equal(skinny_linear.linear(xb, wb), F.linear(xb, wb))  # 32 rows: torch's GEMM
