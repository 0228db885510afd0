"""The own decoder-only transformer (Llama / Qwen2 / Mistral families), written for decoding.

``Transformer.forward(tokens, start, cache)`` writes the new tokens' keys and values into a
preallocated KV cache at positions [start, start+T) and attends to positions [0, start+T); nothing is
allocated per step but activations, and rolling the cache back is the caller setting a shorter
length (the next forward overwrites the rejected slots). ``forward_ragged`` carries many requests'
rows (decode, verify chains and trees, prefill chunks), each in its own cache. Weights are fused (q|k|v
in one matrix, gate|up in another); on CPUs with AMX / AVX512-BF16 the linears, attention and whole
blocks run in specctl's C++ kernels, every row computed as if alone (``kernels``).

What it does not know: sampling, speculation, tokenizers, checkpoints on disk (``modeling.load``).
Numerics follow transformers' modelling code (RMSNorm in fp32, rotary cos/sin cast to the compute
dtype) so that fp32 logits match it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specctl.kernels import amx_linear, decode_attention, decode_layer
from specctl.kernels.select import TORCH, KernelSet
from specctl.modeling.args import SDPA_ROWS, VERIFY_ROWS, ModelArgs, rope_inv_freq
from specctl.modeling.kv_cache import KVCache, scored_upto


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class DenseLinear(nn.Linear):
    """A projection with its row-major weight [N, K], computed by its kernel set (``KernelSet.dense``: the
    skinny bf16 kernel on the vector paths, every row as if alone; torch's F.linear otherwise)."""

    def __init__(self, layer: nn.Linear, kernels: KernelSet):
        nn.Module.__init__(self)
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.weight, self.bias = layer.weight, layer.bias
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.dense(x, self.weight, self.bias)


class AmxLinear(nn.Module):
    """A projection whose weight is held in AMX tiles [N/16, K/32, 16, 16, 2] (``amx_linear.pack``), computed by
    the AMX build (every row as if alone)."""

    def __init__(self, layer: nn.Linear, packed: torch.Tensor, ext):
        super().__init__()
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.weight = nn.Parameter(packed, requires_grad=False)
        self.bias = layer.bias
        self.ext = ext

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return amx_linear.linear(self.ext, x, self.weight, self.bias)

    def dense_weight(self) -> torch.Tensor:
        """The weight row-major [N, K] again."""
        return amx_linear.unpack(self.weight)


def _retype(block: nn.Module, make) -> None:
    """Each of ``block``'s projections replaced by ``make(layer)`` (None: kept)."""
    for name in block.PROJECTIONS:
        new = make(getattr(block, name))
        if new is not None:
            setattr(block, name, new)


def pack_for_amx(model: "Transformer", ext) -> None:
    """Every bf16 projection into an ``AmxLinear`` (its weight repacked into AMX tiles) and a copy of the LM
    head (``head_packed``), for the AMX build ``ext``."""
    todo = [layer for block in model.layers for layer in block.projections
            if type(layer) in (nn.Linear, DenseLinear)  # not GGUF blocks (specctl.runtime.quant): no fused block
            and amx_linear.packable(layer.weight)]
    head = model.quant_head is None and amx_linear.packable(model.head_weight)
    weights = [layer.weight for layer in todo] + ([model.head_weight] if head else [])
    # the packed copies in one arena (one huge-page mapping, not one each: its spare page is paid once)
    arena = amx_linear.Arena(sum(amx_linear.Arena.size(tuple(w.shape), w.dtype) for w in weights))

    def packed(w: torch.Tensor) -> torch.Tensor:
        return amx_linear.pack(w.data, out=arena.take(amx_linear.packed_shape(*w.shape), w.dtype))

    chosen = {id(layer) for layer in todo}
    for block in model.layers:
        _retype(block, lambda layer: AmxLinear(layer, packed(layer.weight), ext) if id(layer) in chosen else None)
    if head:
        model.head_packed = packed(model.head_weight)


def adopt_kernels(module: nn.Module, kernels: KernelSet) -> nn.Module:
    """``module``'s blocks on ``kernels``: each Block's kernel set, and its dense projections as ``DenseLinear``
    (where the set has the skinny kernel). A draft that runs blocks of its own (MTP) takes its target's set."""
    for block in module.modules():
        if isinstance(block, Block):
            block.kernels = kernels
            if kernels.linear is not None:
                _retype(block, lambda layer: DenseLinear(layer, kernels) if type(layer) is nn.Linear else None)
    return module


@dataclass
class Segment:
    """One request's rows in a ragged forward (``Transformer.forward_ragged``): ``n`` tokens written
    at slots [start, start+n) of ``cache`` (the request's own KVCache, batch 1).

    ``mask`` [n, start+n] bool as ``Transformer.forward`` takes it (None for one row); a draft
    tree also has ``positions`` [n] (rotary positions) and ``tree`` [n, n] (each node's ancestors,
    for the exact kernels); ``last_only``: only the last row's logits are wanted (a prompt)."""

    cache: "KVCache"
    start: int
    n: int
    mask: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    tree: torch.Tensor | None = None
    last_only: bool = False


class Block(nn.Module):
    PROJECTIONS = ("qkv", "o", "gate_up", "down")  # its linears: the ones the CPU kernels repack or read quantized

    def __init__(self, a: ModelArgs):
        super().__init__()
        self.a = a
        qkv_out = (a.num_heads + 2 * a.num_kv_heads) * a.head_dim
        self.input_norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.qkv = nn.Linear(a.hidden_size, qkv_out, bias=a.qkv_bias)
        self.o = nn.Linear(a.num_heads * a.head_dim, a.hidden_size, bias=a.o_bias)
        self.post_norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.gate_up = nn.Linear(a.hidden_size, 2 * a.intermediate_size, bias=a.mlp_bias)
        self.down = nn.Linear(a.intermediate_size, a.hidden_size, bias=a.mlp_bias)
        self.kernels: KernelSet = TORCH  # the model's (``enable_exact_bf16``): the attention's and fused block's builds
        self.exact_attention = False  # decode/verify rows through specctl/kernels/decode_attention (bf16 CPU)
        self.fused = False  # decode/verify rows through specctl/kernels/decode_layer (one call per block)
        self.fused_ext = None  # that build (the kernel set's dense one, or the GGUF blocks' quantized one)

    @property
    def projections(self) -> tuple[nn.Module, ...]:
        """The block's linears (``PROJECTIONS``), in that order."""
        return tuple(getattr(self, name) for name in self.PROJECTIONS)

    def forward(self, x, cos, sin, k_cache, v_cache, start: int, mask, tree: bool = False,
                tree_mask: torch.Tensor | None = None):
        # x: [B, T, H]; cos/sin: [T, head_dim]; k_cache/v_cache: [B, n_kv, max_len, head_dim]
        # tree: the rows have positions of their own and attend as ``mask`` says, not as a chain;
        # tree_mask [T, T]: they are a draft tree (each node its ancestors), which the C++ kernels
        # compute as exactly as a chain
        B, T, _ = x.shape
        exact_tree = tree_mask is not None
        if self.fused and (not tree or exact_tree) and B * T <= decode_layer.MAX_ROWS:
            return decode_layer.layer(self, x, cos, sin, k_cache, v_cache, start, tree_mask)
        q, k, v = self._qkv(x, cos, sin)
        att = self._attend(q, k, v, k_cache, v_cache, start, mask, tree, tree_mask)
        return self._out(x, att)

    def _qkv(self, x, cos, sin):
        """x [B, T, H] -> rotated q [B, nh, T, hd], k and v [B, nkv, T, hd]."""
        a = self.a
        B, T, _ = x.shape
        qkv = self.qkv(self.input_norm(x))
        q, k, v = qkv.split([a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.num_kv_heads * a.head_dim], -1)
        q = q.view(B, T, a.num_heads, a.head_dim).transpose(1, 2)  # [B, nh, T, hd]
        k = k.view(B, T, a.num_kv_heads, a.head_dim).transpose(1, 2)  # [B, nkv, T, hd]
        v = v.view(B, T, a.num_kv_heads, a.head_dim).transpose(1, 2)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

    def _attend(self, q, k, v, k_cache, v_cache, start: int, mask, tree: bool, tree_mask) -> torch.Tensor:
        """Write k/v at slots [start, start+T) and attend: -> [B, T, nh * hd]."""
        a = self.a
        B, _, T, _ = q.shape
        end = start + T
        k_cache[:, :, start:end] = k
        v_cache[:, :, start:end] = v
        gqa = a.num_kv_heads != a.num_heads
        if (self.exact_attention and (not tree or tree_mask is not None) and T <= VERIFY_ROWS
                and a.sliding_window is None and q.dtype is torch.bfloat16):
            # Decode and verification rows in one kernel call; each row computed as if alone.
            return decode_attention.attention(self.kernels.attention, q, k_cache, v_cache, start, tree=tree_mask)  # [B, T, nh * hd]
        if mask is not None and not tree and T <= SDPA_ROWS and a.sliding_window is None:
            # Verification: each row attends exactly as it would when decoded alone (one query, no
            # mask, keys [0, pos]), so its output is bit-identical to plain decoding's.
            att = torch.cat([
                F.scaled_dot_product_attention(q[:, :, i:i + 1], k_cache[:, :, :start + i + 1],
                                               v_cache[:, :, :start + i + 1], enable_gqa=gqa)
                for i in range(T)
            ], dim=2)  # [B, nh, T, hd]
        else:
            # a prompt from the start ([T, T] causal): SDPA's own causal form skips the blocks above the
            # diagonal (the same bits as with the mask, in ~0.6 of the time at 2048 tokens)
            causal = (not tree and start == 0 and mask is not None and tuple(mask.shape) == (T, T)
                      and a.sliding_window is None)
            att = F.scaled_dot_product_attention(
                q, k_cache[:, :, :end], v_cache[:, :, :end], attn_mask=None if causal else mask, is_causal=causal,
                enable_gqa=gqa,
            )  # [B, nh, T, hd]
        return att.transpose(1, 2).reshape(B, T, a.num_heads * a.head_dim)

    def _out(self, x, att):
        """The residual after attention's output projection and the MLP."""
        x = x + self.o(att)
        gate, up = self.gate_up(self.post_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)

    def forward_ragged(self, x, cos, sin, layer: int, segs: list["Segment"], weights_out: list | None = None):
        """Many requests' rows in one block: x [1, R, H] (segment after segment), cos/sin [R, hd].
        The projections and the MLP run over all R rows at once (one read of the weights); each
        segment writes its keys/values into its own cache and attends there, exactly as its own
        forward would (segments of at most VERIFY_ROWS rows: longer ones are prefill, which their
        own forward computes differently)."""
        if self.fused:
            return decode_layer.layer_ragged(self, x, cos, sin, layer, segs, weights_out)
        q, k, v = self._qkv(x, cos, sin)
        atts, off = [], 0
        for s in segs:
            sl = slice(off, off + s.n)
            atts.append(self._attend(q[:, :, sl], k[:, :, sl], v[:, :, sl], s.cache.k[layer], s.cache.v[layer],
                                     s.start, s.mask, s.positions is not None, s.tree))
            off += s.n
        return self._out(x, torch.cat(atts, 1))


def _step_static(block: Block, x, cos, sin, k_cache, v_cache, pos, kmask):
    """One decode row of ``block`` in static shapes (for torch.compile / CUDA graphs): the new key and
    value go to slot ``pos`` (a tensor) and the query attends over the whole cache under ``kmask``."""
    a = block.a
    B = x.shape[0]
    qkv = F.linear(block.input_norm(x), block.qkv.weight, block.qkv.bias)
    q, k, v = qkv.split([a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.num_kv_heads * a.head_dim], -1)
    q = q.view(B, 1, a.num_heads, a.head_dim).transpose(1, 2)
    k = k.view(B, 1, a.num_kv_heads, a.head_dim).transpose(1, 2)
    v = v.view(B, 1, a.num_kv_heads, a.head_dim).transpose(1, 2)
    q = q * cos + rotate_half(q) * sin
    k = k * cos + rotate_half(k) * sin
    k_cache.index_copy_(2, pos, k)
    v_cache.index_copy_(2, pos, v)
    att = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=kmask,
                                         enable_gqa=a.num_kv_heads != a.num_heads)
    x = x + F.linear(att.transpose(1, 2).reshape(B, 1, a.num_heads * a.head_dim), block.o.weight, block.o.bias)
    gate, up = F.linear(block.post_norm(x), block.gate_up.weight, block.gate_up.bias).chunk(2, dim=-1)
    return x + F.linear(F.silu(gate) * up, block.down.weight, block.down.bias)


