"""Checkpoints into the own transformer: an HF folder's config.json and safetensors, fused (q|k|v,
gate|up), on the kernels the CPU runs (``--kernels``: ``set_kernels``; ``enable_exact_bf16``).

What it does not know: decoding, tokenizers (``specctl.runtime.loading.load_model`` adds them),
GGUF files (``specctl.runtime.quant``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import nn

from specctl.kernels import decode_attention, decode_layer
from specctl.kernels.select import TORCH, KernelSet, resolve
from specctl.errors import ModelError, UsageError
from specctl.modeling.args import ModelArgs, rope_inv_freq
from specctl.modeling.transformer import AmxLinear, Transformer, adopt_kernels, pack_for_amx

def read_config(folder: Path) -> dict:
    path = Path(folder) / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelError(f"{folder} has no config.json", "give an HF model folder (config.json + *.safetensors)") from None
    except json.JSONDecodeError as e:
        raise ModelError(f"{path} is not valid JSON ({e.msg})", "re-save the checkpoint or re-pull it") from None


KERNEL_MODES = ("auto", "fused", "torch")
_kernels = "auto"


def set_kernels(mode: str) -> None:
    """The kernels bf16 CPU models load with from now on (the commands' ``--kernels``): "auto" (the
    C++ row-independent kernels where the CPU has them, else torch's), "fused" (the C++ kernels or
    an error), "torch" (torch's own ops). Draft models follow their target's."""
    global _kernels
    if mode not in KERNEL_MODES:
        raise UsageError(f"unknown --kernels '{mode}'", f"use one of: {', '.join(KERNEL_MODES)}")
    _kernels = mode


def load_transformer(folder: str | Path, dtype: torch.dtype, device: str | torch.device = "cpu",
                     kernels: str | None = None) -> Transformer:
    """Build the Transformer from an HF folder's config.json and *.safetensors, fusing weights;
    ``kernels`` (default: ``set_kernels``'s) picks the bf16 CPU path (see ``set_kernels``)."""
    from specctl.models import open_safetensors

    folder = Path(folder)
    args = ModelArgs.from_hf_config(read_config(folder))
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelError(f"{folder} has no *.safetensors weights", "convert the checkpoint to safetensors (save_pretrained)")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        with open_safetensors(f, framework="pt") as fh:  # a damaged file: one ModelError naming it
            for key in fh.keys():
                sd[key] = fh.get_tensor(key)
    with torch.device("meta"):
        model = Transformer(args)
    model = model.to_empty(device=device)
    model.load_state_dict(fuse_hf_state_dict(sd, args), strict=True, assign=False)
    model.inv_freq = rope_inv_freq(args).to(device)
    model = model.to(dtype).eval().requires_grad_(False)
    mode = kernels or _kernels
    bf16_cpu = dtype == torch.bfloat16 and torch.device(device).type == "cpu"
    if mode == "fused" and not bf16_cpu:
        raise UsageError("--kernels fused selects specctl's C++ kernels for bf16 on a CPU",
                         "use --dtype bfloat16 --device cpu, or --kernels auto")
    if bf16_cpu and mode != "torch" and not enable_exact_bf16(model, resolve(mode)) and mode == "fused":
        raise UsageError("--kernels fused needs a CPU with AMX, AVX-512 or AVX2 with FMA (and a C++ compiler); this one "
                         "takes torch's path", "use --kernels auto")
    return model


_told_inexact = False


def _dense_bf16(layer) -> bool:
    """A projection the skinny kernel and the fused block read as row-major bf16 on the CPU. A GGUF
    layer (``quantized``) is asked first: its ``weight`` would dequantize a dense copy."""
    if getattr(layer, "quantized", False):
        return False
    w = layer.weight
    return w.dtype is torch.bfloat16 and w.device.type == "cpu" and w.is_contiguous()


def weights_on_huge_pages(model: "Transformer") -> None:
    """Every bf16 projection and the LM head onto transparent huge pages (one specctl.kernels.amx_linear.Arena),
    as the AMX path's packed copies are: a decode step streams them once, and 4 KiB pages cost a page walk
    every 4 KiB of each of the kernel's weight streams (where THP is "madvise", as here, torch's own
    allocations get 4 KiB pages; Qwen2.5-Coder-1.5B decode on an AMD EPYC, alternated in one process:
    118.9 -> 108.9 ms a step, median of 45)."""
    from specctl.kernels.amx_linear import Arena

    layers = [layer for block in model.layers for layer in block.projections if _dense_bf16(layer)]
    head = model.embed if model.lm_head is None else model.lm_head
    if model.quant_head is None and _dense_bf16(head):
        layers.append(head)
    # one arena for all of them (one mapping: its spare huge page is paid once, not once a weight)
    arena = Arena(sum(Arena.size(tuple(layer.weight.shape), layer.weight.dtype) for layer in layers))
    for layer in layers:
        w = layer.weight
        h = arena.take(tuple(w.shape), w.dtype)
        h.copy_(w.data)
        layer.weight = nn.Parameter(h, requires_grad=False)


def enable_exact_bf16(model: "Transformer", kernels: KernelSet | None = None) -> bool:
    """The model onto a row-independent kernel set (``kernels``, default: what this CPU runs, ``resolve()``):
    AMX tiles (projections as ``AmxLinear``), else the skinny kernel (``DenseLinear``, weights on huge
    pages), the row-independent attention and the fused block where they fit. Verification then equals
    plain decoding bit for bit, and decode reads the weights faster than torch's oneDNN GEMV (see
    benchmarks/decode_bandwidth.py). On by default for bf16 on CPU; ``--kernels torch`` keeps torch's
    F.linear. Returns whether a row-independent path is active; where the CPU has none of AMX, AVX-512 or
    AVX2 (or no compiler), says so once on stderr and returns False."""
    global _told_inexact
    ks = resolve() if kernels is None else kernels
    if ks.amx is not None:
        pack_for_amx(model, ks.amx)
    elif ks.linear is None:
        ks = TORCH
    adopt_kernels(model, ks)  # each block's set; the dense projections read by the skinny kernel where it has it
    if ks.linear is not None:
        weights_on_huge_pages(model)
    model.kernels = ks
    model.cpu_kernels = ks.path if ks.exact else None  # "amx", "avx512_bf16", or "avx512"/"avx2" (same results)
    if not ks.exact and not _told_inexact:
        _told_inexact = True
        print("specctl: this CPU has neither AMX, AVX-512 nor AVX2 (or no compiler), so bf16 runs on torch's "
              "kernels: greedy speculative output equals plain output except at near-ties (use --dtype float32 "
              "for token-exact output)", file=sys.stderr)
    fuse_blocks(model.layers, model.args, ks)
    return ks.exact


def fuse_blocks(blocks, a: ModelArgs, ks: KernelSet) -> None:
    """Which of ``blocks`` (on ``ks``, ``adopt_kernels``) run their decode and verify rows through the fused C++
    block (``Block.fused``, one call a block): where the set is row-independent, the attention fits the exact
    kernel and the block's weights are the layout its build takes. The target's blocks, and a draft's of the
    same shape that runs on the target's set (MTP)."""
    if not ks.exact or ks.attention is None:
        return
    probe = torch.empty(1, a.num_heads, 1, a.head_dim, dtype=torch.bfloat16)
    fused_kind = decode_layer.kind(ks.block) if ks.block is not None else None  # and so the weights it takes
    for block in blocks:
        block.exact_attention = decode_attention.supports(probe, a.num_kv_heads)
        linears = block.projections
        if fused_kind == "amx":  # the fused block's AMX build takes the packed weights
            weights_fit = all(isinstance(l, AmxLinear) for l in linears)
        else:  # its other builds the skinny linear's row-major ones (None: no build)
            weights_fit = fused_kind in ("avx512_bf16", "avx512", "avx2") and all(_dense_bf16(l) for l in linears)
        # GGUF blocks (specctl.runtime.quant) on the int8 path: the block's quantized build
        quant = not weights_fit and decode_layer.fits_quant(block)
        block.fused = (block.exact_attention and (weights_fit or quant)
                       and block.gate_up.bias is None and block.down.bias is None
                       and a.sliding_window is None and a.head_dim <= 256
                       and a.intermediate_size % 16 == 0)
        block.fused_ext = None if not block.fused else decode_layer.load_quant(block.qkv.path) if quant else ks.block


def fuse_hf_state_dict(sd: dict[str, torch.Tensor], a: ModelArgs) -> dict[str, torch.Tensor]:
    """Map transformers' names (model.layers.{i}.self_attn.q_proj.weight, ...) to ours, fusing."""

    used: set[str] = set()

    def take(name: str) -> torch.Tensor:
        try:
            used.add(name)
            return sd[name]
        except KeyError:
            raise ModelError(f"checkpoint lacks tensor '{name}'", "check that the folder holds a complete model") from None

    out = {"embed.weight": take("model.embed_tokens.weight"), "norm.weight": take("model.norm.weight")}
    if not a.tie_word_embeddings:
        out["lm_head.weight"] = take("lm_head.weight") if "lm_head.weight" in sd else out["embed.weight"]
    used.add("lm_head.weight")  # a tied checkpoint may still carry a copy of the head
    for i in range(a.num_layers):
        p = f"model.layers.{i}."
        attn = [take(p + f"self_attn.{n}_proj.weight") for n in "qkv"]
        out[f"layers.{i}.qkv.weight"] = torch.cat(attn, 0)
        if a.qkv_bias:
            out[f"layers.{i}.qkv.bias"] = torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"], 0)
        out[f"layers.{i}.o.weight"] = take(p + "self_attn.o_proj.weight")
        if a.o_bias:
            out[f"layers.{i}.o.bias"] = take(p + "self_attn.o_proj.bias")
        out[f"layers.{i}.input_norm.weight"] = take(p + "input_layernorm.weight")
        out[f"layers.{i}.post_norm.weight"] = take(p + "post_attention_layernorm.weight")
        out[f"layers.{i}.gate_up.weight"] = torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")], 0)
        out[f"layers.{i}.down.weight"] = take(p + "mlp.down_proj.weight")
        if a.mlp_bias:
            out[f"layers.{i}.gate_up.bias"] = torch.cat([take(p + "mlp.gate_proj.bias"), take(p + "mlp.up_proj.bias")], 0)
            out[f"layers.{i}.down.bias"] = take(p + "mlp.down_proj.bias")
    def mtp_tensor(k: str) -> bool:
        """MTP modules (DeepSeek-V3: model.layers.{L+i}.*; Qwen3-Next: mtp.*) load in the mtp proposer."""
        if k.startswith("mtp."):
            return True
        parts = k.split(".")
        return (a.num_mtp_layers > 0 and len(parts) > 2 and parts[:2] == ["model", "layers"]
                and parts[2].isdigit() and int(parts[2]) >= a.num_layers)

    unused = sorted(k for k in sd if k not in used and not k.endswith("rotary_emb.inv_freq") and not mtp_tensor(k))
    if unused:
        raise ModelError(
            f"checkpoint has {len(unused)} tensor(s) the own runtime does not understand (e.g. '{unused[0]}')",
            "this architecture variant is not supported yet; use a plain llama/qwen2/mistral checkpoint",
        )
    return out
