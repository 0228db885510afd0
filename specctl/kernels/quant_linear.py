"""Linear layers over GGUF quantized weights, run as they are stored (no dequantized copy).

``linear(x, parts, K, bias)`` computes x @ W^T where W is one or more *parts* ``(blocks, type)``:
``blocks`` [N_p, K / QK * block_bytes] uint8, the raw GGUF rows of one ggml type (``TYPES``), the
parts' outputs side by side (q|k|v or gate|up of different types in one call). x is bf16 or fp32
([..., K]); y is x's dtype, or fp32 with ``out_fp32`` (an LM head's logits). ``dequantize`` gives a
part's dense weights, bit for bit what gguf-py's ``gguf.quants.dequantize`` gives.

The C++ kernel (``csrc/quant_linear.cpp``) is built once per path from one source (``PATHS``):
``"amx_int8"`` (the int8 x below against the weights repacked once, ``pack``, into panels of 16 rows:
AMX-INT8 tiles give a group's exact int32 dot products for 16 weight rows and up to 16 x rows in one
instruction, so verify rows and prefill cost little more than one row; one row takes vpdpbusd on the same
panels and the same fp32 epilogue, bit for bit what it gets among other rows; see csrc/gguf_q8.h amx8),
``"avx512_vnni"`` (x rounded to int8 per row and 32 values, as llama.cpp's Q8_0; integer dot products
with vpdpbusd, the scales applied in fp32 once per 4 weights a lane), ``"avx512_bf16"`` (bf16 x
through vdpbf16ps; fp32 x as "avx512"), ``"avx512"`` and ``"avx2"`` (x in fp32 FMAs against weights
decoded to fp32), ``"scalar"``. ``best_path(dtype)`` picks one by what the CPU has; ``path=`` forces
one (tests run every path the CPU can). Every path is row-independent: a row of x computed among any
number of rows equals, bit for bit, the same row computed alone (so verification equals decoding).
The float paths differ from each other and from the fp32 reference only in fp32 summation order; the
int8 path (``INT8_PATHS``) equals, up to fp32 summation order, the reference over x as its int8 codes
times their scales (``quantize_x``), which is within half an x step (max|x| / 254 over the value's
32-group) of x.

What it does not know: GGUF files, tensor names, models (specctl.runtime.quant reads those).
"""

from __future__ import annotations

import torch

from specctl.kernels import cpu
from specctl.kernels._build import build
from specctl.kernels.amx_linear import huge_empty

# ggml type name -> (ggml type id, weights per block, bytes per block)
TYPES: dict[str, tuple[int, int, int]] = {
    "Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20), "Q5_0": (6, 32, 22), "Q8_0": (8, 32, 34),
    "Q4_K": (12, 256, 144), "Q6_K": (14, 256, 210),
}
PATHS = ("amx_int8", "avx512_vnni", "avx512_bf16", "avx512", "avx2", "scalar")
INT8_PATHS = ("amx_int8", "avx512_vnni")  # x rounded to int8 per 32 values (llama.cpp's Q8_0): not exact vs fp32 x
PACKED_PATHS = ("amx_int8",)  # weights repacked once (``pack``) into 16-row panels; parts' rows in multiples of 16
PACKED = 256  # a type id + PACKED: the part is packed
NEEDS = {"amx_int8": ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "f16c", "amx_tile", "amx_int8"),
         "avx512_vnni": ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "f16c"),
         "avx512_bf16": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "f16c"),
         "avx512": ("avx512f", "avx512bw", "f16c"), "avx2": ("avx2", "fma", "f16c"), "scalar": ()}
_FLAGS = {"amx_int8": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mfma", "-mf16c", "-mamx-tile", "-mamx-int8"],
          "avx512_vnni": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mfma", "-mf16c"],
          "avx512_bf16": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mfma", "-mf16c"],
          "avx512": ["-mavx512f", "-mavx512bw", "-mfma", "-mf16c"], "avx2": ["-mavx2", "-mfma", "-mf16c"], "scalar": []}