class Transformer(nn.Module):
    """A causal LM over a preallocated cache. See the module docstring."""

    def __init__(self, a: ModelArgs):
        super().__init__()
        self.args = a
        self.embed = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = nn.ModuleList(Block(a) for _ in range(a.num_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.lm_head = None if a.tie_word_embeddings else nn.Linear(a.hidden_size, a.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(a), persistent=False)
        self.head_packed: torch.Tensor | None = None  # the LM head in AMX tiles (pack_for_amx)
        self.kernels: KernelSet = TORCH  # the C++ builds its bf16 CPU forward runs on (``enable_exact_bf16``)
        self.quant_head: nn.Module | None = None  # the LM head as GGUF blocks (specctl.runtime.quant), fp32 logits
        # the row-independent C++ path its bf16 linears take on a CPU ("amx", "avx512_bf16", "avx512", "avx2"; see
        # specctl/kernels/cpu.py), or None for torch's own kernels
        self.cpu_kernels: str | None = None

    @property
    def head_weight(self) -> torch.Tensor:
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def rope(self, start: int, T: int, dtype, positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        pos = (torch.arange(start, start + T, device=self.inv_freq.device, dtype=torch.float32) if positions is None
               else positions.to(self.inv_freq.device, torch.float32))
        freqs = pos[..., None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, head_dim], or [B, T, head_dim] for per-row positions
        if emb.dim() == 3:
            emb = emb[:, None]  # [B, 1, T, head_dim]: broadcast over heads
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, tokens: torch.Tensor, start: int, cache: "KVCache", mask: torch.Tensor | None,
                logits: str = "all", positions: torch.Tensor | None = None,
                aux_layers: tuple[int, ...] = (), scores: bool = False) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """tokens: [B, T] at cache slots [start, start+T); mask: [T, start+T] bool or None (T == 1).
        ``positions`` [T] (rotary positions; default start..start+T-1) marks a draft tree: the rows
        then attend as ``mask`` says (each node its ancestors), through SDPA. ``positions`` [B, T]
        with ``mask`` [B, 1, T, start+T]: rows at positions of their own (left-padded rows; the batched
        engine uses ``forward_ragged`` instead, each request in its own cache).

        ``aux_layers``: layers whose *input* hidden state (the residual stream, as vLLM's aux hidden
        states and transformers' hidden_states[i]) the caller wants, e.g. EAGLE-3's (2, L//2, L-3).
        ``scores``: a chain of several rows or a prompt (batch 1) records its attention weights in
        ``cache.scores`` (what Vegas ranks positions by); the outputs are the same bits either way.

        Returns (logits [B, T', V] with T' = T for "all", 1 for "last", None for "none";
        hidden [B, T, H], the final-normed hidden states the LM head reads;
        aux [B, T, len(aux_layers) * H] the aux layers' inputs concatenated, or None).
        """
        tree = positions is not None
        T = tokens.shape[1]
        if (not tree and tokens.shape[0] == 1 and T <= VERIFY_ROWS and all(b.fused for b in self.layers)
                and scores and cache.records(T, logits == "last")):
            # scores to record: the fused kernel writes them while it attends, as in a batch of one
            lg, h, aux = self.forward_ragged(tokens[0], [Segment(cache, start, T, mask, last_only=logits == "last")],
                                             aux_layers=aux_layers, scores=True)
            return (None if logits == "none" else lg[None]), h[None], (None if aux is None else aux[None])
        x = self.embed(tokens)
        cos, sin = self.rope(start, tokens.shape[1], x.dtype, positions)
        # a draft tree (positions [T], mask [T, start+T]): its own [T, T] part, for the exact kernels
        tree_mask = mask[:, start:].contiguous() if tree and positions.dim() == 1 and mask.dim() == 2 else None
        aux = []
        scoring = scores and not tree and tokens.shape[0] == 1 and cache.scoring(start, tokens.shape[1], logits == "last")
        for i, layer in enumerate(self.layers):
            if i in aux_layers:
                aux.append(x)
            x_in = x
            x = layer(x, cos, sin, cache.k[i], cache.v[i], start, mask, tree, tree_mask)
            if scoring:
                cache.scores[i, :, :, :start + tokens.shape[1]] = attention_scores(layer, x_in, cos, sin, cache.k[i], start)
        if scoring:
            cache.scored = scored_upto(start, tokens.shape[1], logits == "last")
        aux = torch.cat(aux, dim=-1) if aux else None
        h = self.norm(x)
        if logits == "none":
            return None, h, aux
        return self.head(h[:, -1:] if logits == "last" else h), h, aux

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """The LM head over final-normed hidden states, through the exact path the linears take."""
        if self.quant_head is not None:
            return self.quant_head(h)
        if self.head_packed is not None:
            return amx_linear.linear(self.kernels.amx, h, self.head_packed)
        return self.kernels.dense(h, self.head_weight)


    def forward_ragged(self, tokens: torch.Tensor, segs: list[Segment], layers: list[int] | None = None,
                       aux_layers: tuple[int, ...] = (), scores: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """One forward over many requests' rows: tokens [R] (the segments' tokens one after the
        other), each segment at its own cache and positions (a decode row, a verify block, a draft
        tree or a prompt). The linears read the weights once for all R rows; on the row-independent
        paths (AMX, AVX512-BF16: specctl/kernels/cpu.py) every row equals, bit for bit, what the request's
        own ``forward`` computes. Returns (logits [R', V]: every row, but only the last of a
        ``last_only`` segment; hidden [R, H], final-normed; aux [R, len(aux_layers) * H] or None).
        ``layers``: run only these (a draft that skips layers; the others' caches are left as they are).
        ``scores``: each chain or prompt segment records its attention weights in its cache (``forward``'s)."""
        x = self.embed(tokens)[None]  # [1, R, H]
        pos = torch.cat([s.positions.to(torch.float32) if s.positions is not None
                         else torch.arange(s.start, s.start + s.n, dtype=torch.float32) for s in segs])
        cos, sin = self.rope(0, 0, x.dtype, pos)  # [R, hd]
        aux = []
        scored, off = [], 0  # (segment, its first row) whose cache keeps attention scores
        for s in segs:
            if scores and s.positions is None and s.cache.scoring(s.start, s.n, s.last_only):
                scored.append((s, off))
            off += s.n
        kept = [s.cache.scores if any(s is t for t, _ in scored) else None for s in segs]
        for i, layer in enumerate(self.layers):
            if layers is not None and i not in layers:
                continue
            if i in aux_layers:
                aux.append(x)
            x_in = x
            if layer.fused and scored:  # the fused kernel writes the weights as it attends
                x = layer.forward_ragged(x, cos, sin, i, segs, [None if w is None else w[i] for w in kept])
                continue
            x = layer.forward_ragged(x, cos, sin, i, segs)
            for s, o in scored:
                s.cache.scores[i, :, :, :s.start + s.n] = attention_scores(layer, x_in[:, o:o + s.n], cos[o:o + s.n],
                                                                           sin[o:o + s.n], s.cache.k[i], s.start)
        for s, _ in scored:
            s.cache.scored = scored_upto(s.start, s.n, s.last_only)
        aux = torch.cat(aux, dim=-1)[0] if aux else None
        h = self.norm(x)[0]  # [R, H]
        rows, off = [], 0
        for s in segs:
            rows.extend([off + s.n - 1] if s.last_only else range(off, off + s.n))
            off += s.n
        return self.head(h if len(rows) == h.shape[0] else h[torch.tensor(rows, device=h.device)]), h, aux

    def decode_step(self, tokens: torch.Tensor, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    aux_layers: tuple[int, ...] = ()):
        """One token per row in static shapes: tokens [B, 1] at cache slot ``pos`` ([1] int64 tensor).

        The shapes never change from step to step (the query attends over the whole preallocated
        cache, masked beyond ``pos``), so ``torch.compile`` compiles it once and, on a GPU, CUDA
        graphs replay it. Returns (logits [B, 1, V], hidden [B, 1, H], aux or None); ``k``/``v``
        are the KVCache tensors, updated in place.
        """
        a = self.args
        x = self.embed(tokens)
        cos, sin = self.rope(0, 1, x.dtype, pos)
        slots = torch.arange(k.shape[3], device=pos.device)
        kmask = slots <= pos
        if a.sliding_window is not None:
            kmask = kmask & (slots > pos - a.sliding_window)
        aux = []
        for i, layer in enumerate(self.layers):
            if i in aux_layers:
                aux.append(x)
            x = _step_static(layer, x, cos, sin, k[i], v[i], pos, kmask[None, None, None, :])
        h = self.norm(x)
        return F.linear(h, self.head_weight), h, (torch.cat(aux, dim=-1) if aux else None)


def attention_scores(block: "Block", x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                     start: int) -> torch.Tensor:
    """The softmax weights that the first and last of ``x``'s rows (x [1, T, H], the block's input,
    at cache slots start..start+T-1, whose keys are already in ``k_cache`` [1, n_kv, max_len, hd])
    give every key, summed over the query heads of each kv head: [2, n_kv, start+T] fp32 (a row's
    weights are 0 past its own position). A side computation (the query projection again for two
    rows, one read of the keys) where the attention kernel does not write them itself: the block's
    own output is untouched."""
    a = block.a
    T = x.shape[1]
    rows = [0, T - 1] if T > 1 else [0]
    xr = x[:, rows]
    q = block.qkv(block.input_norm(xr))[..., :a.num_heads * a.head_dim]
    q = q.view(1, len(rows), a.num_heads, a.head_dim).transpose(1, 2)  # [1, nh, r, hd]
    c, s = cos[rows], sin[rows]
    q = (q * c + rotate_half(q) * s)[0]  # [nh, r, hd]
    end = start + T
    g = a.num_heads // a.num_kv_heads
    keys = k_cache[0, :, :end]  # [nkv, end, hd]
    logits = torch.matmul(q.reshape(a.num_kv_heads, g * len(rows), a.head_dim), keys.transpose(1, 2)).float()
    logits = logits.view(a.num_kv_heads, g, len(rows), end) * (a.head_dim ** -0.5)
    pos = torch.arange(end, device=x.device)
    limit = torch.tensor([start + r for r in rows], device=x.device)
    logits = logits.masked_fill(pos[None, :] > limit[:, None], float("-inf"))  # causal
    w = torch.softmax(logits, dim=-1).sum(dim=1)  # [nkv, rows, end]
    return w.transpose(0, 1) if len(rows) == 2 else w.transpose(0, 1).expand(2, -1, -1)
