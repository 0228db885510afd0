"""A model's shape (``ModelArgs``, from an HF config.json), its rotary frequencies, and the row counts
that separate decode/verify forwards from prefill.

What it does not know: weights, caches, kernels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specctl.config import SUPPORTED_ARCHS
from specctl.errors import ModelError
from specctl.kernels import decode_layer

# Forwards of at most this many tokens are "decode/verify" forwards (a chain's k+1 rows, a draft
# tree's nodes): every op in them computes a row exactly as a one-token forward would (see
# Block.forward and specctl/kernels/skinny_linear.py), so greedy speculative output equals plain greedy
# output bit for bit, in bf16 too. Longer forwards are prefill (attention through SDPA).
VERIFY_ROWS = decode_layer.MAX_ROWS
# Without the C++ attention (fp32, CUDA), verify rows up to this many attend one SDPA call per row,
# as a one-token decode does; more rows (and prefill) attend in one call.
SDPA_ROWS = 16


@dataclass
class ModelArgs:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    qkv_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    rope_scaling: dict | None = None
    num_mtp_layers: int = 0  # DeepSeek-style num_nextn_predict_layers: MTP modules after the main layers
    o_bias: bool = False  # llama attention_bias=True also biases o_proj
    mlp_bias: bool = False
    sliding_window: int | None = None  # each query sees at most this many keys (itself included)

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelArgs":
        arch = cfg.get("model_type", "?")
        if arch not in SUPPORTED_ARCHS:
            raise ModelError(
                f"architecture '{arch}' is not supported by the own runtime yet",
                f"use a model of one of: {', '.join(SUPPORTED_ARCHS)}",
            )
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3", "linear"):
            raise ModelError(f"rope type '{rope_type}' is not supported yet", "use a model with default, linear or llama3 rope")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ModelError(f"activation '{cfg.get('hidden_act')}' is not supported yet", "use a model with silu MLPs")
        n_heads = cfg["num_attention_heads"]
        window = cfg.get("sliding_window") if arch == "mistral" else None
        if arch == "qwen2" and cfg.get("use_sliding_window"):
            raise ModelError("Qwen2 with use_sliding_window=true is not supported yet",
                             "use a checkpoint with use_sliding_window=false")
        return cls(
            arch=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=n_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            qkv_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            rope_scaling=rope if rope_type != "default" else None,
            o_bias=arch != "qwen2" and bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            sliding_window=int(window) if window else None,
            num_mtp_layers=int(cfg.get("num_nextn_predict_layers") or 0),
        )


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] in fp32, with linear or llama3 scaling as transformers does."""
    d = args.head_dim
    inv = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    rs = args.rope_scaling
    if rs is None:
        return inv
    rope_type = rs.get("rope_type", rs.get("type"))
    if rope_type == "linear":
        return inv / rs["factor"]
    # llama3: low frequencies scaled by `factor`, high kept, smooth in between.
    factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old_len = rs["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)
