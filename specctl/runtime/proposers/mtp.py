"""MtpProposer: self-speculation with the target's own multi-token-prediction (MTP) modules.

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

KV caches (one per depth, 1 block each) follow the target by *committed lengths*, the same "write by
position, mask by length" rollback the runner uses. Worked example, context t_0..t_9 (n = 10, the
target's cache holds 0..8, so h^0_0..h^0_8 are known), k = 2:
  depth 1 runs positions j = c_1..8 with tokens t_{j+1}; all real -> committed c_1 = 9; the row at
      j = 8 gives draft d1 (a guess of t_10).
  depth 2 runs j = c_2..8 with tokens t_{j+2}: t_2..t_9 are real (j <= 7 -> committed c_2 = 8), j = 8
      reads d1 (speculative); its row gives d2 (a guess of t_11).
  Next propose (after the target accepted some drafts) restarts each depth from its c_d: speculative
  slots are simply overwritten. Nothing is ever recomputed from scratch.

What it does not know: verification, the target's cache, stop handling beyond not drafting past a stop.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import numpy as np
import torch
from torch import nn

from kernels import skinny_linear
from specctl.config import SpecConfig
from specctl.errors import ModelError, UsageError
from specctl.runtime.model import Block, ModelArgs, RMSNorm, Transformer
from specctl.runtime.proposers.base import DraftOutput, SlotProposer, batch_draft
from specctl.runtime.proposers.base import DraftSampling as _Sampling
from specctl.runtime.rejection import logits_to_probs

log = logging.getLogger("specctl")
LAYOUTS = ("deepseek_v3", "qwen3_next", "mimo")
# vLLM's warning, in substance (vllm/config/speculative.py)
RECURSIVE_WARNING = ("num_speculative_tokens (%d) > num_nextn_predict_layers (%d): the MTP layers will be run "
                     "recursively, which may result in lower acceptance rate")


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
        x = skinny_linear.linear(torch.cat([self.enorm(emb), self.hnorm(h)], dim=-1), self.eh_proj.weight)  # [B, T, H]
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


def mtp_logits(stack: MtpStack, target: Transformer, d: int, normed: torch.Tensor) -> torch.Tensor:
    """[..., H] -> [..., V] with depth d's shared_head.head, or the target's LM head."""
    head = stack.layer_for_depth(d).head
    return skinny_linear.linear(normed, target.head_weight if head is None else head.weight)


# --------------------------------------------------------------------------- loading

def _fuse_block(sd: dict, p: str, a: ModelArgs) -> dict[str, torch.Tensor]:
    """HF block names under prefix ``p`` -> Block's fused names (as model.fuse_hf_state_dict does per layer)."""
    def take(n):
        try:
            return sd[p + n]
        except KeyError:
            raise ModelError(f"MTP checkpoint lacks tensor '{p + n}'", "re-export it with specctl train-mtp") from None

    out = {"qkv.weight": torch.cat([take(f"self_attn.{n}_proj.weight") for n in "qkv"], 0),
           "o.weight": take("self_attn.o_proj.weight"),
           "input_norm.weight": take("input_layernorm.weight"),
           "post_norm.weight": take("post_attention_layernorm.weight"),
           "gate_up.weight": torch.cat([take("mlp.gate_proj.weight"), take("mlp.up_proj.weight")], 0),
           "down.weight": take("mlp.down_proj.weight")}
    if a.qkv_bias:
        out["qkv.bias"] = torch.cat([take(f"self_attn.{n}_proj.bias") for n in "qkv"], 0)
    if a.o_bias:
        out["o.bias"] = take("self_attn.o_proj.bias")
    if a.mlp_bias:
        out["gate_up.bias"] = torch.cat([take("mlp.gate_proj.bias"), take("mlp.up_proj.bias")], 0)
        out["down.bias"] = take("mlp.down_proj.bias")
    return out


