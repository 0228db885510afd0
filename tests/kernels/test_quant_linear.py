"""The GGUF quantized linear kernel: every type on every path this CPU runs, against gguf-py's
dequantize-then-matmul (the reference), and row-independent bit for bit (batch invariance).

Tolerance: the kernel sums in fp32 in its own order, the reference in fp64 over the same weights,
so |y - ref| <= 2^-20 * sum_k |x_k w_k| (~16 fp32 ulps of the magnitudes summed; a single wrong
weight in 4096 shows as ~2^-12). A bf16 output adds one bf16 rounding (2^-8 relative).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels import cpu
from kernels import quant_linear as ql

gguf = pytest.importorskip("gguf")

TYPES = list(ql.TYPES)
FP16_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q8_0": [0], "Q4_K": [0, 2], "Q6_K": [208]}


def path_or_skip(path: str):
    if any(not cpu.has(f) for f in ql.NEEDS[path]):
        pytest.skip(cpu.why_not(ql.NEEDS[path], built=False))
    ext = ql.load(path)
    assert ext is not None, f"the {path} kernel did not build on a CPU that runs it"  # test_build says why
    return path


def random_blocks(qtype: str, N: int, K: int, seed: int = 0) -> torch.Tensor:
    """[N, row_bytes] valid blocks: random bytes everywhere (every quant bit pattern), the fp16
    scale fields set to N(0, 0.01) (random bytes there would be inf/NaN/1e4)."""
    rng = np.random.default_rng(seed)
    _, qk, nbytes = ql.TYPES[qtype]
    b = rng.integers(0, 256, size=(N, K // qk, nbytes), dtype=np.uint8)
    for off in FP16_FIELDS[qtype]:
        half = (rng.standard_normal((N, K // qk)) * 0.01).astype(np.float16)
        b[:, :, off:off + 2] = half.view(np.uint8).reshape(N, K // qk, 2)
    return torch.from_numpy(b.reshape(N, -1))


def reference(blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType[qtype]))  # [N, K] fp32


def shape_for(qtype: str) -> tuple[int, int]:
    """N = 77 (not a multiple of the 8-row parallel grain); K not a multiple of the 1024-weight unit."""
    return 77, (416 if ql.TYPES[qtype][1] == 32 else 1280)


def check_close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None):
    ref = x.double() @ w.double().T + (0 if bias is None else bias.double())
    tol = 2.0 ** -20 * (x.double().abs() @ w.double().abs().T) + 1e-30
    if y.dtype is torch.bfloat16:
        tol = tol + ref.abs() * 2.0 ** -8
    err = (y.double() - ref).abs()
    assert (err <= tol).all(), f"max error {(err / tol).max().item():.3g} x the tolerance"


@pytest.mark.parametrize("path", ql.PATHS)
@pytest.mark.parametrize("qtype", TYPES)
def test_dequantize_equals_gguf_bit_for_bit(qtype, path):
    path_or_skip(path)
    N, K = shape_for(qtype)
    b = random_blocks(qtype, N, K)
    assert torch.equal(ql.dequantize(b, qtype, K, path=path), reference(b, qtype))
    assert torch.equal(ql.dequantize(b, qtype, K, torch.bfloat16, path=path), reference(b, qtype).bfloat16())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", ql.PATHS)
@pytest.mark.parametrize("qtype", TYPES)
def test_matches_dequantize_then_matmul(qtype, path, dtype):
    path_or_skip(path)
    N, K = shape_for(qtype)
    b = random_blocks(qtype, N, K, seed=1)
    w = reference(b, qtype)
    g = torch.Generator().manual_seed(2)
    bias = torch.randn(N, generator=g)
    for M in (1, 2, 5, 16):
        x = torch.randn(M, K, generator=g).to(dtype)
        check_close(ql.linear(x, [(b, qtype)], K, path=path, out_fp32=True), x, w, None)
        y = ql.linear(x, [(b, qtype)], K, bias=bias.to(dtype), path=path)
        assert y.dtype is dtype and y.shape == (M, N)
        check_close(y, x, w, bias.to(dtype))


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0"])
def test_blocks_quantized_by_gguf(qtype):
    """Blocks as llama.cpp writes them (gguf-py's quantizer on Gaussian weights)."""
    path = ql.best_path(torch.bfloat16)
    if path is None:
        pytest.skip("no C++ compiler here")
    g = torch.Generator().manual_seed(3)
    K = 1024 + 64
    wf = torch.randn(40, K, generator=g)
    b = torch.from_numpy(gguf.quants.quantize(wf.numpy(), gguf.GGMLQuantizationType[qtype]))
    x = torch.randn(3, K, generator=g).bfloat16()
    check_close(ql.linear(x, [(b, qtype)], K, out_fp32=True), x, reference(b, qtype), None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", ql.PATHS)
@pytest.mark.parametrize("qtype", TYPES)
def test_rows_are_independent_bit_for_bit(qtype, path, dtype):
    """Row r of an M-row call equals the 1-row call, for M across the register tiles (4 and 8 rows):
    verification, batches and trees compute exactly what decoding computes."""
    path_or_skip(path)
    N, K = shape_for(qtype)
    b = random_blocks(qtype, N, K, seed=4)
    bias = torch.randn(N, generator=torch.Generator().manual_seed(5)).to(dtype)
    x = torch.randn(20, K, generator=torch.Generator().manual_seed(6)).to(dtype)
    alone = torch.cat([ql.linear(x[i:i + 1], [(b, qtype)], K, bias=bias, path=path) for i in range(20)])
    for M in (2, 3, 4, 5, 8, 9, 16, 17, 20):
        assert torch.equal(ql.linear(x[:M], [(b, qtype)], K, bias=bias, path=path), alone[:M]), M


def test_parts_side_by_side_equal_separate_calls():
    """q|k|v of different types in one call = each part alone, concatenated (bit for bit)."""
    path = ql.best_path(torch.bfloat16)
    if path is None:
        pytest.skip("no C++ compiler here")
    K = 512
    parts = [(random_blocks("Q4_K", 64, K, seed=7), "Q4_K"), (random_blocks("Q6_K", 16, K, seed=8), "Q6_K"),
             (random_blocks("Q8_0", 16, K, seed=9), "Q8_0")]
    x = torch.randn(2, 3, K, generator=torch.Generator().manual_seed(10)).bfloat16()  # [B, T, K]
    y = ql.linear(x, parts, K)
    assert y.shape == (2, 3, 96)
    assert torch.equal(y, torch.cat([ql.linear(x, [p], K) for p in parts], -1))


def test_refuses_bad_shapes():
    path = ql.best_path(torch.float32)
    if path is None:
        pytest.skip("no C++ compiler here")
    b = random_blocks("Q8_0", 4, 64)
    with pytest.raises(RuntimeError, match="bytes of this type"):
        ql.linear(torch.randn(1, 96), [(b, "Q8_0")], 96)
    with pytest.raises(ValueError, match="multiples of 256"):
        ql.row_bytes("Q4_K", 300)
