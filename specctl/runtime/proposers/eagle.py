"""EAGLE-1 and EAGLE-3 drafting (arXiv 2401.15077, 2503.01840): the proposers.

The draft network and its fused CPU form: ``specctl.drafts.eagle``; its files: ``specctl.drafts.eagle_files``.
Index convention (vLLM's):
the draft row at position p reads token x[p+1] and the target's feature at p, and predicts x[p+2].

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
best N (a connected tree: a node's score never exceeds its parent's) go to verification, or fewer: with
the decoder's price of a row (``DraftRequest.row_price``), as many as are worth their rows by their
calibrated probabilities, and a branch below the price is not grown (``specctl.runtime.tree_budget``). The
verifier follows the target's greedy choices down the tree, so output stays the target's own.

What it does not know: verification, the target's cache, the network and its files (``specctl.drafts.eagle``,
``eagle_files``),
training (``specctl.training.eagle``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from specctl.config import SpecConfig
from specctl.drafts.eagle import EagleDraft, FusedEagle3
from specctl.drafts.eagle_files import load_eagle_draft
from specctl.errors import UsageError
from specctl.models import resolve_draft
from specctl.modeling import ModelArgs
from specctl.runtime.proposers.base import READ_TIMED, Draft, DraftBatch, DraftRequest, SlotProposer, target_q, weight_bytes
from specctl.runtime.proposers.base import DraftSampling as _Sampling
from specctl.runtime.tree_budget import NodeCalibration, with_ancestors, worth


class _Slot:
    """One request: the draft's KV cache, the target states of the cached positions and their features
    (computed only when the request drafts: a request that does not draft costs no fc), counters."""

    def __init__(self, a: ModelArgs, max_len: int, device, dtype: torch.dtype = torch.float32, src_dim: int = 0,
                 src_dtype: torch.dtype | None = None):
        shape = (1, a.num_kv_heads, max_len, a.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)  # [1, nkv, max_len, hd]
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        # [max_len, A*H | H] the target's states as it gives them (its dtype: no rounding, half an fp32 copy's bytes)
        self.src = torch.zeros(max_len, src_dim or a.hidden_size, device=device, dtype=src_dtype or dtype)
        self.feat = torch.zeros(max_len, a.hidden_size, device=device, dtype=dtype)  # [max_len, H] feature of each target position
        self.n_feat = 0  # target positions with a state (= the target's cache length)
        self.n_ft = 0  # positions whose feature is computed (<= n_feat)
        self.n_fed = 0  # draft cache positions holding feature rows (chain rows beyond are scratch)
        self.prompt: np.ndarray = np.zeros(0, dtype=np.int64)
        self.sampling: _Sampling | None = None
        self.active = False
        self.tree: tuple[list[int], list[int], list[float]] | None = None  # the last tree drafted: ids, parents, probabilities
        self.reading = False  # the next target rows are a prompt chunk the draft reads (``EagleProposer.on_prefill``)


class EagleProposer(SlotProposer):
    """EAGLE-1 chain drafting (see the module docstring). ``Eagle3Proposer`` only changes the version."""

    method = "eagle"
    version = 1
    needs_hidden_states = True
    reads_prompt = True  # the draft reads the prompt (``on_prefill``) where the decoder has it, else it catches up

    def __init__(self, config: SpecConfig, *, target, max_model_len: int, draft: EagleDraft | None = None,
                 embed: torch.Tensor | None = None, fused: bool | None = None):
        """``fused``: draft through the fused bf16 C++ block (EAGLE-3 beside a bf16 target on specctl's CPU
        kernels); None follows the target (fused where it runs the AMX, AVX-512 or AVX2 kernels)."""
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
            draft, embed = load_eagle_draft(resolve_draft(config.model, dtype=str(target.dtype).removeprefix("torch."),
                                                            what="EAGLE draft", trainer="train-eagle"), tmodel.args,
                                           version=self.version)
        if draft.version != self.version:
            raise UsageError(f"{config.model} is an EAGLE-{draft.version} draft but the method is '{self.method}'",
                             f"use \"method\": \"{'eagle3' if draft.version == 3 else 'eagle'}\"")
        self.device = tmodel.embed.weight.device
        self.draft = draft.to(self.device)
        # the network that drafts: the fused bf16 kernels next to a bf16 target on specctl's kernels, else the draft itself
        fused = None
        # fused as the target runs: on its AMX or AVX-512/AVX2 kernels (not torch's, not a GGUF's)
        if self._fused if self._fused is not None else tmodel.cpu_kernels in ("amx", "avx512_bf16", "avx512", "avx2"):
            fused = FusedEagle3.build(self.draft, tmodel.embed.weight.dtype, self.device, tmodel.kernels)
        self.net = fused or self.draft
        self.dtype = FusedEagle3.dtype if fused is not None else torch.float32
        self.embed_weight = embed.to(self.device) if embed is not None else tmodel.embed.weight  # [V, H]
        if draft.version == 3:
            self.aux_layers = tuple(sorted(draft.spec.aux_layers))  # asked of the target by the decoder
        self.target_ids = self.draft.target_ids.to(self.device)  # [N]
        self.Vt = tmodel.args.vocab_size
        self.stop_ids = set(getattr(target, "stop_token_ids", ()) or ())
        self.slots: dict[int, _Slot] = {}
        self.calibration = NodeCalibration()  # P(a tree node is accepted) by its draft probability, every request's
        # the controller's prior for a draft token: the draft's weights (not an embedding: a row a token) over the target's
        own = sum(p.numel() * p.element_size() for n, p in self.draft.named_parameters() if "embed" not in n)
        self.draft_cost = own / max(weight_bytes(tmodel), 1)
        self._own_generator = torch.Generator(device=self.device).manual_seed(int(torch.randint(2**62, ())))

    # ------------------------------------------------------------------ request life
    def _new_slot(self) -> _Slot:
        scratch = self.k + (self.tree_topk or 0) * self.k  # chain rows, or the forwarded tree nodes
        spec = self.draft.spec
        src_dim = len(spec.aux_layers) * spec.target_hidden_size if self.version == 3 else spec.target_hidden_size
        return _Slot(spec.args, self.max_model_len + scratch + 2, self.device, self.dtype, src_dim,
                     self.target_model.embed.weight.dtype)

    def _reset_slot(self, s: _Slot) -> None:
        s.n_feat = s.n_fed = s.n_ft = 0
        s.tree, s.reading = None, False

    def _target_len(self, s: _Slot) -> int:
        return s.n_feat

    @torch.inference_mode()
    def on_target_hidden(self, slot: int, hidden: torch.Tensor, aux: torch.Tensor | None) -> None:
        # hidden: [1, T, H] final-normed; aux: [1, T, A*H] (EAGLE-3) -> features of positions [n_feat, n_feat+T)
        s = self._slot(slot)
        s.active = True
        rows = (aux if self.version == 3 else hidden)[0]  # [T, A*H | H]: its feature when the request drafts
        T = rows.shape[0]
        end = min(s.n_feat + T, s.src.shape[0])
        s.src[s.n_feat:end] = rows[:end - s.n_feat]
        s.n_feat = end
        s.n_fed = min(s.n_fed, s.n_feat)
        if s.reading:  # a prompt chunk the decoder has the proposer read (``on_prefill``): the draft reads it now
            s.reading = False
            self._catch_up([(s, s.prompt)])

    def on_prefill(self, slot: int, upto: int, batch: int = 1) -> None:
        # called before the chunk's on_target_hidden, and only where reading the prompt pays (the decoder's call)
        self._slot(slot).reading = True

    def backlog(self, slot: int) -> int:
        """Context tokens the draft has not read (a prompt it skipped, the steps drafting was off): its next
        draft reads them first."""
        s = self.slots.get(slot)
        return 0 if s is None or not s.active else max(s.n_feat - 1 - s.n_fed, 0)

    def _catch_up(self, todo: list[tuple[_Slot, np.ndarray]]) -> float:
        """Each slot's unread rows but the last (features, then the draft layer; one ragged pass for all), position
        p reading token row[p+1]: reading a prompt (at the prefill, or at a first draft where the prefill did not) or
        the steps drafting was off is then priced as reading, not as drafting, and a draft feeds one row. Returns
        its seconds; a read of READ_TIMED tokens or more times ``catch_up_seconds``."""
        chains = [_Chain(-1, s, row, s.n_feat - 1, 1, _Sampling()) for s, row in todo if s.n_feat - 1 > s.n_fed]
        if not chains:
            return 0.0
        t, read = time.perf_counter(), sum(c.P - c.slot.n_fed for c in chains)
        with torch.inference_mode():
            self._feed(chains)
        seconds = time.perf_counter() - t
        self._timed_read(seconds, read)
        return seconds

    def on_verified(self, slot: int, num_accepted: int, emitted: list[int]) -> None:
        """A verified tree calibrates the nodes' probabilities (which were accepted); otherwise nothing: the
        next ``on_target_hidden`` rows overwrite the rejected chain rows."""
        s = self.slots.get(slot)
        if s is not None and s.tree is not None:
            self.calibration.observe_tree(s.tree, emitted, num_accepted)
            s.tree = None

    def _slot_for(self, r: DraftRequest) -> _Slot:
        s = self._slot_of(r)
        if s is None:
            raise UsageError("the EAGLE proposer was asked to draft for a request whose target states it has not seen",
                             "drive it through SpecDecoder (it calls on_target_hidden after every target forward)")
        return s

    # ------------------------------------------------------------------ drafting
    def propose(self, requests: list[DraftRequest], ks: list[int]) -> DraftBatch:
        """The chains advance together, one ragged draft pass and one read of the draft head per step for
        all requests; greedy requests with a configured tree draft their tree (EAGLE-2) on their own."""
        out = [Draft() for _ in requests]
        chains = []
        read = self._catch_up([(self._slot_for(r), r.ctx) for r, k in zip(requests, ks)
                               if k > 0 and self.backlog(r.slot) >= READ_TIMED])
        for b, (r, k) in enumerate(zip(requests, ks)):
            if k <= 0:
                continue
            if self.tree_topk is not None:
                s = self._slot_for(r)
                if (s.sampling or _Sampling()).temperature <= 0:
                    out[b] = self._propose_tree(s, r.ctx, k, r.row_price)
                    continue
            chains.append(b)
        for b, (ids, q) in zip(chains, self._drafts([requests[b] for b in chains], [ks[b] for b in chains])):
            out[b] = Draft(ids, q)
        return DraftBatch(out, read)

    @torch.inference_mode()
    def _drafts(self, requests: list[DraftRequest], ks: list[int]) -> list[tuple[list[int], torch.Tensor | None]]:
        """Each request's chain (draft ids, q [n_draft, V] or None), all stepping together."""
        out: list[tuple[list[int], torch.Tensor | None]] = [([], None)] * len(requests)
        live: list[_Chain] = []
        for i, (r, k) in enumerate(zip(requests, ks)):
            s = self._slot_for(r)
            P = s.n_feat  # = n - 1: positions [0, P) are in the target's cache; row[P] is the last emitted token
            if k > 0 and P > 0 and P + k + 1 <= s.k.shape[2]:
                live.append(_Chain(i, s, r.ctx, P, k, s.sampling or _Sampling()))
        if not live:
            return out
        o = self._feed(live)  # [J, H] the out of each request's last fed row
        j = 0
        while live:
            logits = self.net.logits(o, self.target_model.head_weight)  # [J, N]
            still, o_next = [], []
            for c, lg, oc in zip(live, logits, o):
                sp = c.sampling
                di = sp.pick(lg, c.q_rows, self._own_generator)  # [N] -> a draft-vocabulary id
                t = int(self.target_ids[di])
                c.ids.append(t)
                if j + 1 == c.k or t in self.stop_ids:
                    out[c.index] = (c.ids, target_q(c.q_rows, self.target_ids, self.Vt))
                else:
                    still.append(c)
                    o_next.append(oc)
            if not still:
                break
            emb = self.embed_weight[torch.tensor([c.ids[-1] for c in still], device=self.device)].to(self.dtype)[None]
            o = self.net.forward_ragged(emb, torch.stack(o_next)[None], [(c.P + j, 1, c.slot.k, c.slot.v) for c in still])[0]
            live, j = still, j + 1  # chain row j of each request at position P + j
        return out

    def _feed(self, chains: list["_Chain"]) -> torch.Tensor:
        """Feed each request's feature rows not yet in its draft cache (at least the last, whose output
        starts the draft), all in one ragged pass: position p reads token row[p+1]. Returns the out of
        each request's last row [J, H]."""
        self._features(chains)
        embs, hs, segs = [], [], []
        for c in chains:
            s, P = c.slot, c.P
            a = min(s.n_fed, P - 1)
            toks = torch.from_numpy(c.row[a + 1:P + 1].astype(np.int64)).to(self.device)  # [P - a]
            embs.append(self.embed_weight[toks].to(self.dtype))
            hs.append(s.feat[a:P])  # [P - a, H]
            segs.append((a, P - a, s.k, s.v))
            s.n_fed = P
        o = self.net.forward_ragged(torch.cat(embs)[None], torch.cat(hs)[None], segs)[0]  # [R, H]
        ends = torch.tensor([n for _, n, _, _ in segs]).cumsum(0) - 1
        return o[ends.to(o.device)]

    def _features(self, chains: list["_Chain"]) -> None:
        """The features of every drafting request's positions not computed yet, in one call for all
        (EAGLE-3: fc over the aux states; EAGLE-1: the hidden states themselves)."""
        todo = [c.slot for c in chains if c.slot.n_ft < c.P]
        if not todo:
            return
        rows = torch.cat([s.src[s.n_ft:s.n_feat] for s in todo])[None]  # [1, R, A*H | H]
        f = self.net.feature(rows, rows)[0]  # [R, H]
        off = 0
        for s in todo:
            n = s.n_feat - s.n_ft
            s.feat[s.n_ft:s.n_feat] = f[off:off + n]
            s.n_ft, off = s.n_feat, off + n

    @torch.inference_mode()
    def _propose_tree(self, s: _Slot, row: np.ndarray, depth: int, price: float | None = None) -> Draft:
        """EAGLE-2's dynamic tree (see the module docstring): a greedy request's. ``price``: one more row's
        cost in plain steps; the tree keeps the nodes worth it (``specctl.runtime.tree_budget``)."""
        P, K, d = s.n_feat, self.tree_topk, self.net
        s.tree = None
        if P == 0 or P + K * depth + 2 > s.k.shape[2]:
            return Draft()
        o = self._feed([_Chain(-1, s, row, P, depth, _Sampling())])[None]  # [1, 1, H]
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
        cal = self.calibration
        for lev in range(1, depth):  # a branch below the row's price grows no node worth verifying
            frontier = [c for c in frontier if tok[c] not in self.stop_ids and not (price and cal(math.exp(score[c])) <= price)]
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
        # rerank: the best N candidates (as many as pay for their rows), closed under parents, parents first
        best = sorted(range(len(tok)), key=lambda c: -score[c])[:self.tree_tokens]
        keep = with_ancestors(best[:worth([cal(math.exp(score[c])) for c in best], price)], parent)
        if not keep:
            return Draft()
        order = sorted(keep, key=lambda c: (level[c], -score[c]))
        index = {c: i for i, c in enumerate(order)}
        ids, parents = [tok[c] for c in order], [-1 if parent[c] < 0 else index[parent[c]] for c in order]
        s.tree = (ids, parents, [math.exp(score[c]) for c in order])  # calibrated once verified
        return Draft(ids, None, parents)


@dataclass
class _Chain:
    """One request's chain in progress: its row in the call, slot, context row, P = the target
    positions cached, draft length, sampling, what it drafted."""

    index: int
    slot: _Slot
    row: np.ndarray
    P: int
    k: int
    sampling: _Sampling
    ids: list[int] = field(default_factory=list)
    q_rows: list[torch.Tensor] = field(default_factory=list)


class Eagle3Proposer(EagleProposer):
    """EAGLE-3: features fused from the target's aux layers, a reduced draft vocabulary mapped by d2t."""

    method = "eagle3"
    version = 3


PROPOSERS = {"eagle": EagleProposer, "eagle3": Eagle3Proposer}
