"""One transformer block per call for decode and verification forwards (bf16; AMX, AVX-512 or AVX2).

``layer(block, x, cos, sin, k_cache, v_cache, start)`` runs specctl.modeling.Block for a few
rows (batch x tokens <= 64) in one C++ call and one parallel region (``csrc/decode_layer.cpp``):
the same arithmetic as the AMX linears and the row-independent attention, without ~25 torch
dispatches and 5 thread-pool wake-ups per block. ``load()`` returns None where it cannot run (neither
AMX nor AVX512-BF16, or no compiler); callers keep the per-op path. ``kind()`` says which build runs:
``"amx"`` takes the AMX-packed weights (kernels/amx_linear), ``"avx512_bf16"``, ``"avx512"`` and ``"avx2"``
(its FMA form for AVX-512 without BF16, and for AVX2) the row-major ones of the skinny linear (same arithmetic as
kernels/skinny_linear, one shared core: csrc/skinny_gemm.h).
``layer_ragged`` does the same for many requests' rows at once, each request with its own cache,
length and draft tree (the batched engine).

``load_quant()`` builds the same block over GGUF quantized weights as stored (``-DSPECCTL_QUANT``: the
int8 core specctl/kernels/quant_linear.py runs, csrc/gguf_q8.h, so each projection equals its QuantLinear bit for
bit; CPUs with AVX512-VNNI and AVX512-BF16); ``layer``/``layer_ragged`` take it for a block whose linears
are ``specctl.runtime.quant.QuantLinear`` on the "avx512_vnni" path (``fits_quant``).

``eagle3_layer(...)`` runs EAGLE-3's draft layer the same way: its attention reads
cat(emb_norm(emb), in_norm(x)) [2H] while x stays the residual (specctl.runtime.proposers.eagle).
"""

from __future__ import annotations

import torch

from specctl.kernels import amx_linear, cpu, skinny_linear
from specctl.kernels._build import build

MAX_ROWS = 64  # a chain's k+1 rows, or a draft tree's nodes
AVX512 = ["-mavx512f", "-mavx512bf16", "-mavx512vl", "-mavx512bw"]


def build_spec(kind: str) -> tuple[str, tuple[str, ...], list[str]]:
    """(extension name, CPU features, compiler flags) of the block's build for ``kind``: "amx", "avx512_bf16",
    "avx512", or a quant_linear int8 path ("avx512_vnni", "amx_int8": the quantized block)."""
    if kind == "amx":
        return "specctl_decode_layer", ("amx_bf16", "amx_tile", "avx512_bf16"), ["-mamx-tile", "-mamx-bf16", *AVX512]
    if kind == "avx512_bf16":
        return "specctl_decode_layer_avx512", ("avx512_bf16",), ["-DSPECCTL_SKINNY", *AVX512]
    if kind == "avx512":
        return "specctl_decode_layer_avx512f", cpu.AVX512, ["-DSPECCTL_SKINNY", *skinny_linear.FLAGS_AVX512]
    if kind == "avx2":
        return "specctl_decode_layer_avx2", cpu.AVX2, ["-DSPECCTL_SKINNY", *skinny_linear.FLAGS_AVX2]
    needs = ("avx512_bf16", "avx512_vnni", "avx512bw", "f16c")
    flags = ["-DSPECCTL_QUANT", *AVX512, "-mavx512vnni", "-mfma", "-mf16c", "-ffp-contract=off"]
    if kind == "amx_int8":
        return "specctl_decode_layer_q8amx", (*needs, "amx_tile", "amx_int8"), [*flags, "-mamx-tile", "-mamx-int8"]
    if kind == "avx512_vnni":
        return "specctl_decode_layer_q8", needs, flags
    raise ValueError(f"no fused block build for {kind!r}")


def spec(kind: str) -> tuple[str, str, tuple[str, ...], list[str]]:
    """(extension name, source, CPU features, compiler flags) of ``kind``'s build."""
    name, needs, flags = build_spec(kind)
    return name, "decode_layer.cpp", needs, flags


def _build(kind: str):
    return build(*spec(kind))


def load():
    """The dense block's build for this CPU: "amx" where AMX runs, else the skinny linear's vector path
    (None: neither)."""
    if amx_linear.load() is not None:  # asks the OS for AMX tile state
        return _build("amx")
    p = skinny_linear.vector_path()
    return None if p is None or skinny_linear.load() is None else _build(p)


