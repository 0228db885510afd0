"""The skinny bf16 linear kernel: correct to bf16 rounding, and row-independent (bit for bit)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specctl.kernels import cpu, skinny_linear

needs_kernel = pytest.mark.skipif(not skinny_linear.available(), reason=cpu.why_not(cpu.AVX512, built=False))


@needs_kernel
@pytest.mark.parametrize("K", [64, 576, 1000])  # 1000: a tail that is not a multiple of 32
@pytest.mark.parametrize("bias", [False, True])
def test_matches_fp32_reference(K, bias):
    g = torch.Generator().manual_seed(K)
    N = 300
    w = torch.randn(N, K, generator=g).bfloat16()
    b = torch.randn(N, generator=g).bfloat16() if bias else None
    for M in (1, 3, 11, 16, 17, 45):
        x = torch.randn(M, K, generator=g).bfloat16()
        y = skinny_linear.load().skinny_linear(x, w, b)
        ref = x.float() @ w.float().T + (b.float() if bias else 0)
        # one bf16 rounding of an fp32 sum: within 2 ulp of bf16 (fp32 summation order differs)
        tol = ref.abs() * 2 ** -7 + 1e-3
        assert y.dtype == torch.bfloat16 and y.shape == (M, N)
        assert ((y.float() - ref).abs() <= tol).all()


@needs_kernel
@pytest.mark.parametrize("K", [1536, 1000, 4160])  # a row alone reads rows of K < 4096 one by one, longer 4 at a time
def test_rows_are_independent_bit_for_bit(K):
    """A row computed among M rows equals the same row computed alone, for any M (the kernel tiles
    rows by 16; on AVX2 from 20 rows on the blocked GEMM takes them, 128 at a time): verification, draft trees,
    batches and prompts == decode."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(517, K, generator=g).bfloat16()
    b = torch.randn(517, generator=g).bfloat16()
    x = torch.randn(261, K, generator=g).bfloat16()
    alone = torch.cat([skinny_linear.load().skinny_linear(x[i:i + 1], w, b) for i in range(261)])
    for M in list(range(1, 18)) + [19, 20, 21, 31, 32, 33, 64, 100, 261]:
        assert torch.equal(skinny_linear.load().skinny_linear(x[:M], w, b), alone[:M]), M


@needs_kernel
def test_a_kernel_set_with_the_kernel_takes_it_for_any_rows():
    from specctl.kernels.select import KernelSet

    g = torch.Generator().manual_seed(1)
    wb = torch.randn(40, 64, generator=g).bfloat16()
    xb = torch.randn(3, 40, 64, generator=g).bfloat16()  # 120 rows
    ks = KernelSet(skinny_linear.path(), linear=skinny_linear.load())
    assert torch.equal(ks.dense(xb, wb), skinny_linear.load().skinny_linear(xb.reshape(120, 64), wb, None).view(3, 40, 40))


def test_a_kernel_set_takes_torch_outside_its_domain():
    from specctl.kernels.select import TORCH, KernelSet

    g = torch.Generator().manual_seed(1)
    w = torch.randn(40, 64, generator=g)
    x = torch.randn(2, 5, 64, generator=g)
    ks = KernelSet("avx512_bf16", linear=skinny_linear.load())
    torch.testing.assert_close(ks.dense(x, w), F.linear(x, w))  # fp32: torch's path
    xb, wb = torch.randn(32, 64, generator=g).bfloat16(), w.bfloat16()
    assert torch.equal(TORCH.dense(xb, wb), F.linear(xb, wb))  # a set without the kernel: torch's path


@pytest.mark.parametrize("path", ["avx512", "avx2"])
def test_fma_form_equals_avx512_bf16_bit_for_bit(path):
    """The "avx512" build (Intel Skylake-SP to Ice Lake) and the "avx2" build (AMD Zen 2/3, Intel Haswell
    to Comet Lake) compute what the "avx512_bf16" build computes, bit for bit, for every row count and K
    tail, over values spanning 2^-40..2^40 (all flush subnormals as specctl's runtime runs them)."""
    from tests.conftest import fma_form

    fma = fma_form(skinny_linear, path)
    torch.set_flush_denormal(True)  # torch has no getter for the mode: set, then cleared again below
    try:
        g = torch.Generator().manual_seed(7)
        for K in (32, 1000, 1536):
            w = (torch.randn(203, K, generator=g) * torch.exp2(torch.randint(-20, 21, (203, K), generator=g))).bfloat16()
            b = torch.randn(203, generator=g).bfloat16()
            for M in (1, 2, 4, 5, 8, 16, 17, 33, 46):
                x = (torch.randn(M, K, generator=g) * torch.exp2(torch.randint(-20, 21, (M, K), generator=g))).bfloat16()
                assert torch.equal(fma.skinny_linear(x, w, b), skinny_linear.load().skinny_linear(x, w, b)), (K, M)
    finally:
        torch.set_flush_denormal(False)