def read_mtp_tensors(folder: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json, the MTP tensors of every *.safetensors in ``folder``) without reading the main model."""
    from safetensors import safe_open

    folder = Path(folder)
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise ModelError(f"{folder} has no config.json", "give the target folder, or a draft folder written by train-mtp")
    cfg = json.loads(cfg_path.read_text())
    n_main = int(cfg.get("num_hidden_layers", 0))
    sd: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            for key in fh.keys():
                m = re.match(r"model\.layers\.(\d+)\.", key)
                if key.startswith(("mtp.", "model.mtp_layers.")) or (m and int(m.group(1)) >= n_main):
                    sd[key] = fh.get_tensor(key)
    return cfg, sd


def stack_from_state_dict(cfg: dict, sd: dict[str, torch.Tensor], a: ModelArgs, where: str = "checkpoint") -> MtpStack:
    """Build an MtpStack from MTP tensors in any of the layouts (detected from the names)."""
    if any(k.startswith("model.mtp_layers.") for k in sd):
        return _mimo_stack(cfg, sd, a, where)
    if any(k.startswith("mtp.") for k in sd):
        idx = sorted({int(k.split(".")[2]) for k in sd if k.startswith("mtp.layers.")})
        if not idx:
            raise ModelError(f"{where} has mtp.* tensors but no mtp.layers.*", "check the checkpoint")
        stack = MtpStack(a, len(idx), "qwen3_next")
        first = stack.layers[0]
        first.enorm.weight.data = sd["mtp.pre_fc_norm_embedding.weight"]
        first.hnorm.weight.data = sd["mtp.pre_fc_norm_hidden.weight"]
        first.eh_proj.weight.data = sd["mtp.fc.weight"]
        first.norm.weight.data = sd["mtp.norm.weight"]
        for i, layer in zip(idx, stack.layers):
            layer.block.load_state_dict(_fuse_block(sd, f"mtp.layers.{i}.", a))
        return stack
    idx = sorted(int(m.group(1)) for k in sd if (m := re.match(r"model\.layers\.(\d+)\.eh_proj\.weight$", k)))
    if not idx:
        raise ModelError(f"{where} holds no MTP modules (no model.layers.N.eh_proj nor mtp.* tensors)",
                         "train some with `specctl train-mtp`, or pick another method")
    expected = int(cfg.get("num_nextn_predict_layers") or len(idx))
    if expected != len(idx):
        raise ModelError(f"{where}: num_nextn_predict_layers is {expected} but {len(idx)} MTP module(s) found",
                         "fix num_nextn_predict_layers in config.json")
    own_head = all(f"model.layers.{i}.shared_head.head.weight" in sd for i in idx)
    embed = sd.get(f"model.layers.{idx[0]}.embed_tokens.weight")
    stack = MtpStack(a, len(idx), "deepseek_v3", own_head=own_head, embed=embed)
    for i, layer in zip(idx, stack.layers):
        p = f"model.layers.{i}."
        for ours, theirs in (("enorm", "enorm"), ("hnorm", "hnorm"), ("eh_proj", "eh_proj"), ("norm", "shared_head.norm")):
            try:
                getattr(layer, ours).weight.data = sd[p + theirs + ".weight"]
            except KeyError:
                raise ModelError(f"{where} lacks tensor '{p}{theirs}.weight'", "re-export it with specctl train-mtp") from None
        if own_head:
            layer.head.weight.data = sd[p + "shared_head.head.weight"]
        layer.block.load_state_dict(_fuse_block(sd, p, a))
    return stack


def _mimo_stack(cfg: dict, sd: dict[str, torch.Tensor], a: ModelArgs, where: str) -> MtpStack:
    """MiMo's layout: ``model.mtp_layers.{i}.{token_layernorm, hidden_layernorm, input_proj, final_layernorm}``
    + the block's HF names; input_proj reads cat[hidden_layernorm(h), token_layernorm(emb)] (hidden first)."""
    idx = sorted({int(k.split(".")[2]) for k in sd if k.startswith("model.mtp_layers.")})
    expected = int(cfg.get("num_nextn_predict_layers") or len(idx))
    if expected != len(idx):
        raise ModelError(f"{where}: num_nextn_predict_layers is {expected} but {len(idx)} MTP module(s) found",
                         "fix num_nextn_predict_layers in config.json")
    stack = MtpStack(a, len(idx), "mimo", own_head=False)
    H = a.hidden_size
    for i, layer in zip(idx, stack.layers):
        p = f"model.mtp_layers.{i}."

        def take(n):
            try:
                return sd[p + n]
            except KeyError:
                raise ModelError(f"{where} lacks tensor '{p}{n}'", "re-export it with specctl train-mtp") from None

        layer.enorm.weight.data = take("token_layernorm.weight")
        layer.hnorm.weight.data = take("hidden_layernorm.weight")
        w = take("input_proj.weight")  # [H, 2H]: columns [:H] read h, [H:] read emb
        layer.eh_proj.weight.data = torch.cat([w[:, H:], w[:, :H]], dim=1).contiguous()  # ours: [emb | h]
        layer.norm.weight.data = take("final_layernorm.weight")
        layer.block.load_state_dict(_fuse_block(sd, p, a))
    return stack