def spec(path: str) -> tuple[str, str, tuple[str, ...], list[str]]:
    """(extension name, source, CPU features, compiler flags) of ``path``'s build."""
    return f"specctl_quant_linear_{path}", "quant_linear.cpp", NEEDS[path], [*_FLAGS[path], "-ffp-contract=off"]


def load(path: str = "avx512"):
    """The extension built for ``path``, or None where this CPU lacks its features or it cannot
    build (built once per path; the CPU's features are asked on every call, see specctl.kernels.select.hidden)."""
    if any(not cpu.has(f) for f in NEEDS[path]):
        return None
    ext = build(*spec(path))  # built once (specctl.kernels._build)
    return None if ext is None or not getattr(ext, "amx_ready", True) else ext  # the OS may refuse AMX state


def best_path(dtype: torch.dtype = torch.bfloat16, packed: bool = True) -> str | None:
    """The path x of ``dtype`` takes on this CPU, or None without a compiler (``packed=False``: not a
    path that repacks the weights, for parts whose rows are not a multiple of 16).

    bf16 x takes the AMX-INT8 panels where the CPU has them: on an AMX Xeon, a Qwen2.5-Coder-1.5B Q4_K_M
    verify forward over 9 rows costs 2.0x one row there against 2.8x on the int8 path below and a
    512-token prefill is 2.2x faster, while one row decodes 3-7 % slower (benchmarks/quant_decode.py,
    benchmarks/quant_prefill.py, benchmarks/llama_cpp_compare.py --hide amx_int8; README).
    bf16 x takes the int8 path where the CPU has AVX512-VNNI: it decodes a weight to a byte code in
    1-2 instructions per 64 and multiplies 64 a vpdpbusd, where the float paths spend an fp32 (or
    bf16) multiply per 16 (32) weights; measured 1.5-1.8x a single-row Q4_K/Q6_K linear and 1.46x a
    Qwen2.5-Coder-1.5B Q4_K_M decode step over "avx512" on an AMX Xeon (benchmarks/quant_decode.py).
    fp32 x keeps the float paths: the int8 rounding of x (up to max|x|/254 a value) is llama.cpp's
    trade, not one to make for a caller who asked for fp32 (tests/runtime/test_quant.py checks an fp32
    quantized model against the dequantized dense model to 1e-4). Without VNNI, bf16 x takes the
    AVX512-BF16 path only without AMX: on AMX CPUs (Sapphire Rapids) vdpbf16ps runs ~0.4 a cycle
    against fp32 FMA's 2 (measured), so the fp32 path is the faster one there; on AMD Zen 4 vdpbf16ps
    is as fast as an FMA and does twice the work (and Zen 4 has VNNI, so takes the int8 path)."""
    order = [p for p in PATHS if packed or p not in PACKED_PATHS]
    if dtype is not torch.bfloat16:
        order = [p for p in order if p not in INT8_PATHS]
    if dtype is not torch.bfloat16 or cpu.has("amx_bf16"):
        order.remove("avx512_bf16")
    return next((p for p in order if load(p) is not None), None)


def row_bytes(qtype: str, K: int) -> int:
    _, qk, nbytes = TYPES[qtype]
    if K % qk:
        raise ValueError(f"{qtype} rows hold multiples of {qk} weights, not {K}")
    return K // qk * nbytes


