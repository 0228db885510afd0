"""EAGLE-1 and EAGLE-3 drafts (arXiv 2401.15077, 2503.01840): the network and its fused CPU form.
Its files (vLLM's and SGLang's layouts, read, written, detected): ``specctl.drafts.eagle_files``.

The draft is one decoder layer that reads the target's hidden states ("features") as well as the
tokens. Index convention (vLLM's, the proposer's in ``specctl.runtime.proposers.eagle`` and the
trainer's in ``specctl.training.eagle``): the draft row at position p reads token x[p+1] and the
target's feature at p, and predicts x[p+2].

  EAGLE-3: feature f_p = fc(aux_p), aux_p = the inputs of the target's layers (2, L//2, L-3)
           concatenated [3H]. Layer: residual = h; attention input cat(input_layernorm(emb),
           hidden_norm(h)) [2H]; out = residual + attn + mlp (the "prenorm" state); logits =
           lm_head(norm(out)) over the reduced draft vocabulary (target id = i + d2t[i]).
  EAGLE-1: feature f_p = the target's final-normed hidden state (what its LM head reads). Layer
           input fc(cat(emb, h)) [2H -> H], no input norm; out = the regressed next feature;
           logits = the target's LM head on out.

What it does not know: drafting (chains, trees, slots), verification, training.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from specctl.modeling import ModelArgs, RMSNorm, rope_inv_freq, rotate_half


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's default target layers (2, L//2, L-3); a target under 8 layers gets fewer, distinct ones.

    The target concatenates the aux states in layer order (as vLLM does), so ids are sorted and unique.
    """
    return tuple(sorted({min(max(i, 0), num_layers - 1) for i in (2, num_layers // 2, num_layers - 3)}))


def rope_cos_sin(inv_freq: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """pos: [..., T] float positions -> cos, sin [..., T, head_dim] (fp32)."""
    freqs = pos[..., None].float() * inv_freq  # [..., T, hd/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


class _Attn(nn.Module):
    def __init__(self, in_dim: int, a: ModelArgs):
        super().__init__()
        self.q_proj = nn.Linear(in_dim, a.num_heads * a.head_dim, bias=False)
        self.k_proj = nn.Linear(in_dim, a.num_kv_heads * a.head_dim, bias=False)
        self.v_proj = nn.Linear(in_dim, a.num_kv_heads * a.head_dim, bias=False)
        self.o_proj = nn.Linear(a.num_heads * a.head_dim, a.hidden_size, bias=False)


class _MLP(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.gate_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=False)
        self.up_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=False)
        self.down_proj = nn.Linear(a.intermediate_size, a.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class EagleLayer(nn.Module):
    """The draft's one decoder layer, with transformers' tensor names (``self_attn.q_proj`` ...)."""

    def __init__(self, a: ModelArgs, version: int):
        super().__init__()
        self.a, self.version = a, version
        H = a.hidden_size
        self.self_attn = _Attn(2 * H if version == 3 else H, a)
        self.mlp = _MLP(a)
        if version == 3:
            self.input_layernorm = RMSNorm(H, a.rms_norm_eps)  # on the embedding
            self.hidden_norm = RMSNorm(H, a.rms_norm_eps)  # on the hidden state
        self.post_attention_layernorm = RMSNorm(H, a.rms_norm_eps)

    def attn_input(self, emb: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """emb, h: [B, T, H] -> the attention input [B, T, 2H] (EAGLE-3) or [B, T, H] (EAGLE-1: h)."""
        if self.version == 3:
            return torch.cat([self.input_layernorm(emb), self.hidden_norm(h)], dim=-1)
        return h

    def qkv(self, x, cos, sin):
        """x: [B, T, in]; cos/sin: [T, hd] -> q [B, nh, T, hd], k/v [B, nkv, T, hd] (rope applied)."""
        a = self.a
        B, T, _ = x.shape
        q = self.self_attn.q_proj(x).view(B, T, a.num_heads, a.head_dim).transpose(1, 2)
        k = self.self_attn.k_proj(x).view(B, T, a.num_kv_heads, a.head_dim).transpose(1, 2)
        v = self.self_attn.v_proj(x).view(B, T, a.num_kv_heads, a.head_dim).transpose(1, 2)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

    def finish(self, att: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """att: [B, nh, T, hd] attention output; residual [B, T, H] -> out (prenorm) [B, T, H]."""
        B, _, T, _ = att.shape
        h = residual + self.self_attn.o_proj(att.transpose(1, 2).reshape(B, T, -1))
        return h + self.mlp(self.post_attention_layernorm(h))


@dataclass
class EagleSpec:
    """What a draft is: version, draft vocabulary, target shape, aux layers (saved as config.json)."""

    version: int  # 1 or 3
    args: ModelArgs  # the draft layer's shape (hidden_size = the target's)
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int  # EAGLE-3: N; EAGLE-1: = vocab_size
    target_hidden_size: int
    aux_layers: tuple[int, ...] = ()  # EAGLE-3: the target layers whose inputs feed fc
    extra: dict = field(default_factory=dict)


def spec_from_target(target_args: ModelArgs, version: int, draft_vocab_size: int | None = None,
                     aux_layers: tuple[int, ...] | None = None) -> EagleSpec:
    """The draft shape the trainer builds for a target: one layer of the target's own width."""
    a = dataclasses.replace(target_args, arch="llama", num_layers=1, qkv_bias=False, o_bias=False, mlp_bias=False,
                            tie_word_embeddings=False, sliding_window=None)
    V = target_args.vocab_size
    n = V if version == 1 else int(draft_vocab_size or V)
    aux = tuple(sorted(set(aux_layers))) if aux_layers else (default_aux_layers(target_args.num_layers) if version == 3 else ())
    L = target_args.num_layers
    if any(not 0 <= i < L for i in aux):
        from specctl.errors import UsageError

        raise UsageError(f"--aux-layers {','.join(map(str, aux_layers or aux))}: the target has layers 0..{L - 1}",
                         f"give layer indices in 0..{L - 1} (the default is {','.join(map(str, default_aux_layers(L)))})")
    return EagleSpec(version, a, V, n, target_args.hidden_size, aux)


class EagleDraft(nn.Module):
    """fc + one EagleLayer (+ EAGLE-3's norm and lm_head over the draft vocabulary).

    The token embedding and (EAGLE-1) the LM head are the target's, passed in, never copied.
    """

    def __init__(self, spec: EagleSpec):
        super().__init__()
        self.spec = spec
        a, H = spec.args, spec.args.hidden_size
        self.version = spec.version
        fc_in = len(spec.aux_layers) * spec.target_hidden_size if spec.version == 3 else 2 * H
        self.fc = nn.Linear(fc_in, H, bias=bool(spec.extra.get("fc_bias", False)))
        self.midlayer = EagleLayer(a, spec.version)
        if spec.version == 3:
            self.norm = RMSNorm(H, a.rms_norm_eps)
            self.lm_head = nn.Linear(H, spec.draft_vocab_size, bias=False)
            ids = torch.arange(spec.draft_vocab_size, dtype=torch.int64)
            self.register_buffer("d2t", torch.zeros_like(ids))  # [N] target id = i + d2t[i]
            self.register_buffer("t2d", torch.zeros(spec.vocab_size, dtype=torch.bool))  # [V]
        self.register_buffer("inv_freq", rope_inv_freq(a), persistent=False)

    @property
    def target_ids(self) -> torch.Tensor:
        """[N] target id of each draft id (EAGLE-1: the identity)."""
        if self.version == 3:
            return self.d2t + torch.arange(self.d2t.numel(), device=self.d2t.device)
        return torch.arange(self.spec.vocab_size, device=self.fc.weight.device)

    def feature(self, target_hidden: torch.Tensor | None, target_aux: torch.Tensor | None) -> torch.Tensor:
        """The target's feature [B, T, H]: fc(aux [B, T, 3H]) (EAGLE-3) or hidden [B, T, H] (EAGLE-1)."""
        if self.version == 3:
            return self.fc(target_aux.to(self.fc.weight.dtype))
        return target_hidden.to(self.fc.weight.dtype)

    def layer_input(self, emb: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """(emb, feature or previous out) [B, T, H] -> the residual stream entering the layer."""
        if self.version == 1:
            return self.fc(torch.cat([emb, h], dim=-1))
        return h

    def logits(self, out: torch.Tensor, head_weight: torch.Tensor | None = None) -> torch.Tensor:
        """out: [..., H] -> draft logits [..., N] (EAGLE-3) or [..., V] via the target's head (EAGLE-1)."""
        if self.version == 3:
            return self.lm_head(self.norm(out))
        return F.linear(out.to(head_weight.dtype), head_weight).float()

    def forward_cached(self, emb, h, start: int, k_cache, v_cache, positions: torch.Tensor | None = None,
                       mask: torch.Tensor | None = None) -> torch.Tensor:
        """Rows in cache slots [start, start+T): emb/h [1, T, H]; caches [1, nkv, max_len, hd] -> out [1, T, H].
        Rows sit at positions start.. and attend causally, unless ``positions`` [T] and ``mask``
        [T, start+T] (a draft tree: each node its prefix and ancestors) say otherwise."""
        lay, a = self.midlayer, self.spec.args
        x = self.layer_input(emb, h)
        T = x.shape[1]
        pos = torch.arange(start, start + T, device=x.device) if positions is None else positions
        cos, sin = rope_cos_sin(self.inv_freq, pos)
        q, k, v = lay.qkv(lay.attn_input(emb, x), cos.to(x.dtype), sin.to(x.dtype))
        end = start + T
        k_cache[:, :, start:end] = k
        v_cache[:, :, start:end] = v
        if mask is None and T > 1:
            mask = torch.arange(end, device=x.device)[None, :] <= torch.arange(start, end, device=x.device)[:, None]
        att = F.scaled_dot_product_attention(q, k_cache[:, :, :end], v_cache[:, :, :end], attn_mask=mask,
                                             enable_gqa=a.num_kv_heads != a.num_heads)
        return lay.finish(att, x)

    def forward_ragged(self, emb, h, segs: list[tuple[int, int, torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Many requests' causal rows in one pass: emb/h [1, R, H] segment after segment; segs: each
        request's (start, n, k_cache, v_cache). The projections and the MLP run over all R rows at once
        (one read of the layer's weights); each request writes and attends in its own cache, as its
        own ``forward_cached`` does. -> out [1, R, H]."""
        lay, a = self.midlayer, self.spec.args
        x = self.layer_input(emb, h)
        pos = torch.cat([torch.arange(st, st + n, device=x.device) for st, n, _, _ in segs])  # [R]
        cos, sin = rope_cos_sin(self.inv_freq, pos)
        q, k, v = lay.qkv(lay.attn_input(emb, x), cos.to(x.dtype), sin.to(x.dtype))
        atts, off = [], 0
        for st, n, kc, vc in segs:
            sl, end = slice(off, off + n), st + n
            kc[:, :, st:end] = k[:, :, sl]
            vc[:, :, st:end] = v[:, :, sl]
            mask = None if n == 1 else (torch.arange(end, device=x.device)[None, :]
                                        <= torch.arange(st, end, device=x.device)[:, None])  # [n, end] causal
            atts.append(F.scaled_dot_product_attention(q[:, :, sl], kc[:, :, :end], vc[:, :, :end], attn_mask=mask,
                                                       enable_gqa=a.num_kv_heads != a.num_heads))
            off += n
        return lay.finish(torch.cat(atts, 2), x)


class FusedEagle3:
    """An EAGLE-3 draft for a bf16 target on specctl's CPU kernels: its layer is one C++ call
    (specctl/kernels/decode_layer's ``eagle3_layer``, the build the target's blocks take), fc and the draft
    head are AMX linears on weights packed once (AMX) or skinny-kernel linears on row-major bf16 weights
    (AVX512-BF16, AVX-512, AVX2), all in bf16.

    At batch 1 the fp32 per-op layer cost ~1.3 ms per call for SmolLM2-135M's width, mostly torch
    dispatch; this path reads 8 MB of bf16 weights in one parallel region. The same methods as
    ``EagleDraft`` (``feature``, ``layer_input``, ``forward_cached``, ``logits``), bf16 in and out.
    The draft's numerics differ from fp32 in rounding only, and verification keeps the output exact.
    ``build(draft)`` returns None where the kernels or the shapes do not fit (callers keep EagleDraft).
    """

    dtype = torch.bfloat16

    def __init__(self, draft: EagleDraft, kernels):
        """``kernels``: its target's kernel set (``KernelSet``), whose fused block build runs the layer ("amx":
        weights packed in AMX tiles, fc and the head AMX linears; "avx512_bf16", "avx512", "avx2": the skinny
        build, row-major bf16 weights, fc and the head through the skinny kernel)."""
        from specctl.kernels import amx_linear, decode_layer, skinny_linear

        kind = decode_layer.kind(kernels.block)
        bf = lambda w: w.detach().to(torch.bfloat16).contiguous()  # noqa: E731
        pk = (lambda w: amx_linear.pack(bf(w))) if kind == "amx" else bf
        self.kind, self.block_ext = kind, kernels.block
        ext = kernels.amx if kind == "amx" else kernels.linear
        run = amx_linear.linear if kind == "amx" else skinny_linear.run
        self._linear = lambda x, w, b=None: run(ext, x, w, b)
        lay, a = draft.midlayer, draft.spec.args
        at = lay.self_attn
        self.spec, self.version, self.a = draft.spec, 3, a
        self.inv_freq = draft.inv_freq
        self.fc = pk(draft.fc.weight)
        self.fc_bias = None if draft.fc.bias is None else bf(draft.fc.bias)
        self.qkv = pk(torch.cat([at.q_proj.weight, at.k_proj.weight, at.v_proj.weight]))
        self.o = pk(at.o_proj.weight)
        self.gate_up = pk(torch.cat([lay.mlp.gate_proj.weight, lay.mlp.up_proj.weight]))
        self.down = pk(lay.mlp.down_proj.weight)
        self.hidden_norm, self.input_norm = bf(lay.hidden_norm.weight), bf(lay.input_layernorm.weight)
        self.post_norm = bf(lay.post_attention_layernorm.weight)
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps).requires_grad_(False)  # the final norm, in bf16
        self.norm.weight.data = bf(draft.norm.weight)
        self.head = pk(draft.lm_head.weight)
        self.eps = float(a.rms_norm_eps)
        self.num_heads, self.num_kv_heads = a.num_heads, a.num_kv_heads

    @classmethod
    def build(cls, draft: EagleDraft, target_dtype: torch.dtype, device, kernels) -> "FusedEagle3 | None":
        """The fused draft on its target's kernel set ``kernels``, or None where the draft's shapes or the set do
        not fit."""
        from specctl.kernels import decode_layer

        a, H = draft.spec.args, draft.spec.args.hidden_size
        fits = (draft.version == 3 and target_dtype == torch.bfloat16 and torch.device(device).type == "cpu"
                and H % 32 == 0 and a.head_dim % 32 == 0 and a.num_heads % a.num_kv_heads == 0
                and a.num_heads // a.num_kv_heads <= 16 and (a.num_heads + 2 * a.num_kv_heads) * a.head_dim % 16 == 0
                and a.intermediate_size % 32 == 0 and draft.spec.draft_vocab_size % 16 == 0
                and draft.fc.weight.shape[1] % 32 == 0 and a.num_heads * a.head_dim % 32 == 0)
        kind = decode_layer.kind(kernels.block) if fits and kernels.block is not None else None
        if kind is None or (kernels.amx if kind == "amx" else kernels.linear) is None:
            return None
        return cls(draft, kernels)

    def feature(self, target_hidden, target_aux: torch.Tensor) -> torch.Tensor:
        return self._linear(target_aux.to(torch.bfloat16).contiguous(), self.fc, self.fc_bias)

    def layer_input(self, emb, h):
        return h

    def forward_cached(self, emb, h, start: int, k_cache, v_cache, positions=None, mask=None) -> torch.Tensor:
        """As EagleDraft.forward_cached; a tree ``mask`` [T, start+T] must see the whole prefix before
        the tree's first slot (as the proposer's masks do)."""
        from specctl.kernels import decode_layer

        T, R = h.shape[1], decode_layer.MAX_ROWS
        if T > R:  # a prompt's feature rows: causal chunks of what one call takes
            return torch.cat([self.forward_cached(emb[:, i:i + R], h[:, i:i + R], start + i, k_cache, v_cache)
                              for i in range(0, T, R)], dim=1)
        pos = torch.arange(start, start + T) if positions is None else positions
        cos, sin = rope_cos_sin(self.inv_freq, pos)
        tree = None
        if mask is not None:  # the kernel's mask starts where the fully visible prefix ends
            first = int(mask.all(0).logical_not().nonzero()[0]) if not bool(mask.all()) else start
            tree = mask[:, first:]
        return decode_layer.eagle3_layer(self, h.to(torch.bfloat16), emb.to(torch.bfloat16), cos.to(torch.bfloat16),
                                         sin.to(torch.bfloat16), k_cache, v_cache, start, tree)

    def forward_ragged(self, emb, h, segs: list[tuple[int, int, torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """As EagleDraft.forward_ragged: the layer runs request by request (one C++ call each); the
        draft head, the large read, is batched by the caller through ``logits``."""
        outs, off = [], 0
        for st, n, kc, vc in segs:
            outs.append(self.forward_cached(emb[:, off:off + n], h[:, off:off + n], st, kc, vc))
            off += n
        return torch.cat(outs, 1)

    def logits(self, out: torch.Tensor, head_weight=None) -> torch.Tensor:
        return self._linear(self.norm(out.to(torch.bfloat16)).contiguous(), self.head).float()
