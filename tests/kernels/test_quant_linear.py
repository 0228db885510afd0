"""The GGUF quantized linear kernel: every type on every path this CPU runs, against gguf-py's
dequantize-then-matmul (the reference), and row-independent bit for bit (batch invariance).

Tolerance (float paths): the kernel sums in fp32 in its own order, the reference in fp64 over the same
weights, so |y - ref| <= 2^-20 * sum_k |x_k w_k| (~16 fp32 ulps of the magnitudes summed; a single wrong
weight in 4096 shows as ~2^-12). A bf16 output adds one bf16 rounding (2^-8 relative).

The int8 paths (``ql.INT8_PATHS``) round x to int8 first (per row, per 32 values: d = max|x| / 127, q =
round-half-even(x * (127 / max|x|)), llama.cpp's Q8_0), so they are checked in three steps:
1. ``quantize_x`` equals a numpy quantizer bit for bit, and |x - q d| <= d (1/2 + 2^-15) (the fp32
   roundings of d and 1/d add < 2.5e-5 d to the half step).
2. y against the fp64 reference over those x values, x^ = q d, and the weights split as the kernel
   multiplies them, w = s * c + o (``components``: unsigned codes c, Q8_0's as c + 128; the offset o:
   Q4_0's -8 d, Q4_1's m, Q4_K's -dmin m, ...). Every product the kernel forms is exact (int8 codes in
   int32) up to its two fp32 scale roundings, and each lane sums about 15 fp32 terms (one a 256-value
   chunk, 5 within one, the 16-lane reduce) for the K here, so |y - ref| <= 2^-20 * sum_k |x^_k| (|s_k
   c_k| + |o_k|): 16 ulps of the magnitudes it sums, the offset terms included (it sums them apart).
   The split is itself checked against gguf-py's dequantize (to fp32 rounding).
3. y against the fp32-x reference x @ W^T: the above plus sum_k |w_k| |x_k - x^_k| (the x rounding,
   at most max|x_g| / 254 a value): what x's int8 rounding costs, and no more.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specctl.kernels import cpu
from specctl.kernels import quant_linear as ql

gguf = pytest.importorskip("gguf")

TYPES = list(ql.TYPES)
FLOAT_PATHS = [p for p in ql.PATHS if p not in ql.INT8_PATHS]
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
@pytest.mark.parametrize("path", FLOAT_PATHS)
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
    """Blocks as llama.cpp writes them (gguf-py's quantizer on Gaussian weights), on bf16's path."""
    path = ql.best_path(torch.bfloat16)
    if path is None:
        pytest.skip("no C++ compiler here")
    g = torch.Generator().manual_seed(3)
    K = 1024 + 64
    wf = torch.randn(40, K, generator=g)
    b = torch.from_numpy(gguf.quants.quantize(wf.numpy(), gguf.GGMLQuantizationType[qtype]))
    x = torch.randn(3, K, generator=g).bfloat16()
    y = ql.linear(x, [(b, qtype)], K, out_fp32=True)
    if path in ql.INT8_PATHS:
        check_int8(y, x, b, qtype, None)
    else:
        check_close(y, x, reference(b, qtype), None)


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


# ---- the int8 paths

def quantize_x_numpy(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """x [M, K] -> (codes [M, K] int8, scales [M, K / 32] fp32), in fp32 as the kernel does."""
    xf = x.float().numpy().reshape(x.shape[0], -1, 32)
    amax = np.abs(xf).max(-1)
    d = (amax / np.float32(127)).astype(np.float32)
    inv = np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax > 0).astype(np.float32)
    q = np.rint((xf * inv[..., None]).astype(np.float32)).astype(np.int8)
    return q.reshape(x.shape), d


def components(blocks: torch.Tensor, qtype: str, K: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The weights [N, K] as the int8 paths split them, w = s * c + o (float64): c the unsigned code
    vpdpbusd multiplies, s its scale, o the offset (multiplied by the sums of x)."""
    _, qk, nb = ql.TYPES[qtype]
    B = blocks.numpy().reshape(blocks.shape[0], K // qk, nb)
    f16 = lambda o: B[:, :, o:o + 2].copy().view(np.float16)[..., 0].astype(np.float64)[..., None]  # noqa: E731
    if qtype in ("Q4_0", "Q4_1", "Q5_0"):
        qs = B[:, :, {"Q4_0": 2, "Q4_1": 4, "Q5_0": 6}[qtype]:][:, :, :16].astype(np.int64)
        c = np.concatenate([qs & 15, qs >> 4], -1)
        if qtype == "Q5_0":
            qh = B[:, :, 2:6].copy().view(np.uint32).astype(np.int64)
            c = c | (((qh >> np.arange(32)) & 1) << 4)
        d = f16(0)
        s, o = d * np.ones(32), {"Q4_0": -8 * d, "Q4_1": f16(2), "Q5_0": -16 * d}[qtype] * np.ones(32)
    elif qtype == "Q8_0":
        c = B[:, :, 2:].view(np.int8).astype(np.int64) + 128
        d = f16(0)
        s, o = d * np.ones(32), -128 * d * np.ones(32)
    elif qtype == "Q4_K":
        d, dmin, sc = f16(0), f16(2), B[:, :, 4:16].astype(np.int64)
        j = np.arange(8)
        scale = np.where(j < 4, sc[..., j % 4] & 63, (sc[..., (j % 4) + 8] & 15) | ((sc[..., j % 4] >> 6) << 4))
        mins = np.where(j < 4, sc[..., (j % 4) + 4] & 63, (sc[..., (j % 4) + 8] >> 4) | ((sc[..., (j % 4) + 4] >> 6) << 4))
        qs = B[:, :, 16:].astype(np.int64).reshape(*B.shape[:2], 4, 32)
        c = np.stack([qs & 15, qs >> 4], 3).reshape(*B.shape[:2], 256)  # chunk c: sub-blocks 2c (low), 2c+1 (high)
        s, o = np.repeat(d * scale, 32, -1), np.repeat(-(dmin * mins), 32, -1)
    else:  # Q6_K
        ql_, qh = B[:, :, :128].astype(np.int64).reshape(*B.shape[:2], 2, 64), B[:, :, 128:192].astype(np.int64)
        qh = qh.reshape(*B.shape[:2], 2, 32)
        lo, hi = ql_[..., :32], ql_[..., 32:]
        c = np.concatenate([(lo & 15) | ((qh & 3) << 4), (hi & 15) | (((qh >> 2) & 3) << 4),
                            (lo >> 4) | (((qh >> 4) & 3) << 4), (hi >> 4) | (((qh >> 6) & 3) << 4)], -1)
        c = c.reshape(*B.shape[:2], 256)
        s = np.repeat(f16(208) * B[:, :, 192:208].view(np.int8).astype(np.float64), 16, -1)
        o = -32 * s
    return (x.reshape(blocks.shape[0], K) for x in (s, c.astype(np.float64), o))


def check_int8(y: torch.Tensor, x: torch.Tensor, blocks: torch.Tensor, qtype: str, bias: torch.Tensor | None):
    """Steps 2 and 3 of the module docstring."""
    K = x.shape[-1]
    q, d = quantize_x_numpy(x)
    xh = (q.reshape(x.shape[0], -1, 32) * d[..., None].astype(np.float64)).reshape(x.shape)
    s, c, o = components(blocks, qtype, K)
    w = s * c + o
    gw = reference(blocks, qtype).double().numpy()
    assert np.all(np.abs(w - gw) <= 2.0 ** -23 * (np.abs(s * c) + np.abs(o))), "the split is not gguf-py's weights"
    b = 0 if bias is None else bias.double().numpy()
    ref = xh @ w.T + b
    tol = 2.0 ** -20 * (np.abs(xh) @ (np.abs(s * c) + np.abs(o)).T + np.abs(b)) + 1e-30
    if y.dtype is torch.bfloat16:
        tol = tol + np.abs(ref) * 2.0 ** -8
    err = np.abs(y.double().numpy() - ref)
    assert (err <= tol).all(), f"vs the int8-x reference: max error {(err / tol).max():.3g} x the tolerance"
    xf = x.double().numpy()
    err = np.abs(y.double().numpy() - (xf @ gw.T + b))
    tol = tol + np.abs(xf - xh) @ np.abs(gw).T
    assert (err <= tol).all(), f"vs the fp32-x reference: max error {(err / tol).max():.3g} x the tolerance"


@pytest.mark.parametrize("path", ql.INT8_PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_x_is_rounded_per_32_values_as_numpy_does(path, dtype):
    path_or_skip(path)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(7, 1024, generator=g) * torch.rand(7, 1024, generator=g) ** 4  # groups of every spread
    x[0, :32] = 0  # an all-zero group: d = 0, codes 0
    x[1, 32:64] *= 1e4
    x = x.to(dtype)
    q, d = ql.quantize_x(x)
    qn, dn = quantize_x_numpy(x)
    assert np.array_equal(q.numpy(), qn) and np.array_equal(d.numpy(), dn)
    assert q.abs().max().item() <= 127
    step = np.repeat(dn, 32, -1)
    assert np.all(np.abs(x.double().numpy() - qn * step) <= step * (0.5 + 2.0 ** -15))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", ql.INT8_PATHS)
@pytest.mark.parametrize("qtype", TYPES)
def test_int8_path_matches_the_int8_x_reference(qtype, path, dtype):
    path_or_skip(path)
    N, K = shape_for(qtype)
    b = random_blocks(qtype, N, K, seed=1)
    g = torch.Generator().manual_seed(2)
    bias = torch.randn(N, generator=g)
    for M in (1, 2, 5, 9, 16):
        x = torch.randn(M, K, generator=g).to(dtype)
        check_int8(ql.linear(x, [(b, qtype)], K, path=path, out_fp32=True), x, b, qtype, None)
        y = ql.linear(x, [(b, qtype)], K, bias=bias.to(dtype), path=path)
        assert y.dtype is dtype and y.shape == (M, N)
        check_int8(y, x, b, qtype, bias.to(dtype))


@pytest.mark.parametrize("path", ql.INT8_PATHS)
def test_int8_path_on_whole_chunks_and_outliers(path):
    """K a multiple of the 256-value chunk (no padded tail), and x with an outlier channel (the
    activations of real models have them): its 32-group alone gets a coarse scale."""
    path_or_skip(path)
    g = torch.Generator().manual_seed(12)
    for qtype in TYPES:
        K = 1536
        b = random_blocks(qtype, 24, K, seed=13)
        x = torch.randn(3, K, generator=g)
        x[:, 100] = 300.0
        x = x.bfloat16()
        check_int8(ql.linear(x, [(b, qtype)], K, path=path, out_fp32=True), x, b, qtype, None)


def test_parts_side_by_side_equal_separate_calls():
    """q|k|v of different types in one call = each part alone, concatenated (bit for bit), at 1 and 2
    x rows (where a call takes several weight rows at once; the parts' row counts are not multiples of
    that), at 6 and at 37 (past 16 rows x is taken in blocks under groups of 16 weight rows)."""
    path = ql.best_path(torch.bfloat16)
    if path is None:
        pytest.skip("no C++ compiler here")
    K = 512
    parts = [(random_blocks("Q4_K", 61, K, seed=7), "Q4_K"), (random_blocks("Q6_K", 13, K, seed=8), "Q6_K"),
             (random_blocks("Q8_0", 7, K, seed=9), "Q8_0")]
    x = torch.randn(2, 3, K, generator=torch.Generator().manual_seed(10)).bfloat16()  # [B, T, K]
    y = ql.linear(x, parts, K)
    assert y.shape == (2, 3, 81)
    assert torch.equal(y, torch.cat([ql.linear(x, [p], K) for p in parts], -1))
    many = torch.randn(37, K, generator=torch.Generator().manual_seed(11)).bfloat16()  # a prefill's rows: x in blocks
    for rows in (x[0, :1], x[0, :2], many):                                           # under groups of weight rows
        y = ql.linear(rows, parts, K)                                                 # that straddle the parts
        assert torch.equal(y, torch.cat([ql.linear(rows, [p], K) for p in parts], -1))
        assert torch.equal(y, torch.cat([ql.linear(r[None], parts, K) for r in rows]))


# ---- the packed (AMX-INT8) path

@pytest.mark.parametrize("qtype", TYPES)
def test_pack_is_lossless(qtype):
    """Panels hold every bit of the GGUF rows: unpack(pack(rows)) == rows, with a padded chunk tail."""
    path_or_skip("amx_int8")
    K = 512 if ql.TYPES[qtype][1] == 256 else 352  # 352: a chunk of 256 and a tail of 96
    b = random_blocks(qtype, 48, K, seed=21)
    p = ql.pack(b, qtype, K)
    assert p.shape[0] == 3 and torch.equal(ql.unpack(p, qtype, K), b)


@pytest.mark.parametrize("qtype", TYPES)
def test_packed_path_takes_one_arithmetic_for_every_row_count(qtype):
    """One row (vpdpbusd against x broadcast), few rows (a tile row per x row and group of a 64-code span)
    and many (a tile row per x row, a tile per group; past 16 rows, x in blocks of 16) compute the same
    exact int32 dots and the same fp32 sums: row r of any call equals it alone, bit for bit, in each of the
    row counts where the way changes (Q4 types 8/9 rows, Q6_K 4/5, 16/17)."""
    path_or_skip("amx_int8")
    K = 768 if ql.TYPES[qtype][1] == 256 else 352
    b = random_blocks(qtype, 32, K, seed=22)
    x = torch.randn(20, K, generator=torch.Generator().manual_seed(23)).bfloat16()
    alone = torch.cat([ql.linear(x[i:i + 1], [(b, qtype)], K, path="amx_int8", out_fp32=True) for i in range(20)])
    for M in (2, 4, 5, 8, 9, 16, 17, 20):
        assert torch.equal(ql.linear(x[:M], [(b, qtype)], K, path="amx_int8", out_fp32=True), alone[:M]), M
    check_int8(alone, x, b, qtype, None)


def test_refuses_bad_shapes():
    path = ql.best_path(torch.float32)
    if path is None:
        pytest.skip("no C++ compiler here")
    b = random_blocks("Q8_0", 4, 64)
    with pytest.raises(RuntimeError, match="bytes of this type"):
        ql.linear(torch.randn(1, 96), [(b, "Q8_0")], 96)
    with pytest.raises(ValueError, match="multiples of 256"):
        ql.row_bytes("Q4_K", 300)