def linear(x: torch.Tensor, parts: list[tuple[torch.Tensor, str]], K: int, bias: torch.Tensor | None = None,
           out_fp32: bool = False, path: str | None = None) -> torch.Tensor:
    """x [..., K] (bf16/fp32) @ [part blocks...]^T (+ bias [N]) -> [..., N]; ``path`` forces a kernel. A
    packed path packs the parts on every call (each padded to 16 rows with zero rows): for tests; a model
    packs once (specctl.runtime.quant.QuantLinear)."""
    path = path or best_path(x.dtype) or "scalar"
    ext = load(path)
    if ext is None:
        raise RuntimeError(f"the quant_linear kernel ({path}) cannot run on this machine")
    rows = x.numel() // K
    ws, ids = [b for b, _ in parts], [TYPES[t][0] for _, t in parts]
    ns = [b.shape[0] for b in ws]
    padded = ns
    if path in PACKED_PATHS:
        padded = [n + -n % 16 for n in ns]
        ws = [pack(torch.cat([b, b.new_zeros(p - n, b.shape[1])]), t, K) for (b, t), n, p in zip(parts, ns, padded)]
        ids = [i + PACKED for i in ids]
        if bias is not None:  # bias beside the padded rows too
            bias = torch.cat([torch.cat([c, c.new_zeros(p - n)]) for c, n, p in zip(bias.split(ns), ns, padded)])
    y = ext.quant_linear(x.reshape(rows, K), ws, ids, K, bias, out_fp32)
    if padded != ns:
        y = torch.cat([c[:, :n] for c, n in zip(y.split(padded, dim=1), ns)], dim=1)
    return y.view(*x.shape[:-1], y.shape[-1])


def packed_shape(N: int, qtype: str, K: int) -> tuple[int, int]:
    """The shape of ``pack``'s panels for N GGUF rows of ``qtype`` over K inputs."""
    ext = load("amx_int8")
    if ext is None:
        raise RuntimeError("the amx_int8 quant_linear path cannot run on this machine (it needs AMX-INT8)")
    if N % 16:
        raise ValueError(f"the amx_int8 panels take 16 rows at a time; these blocks have {N}")
    return N // 16, (K + 255) // 256 * ext.rec_bytes(TYPES[qtype][0])


def pack(blocks: torch.Tensor, qtype: str, K: int, huge: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """GGUF rows [N, row_bytes] (N a multiple of 16) -> the amx_int8 path's panels [N / 16, ...] uint8
    (lossless: ``unpack`` gives the rows back). ``out``: the panels' place (``packed_shape``; a model's parts
    share one huge-page ``specctl.kernels.amx_linear.Arena``, as weights streamed every step want: measured, 4 KiB
    pages made a 1.5B Q4_K_M decode step 11 % slower). ``huge``: a huge-page mapping of its own (a whole
    spare huge page: for one large tensor only)."""
    shape = packed_shape(blocks.shape[0], qtype, K)
    ext = load("amx_int8")
    if out is None:
        out = huge_empty(shape, torch.uint8) if huge else torch.empty(shape, dtype=torch.uint8)
    elif tuple(out.shape) != shape or out.dtype != torch.uint8:
        raise ValueError(f"pack's out is uint8 {list(shape)}, not {out.dtype} {list(out.shape)}")
    ext.pack(blocks.contiguous(), TYPES[qtype][0], K, out)
    return out


def unpack(packed: torch.Tensor, qtype: str, K: int) -> torch.Tensor:
    """``pack``'s inverse: panels -> GGUF rows [N, row_bytes], bit for bit."""
    ext = load("amx_int8")
    if ext is None:
        raise RuntimeError("the amx_int8 quant_linear path cannot run on this machine (it needs AMX-INT8)")
    return ext.unpack(packed.contiguous(), TYPES[qtype][0], K)


def quantize_x(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (bf16/fp32) -> (codes [M, K] int8, scales [M, K / 32] fp32): the x an int8 path
    multiplies, row by row: per 32 values d = max|x| / 127, q = round-half-even(x * (127 / max|x|))."""
    ext = next((e for p in INT8_PATHS if (e := load(p)) is not None), None)
    if ext is None:
        raise RuntimeError("no int8 quant_linear path runs on this machine")
    return tuple(ext.quantize_x(x))


def dequantize(blocks: torch.Tensor, qtype: str, K: int, dtype: torch.dtype = torch.float32,
               path: str | None = None) -> torch.Tensor:
    """Blocks [N, row_bytes] of ``qtype`` -> dense weights [N, K] in ``dtype`` (fp32 or bf16)."""
    ext = load(path or best_path(torch.float32) or "scalar")
    if ext is None:
        raise RuntimeError("the quant_linear kernel cannot run on this machine")
    return ext.dequantize(blocks.contiguous(), TYPES[qtype][0], K, dtype)
