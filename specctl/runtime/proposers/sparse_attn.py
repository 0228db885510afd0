"""SparseAttnProposer: the target drafts for itself, attending to a small subset of its own KV cache
(sparse-attention self-speculation, vLLM RFC #47351; reference: the platformxlab/vegas fork).

No extra weights, no training. Each step, for a request whose cache holds L positions:

  1. choose, per layer, B = clamp(ceil(L * sparse_attn_ratio), sparse_attn_min_tokens, L) positions:
       streamingllm : the first SINK_TOKENS positions (attention sinks) and the most recent ones
                      (StreamingLLM, arXiv 2309.17453; same positions in every layer);
       vegas        : the positions the last verification attended to most (per layer, the softmax
                      weights from the verify forward's first and last queries, summed over heads:
                      ``KVCache.scores``), top-B among those before that verification, plus every
                      position since (the accepted tokens): "verification-guided" (Vegas).
  2. gather those keys/values into the slot's scratch cache (they were rotated at their true
     positions, so relative positions stay right in any order);
  3. run the target's own layers (all, or all but ``sparse_attn_skip_layers``) one token at a time on
     the scratch cache, the queries rotated at their true positions: the last emitted token, then each
     draft token, k forwards for k drafts. The drafts' keys/values go to the scratch cache only.

The real cache is only read (bit for bit unchanged); verification is the ordinary full forward, so the
method is lossless whatever is selected: greedy drafts are argmaxes, sampled drafts come with the
exact q they were drawn from.

What it does not know: verification, rollback (it reads the runner's length anew each step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from specctl.config import SpecConfig
from specctl.errors import UsageError
from specctl.runtime.model import KVCache
from specctl.runtime.proposers.base import DraftOutput, DraftSampling, SlotProposer
from specctl.runtime.rejection import logits_to_probs

# StreamingLLM's attention sinks: vLLM's reference keeps the first KV block (16 positions)
SINK_TOKENS = 16


def draft_budget(length: int, ratio: float, min_tokens: int) -> int:
    """Positions a draft step attends to in a cache of ``length`` (all of them when fewer)."""
    return min(length, max(math.ceil(length * ratio), min_tokens))


def streamingllm_positions(length: int, budget: int, sinks: int = SINK_TOKENS) -> torch.Tensor:
    """[min(budget, length)] int64: the first ``sinks`` positions and the most recent rest."""
    if budget >= length:
        return torch.arange(length)
    sinks = min(sinks, budget)
    return torch.cat([torch.arange(sinks), torch.arange(length - (budget - sinks), length)])


def vegas_positions(scores: torch.Tensor, valid: int, length: int, budget: int) -> torch.Tensor:
    """[layers, m] int64: per layer, the ``budget`` best-scored positions below ``valid`` (scores
    [layers, >= valid]), then every position in [valid, length) (since the scoring forward)."""
    layers = scores.shape[0]
    recent = torch.arange(valid, length, device=scores.device).expand(layers, -1)
    if budget >= valid:
        top = torch.arange(valid, device=scores.device).expand(layers, -1)
    else:
        top = scores[:, :valid].topk(budget, dim=-1).indices.sort(dim=-1).values
    return torch.cat([top, recent], dim=1)


@dataclass
class _Slot:
    runner: object | None = None  # the request's TargetRunner (its model and KV cache)
    scratch: KVCache | None = None
    prompt: np.ndarray | None = None
    sampling: DraftSampling | None = None
    active: bool = False
    selected: int = 0  # positions the last draft attended to (for stats)


class SparseAttnProposer(SlotProposer):
    method = "sparse_attn"

    def __init__(self, config: SpecConfig, *, target, max_model_len: int):
        if target is None:
            raise UsageError("the sparse_attn method drafts with the target model itself",
                             "build it through build_proposer(config, max_model_len, target=LOADED_MODEL)")
        self.model = target.model
        a = self.model.args
        self.k = int(config.num_speculative_tokens or 4)
        self.algorithm = config.sparse_attn_algorithm or "streamingllm"
        self.ratio = float(config.sparse_attn_ratio if config.sparse_attn_ratio is not None else 0.05)
        self.min_tokens = int(config.sparse_attn_min_tokens or 256)
        skip = config.sparse_attn_skip_layers or []
        if skip == "auto":
            raise UsageError('sparse_attn_skip_layers "auto" is not available yet',
                             "give a list of layer indices, e.g. [8, 9, 10]")
        bad = [i for i in skip if i >= a.num_layers]
        if bad:
            raise UsageError(f"sparse_attn_skip_layers names layer {bad[0]}, but the target has {a.num_layers} "
                             f"layers (0..{a.num_layers - 1})", "give layer indices below the number of layers")
        if len(skip) >= a.num_layers:
            raise UsageError("sparse_attn_skip_layers skips every layer", "keep at least one layer")
        self.layers = [i for i in range(a.num_layers) if i not in set(skip)]
        self.max_model_len = int(max_model_len)
        # the most positions a draft attends to: the budget, the positions accepted since the last
        # verification (up to k + 1) and the draft's own k
        self.scratch_len = draft_budget(self.max_model_len, self.ratio, self.min_tokens) + 2 * self.k + 2
        self.slots: dict[int, _Slot] = {}
        self.stop_ids = set(getattr(target, "stop_token_ids", ()) or ())
        self.device = target.device
        self._own_generator = torch.Generator(device=self.device).manual_seed(int(torch.randint(2**62, ())))

    # ------------------------------------------------------------------ request life
    def _new_slot(self) -> _Slot:
        return _Slot()

    def _target_len(self, s: _Slot) -> int:
        return -1 if s.runner is None else s.runner.length

    def bind_target(self, slot: int, runner) -> None:
        s = self._slot(slot)
        if runner.model is not self.model:
            raise UsageError("sparse_attn was asked to draft for a runner of another model",
                             "build the proposer with the same target the decoder runs")
        s.runner = runner
        if self.algorithm == "vegas":
            runner.cache.keep_scores()  # the verify forwards record what they attended to
        if s.scratch is None:
            p = self.model.embed.weight
            s.scratch = KVCache(self.model.args, 1, self.scratch_len, p.dtype, p.device)

    # ------------------------------------------------------------------ drafting
    def propose(self, token_ids, num_tokens, k, hidden_states=None, slots=None) -> DraftOutput:
        B = token_ids.shape[0]
        out = torch.full((B, k), -1, dtype=torch.long)
        num = torch.zeros(B, dtype=torch.long)
        qs: list[torch.Tensor | None] = []
        V = self.model.args.vocab_size
        for b in range(B):
            n = int(num_tokens[b])
            s = self._match_slot(token_ids[b], n, None if slots is None else int(slots[b]))
            if s is None:
                raise UsageError("sparse_attn was asked to draft for a request whose KV cache it was not given",
                                 "drive it through SpecDecoder (it binds each request's runner)")
            ids, q = self._propose_one(s, int(token_ids[b, n - 1]), k)
            out[b, :len(ids)] = torch.tensor(ids, dtype=torch.long)
            num[b] = len(ids)
            qs.append(q)
        probs = None
        if any(q is not None for q in qs):
            probs = torch.zeros(B, k, V, device=self.device)
            for b, q in enumerate(qs):
                nb = int(num[b])
                if q is not None:
                    probs[b, :nb] = q[:nb]
                elif nb:
                    probs[b, torch.arange(nb), out[b, :nb].to(self.device)] = 1.0
        return DraftOutput(out, num, probs)

    def select(self, s: _Slot) -> torch.Tensor:
        """The cached positions the next draft attends to: [m] (every layer) or [layers, m]."""
        cache, L = s.runner.cache, s.runner.length
        budget = draft_budget(L, self.ratio, self.min_tokens)
        if self.algorithm == "vegas" and cache.scores is not None and cache.scored > 0:
            return vegas_positions(cache.scores, min(cache.scored, L), L, budget)
        return streamingllm_positions(L, budget).to(cache.k.device)

    @torch.inference_mode()
    def _propose_one(self, s: _Slot, last: int, k: int) -> tuple[list[int], torch.Tensor | None]:
        L = s.runner.length
        if k <= 0 or L == 0:
            return [], None
        idx = self.select(s)
        m = idx.shape[-1]
        if m + k > s.scratch.max_len:
            return [], None
        rk, rv = s.runner.cache.k, s.runner.cache.v  # [layers, 1, nkv, max_len, hd]
        sk, sv = s.scratch.k, s.scratch.v
        for i in self.layers:
            li = idx if idx.dim() == 1 else idx[i]
            sk[i, :, :, :m] = rk[i, :, :, li]
            sv[i, :, :, :m] = rv[i, :, :, li]
        s.selected = m
        model = self.model
        sp = s.sampling or DraftSampling()
        sample = sp.temperature > 0
        gen = sp.generator or self._own_generator
        ids: list[int] = []
        q_rows: list[torch.Tensor] = []
        tok = torch.tensor([[last]], device=self.device)
        for j in range(k):
            x = model.embed(tok)
            cos, sin = model.rope(L + j, 1, x.dtype)  # the query at its true position
            for i in self.layers:
                x = model.layers[i](x, cos, sin, sk[i], sv[i], m + j, None)
            logits = model.head(model.norm(x)[:, -1])[0]  # [V]
            if sample:
                p = logits_to_probs(logits.float(), sp.temperature, sp.top_k, sp.top_p)
                d = int(torch.multinomial(p, 1, generator=gen))
                q_rows.append(p)
            else:
                d = int(torch.argmax(logits))
            ids.append(d)
            if j + 1 == k or d in self.stop_ids:
                break
            tok = torch.tensor([[d]], device=self.device)
        return ids, (torch.stack(q_rows) if sample else None)


PROPOSERS = {"sparse_attn": SparseAttnProposer}
