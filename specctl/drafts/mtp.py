"""Multi-token-prediction (MTP) modules: the network and how its depths chain. Its files, in every layout
specctl reads and writes: ``specctl.drafts.mtp_files``.

DeepSeek-V3 (arXiv 2412.19437, §2.2), GLM-4.5, MiMo and Qwen3-Next ship MTP modules beside the main
model: no second model and no second tokenizer. MTP module i (depth d = i + 1) reads, at position j,

    x = eh_proj( cat[ enorm(emb(t_{j+d})), hnorm(h^{d-1}_j) ] )      2H -> H
    h^d_j = Block(x)                                                 one decoder block, causal over j
    q(t_{j+d+1}) = softmax( head( norm(h^d_j) ) )

with h^0 the target's hidden state (what its LM head reads: the final-normed state, as vLLM feeds
``target_hidden_states`` to deepseek_mtp) and emb the target's embedding. Depths chain: h^d feeds
depth d+1 (DeepSeek-V3 layout: the pre-norm block output, as vLLM's DeepSeekMultiTokenPredictorLayer
returns it; Qwen3-Next layout: the normed output). When k exceeds the number m of MTP modules,
module (d-1) % m is reused (vLLM does the same and warns; so do we).

Layouts read (from the target's own checkpoint, or from a separate draft folder, ``model``):
  deepseek_v3 : config ``num_nextn_predict_layers``; ``model.layers.{N+i}.{enorm,hnorm,eh_proj,
                shared_head.norm,shared_head.head}`` + the block's usual HF names (self_attn.*, mlp.*,
                input_layernorm, post_attention_layernorm); optional ``embed_tokens`` (used if given).
                The embedding of position 0 is zeroed (vLLM: "not needed by MTP").
  mimo        : ``model.mtp_layers.{i}.{token_layernorm,hidden_layernorm,input_proj,final_layernorm}`` + the
                block's HF names (MiMo-7B's, which vLLM's MiMoMTPModel loads); input_proj reads
                cat[hidden, embedding] (hidden first); depths chain the final-normed output, position 0's
                embedding is zeroed; the target's LM head.
  qwen3_next  : ``mtp.{fc,pre_fc_norm_embedding,pre_fc_norm_hidden,norm}`` shared by ``mtp.layers.{i}.*``;
                the target's LM head. Norms follow the base architecture's convention (plain weight;
                Qwen3-Next's own zero-centred norms belong to its architecture, which the runner lacks).

What it does not know: drafting (slots, per-depth caches), verification, training.
"""

from __future__ import annotations


import torch
from torch import nn

from specctl.modeling import Block, ModelArgs, RMSNorm, Segment, Transformer

LAYOUTS = ("deepseek_v3", "qwen3_next", "mimo")


class MtpLayer(nn.Module):
    """One MTP module: enorm, hnorm, eh_proj (2H -> H), one decoder Block, norm (+ its own head, optional)."""

    def __init__(self, a: ModelArgs, own_head: bool = True):
        super().__init__()
        H = a.hidden_size
        self.enorm = RMSNorm(H, a.rms_norm_eps)
        self.hnorm = RMSNorm(H, a.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.block = Block(a)
        self.norm = RMSNorm(H, a.rms_norm_eps)  # shared_head.norm (qwen3_next: mtp.norm)
        self.head = nn.Linear(H, a.vocab_size, bias=False) if own_head else None  # shared_head.head

    def forward(self, h, emb, cos, sin, k_cache, v_cache, start: int, mask):
        # h, emb: [B, T, H] (h^{d-1}_j and emb(t_{j+d})); caches [B, n_kv, max_len, hd] -> pre-norm [B, T, H]
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(h)], dim=-1))  # [B, T, H]
        return self.block(x, cos, sin, k_cache, v_cache, start, mask)


class MtpStack(nn.Module):
    """The m MTP modules of a checkpoint and how their depths chain (see the module docstring)."""

    def __init__(self, a: ModelArgs, num_layers: int, layout: str = "deepseek_v3", own_head: bool = True,
                 embed: torch.Tensor | None = None):
        super().__init__()
        if layout not in LAYOUTS:
            raise ValueError(f"unknown MTP layout {layout!r}")
        self.args, self.layout = a, layout
        self.layers = nn.ModuleList(MtpLayer(a, own_head and layout == "deepseek_v3") for _ in range(num_layers))
        if layout == "qwen3_next":  # fc and the three norms are one set shared by every mtp.layers.{i}
            first = self.layers[0]
            for layer in self.layers[1:]:
                layer.enorm, layer.hnorm, layer.eh_proj, layer.norm = first.enorm, first.hnorm, first.eh_proj, first.norm
        self.embed = None if embed is None else nn.Parameter(embed, requires_grad=False)  # [V, H] own embed_tokens
        self.vocab_ids: torch.Tensor | None = None  # a draft vocabulary (ascending target ids) the head is cut to
        self.zero_pos0 = layout in ("deepseek_v3", "mimo")
        self.chain_normed = layout in ("qwen3_next", "mimo")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def layer_for_depth(self, d: int) -> MtpLayer:
        """Depth d (1-based) uses module (d-1) % m: recursion when k > m."""
        return self.layers[(d - 1) % len(self.layers)]


