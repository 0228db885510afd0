"""GGUF quantized models run as stored: the own Transformer with its projections kept as GGUF blocks.

``load_gguf_transformer(path, dtype)`` reads a llama or qwen2 GGUF file (gguf's GGUFReader, memory
mapped) into ``specctl.modeling.Transformer``: the config from the GGUF metadata; the token
embeddings and norms in the activation dtype (small: the embedding is dequantized once by the
kernel's own decoder); every attention and MLP projection, and the LM head where it is stored
quantized, as a ``QuantLinear`` holding the raw blocks (specctl/kernels/quant_linear.py). A projection's
forward reads its blocks once per forward for all rows; a row's output does not depend on the rows
beside it, so speculation (verification) stays lossless relative to the quantized model.

llama-arch GGUFs store Q and K rows permuted (llama.cpp's convert script); they are put back in HF
order here by moving whole rows of blocks (quantization is per row, so this is exact). Qwen2 GGUFs
are not permuted.

What it does not know: tokenizers and stop tokens (``specctl.runtime.loading.load_gguf_model`` adds them through
transformers' GGUF tokenizer), GPUs (the kernels are CPU kernels), other architectures or
quantization types (refused in one line naming the fix).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

from specctl.errors import ModelError, UsageError
from specctl.kernels import quant_linear as ql
from specctl.kernels.amx_linear import Arena
from specctl.modeling import ModelArgs, Transformer, enable_exact_bf16, rope_inv_freq

GGUF_ARCHS = ("llama", "qwen2")
DENSE_TYPES = ("F32", "F16", "BF16")


class QuantLinear(nn.Module):
    """y = x @ W^T + b with W as GGUF blocks: ``parts`` [(blocks [N_p, row_bytes] uint8, ggml type)],
    their outputs side by side (a fused q|k|v whose parts have different types). ``out_fp32``: fp32
    outputs whatever x is (an LM head's logits). ``path``: the kernel path (specctl.kernels.quant_linear),
    fixed at construction. ``weight`` is a dense copy made on first use (for code that reads a
    head's rows); the forward never uses it."""

    quantized = True

    def __init__(self, parts: list[tuple[torch.Tensor, str]], in_features: int, bias: torch.Tensor | None = None,
                 dtype: torch.dtype = torch.bfloat16, out_fp32: bool = False, path: str | None = None,
                 arena: Arena | None = None):
        super().__init__()
        self.in_features, self.out_fp32, self.dtype = in_features, out_fp32, dtype
        self.types = [t for _, t in parts]
        for i, (b, t) in enumerate(parts):
            if b.dtype != torch.uint8 or b.dim() != 2 or b.shape[1] != ql.row_bytes(t, in_features):
                raise ValueError(f"part {i}: {t} blocks for {in_features} inputs are uint8 [N, {ql.row_bytes(t, in_features)}]")
        self.out_features = sum(b.shape[0] for b, _ in parts)
        self.register_buffer("bias", None if bias is None else bias.to(dtype))  # [N]
        self.path = kernel_path(parts, dtype, path)
        self.packed = self.path in ql.PACKED_PATHS
        # [N_p, row_bytes] uint8 GGUF rows, or their panels (packed once, here), placed in ``arena`` (the model's
        # one buffer: see load_gguf_transformer) or in one of their own
        arena = arena or Arena(stored_bytes(parts, in_features, self.path))
        for i, (b, t) in enumerate(parts):
            if self.packed:
                out = ql.pack(b, t, in_features, out=arena.take(ql.packed_shape(b.shape[0], t, in_features)))
            else:
                out = arena.take(tuple(b.shape)).copy_(b)
            self.register_buffer(f"blocks{i}", out)
        self._ext = ql.load(self.path)
        self._type_ids = [ql.TYPES[t][0] + (ql.PACKED if self.packed else 0) for t in self.types]
        self._dense: torch.Tensor | None = None

    @property
    def kernel_parts(self) -> tuple[list[torch.Tensor], list[int]]:
        """(part tensors, type ids) as the kernels take them: GGUF rows, or panels (type id + ql.PACKED)."""
        return [getattr(self, f"blocks{i}") for i in range(len(self.types))], self._type_ids

    @property
    def parts(self) -> list[torch.Tensor]:
        """The GGUF rows [N_p, row_bytes] of each part (unpacked from the panels on a packed path)."""
        ws = self.kernel_parts[0]
        return [ql.unpack(w, t, self.in_features) for w, t in zip(ws, self.types)] if self.packed else ws

    @property
    def nbytes(self) -> int:
        """Bytes of weights one forward reads."""
        return sum(b.numel() for b in self.kernel_parts[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in_features] -> [..., out_features]
        rows = x.numel() // self.in_features
        y = self._ext.quant_linear(x.reshape(rows, self.in_features), *self.kernel_parts, self.in_features,
                                   self.bias, self.out_fp32)
        return y.view(*x.shape[:-1], self.out_features)

    @property
    def weight(self) -> torch.Tensor:
        if self._dense is None:  # [out_features, in_features]
            path = None if self.packed else self.path
            self._dense = torch.cat([ql.dequantize(b, t, self.in_features, self.dtype, path=path)
                                     for b, t in zip(self.parts, self.types)])
        return self._dense

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, types={'|'.join(self.types)}, path={self.path}"


def kernel_path(parts: list[tuple[torch.Tensor, str]], dtype: torch.dtype, path: str | None = None) -> str:
    """The quant_linear path a QuantLinear over ``parts`` takes: ``path`` or the CPU's best, a path that does
    not repack where a part's rows are not a multiple of 16 (panels take 16 rows at a time)."""
    path = path or ql.best_path(dtype)
    if path in ql.PACKED_PATHS and any(b.shape[0] % 16 for b, _ in parts):
        path = ql.best_path(dtype, packed=False)
    if path is None:
        raise ModelError("GGUF quantized weights need specctl's C++ kernel, which did not build here",
                         "install a C++ compiler (g++), or load the GGUF dequantized (without --quantization gguf)")
    return path


def stored_bytes(parts: list[tuple[torch.Tensor, str]], K: int, path: str) -> int:
    """Bytes of an Arena that holds ``parts`` as a QuantLinear on ``path`` stores them."""
    if path in ql.PACKED_PATHS:
        return sum(Arena.size(ql.packed_shape(b.shape[0], t, K)) for b, t in parts)
    return sum(Arena.size(tuple(b.shape)) for b, _ in parts)


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_config(reader) -> dict:
    """The HF-style config (what ``ModelArgs.from_hf_config`` reads) of a llama/qwen2 GGUF."""
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHS:
        from specctl.modeling import SUPPORTED_ARCHS

        dense = arch in SUPPORTED_ARCHS  # the advice to load it dequantized only where that runs
        raise ModelError(f"GGUF architecture '{arch}' cannot run quantized in the own runtime yet"
                         + ("" if dense else " (nor dequantized)"),
                         f"use a GGUF of one of: {', '.join(GGUF_ARCHS)}"
                         + (", or load it dequantized (without --quantization gguf)" if dense else ""))
    names = {t.name: t for t in reader.tensors}
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    cfg = {
        "model_type": arch,
        "vocab_size": int(names["token_embd.weight"].shape[1]),
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(_field(reader, f"{arch}.attention.key_length", hidden // heads)),
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": arch == "llama" and "blk.0.attn_q.bias" in names,
    }
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        cfg["rope_scaling"] = {"rope_type": scaling, "factor": float(_field(reader, f"{arch}.rope.scaling.factor", 1.0))}
    return cfg


def _unpermute(t: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's Q/K row order -> HF's (transformers' reverse_permute): rows [n_head*hd, ...]."""
    dim = t.shape[0] // n_head // 2
    return t.reshape(n_head, dim, 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape).contiguous()


class _Tensors:
    """The GGUF's tensors by name, each read once (``take``), as raw blocks or dense torch tensors."""

    def __init__(self, reader, path: Path):
        self.by_name = {t.name: t for t in reader.tensors}
        self.used: set[str] = set()
        self.path = path

    def __contains__(self, name: str) -> bool:
        return name in self.by_name

    def take(self, name: str) -> tuple[torch.Tensor, str]:
        """(tensor, ggml type name): uint8 blocks [N, row_bytes] for quantized types, else dense."""
        if name not in self.by_name:
            raise ModelError(f"{self.path.name} lacks tensor '{name}'", "check that the GGUF holds a complete model")
        self.used.add(name)
        t = self.by_name[name]
        qtype = t.tensor_type.name
        if qtype in ql.TYPES:  # the mapped bytes, read once by QuantLinear into the model's arena (no copy here)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # read-only mapping: never written
                return torch.from_numpy(t.data).view(torch.uint8), qtype
        data = np.array(t.data)  # a copy of the mapped bytes
        if qtype == "BF16":
            return torch.from_numpy(data.view(np.int16)).view(torch.bfloat16).reshape(data.shape[0], -1).squeeze(-1), qtype
        if qtype in ("F32", "F16"):
            return torch.from_numpy(data).float(), qtype
        raise ModelError(f"{self.path.name}: tensor '{name}' is {qtype}, which specctl's kernels do not run",
                         f"use a GGUF quantized to {', '.join(ql.TYPES)} (e.g. Q4_K_M or Q8_0), or load it "
                         "dequantized (without --quantization gguf)")


def _linear(parts: list[tuple[torch.Tensor, str]], K: int, bias: torch.Tensor | None, dtype: torch.dtype,
            name: str, out_fp32: bool = False, path: str | None = None, arena: Arena | None = None) -> nn.Module:
    """QuantLinear over quantized parts; a projection stored dense (F16, BF16, F32) is refused, as README
    promises: it would run dense while bench says "quantized"."""
    dense = [t for _, t in parts if t in DENSE_TYPES]
    if dense:
        raise ModelError(f"{name} is stored {'|'.join(t for _, t in parts)}, not quantized: --quantization gguf runs "
                         f"projections of {', '.join(ql.TYPES)}",
                         "load this GGUF dequantized (without --quantization gguf), or use a quantized GGUF (e.g. Q4_K_M)")
    return QuantLinear(parts, K, bias, dtype, out_fp32=out_fp32, path=path, arena=arena)


def load_gguf_transformer(path: str | Path, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
                          kernels: str | None = None, quant_path: str | None = None) -> Transformer:
    """The own Transformer over a GGUF file's quantized weights (see the module docstring).
    ``kernels``: the attention path of a bf16 model, as ``load_transformer``'s (the projections
    always take the quantized kernel). ``quant_path``: the quant_linear path of every projection
    (default: specctl.kernels.quant_linear.best_path)."""
    from specctl.gguf_files import open_gguf

    path = Path(path)
    if torch.device(device).type != "cpu":
        raise UsageError("GGUF quantized weights run on the CPU kernels only", "use --device cpu, or load the GGUF "
                         "dequantized (without --quantization gguf)")
    if dtype not in (torch.bfloat16, torch.float32):
        raise UsageError(f"GGUF quantized models run in bfloat16 or float32, not {dtype}", "use --dtype bfloat16")
    reader = open_gguf(path)  # a truncated or unreadable file: one line
    args = ModelArgs.from_hf_config(gguf_config(reader))
    ts = _Tensors(reader, path)
    with torch.device("meta"):
        model = Transformer(args)
    H, nh, nkv = args.hidden_size, args.num_heads, args.num_kv_heads

    def dense(name: str) -> torch.Tensor:
        w, t = ts.take(name)
        return ql.dequantize(w, t, w.shape[1] // ql.TYPES[t][2] * ql.TYPES[t][1], dtype) if t in ql.TYPES else w.to(dtype)

    state = {"embed.weight": dense("token_embd.weight"), "norm.weight": dense("output_norm.weight")}
    head = ts.take("output.weight") if "output.weight" in ts else (None, None)
    if head[0] is None:  # tied: the head reads the embedding's blocks (as stored, quantized or not)
        ts.used.discard("token_embd.weight")
        head = ts.take("token_embd.weight")
    # every projection's parts first, so that all of them go into one arena sized for them (specctl.kernels.amx_linear.Arena)
    linears: list[tuple[nn.Module, str, list, int, torch.Tensor | None, str]] = []  # (owner, attribute, parts, K, bias, name)
    for i, block in enumerate(model.layers):
        p = f"blk.{i}."
        q, k = ts.take(p + "attn_q.weight"), ts.take(p + "attn_k.weight")
        bias = None
        if args.qkv_bias:
            bias = [ts.take(p + f"attn_{n}.bias")[0] for n in "qkv"]
        if args.arch == "llama":  # llama.cpp permuted Q and K rows; back to HF order
            q, k = (_unpermute(q[0], nh), q[1]), (_unpermute(k[0], nkv), k[1])
            if bias is not None:
                bias[0], bias[1] = _unpermute(bias[0], nh), _unpermute(bias[1], nkv)
        linears += [
            (block, "qkv", [q, k, ts.take(p + "attn_v.weight")], H, None if bias is None else torch.cat(bias), p + "attn_qkv"),
            (block, "o", [ts.take(p + "attn_output.weight")], nh * args.head_dim,
             ts.take(p + "attn_output.bias")[0] if args.o_bias else None, p + "attn_output"),
            (block, "gate_up", [ts.take(p + "ffn_gate.weight"), ts.take(p + "ffn_up.weight")], H, None, p + "ffn"),
            (block, "down", [ts.take(p + "ffn_down.weight")], args.intermediate_size, None, p + "ffn_down"),
        ]
    quant = [(parts, K) for _, _, parts, K, _, _ in linears if all(t in ql.TYPES for _, t in parts)]  # (the rest: refused)
    if head[1] in ql.TYPES:
        quant.append(([head], H))
    arena = Arena(sum(stored_bytes(parts, K, kernel_path(parts, dtype, quant_path)) for parts, K in quant))
    if head[1] in ql.TYPES:
        model.quant_head = QuantLinear([head], H, None, dtype, out_fp32=True, path=quant_path, arena=arena)
        if not args.tie_word_embeddings:
            model.lm_head = model.quant_head
    elif not args.tie_word_embeddings:
        state["lm_head.weight"] = head[0].to(dtype)
    for owner, attr, parts, K, bias, name in linears:
        setattr(owner, attr, _linear(parts, K, bias, dtype, name, path=quant_path, arena=arena))
    del linears, head, quant
    for i in range(len(model.layers)):
        p = f"blk.{i}."
        state[f"layers.{i}.input_norm.weight"] = dense(p + "attn_norm.weight")
        state[f"layers.{i}.post_norm.weight"] = dense(p + "ffn_norm.weight")
    inv_freq = rope_inv_freq(args)
    if "rope_freqs.weight" in ts:  # llama3-style rope: per-frequency divisors
        inv_freq = inv_freq / ts.take("rope_freqs.weight")[0].float()
    unused = sorted(set(ts.by_name) - ts.used)
    if unused:
        raise ModelError(f"{path.name} has {len(unused)} tensor(s) the own runtime does not understand (e.g. "
                         f"'{unused[0]}')", "this architecture variant is not supported quantized; load it dequantized")
    model.load_state_dict(state, strict=False, assign=True)
    model.inv_freq = inv_freq
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise ModelError(f"{path.name} left {left[0]} unset", "check that the GGUF holds a complete model")
    model = model.eval().requires_grad_(False)
    if dtype == torch.bfloat16 and (kernels or "auto") != "torch":
        enable_exact_bf16(model)  # the row-independent attention (the projections are quantized)
    paths = [m.path for m in model.modules() if isinstance(m, QuantLinear)]
    model.cpu_kernels = f"gguf-{max(set(paths), key=paths.count) if paths else ql.best_path(dtype)}"  # most projections' path
    model.quantization = "gguf"  # what bench's header records (a dense Transformer has none)
    return model