def load_mtp(source: str | Path, target: Transformer) -> MtpStack:
    """The MTP modules of ``source`` (the target's folder, or a separate draft folder) for ``target``."""
    cfg, sd = read_mtp_tensors(source)
    stack = stack_from_state_dict(cfg, sd, target.args, where=str(source))
    p = target.embed.weight
    stack = stack.to(device=p.device, dtype=p.dtype)
    for layer in stack.layers:  # a shared_head.head equal to the target's head is the target's head
        if layer.head is not None and layer.head.weight.shape == target.head_weight.shape \
                and torch.equal(layer.head.weight, target.head_weight):
            layer.head = None
    if stack.embed is not None and torch.equal(stack.embed, target.embed.weight):
        stack.embed = None
    return stack.eval().requires_grad_(False)


# --------------------------------------------------------------------------- proposer



class _Slot:
    """One request: h^d buffers, per-depth caches and committed lengths (see the module docstring)."""

    def __init__(self, a: ModelArgs, max_len: int, dtype, device):
        self.a, self.max_len, self.dtype, self.device = a, max_len, dtype, device
        self.h = [torch.zeros(max_len, a.hidden_size, dtype=dtype, device=device)]  # h[d]: [max_len, H]
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []  # kv[d-1]: ([1, n_kv, max_len, hd],) * 2
        self.c = [0]  # c[d]: positions [0, c[d]) of depth d hold real (committed) values; c[0] = target rows
        self.prompt = np.zeros(0, dtype=np.int64)
        self.sampling: _Sampling | None = None
        self.active = False

    def ensure_depth(self, k: int) -> None:
        a = self.a
        while len(self.kv) < k:
            shape = (1, a.num_kv_heads, self.max_len, a.head_dim)
            self.kv.append((torch.zeros(shape, dtype=self.dtype, device=self.device),
                            torch.zeros(shape, dtype=self.dtype, device=self.device)))
            self.h.append(torch.zeros(self.max_len, a.hidden_size, dtype=self.dtype, device=self.device))
            self.c.append(0)


