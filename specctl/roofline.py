"""A roofline model of one decoding step: bytes and FLOPs from the model's shapes, time from the
machine's measured bandwidth and compute, for plain decoding and for sparse-attention
self-speculation (``sparse_attn``), at any context length, batch size and draft length.

Why: sparse_attn trades KV-cache reads for extra compute (k sparse draft forwards, then a verify
forward of k+1 rows whose attention over the whole context grows with rows x context). Whether that
pays depends on how large the KV read is next to the weights read (context, batch, GQA) and on the
machine: a 2-core CPU has ~10 bf16 FLOP per byte of bandwidth at best, an H100 ~300.

The forward model, per forward of R rows (requests r, each ``rows_r`` rows at context ``c_r``):

  t = max(f W / BW, f R F_lin_row / F_lin)                       weights and linear layers
    + sum_r max(f KV(c_r) / BW, f rows_r c_r F_att_pos / F_att)  attention, per request

W: bytes of the weights; F_lin_row: linear FLOPs per row; KV(c): bytes of c cached positions;
F_att_pos: attention FLOPs per row and position; f: the share of layers run (1, or less when the
draft skips layers). ``Machine`` holds BW, F_lin and F_att, measured on the model itself
(``specctl.runtime.machine.measure_machine``: a 1-row forward, a many-row forward, a 1-row forward
at a long context).

Torch-free: pure arithmetic.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace


@dataclass(frozen=True)
class Shapes:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    bytes_per_param: float = 2  # the weights' bytes per parameter read (bf16: 2; GGUF Q4_K_M: ~0.6)
    kv_bytes: int = 2  # bytes of one cached K or V element (bf16), whatever the weights' format

    @classmethod
    def from_config(cls, cfg: dict, bytes_per_param: float = 2, kv_bytes: int = 2) -> "Shapes":
        heads = cfg["num_attention_heads"]
        return cls(cfg["num_hidden_layers"], cfg["hidden_size"], heads, cfg.get("num_key_value_heads") or heads,
                   cfg.get("head_dim") or cfg["hidden_size"] // heads, cfg["intermediate_size"], cfg["vocab_size"],
                   bytes_per_param, kv_bytes)

    @classmethod
    def of(cls, model) -> "Shapes":
        """The shapes of a loaded specctl Transformer: its weights at the bytes a forward reads of them
        (``weight_bytes_read``: a GGUF model's blocks, not a dense width), its KV cache at the model's dtype."""
        a = model.args
        width = model.embed.weight.element_size()
        s = cls(a.num_layers, a.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim, a.intermediate_size,
                a.vocab_size, width, width)
        return replace(s, bytes_per_param=weight_bytes_read(model) / s.params_read)

    @property
    def params_read(self) -> int:
        """Parameters a forward reads: every layer's projections and the LM head."""
        return self.layers * self.layer_params + self.vocab * self.hidden

    @property
    def layer_params(self) -> int:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return self.hidden * (q + 2 * kv) + q * self.hidden + 3 * self.hidden * self.intermediate

    @property
    def weight_bytes(self) -> float:
        """Weights a forward reads: every layer and the LM head (the embedding row is negligible)."""
        return self.params_read * self.bytes_per_param

    @property
    def linear_flops_per_row(self) -> float:
        return 2.0 * self.params_read

    @property
    def kv_bytes_per_position(self) -> float:
        return self.layers * 2 * self.kv_heads * self.head_dim * self.kv_bytes

    @property
    def attention_flops_per_position(self) -> float:
        """Per row and cached position: q.k and p.v over every query head of every layer."""
        return self.layers * 4.0 * self.heads * self.head_dim

    def kv_share(self, context: int, batch: int = 1) -> float:
        """The KV cache read in one decode step over the weights read (batch requests at ``context``)."""
        return batch * context * self.kv_bytes_per_position / self.weight_bytes


def weight_bytes_read(model) -> int:
    """Bytes of weights one forward of a loaded specctl Transformer reads: its projections and LM head as
    they are stored (dense at their width, or a GGUF QuantLinear's blocks: ``nbytes``)."""
    def nbytes(layer) -> int:
        if getattr(layer, "quantized", False):
            return layer.nbytes
        return layer.weight.numel() * layer.weight.element_size()

    layers = sum(nbytes(layer) for b in model.layers for layer in b.projections)
    head = model.quant_head
    return layers + (nbytes(head) if head is not None else model.head_weight.numel() * model.head_weight.element_size())


@dataclass(frozen=True)
class Machine:
    bandwidth: float  # bytes/s the weights stream at (effective, measured)
    linear_flops: float  # FLOP/s of the linear layers over many rows
    attention_flops: float  # FLOP/s of the attention kernel over a long context (several rows)
    name: str = ""
    kv_bandwidth: float | None = None  # bytes/s the attention reads the KV cache at (default: bandwidth)

    @property
    def kv_bw(self) -> float:
        return self.kv_bandwidth or self.bandwidth

    def to_dict(self) -> dict:
        return asdict(self)


def forward_seconds(s: Shapes, m: Machine, requests: list[tuple[int, int]], layer_share: float = 1.0) -> float:
    """One forward: ``requests`` = (rows, context) per request (rows attend over ~context positions)."""
    rows = sum(r for r, _ in requests)
    t = layer_share * max(s.weight_bytes / m.bandwidth, rows * s.linear_flops_per_row / m.linear_flops)
    for r, c in requests:
        t += layer_share * max(c * s.kv_bytes_per_position / m.kv_bw,
                               r * c * s.attention_flops_per_position / m.attention_flops)
    return t


@dataclass(frozen=True)
class SparseEstimate:
    plain_step_s: float  # one decode step of the batch
    sparse_step_s: float  # k draft forwards + the verify forward (+ Vegas' scoring)
    tokens_per_step: float  # mean acceptance length tau (per request)
    speedup: float
    draft_positions: int
    kv_share: float

    def to_dict(self) -> dict:
        return asdict(self)


def budget(context: int, ratio: float, min_tokens: int) -> int:
    """Positions a sparse_attn draft step attends to in a cache of ``context`` (all of them when fewer)."""
    return min(context, max(math.ceil(context * ratio), min_tokens))


def sparse_attn_estimate(s: Shapes, m: Machine, *, context: int, batch: int, k: int, tau: float,
                         ratio: float = 0.05, min_tokens: int = 256, layer_share: float = 1.0,
                         algorithm: str = "streamingllm") -> SparseEstimate:
    """Predicted speedup of sparse_attn over plain decoding for ``batch`` requests at ``context``,
    drafting k tokens per step with mean acceptance length ``tau`` (1 + accepted per step)."""
    plain = forward_seconds(s, m, [(1, context)] * batch)
    pos = budget(context, ratio, min_tokens)
    draft = sum(forward_seconds(s, m, [(1, pos + j)] * batch, layer_share) for j in range(k))
    verify = forward_seconds(s, m, [(k + 1, context)] * batch)
    if algorithm == "vegas":  # the verify forward also scores its first and last queries
        verify += batch * max(context * s.kv_bytes_per_position / 2 / m.kv_bw,
                              2 * context * s.attention_flops_per_position / 2 / m.attention_flops)
    step = draft + verify
    return SparseEstimate(plain, step, tau, tau * plain / step, pos, s.kv_share(context, batch))