def load_quant(path: str = "avx512_vnni"):
    """The quantized block's build for a quant_linear int8 ``path`` ("avx512_vnni", or "amx_int8": its
    AMX-INT8 panels), None where the CPU lacks what it needs or there is no compiler."""
    if path == "amx_int8":  # the OS grants AMX state to the process when quant_linear's build loads
        from specctl.kernels import quant_linear

        if quant_linear.load(path) is None:
            return None
    return _build(path)


def fits_quant(block) -> bool:
    """Whether ``block``'s projections are GGUF blocks the quantized build takes (an int8 path's, one for all)."""
    linears = (block.qkv, block.o, block.gate_up, block.down)
    if not all(getattr(l, "quantized", False) and not l.out_fp32 for l in linears):
        return False
    path = linears[0].path
    return path in ("avx512_vnni", "amx_int8") and all(l.path == path for l in linears) and load_quant(path) is not None


def _build_and_weights(block):
    """The build that runs ``block`` and its projections as that build takes them (qkv, o, gate_up, down):
    GGUF parts (or their AMX-INT8 panels) and type ids for the quantized build, the dense (or AMX-packed)
    weights otherwise; the build is the one the block holds (``Block.fused_ext``, set with ``fused``)."""
    linears = (block.qkv, block.o, block.gate_up, block.down)
    quantized = getattr(block.qkv, "quantized", False)
    return block.fused_ext, [l.kernel_parts if quantized else l.weight for l in linears]


def kind(ext=None) -> str | None:
    """"amx", "avx512_bf16", "avx512" or "avx2": the dense build ``ext`` is (default: ``load()``'s), and so the
    weights it takes (None: no build)."""
    ext = load() if ext is None else ext
    if ext is None:
        return None
    return next(k for k in ("amx", "avx512_bf16", "avx512", "avx2") if ext.__name__ == build_spec(k)[0])


def layer(block, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
          v_cache: torch.Tensor, start: int, tree: torch.Tensor | None = None) -> torch.Tensor:
    """``tree`` [T, W] bool: the rows are a draft tree (see decode_attention.attention)."""
    a = block.a
    ext, w = _build_and_weights(block)
    return ext.decode_layer(x.contiguous(), block.input_norm.weight, block.post_norm.weight, a.rms_norm_eps,
                            w[0], block.qkv.bias, w[1], block.o.bias, w[2], w[3], cos, sin, k_cache, v_cache, start,
                            a.num_heads, a.num_kv_heads, tree)


def layer_ragged(block, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, index: int, segs,
                 weights_out: list | None = None) -> torch.Tensor:
    """Many requests' rows through ``block`` (layer ``index``) in one call: x [1, M, H], cos/sin [M, hd],
    ``segs`` the requests' specctl.modeling.Segment (own caches, starts, lengths, trees). Each
    row is computed exactly as ``layer`` computes it for its request alone. ``weights_out``: per
    segment None or a [2, nkv, S] fp32 tensor that receives the attention weights of its first and
    last row, summed over each kv head's query heads (a by-product: the outputs do not change)."""
    a = block.a
    ext, w = _build_and_weights(block)
    return ext.decode_layer_ragged(x.contiguous(), block.input_norm.weight, block.post_norm.weight,
                                   a.rms_norm_eps, w[0], block.qkv.bias, w[1], block.o.bias, w[2], w[3], cos, sin,
                                   [s.cache.k[index] for s in segs], [s.cache.v[index] for s in segs],
                                   [s.start for s in segs], [s.n for s in segs], [s.tree for s in segs],
                                   a.num_heads, a.num_kv_heads, weights_out or [])


def eagle3_layer(w, x: torch.Tensor, emb: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, start: int, tree: torch.Tensor | None = None) -> torch.Tensor:
    """EAGLE-3's draft layer; ``w`` holds the block's build (``block_ext``), packed bf16 weights (qkv [Nqkv, 2H],
    o, gate_up, down), the norms (hidden_norm on x, input_norm on emb, post_norm), eps and the head counts."""
    return w.block_ext.decode_layer(x.contiguous(), w.hidden_norm, w.post_norm, w.eps, w.qkv, None, w.o, None,
                                    w.gate_up, w.down, cos, sin, k_cache, v_cache, start, w.num_heads,
                                    w.num_kv_heads, tree, emb.contiguous(), w.input_norm)
