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
  3. run the target's own layers (all, or all but ``sparse_attn_skip_layers``: a list, or "auto",
     chosen among a few blocks of later layers by measured accepted tokens per second) one token at a time on
     the scratch cache, the queries rotated at their true positions: the last emitted token, then each
     draft token, k forwards for k drafts. The drafts' keys/values go to the scratch cache only.

The real cache is only read (bit for bit unchanged); verification is the ordinary full forward, so the
method is lossless whatever is selected: greedy drafts are argmaxes, sampled drafts come with the
exact q they were drawn from.

What it does not know: verification, rollback (it reads the runner's length anew each step).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from specctl.config import SpecConfig
from specctl.errors import UsageError
from specctl.modeling import KVCache
from specctl.runtime.proposers.base import Draft, DraftBatch, DraftRequest, DraftSampling, SlotProposer
from specctl.roofline import budget as draft_budget

# StreamingLLM's attention sinks: vLLM's reference keeps the first KV block (16 positions)
SINK_TOKENS = 16


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


def skip_candidates(num_layers: int) -> list[list[int]]:
    """The skip sets "auto" chooses among: none, then blocks of a quarter, a third and half of the
    layers ending two before the last (the first and last layers are kept: they carry the most)."""
    out: list[list[int]] = [[]]
    end = num_layers - 2
    for frac in (4, 3, 2):
        n = num_layers // frac
        if n >= 1 and end - n >= 1:
            block = list(range(end - n, end))
            if block not in out:
                out.append(block)
    return out


class _SkipChooser:
    """Chooses the draft's skipped layers from measured acceptance: each candidate (``skip_candidates``)
    drafts ``TRIES`` steps in turn, then the one with the most tokens per second (1 + accepted per
    step, over its drafting seconds plus a verify's, estimated as a full draft step) drafts, with one
    step in ``EXPLORE`` given to another in turn so the figures follow the workload."""

    TRIES, EXPLORE = 6, 20

    def __init__(self, num_layers: int):
        self.candidates = skip_candidates(num_layers)
        self.steps = [0] * len(self.candidates)
        self.accepted = [0] * len(self.candidates)
        self.seconds = [0.0] * len(self.candidates)
        self.drafted = [0] * len(self.candidates)
        self.calls = 0

    def pick(self) -> int:
        self.calls += 1
        fewest = min(range(len(self.candidates)), key=lambda c: self.steps[c])
        if self.steps[fewest] < self.TRIES or self.calls % self.EXPLORE == 0:
            return fewest
        return self.best()

    def best(self) -> int:
        per_token = self.seconds[0] / max(self.drafted[0], 1)  # a full-layer draft step ~ a verify forward

        def rate(c: int) -> float:
            n = max(self.steps[c], 1)
            return (1 + self.accepted[c] / n) / (self.seconds[c] / n + per_token)
        return max((c for c in range(len(self.candidates)) if self.steps[c]), key=rate, default=0)

    def observe(self, c: int, drafted: int, seconds: float) -> None:
        self.drafted[c] += drafted
        self.seconds[c] += seconds

    def verified(self, c: int, accepted: int) -> None:
        self.steps[c] += 1
        self.accepted[c] += accepted


@dataclass
class _Slot:
    runner: object | None = None  # the request's TargetRunner (its model and KV cache)
    scratch: KVCache | None = None
    prompt: np.ndarray | None = None
    sampling: DraftSampling | None = None
    active: bool = False
    selected: int = 0  # positions the last draft attended to (for stats)
    skip_choice: int | None = None  # "auto": the candidate its last draft used


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
        self.attention_scores = self.algorithm == "vegas"  # the verify forwards record what they attended to
        self.ratio = float(config.sparse_attn_ratio if config.sparse_attn_ratio is not None else 0.05)
        self.min_tokens = int(config.sparse_attn_min_tokens or 256)
        skip = config.sparse_attn_skip_layers or []
        # "auto": a few skip sets tried on the live requests, the one with the most accepted tokens per
        # second of drafting and verifying kept (``_SkipChooser``); a list: those layers, always
        self.chooser = _SkipChooser(a.num_layers) if skip == "auto" else None
        skip = [] if skip == "auto" else skip
        bad = [i for i in skip if i >= a.num_layers]
        if bad:
            raise UsageError(f"sparse_attn_skip_layers names layer {bad[0]}, but the target has {a.num_layers} "
                             f"layers (0..{a.num_layers - 1})", "give layer indices below the number of layers")
        if len(skip) >= a.num_layers:
            raise UsageError("sparse_attn_skip_layers skips every layer", "keep at least one layer")
        self.layers = [i for i in range(a.num_layers) if i not in set(skip)]
        self.skipping = self.layers if skip else None  # the layers the draft runs, when not all
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
        if s.scratch is None:
            p = self.model.embed.weight
            s.scratch = KVCache(self.model.args, 1, self.scratch_len, p.dtype, p.device)

    # ------------------------------------------------------------------ drafting
    def propose(self, requests: list[DraftRequest], ks: list[int]) -> DraftBatch:
        """Every drafting step is one ragged forward of the target over every drafting request (one read
        of the weights), each request's row attending to its own scratch cache; the layers are those
        "auto" picks this step."""
        out = [Draft() for _ in requests]
        live = [b for b, k in enumerate(ks) if k > 0]
        if not live:
            return DraftBatch(out)
        slots = []
        for b in live:
            s = self._slot_of(requests[b])
            if s is None:
                raise UsageError("sparse_attn was asked to draft for a request whose KV cache it was not given",
                                 "drive it through SpecDecoder (it binds each request's runner)")
            slots.append(s)
        lasts = [int(requests[b].ctx[requests[b].n - 1]) for b in live]
        kl = [ks[b] for b in live]
        if self.chooser is None:
            drafts = self._draft(slots, lasts, kl, self.skipping)
        else:
            choice = self.chooser.pick()
            skip = self.chooser.candidates[choice]
            layers = [i for i in range(self.model.args.num_layers) if i not in skip] if skip else None
            t0 = time.perf_counter()
            drafts = self._draft(slots, lasts, kl, layers)
            self.chooser.observe(choice, sum(len(ids) for ids, _ in drafts), time.perf_counter() - t0)
            for s in slots:
                s.skip_choice = choice
        for b, (ids, q) in zip(live, drafts):
            out[b] = Draft(ids, q)
        return DraftBatch(out)

    def select(self, s: _Slot) -> torch.Tensor:
        """The cached positions the next draft attends to: [m] (every layer) or [layers, m]."""
        cache, L = s.runner.cache, s.runner.length
        budget = draft_budget(L, self.ratio, self.min_tokens)
        if self.algorithm == "vegas" and cache.scores is not None and cache.scored > 0:
            # the recent positions: those since the scoring forward (at most a verify block's k + 1)
            valid = max(min(cache.scored, L), L - self.k - 1)
            return vegas_positions(cache.ranking(valid), valid, L, budget)
        return streamingllm_positions(L, budget).to(cache.k.device)

    def on_verified(self, slot: int, num_accepted: int, emitted: list[int]) -> None:
        s = self.slots.get(slot)
        if self.chooser is not None and s is not None and s.skip_choice is not None:
            self.chooser.verified(s.skip_choice, num_accepted)
            s.skip_choice = None

    def _gather(self, s: _Slot) -> int:
        """The selected keys/values into the slot's scratch cache; returns how many (m)."""
        idx = self.select(s)
        m = idx.shape[-1]
        rk, rv = s.runner.cache.k, s.runner.cache.v  # [layers, 1, nkv, max_len, hd]
        for i in range(self.model.args.num_layers) if self.chooser is not None else self.layers:
            li = idx if idx.dim() == 1 else idx[i]
            s.scratch.k[i, :, :, :m] = rk[i, :, :, li]
            s.scratch.v[i, :, :, :m] = rv[i, :, :, li]
        s.selected = m
        return m

    @torch.inference_mode()
    def _draft(self, slots: list[_Slot], lasts: list[int], ks: list[int],
               layers: list[int] | None) -> list[tuple[list[int], torch.Tensor | None]]:
        """(draft ids, q [n, V] or None) per request; drafting step j is one forward of every request
        still drafting: its newest token at scratch slot m + j, rotated at its true position L + j."""
        from specctl.modeling import Segment

        results: list[tuple[list[int], torch.Tensor | None]] = [([], None)] * len(slots)
        live = []
        for i, (s, last, k) in enumerate(zip(slots, lasts, ks)):
            L = s.runner.length
            if k <= 0 or L == 0 or draft_budget(L, self.ratio, self.min_tokens) + 2 * k + 2 > s.scratch.max_len:
                continue
            live.append(_Drafting(i, s, k, self._gather(s), L, last, s.sampling or DraftSampling()))
        j = 0
        while live:
            segs = [Segment(d.slot.scratch, d.m + j, 1, positions=torch.tensor([float(d.L + j)], device=self.device))
                    for d in live]
            tokens = torch.tensor([d.feed for d in live], device=self.device)
            logits, _, _ = self.model.forward_ragged(tokens, segs, layers=layers)  # [len(live), V]
            still = []
            for d, lg in zip(live, logits):
                sp = d.sampling
                d.feed = sp.pick(lg, d.q_rows, self._own_generator)
                d.ids.append(d.feed)
                if len(d.ids) < d.k and d.feed not in self.stop_ids:
                    still.append(d)
                else:
                    results[d.index] = (d.ids, torch.stack(d.q_rows) if d.q_rows else None)
            live, j = still, j + 1
        return results


@dataclass
class _Drafting:
    """One request's draft in progress (``_draft``): where it came from, its slot and draft length, the
    positions in its scratch cache (m) and real cache (L), the token it feeds next, what it drafted."""

    index: int
    slot: _Slot
    k: int
    m: int
    L: int
    feed: int
    sampling: DraftSampling
    ids: list[int] = field(default_factory=list)
    q_rows: list[torch.Tensor] = field(default_factory=list)


PROPOSERS = {"sparse_attn": SparseAttnProposer}