class MtpProposer(SlotProposer):
    method = "mtp"
    needs_hidden_states = True

    def __init__(self, config: SpecConfig, *, target, max_model_len: int, stack: MtpStack | None = None):
        """``target``: the LoadedModel drafted for; its folder holds the MTP modules unless ``config.model``
        names a separate draft folder. ``stack`` overrides both (tests, trainers)."""
        if target is None:
            raise UsageError("the mtp method needs the target model whose MTP layers draft",
                             "build it through build_proposer(config, max_model_len, target=LOADED_MODEL)")
        self.target = target
        self.k = int(config.num_speculative_tokens or 1)
        self.max_model_len = int(config.max_model_len or max_model_len)
        if stack is None:
            source = config.model
            if source is not None and not Path(source).expanduser().is_dir():
                from specctl.models import resolve_model

                source = resolve_model(source, dtype=str(target.dtype).removeprefix("torch."))
            stack = load_mtp(Path(source).expanduser() if source else target.path, target.model)
        self.stack = stack
        if self.k > stack.num_layers:
            log.warning(RECURSIVE_WARNING, self.k, stack.num_layers)
        p = target.model.embed.weight
        self.dtype, self.device = p.dtype, p.device
        self.stop_ids = set(target.stop_token_ids)
        self.temperature: float = 0.0
        self.slots: dict[int, _Slot] = {}
        self._own_generator = torch.Generator(device=self.device).manual_seed(int(torch.randint(2**62, ())))

    # ------------------------------------------------------------------ request life (SlotProposer)
    def _new_slot(self) -> _Slot:
        return _Slot(self.target.model.args, self.max_model_len + self.k + 2, self.dtype, self.device)

    def _reset_slot(self, s: _Slot) -> None:
        s.c = [0] * len(s.c)

    def _target_len(self, s: _Slot) -> int:
        return s.c[0]

    def on_target_hidden(self, slot: int, hidden: torch.Tensor, aux: torch.Tensor | None) -> None:
        # hidden: [1, T, H] the target rows now in its cache, at positions [c[0], c[0]+T)
        s = self._slot(slot)
        T = hidden.shape[1]
        if s.c[0] + T > s.max_len:
            raise UsageError(f"mtp: sequence longer than its max length {s.max_len}", "raise --max-model-len")
        s.h[0][s.c[0]:s.c[0] + T] = hidden[0].to(self.dtype)
        s.c[0] += T

    # ------------------------------------------------------------------ drafting
    @torch.inference_mode()
    def propose(self, token_ids, num_tokens, k, hidden_states=None, slots=None) -> DraftOutput:
        B = token_ids.shape[0]
        drafts: list[tuple[list[int], torch.Tensor | None]] = [([], None)] * B
        for b in range(B):
            n = int(num_tokens[b])
            s = self._match_slot(token_ids[b], n, None if slots is None else int(slots[b]))
            if s is None or n < 2 or n + k > s.max_len:
                continue  # no target states for this row (or no room): no draft this step
            drafts[b] = self._propose_one(s, torch.from_numpy(np.asarray(token_ids[b, :n], dtype=np.int64)), k)
        return batch_draft(drafts, k, self.target.model.args.vocab_size, self.device)

    def _propose_one(self, s: _Slot, seq: torch.Tensor, k: int) -> tuple[list[int], torch.Tensor | None]:
        """seq: [n] the context. Returns (draft ids, q [n_draft, V] or None)."""
        n = seq.shape[0]
        s.ensure_depth(k)
        sp = s.sampling or _Sampling(self.temperature)
        gen = sp.generator or self._own_generator
        seq = seq.to(self.device)
        drafts: list[int] = []
        q_rows: list[torch.Tensor] = []
        end = n - 1  # positions [start, end) run; row end-1 = n-2 gives this depth's draft
        for d in range(1, k + 1):
            start = min(s.c[d], end - 1)
            # tokens t_{j+d} for j in [start, end): real below n, then the drafts so far
            real = seq[start + d:n]
            spec = torch.tensor(drafts[max(0, start + d - n):], dtype=torch.long, device=self.device)
            tokens = torch.cat([real, spec])[None]  # [1, end - start]
            kc, vc = s.kv[d - 1]
            chain, normed = mtp_step(self.stack, self.target.model, d, s.h[d - 1][start:end][None], tokens, start, kc, vc)
            s.h[d][start:end] = chain[0]
            s.c[d] = max(0, n - d)
            logits = mtp_logits(self.stack, self.target.model, d, normed[0, -1])  # [V]
            if sp.temperature > 0:
                p = logits_to_probs(logits, sp.temperature, sp.top_k, sp.top_p)  # [V]
                tok = int(torch.multinomial(p, 1, generator=gen))
                q_rows.append(p)
            else:
                tok = int(torch.argmax(logits))
            drafts.append(tok)
            if tok in self.stop_ids:
                break
        return drafts, (torch.stack(q_rows) if q_rows else None)


PROPOSERS = {"mtp": MtpProposer}