def mtp_step(stack: MtpStack, target: Transformer, d: int, h_prev: torch.Tensor, tokens: torch.Tensor, start: int,
             k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One depth over positions [start, start+T). Shared by the proposer and the trainer.

    h_prev: [B, T, H] h^{d-1} at those positions; tokens: [B, T] t_{j+d}; k_cache/v_cache:
    [B, n_kv, >= start+T, hd] this depth's cache. Returns (h^d [B, T, H] to chain, normed [B, T, H] for the head).
    """
    layer = stack.layer_for_depth(d)
    T = tokens.shape[1]
    emb = (target.embed.weight if stack.embed is None else stack.embed)[tokens]  # [B, T, H]
    if stack.zero_pos0 and start == 0:
        emb = torch.cat([torch.zeros_like(emb[:, :1]), emb[:, 1:]], dim=1)
    cos, sin = target.rope(start, T, emb.dtype)
    mask = None
    if T > 1:
        q_pos = torch.arange(start, start + T, device=emb.device)[:, None]
        mask = torch.arange(start + T, device=emb.device)[None, :] <= q_pos  # [T, start+T] causal
    out = layer(h_prev.to(emb.dtype), emb, cos, sin, k_cache, v_cache, start, mask)
    normed = layer.norm(out)
    return (normed if stack.chain_normed else out), normed


class _DepthCache:
    """One depth's cache as a ``Segment``'s cache: k[0], v[0] are its [1, n_kv, max_len, hd] tensors."""

    def __init__(self, k_cache: torch.Tensor, v_cache: torch.Tensor):
        self.k, self.v = k_cache[None], v_cache[None]


def mtp_step_ragged(stack: MtpStack, target: Transformer, d: int,
                    parts: list[tuple[torch.Tensor, torch.Tensor, int, torch.Tensor, torch.Tensor]]
                    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``mtp_step`` for many requests in one pass: each part is (h_prev [T, H], tokens [T], start,
    k_cache, v_cache) of one request, T <= VERIFY_ROWS. eh_proj, the block's projections and MLP run
    over every row at once (one read of the weights, ``Block.forward_ragged``); each request writes and
    attends in its own cache, its rows computed as its own ``mtp_step`` computes them. Returns each
    request's (h^d [T, H], normed [T, H])."""
    layer = stack.layer_for_depth(d)
    embed = target.embed.weight if stack.embed is None else stack.embed
    tokens = torch.cat([t for _, t, _, _, _ in parts])  # [R]
    pos = torch.cat([torch.arange(st, st + t.shape[0], device=tokens.device) for _, t, st, _, _ in parts])  # [R]
    emb = embed[tokens][None]  # [1, R, H]
    if stack.zero_pos0 and bool((pos == 0).any()):
        emb = torch.where((pos == 0)[None, :, None], torch.zeros_like(emb), emb)
    h = torch.cat([hp for hp, _, _, _, _ in parts]).to(emb.dtype)[None]  # [1, R, H]
    x = layer.eh_proj(torch.cat([layer.enorm(emb), layer.hnorm(h)], dim=-1))
    cos, sin = target.rope(0, pos.shape[0], emb.dtype, positions=pos)
    segs = []
    for _, t, st, kc, vc in parts:
        n = t.shape[0]
        mask = None if n == 1 else (torch.arange(st + n, device=t.device)[None, :]
                                    <= torch.arange(st, st + n, device=t.device)[:, None])  # [n, st+n] causal
        segs.append(Segment(_DepthCache(kc, vc), st, n, mask=mask))
    out = layer.block.forward_ragged(x, cos, sin, 0, segs)[0]  # [R, H]
    normed = layer.norm(out)
    chain = normed if stack.chain_normed else out
    sizes = [t.shape[0] for _, t, _, _, _ in parts]
    return list(zip(chain.split(sizes), normed.split(sizes)))


def mtp_logits(stack: MtpStack, target: Transformer, d: int, normed: torch.Tensor) -> torch.Tensor:
    """[..., H] -> [..., V] with depth d's shared_head.head, or the target's LM head."""
    head = stack.layer_for_depth(d).head
    return target.kernels.dense(normed, target.head_weight if head is None else head.weight)
