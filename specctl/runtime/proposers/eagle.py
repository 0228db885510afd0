"""EAGLE-1 and EAGLE-3 drafting (arXiv 2401.15077, 2503.01840): the draft network and its proposers.

The draft is one decoder layer that reads the target's hidden states ("features") as well as the
tokens. Index convention (vLLM's, and the trainer's in ``specctl.training.eagle``): the draft row
at position p reads token x[p+1] and the target's feature at p, and predicts x[p+2].

  EAGLE-3: feature f_p = fc(aux_p), aux_p = the inputs of the target's layers (2, L//2, L-3)
           concatenated [3H]. Layer: residual = h; attention input cat(input_layernorm(emb),
           hidden_norm(h)) [2H]; out = residual + attn + mlp (the "prenorm" state); logits =
           lm_head(norm(out)) over the reduced draft vocabulary (target id = i + d2t[i]).
  EAGLE-1: feature f_p = the target's final-normed hidden state (what its LM head reads). Layer
           input fc(cat(emb, h)) [2H -> H], no input norm; out = the regressed next feature;
           logits = the target's LM head on out.
Chain drafting: step 1 is the last fed row (feature of the last cached target position, token =
the last emitted token); step j+1 feeds (draft token j, out of step j) at the next position, so
the draft's own ``out`` stands in for the feature it has not seen yet.

Worked example (k = 3): the target cache holds positions 0..9 (10 features known), the last
emitted token x10 is not cached. ``propose`` feeds rows [n_fed, 10) with tokens x[p+1] (the last
one x10), whose row 9 gives d1; then (d1, out_9) at position 10 gives d2, (d2, out_10) at 11 gives
d3. The draft's cache length stays 10: positions 10, 11 hold chain keys, overwritten next time by
features of whatever the target accepts (KV rollback is setting a length).

Tree drafting (EAGLE-2's dynamic tree, arXiv 2406.16858; ``speculative_eagle_topk`` = K and
``speculative_num_draft_tokens`` = N, greedy requests): the last fed row's top-K tokens are level 1;
each later level forwards the K best nodes of the level before (by cumulative draft log-probability)
as one draft call of K rows, each node at position P + depth - 1 in a scratch slot of its own and
attending to the prefix and its ancestors only (a tree mask), and each forwarded node offers its
top-K children. After ``k`` levels every candidate is reranked by cumulative log-probability and the
best N (a connected tree: a node's score never exceeds its parent's) go to verification. The
verifier follows the target's greedy choices down the tree, so output stays the target's own.

What it does not know: verification, the target's cache, training (``specctl.training.eagle``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from specctl.config import SpecConfig
from specctl.errors import ModelError, UsageError
from specctl.runtime.model import ModelArgs, RMSNorm, rope_inv_freq, rotate_half
from specctl.runtime.proposers.base import DraftOutput, SlotProposer, batch_draft
from specctl.runtime.proposers.base import DraftSampling as _Sampling
from specctl.runtime.rejection import logits_to_probs


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
    import dataclasses

    a = dataclasses.replace(target_args, arch="llama", num_layers=1, qkv_bias=False, o_bias=False, mlp_bias=False,
                            tie_word_embeddings=False, sliding_window=None)
    V = target_args.vocab_size
    n = V if version == 1 else int(draft_vocab_size or V)
    aux = tuple(sorted(set(aux_layers))) if aux_layers else (default_aux_layers(target_args.num_layers) if version == 3 else ())
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


class FusedEagle3:
    """An EAGLE-3 draft for a bf16 target on an AMX CPU: its layer is one C++ call (kernels/decode_layer's
    ``eagle3_layer``), fc and the draft head are AMX linears on weights packed once, all in bf16.

    At batch 1 the fp32 per-op layer cost ~1.3 ms per call for SmolLM2-135M's width, mostly torch
    dispatch; this path reads 8 MB of bf16 weights in one parallel region. The same methods as
    ``EagleDraft`` (``feature``, ``layer_input``, ``forward_cached``, ``logits``), bf16 in and out.
    The draft's numerics differ from fp32 in rounding only, and verification keeps the output exact.
    ``build(draft)`` returns None where the kernels or the shapes do not fit (callers keep EagleDraft).
    """

    dtype = torch.bfloat16

    def __init__(self, draft: EagleDraft):
        from kernels import amx_linear

        pk = lambda w: amx_linear.pack(w.detach().to(torch.bfloat16).contiguous())  # noqa: E731
        bf = lambda w: w.detach().to(torch.bfloat16).contiguous()  # noqa: E731
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
    def build(cls, draft: EagleDraft, target_dtype: torch.dtype, device) -> "FusedEagle3 | None":
        from kernels import amx_linear, decode_layer

        a, H = draft.spec.args, draft.spec.args.hidden_size
        fits = (draft.version == 3 and target_dtype == torch.bfloat16 and torch.device(device).type == "cpu"
                and H % 32 == 0 and a.head_dim % 32 == 0 and a.num_heads % a.num_kv_heads == 0
                and a.num_heads // a.num_kv_heads <= 16 and (a.num_heads + 2 * a.num_kv_heads) * a.head_dim % 16 == 0
                and a.intermediate_size % 32 == 0 and draft.spec.draft_vocab_size % 16 == 0
                and draft.fc.weight.shape[1] % 32 == 0 and a.num_heads * a.head_dim % 32 == 0)
        if not fits or decode_layer.load() is None or amx_linear.load() is None:
            return None
        return cls(draft)

    def feature(self, target_hidden, target_aux: torch.Tensor) -> torch.Tensor:
        from kernels import amx_linear

        return amx_linear.linear(target_aux.to(torch.bfloat16).contiguous(), self.fc, self.fc_bias)

    def layer_input(self, emb, h):
        return h

    def forward_cached(self, emb, h, start: int, k_cache, v_cache, positions=None, mask=None) -> torch.Tensor:
        """As EagleDraft.forward_cached; a tree ``mask`` [T, start+T] must see the whole prefix before
        the tree's first slot (as the proposer's masks do)."""
        from kernels import decode_layer

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

    def logits(self, out: torch.Tensor, head_weight=None) -> torch.Tensor:
        from kernels import amx_linear

        return amx_linear.linear(self.norm(out.to(torch.bfloat16)).contiguous(), self.head).float()


# --------------------------------------------------------------------------- loading (vLLM / SGLang layouts)

def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    sd: dict[str, torch.Tensor] = {}
    files = sorted(folder.glob("*.safetensors"))
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for key in fh.keys():
                sd[key] = fh.get_tensor(key)
    if not files:
        bins = sorted(folder.glob("pytorch_model*.bin"))
        for f in bins:
            sd.update(torch.load(f, map_location="cpu", weights_only=True))
    if not sd:
        raise ModelError(f"{folder} has no EAGLE weights (*.safetensors or pytorch_model.bin)",
                         "pass the folder `specctl train-eagle` wrote, or an EAGLE checkpoint folder")
    return sd


def load_eagle_draft(folder: str | Path, target_args: ModelArgs, version: int | None = None) -> tuple[EagleDraft, torch.Tensor | None]:
    """An EAGLE-1/-3 draft in vLLM's layout -> (EagleDraft fp32 eval, its own embedding [V, H] or None).

    Accepts ``midlayer.*`` or ``layers.0.*`` names, with or without a ``model.`` prefix; EAGLE-3
    without d2t means a full draft vocabulary.
    """
    folder = Path(folder)
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError) as e:
        raise ModelError(f"{folder} has no readable config.json ({type(e).__name__})",
                         "pass the EAGLE draft folder (config.json + weights)") from None
    sd = {k.removeprefix("model."): v for k, v in _read_tensors(folder).items()}
    archs = " ".join(cfg.get("architectures") or [])
    is3 = "Eagle3" in archs or "d2t" in sd or any(k.startswith("midlayer.") for k in sd) or "hidden_norm" in " ".join(sd)
    v = version or (3 if is3 else 1)
    sd = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): t for k, t in sd.items()}
    c = dict(cfg, model_type="llama", num_hidden_layers=1)
    c.setdefault("vocab_size", target_args.vocab_size)
    c.setdefault("hidden_size", target_args.hidden_size)
    args = ModelArgs.from_hf_config(c)
    if args.hidden_size != target_args.hidden_size and v == 1:
        raise ModelError(f"EAGLE-1 draft width {args.hidden_size} != the target's {target_args.hidden_size}",
                         "use a draft trained for this target")
    if args.vocab_size != target_args.vocab_size:
        raise ModelError(f"the draft was made for a vocabulary of {args.vocab_size}, the target has {target_args.vocab_size}",
                         "use a draft trained for this target")
    eagle_cfg = cfg.get("eagle_config") or {}
    aux = tuple(sorted(set(cfg.get("eagle_aux_hidden_state_layer_ids") or eagle_cfg.get("eagle_aux_hidden_state_layer_ids")
                           or (default_aux_layers(target_args.num_layers) if v == 3 else ()))))
    n = int(cfg.get("draft_vocab_size") or args.vocab_size) if v == 3 else args.vocab_size
    spec = EagleSpec(v, args, args.vocab_size, n, int(cfg.get("target_hidden_size") or target_args.hidden_size), aux,
                     extra={"fc_bias": "fc.bias" in sd})
    fc_in = sd["fc.weight"].shape[1] if "fc.weight" in sd else None
    if v == 3 and fc_in is not None and fc_in != len(aux) * spec.target_hidden_size:
        raise ModelError(f"fc.weight reads {sd['fc.weight'].shape[1]} features, not {len(aux)} aux layers x {spec.target_hidden_size}",
                         "set eagle_aux_hidden_state_layer_ids in the draft's config.json")
    draft = EagleDraft(spec)
    embed = sd.pop("embed_tokens.weight", None)
    if v == 3:
        if "d2t" not in sd:
            sd["d2t"] = torch.zeros(n, dtype=torch.int64)
        if "t2d" not in sd:
            t2d = torch.zeros(args.vocab_size, dtype=torch.bool)
            t2d[sd["d2t"].long() + torch.arange(n)] = True
            sd["t2d"] = t2d
        sd["d2t"], sd["t2d"] = sd["d2t"].long(), sd["t2d"].bool()
    if v == 1:  # layer 0 of EAGLE-1 has no input norm (vLLM replaces it by the identity)
        sd.pop("midlayer.input_layernorm.weight", None)
    sd = {k: t for k, t in sd.items() if not k.endswith("rotary_emb.inv_freq")}
    missing, unexpected = draft.load_state_dict({k: t.float() if t.is_floating_point() else t for k, t in sd.items()},
                                                strict=False)
    if missing or unexpected:
        raise ModelError(f"EAGLE-{v} checkpoint in {folder} does not fit: missing {missing[:3]}, unexpected {unexpected[:3]}",
                         "pass a draft in vLLM's EAGLE layout (see `specctl train-eagle --help`)")
    if embed is not None and embed.shape[0] != target_args.vocab_size:
        embed = None
    return draft.float().eval().requires_grad_(False), None if embed is None else embed.float()


# --------------------------------------------------------------------------- proposers



class _Slot:
    """One request: the draft's KV cache, the target features of the cached positions, counters."""

    def __init__(self, a: ModelArgs, max_len: int, device, dtype: torch.dtype = torch.float32):
        shape = (1, a.num_kv_heads, max_len, a.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)  # [1, nkv, max_len, hd]
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.feat = torch.zeros(max_len, a.hidden_size, device=device, dtype=dtype)  # [max_len, H] feature of each target position
        self.n_feat = 0  # target positions with a feature (= the target's cache length)
        self.n_fed = 0  # draft cache positions holding feature rows (chain rows beyond are scratch)
        self.prompt: np.ndarray = np.zeros(0, dtype=np.int64)
        self.sampling: _Sampling | None = None
        self.active = False


class EagleProposer(SlotProposer):
    """EAGLE-1 chain drafting (see the module docstring). ``Eagle3Proposer`` only changes the version."""

    method = "eagle"
    version = 1
    needs_hidden_states = True

    def __init__(self, config: SpecConfig, *, target, max_model_len: int, draft: EagleDraft | None = None,
                 embed: torch.Tensor | None = None, fused: bool | None = None):
        """``fused``: draft through the fused bf16 C++ block (EAGLE-3 beside a bf16 target on an AMX
        CPU); None follows the target (fused where it runs the AMX kernels)."""
        self._fused = fused
        if target is None:
            raise UsageError(f"the {self.method} method needs the target model it drafts for",
                             "build it through build_proposer(config, max_model_len, target=LOADED_MODEL)")
        tmodel = getattr(target, "model", target)  # a LoadedModel or a Transformer
        self.target_model = tmodel
        self.k = int(config.num_speculative_tokens or 1)
        self.max_model_len = int(config.max_model_len or max_model_len)
        self.tree_topk = config.speculative_eagle_topk  # None: chains only
        self.tree_tokens = config.speculative_num_draft_tokens or 16
        if draft is None:
            draft, embed = load_eagle_draft(_resolve(config.model), tmodel.args)
        if draft.version != self.version:
            raise UsageError(f"{config.model} is an EAGLE-{draft.version} draft but the method is '{self.method}'",
                             f"use \"method\": \"{'eagle3' if draft.version == 3 else 'eagle'}\"")
        self.device = tmodel.embed.weight.device
        self.draft = draft.to(self.device)
        # the network that drafts: the fused bf16 kernels next to a bf16 target on an AMX CPU, else the draft itself
        fused = None
        if self._fused if self._fused is not None else tmodel.cpu_kernels == "amx":  # as the target runs
            fused = FusedEagle3.build(self.draft, tmodel.embed.weight.dtype, self.device)
        self.net = fused or self.draft
        self.dtype = FusedEagle3.dtype if fused is not None else torch.float32
        self.embed_weight = embed.to(self.device) if embed is not None else tmodel.embed.weight  # [V, H]
        if draft.version == 3:
            self.aux_layers = tuple(sorted(draft.spec.aux_layers))  # asked of the target by the decoder
        self.target_ids = self.draft.target_ids.to(self.device)  # [N]
        self.Vt = tmodel.args.vocab_size
        self.stop_ids = set(getattr(target, "stop_token_ids", ()) or ())
        self.slots: dict[int, _Slot] = {}
        self._own_generator = torch.Generator(device=self.device).manual_seed(int(torch.randint(2**62, ())))

    # ------------------------------------------------------------------ request life
    def _new_slot(self) -> _Slot:
        scratch = self.k + (self.tree_topk or 0) * self.k  # chain rows, or the forwarded tree nodes
        return _Slot(self.draft.spec.args, self.max_model_len + scratch + 2, self.device, self.dtype)

    def _reset_slot(self, s: _Slot) -> None:
        s.n_feat = s.n_fed = 0

    def _target_len(self, s: _Slot) -> int:
        return s.n_feat

    @torch.inference_mode()
    def on_target_hidden(self, slot: int, hidden: torch.Tensor, aux: torch.Tensor | None) -> None:
        # hidden: [1, T, H] final-normed; aux: [1, T, A*H] (EAGLE-3) -> features of positions [n_feat, n_feat+T)
        s = self._slot(slot)
        s.active = True
        f = self.net.feature(hidden, aux)[0]  # [T, H]
        T = f.shape[0]
        end = min(s.n_feat + T, s.feat.shape[0])
        s.feat[s.n_feat:end] = f[:end - s.n_feat]
        s.n_feat = end
        s.n_fed = min(s.n_fed, s.n_feat)

    def on_verified(self, slot: int, num_accepted: int, emitted: list[int]) -> None:
        """Nothing to do: the next ``on_target_hidden`` rows overwrite the rejected chain rows."""

    def _slot_for_row(self, row: np.ndarray, n: int, slot: int | None = None) -> _Slot:
        s = self._match_slot(row, n, slot)
        if s is None:
            raise UsageError("the EAGLE proposer was asked to draft for a request whose target states it has not seen",
                             "drive it through SpecDecoder (it calls on_target_hidden after every target forward)")
        return s

    # ------------------------------------------------------------------ drafting
    def propose(self, token_ids, num_tokens, k, hidden_states=None, slots=None) -> DraftOutput:
        B = token_ids.shape[0]
        slot_of = (lambda b: None) if slots is None else (lambda b: int(slots[b]))
        if self.tree_topk is not None and B == 1 and k > 0:
            s = self._slot_for_row(token_ids[0], int(num_tokens[0]), slot_of(0))
            if (s.sampling or _Sampling()).temperature <= 0:
                return self._propose_tree(s, token_ids[0], int(num_tokens[0]), k)
        drafts = [self._propose_one(self._slot_for_row(token_ids[b], int(num_tokens[b]), slot_of(b)), token_ids[b],
                                    int(num_tokens[b]), k) for b in range(B)]
        return batch_draft(drafts, k, self.Vt, self.device)

    @torch.inference_mode()
    def _propose_one(self, s: _Slot, row: np.ndarray, n: int, k: int) -> tuple[list[int], torch.Tensor | None]:
        P = s.n_feat  # = n - 1: positions [0, P) are in the target's cache; row[P] is the last emitted token
        if P == 0 or P + k + 1 > s.k.shape[2]:
            return [], None
        d = self.net
        o = self._feed(s, row, P)
        sp = s.sampling or _Sampling()
        sample = sp.temperature > 0
        gen = sp.generator or self._own_generator
        ids: list[int] = []
        q_rows: list[torch.Tensor] = []
        for j in range(k):
            logits = d.logits(o[0, -1], self.target_model.head_weight)  # [N]
            if sample:
                p = logits_to_probs(logits, sp.temperature, sp.top_k, sp.top_p)  # [N]
                di = int(torch.multinomial(p, 1, generator=gen))
                q_rows.append(p)
            else:
                di = int(torch.argmax(logits))
            t = int(self.target_ids[di])
            ids.append(t)
            if j + 1 == k or t in self.stop_ids:
                break
            tok = torch.tensor([[t]], device=self.device)
            o = d.forward_cached(self.embed_weight[tok].to(self.dtype), o, P + j, s.k, s.v)  # chain row at P + j
        if not sample:
            return ids, None
        q = torch.zeros(len(q_rows), self.Vt, device=self.device)  # [n, V_target]
        q[:, self.target_ids] = torch.stack(q_rows).float()
        return ids, q


    def _feed(self, s: _Slot, row: np.ndarray, P: int) -> torch.Tensor:
        """Feed the feature rows not yet in the draft cache (at least the last, whose output starts the
        draft): position p reads token row[p+1]. Returns the last row's out [1, 1, H]."""
        a = min(s.n_fed, P - 1)
        toks = torch.from_numpy(row[a + 1:P + 1].astype(np.int64)).to(self.device)[None]  # [1, P - a]
        h = s.feat[a:P][None]  # [1, P - a, H]
        o = self.net.forward_cached(self.embed_weight[toks].to(self.dtype), h, a, s.k, s.v)[:, -1:]  # [1, 1, H]
        s.n_fed = P
        return o

    @torch.inference_mode()
    def _propose_tree(self, s: _Slot, row: np.ndarray, n: int, depth: int) -> DraftOutput:
        """EAGLE-2's dynamic tree (see the module docstring): greedy requests, batch 1."""
        P, K, d = s.n_feat, self.tree_topk, self.net
        if P == 0 or P + K * depth + 2 > s.k.shape[2]:
            return DraftOutput(torch.full((1, depth), -1, dtype=torch.long), torch.zeros(1, dtype=torch.long))
        o = self._feed(s, row, P)
        # candidates: target token, parent candidate (-1: the last emitted token), cumulative log-prob, depth
        tok: list[int] = []
        parent: list[int] = []
        score: list[float] = []
        level: list[int] = []
        lp = torch.log_softmax(d.logits(o[0, -1], self.target_model.head_weight).float(), -1)  # [N]
        top = lp.topk(min(K, lp.numel()))
        for v, i in zip(top.values.tolist(), top.indices.tolist()):
            tok.append(int(self.target_ids[i]))
            parent.append(-1)
            score.append(v)
            level.append(1)
        frontier = list(range(len(tok)))
        out_of: dict[int, torch.Tensor] = {}  # forwarded candidate -> its out [H]
        slot_of: dict[int, int] = {}  # forwarded candidate -> draft cache slot
        nxt = P  # scratch slots from P on (overwritten by the next feed, like chain rows)
        for lev in range(1, depth):
            frontier = [c for c in frontier if tok[c] not in self.stop_ids]
            if not frontier:
                break
            F = len(frontier)
            emb = self.embed_weight[torch.tensor([tok[c] for c in frontier], device=self.device)].to(self.dtype)[None]
            h = torch.stack([o[0, -1] if parent[c] < 0 else out_of[parent[c]] for c in frontier])[None]  # [1, F, H]
            mask = torch.zeros(F, nxt + F, dtype=torch.bool, device=self.device)
            mask[:, :P] = True
            for r, c in enumerate(frontier):
                mask[r, nxt + r] = True
                a = parent[c]
                while a >= 0:
                    mask[r, slot_of[a]] = True
                    a = parent[a]
            pos = torch.full((F,), P + lev - 1, device=self.device)
            outs = d.forward_cached(emb, h, nxt, s.k, s.v, positions=pos, mask=mask)[0]  # [F, H]
            for r, c in enumerate(frontier):
                out_of[c], slot_of[c] = outs[r], nxt + r
            nxt += F
            lp = torch.log_softmax(d.logits(outs, self.target_model.head_weight).float(), -1)  # [F, N]
            top = lp.topk(min(K, lp.shape[-1]), dim=-1)
            new = []
            for r, c in enumerate(frontier):
                for v, i in zip(top.values[r].tolist(), top.indices[r].tolist()):
                    tok.append(int(self.target_ids[i]))
                    parent.append(c)
                    score.append(score[c] + v)
                    level.append(lev + 1)
                    new.append(len(tok) - 1)
            frontier = sorted(new, key=lambda c: -score[c])[:K]
        # rerank: the best N candidates, closed under parents, parents before children
        keep = set(sorted(range(len(tok)), key=lambda c: -score[c])[:self.tree_tokens])
        for c in list(keep):
            a = parent[c]
            while a >= 0 and a not in keep:
                keep.add(a)
                a = parent[a]
        order = sorted(keep, key=lambda c: (level[c], -score[c]))
        index = {c: i for i, c in enumerate(order)}
        ids = torch.tensor([[tok[c] for c in order]], dtype=torch.long)
        return DraftOutput(ids, torch.tensor([len(order)]), None,
                           [-1 if parent[c] < 0 else index[parent[c]] for c in order])


class Eagle3Proposer(EagleProposer):
    """EAGLE-3: features fused from the target's aux layers, a reduced draft vocabulary mapped by d2t."""

    method = "eagle3"
    version = 3


def _resolve(model: str | None) -> Path:
    p = Path(str(model)).expanduser()
    if p.is_dir():
        return p
    raise ModelError(f"EAGLE draft folder '{model}' not found", "set \"model\" to the folder `specctl train-eagle` wrote")


PROPOSERS = {"eagle": EagleProposer, "eagle3": Eagle3Proposer}
