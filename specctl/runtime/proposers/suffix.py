"""SuffixProposer: suffix decoding (arXiv 2411.04975) as ArcticInference implements it and vLLM's ``suffix`` calls it.

Two kinds of suffix trees (``specctl/kernels/suffix.py``), both of depth ``suffix_decoding_max_tree_depth``:

- a *local* tree per request over its prompt and everything generated so far, appended as tokens
  are verified (``on_verified``; the first token, emitted by the prefill, is read from the context);
- one *global* tree over the responses of finished requests (``end_request`` adds the response, not
  the prompt), holding at most ``suffix_decoding_max_cached_requests`` of them: the oldest is evicted
  first (FIFO); 0 disables it.

Each step drafts from both trees (for each match length up to the depth, follow the most frequent
child while the running probability stays >= ``suffix_decoding_min_token_prob``, at most
min(k, floor(``suffix_decoding_max_spec_factor`` x match length)) tokens; score = sum of the
probabilities) and keeps the better: the global draft only when its score is strictly higher. The
draft is deterministic (``probs=None``) and its length varies from step to step.

Each request names its slot (``DraftRequest.slot``); a slot never started is an error. A context whose
tokens do not continue its slot's tree restarts that slot's tree from the context (drafts are then
only less informed, never wrong: verification is lossless).

What it does not know: verification, models, tokenizers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from specctl.config import SpecConfig
from specctl.kernels.suffix import SuffixTree
from specctl.runtime.proposers.base import Draft, DraftBatch, DraftRequest, Proposer, unknown_slot


@dataclass
class _Request:
    tree: SuffixTree  # local tree: one growing sequence, prompt + generated tokens
    prompt_len: int

    @property
    def length(self) -> int:
        return int(self.tree.seq_len[0])

    def tokens(self) -> np.ndarray:
        return self.tree.tokens(0)


class SuffixProposer(Proposer):

    learns_across_requests = True
    method = "suffix"

    def __init__(self, config: SpecConfig, *, target=None, max_model_len: int):
        self.depth = int(config.suffix_decoding_max_tree_depth)
        self.max_cached = int(config.suffix_decoding_max_cached_requests)
        self.factor = float(config.suffix_decoding_max_spec_factor)
        self.min_prob = float(config.suffix_decoding_min_token_prob)
        self.max_model_len = int(config.max_model_len or max_model_len)
        self.global_tree = SuffixTree(self.depth, max_seqs=self.max_cached) if self.max_cached > 0 else None
        self.requests: dict[int, _Request] = {}
        self.last_source: list[str] = []  # per row of the latest propose: "local", "global" or "none"

    # ------------------------------------------------------------------ request lifecycle
    def start_request(self, slot: int, prompt_ids: np.ndarray) -> None:
        self.requests.pop(slot, None)  # a slot restarted without end_request: drop, do not cache
        prompt = np.ascontiguousarray(prompt_ids, dtype=np.int32)
        tree = SuffixTree(self.depth, node_capacity=max(1024, 4 * prompt.size), pool_capacity=prompt.size + 512)
        tree.start_seq()
        tree.extend(prompt)
        self.requests[slot] = _Request(tree, prompt.size)

    def on_verified(self, slot: int, num_accepted: int, emitted: list[int]) -> None:
        req = self.requests.get(slot)
        if req is not None and emitted:
            req.tree.extend(np.asarray(emitted, dtype=np.int32))

    def end_request(self, slot: int) -> None:
        req = self.requests.pop(slot, None)
        if req is None or self.global_tree is None:
            return
        response = req.tokens()[req.prompt_len:]
        if response.size == 0:
            return
        g = self.global_tree
        while len(g.live) >= self.max_cached:
            g.remove_oldest()
        g.start_seq()
        g.extend(response)
        g.end_seq()

    # ------------------------------------------------------------------ drafting
    def propose(self, requests: list[DraftRequest], ks: list[int]) -> DraftBatch:
        self.last_source = ["none"] * len(requests)
        return DraftBatch([self._draft(b, r, k) if k > 0 else Draft() for b, (r, k) in enumerate(zip(requests, ks))])

    def _draft(self, b: int, r: DraftRequest, k: int) -> Draft:
        """Request b's draft: the local tree's or, where it scores strictly higher, the global tree's."""
        n, row = r.n, r.ctx
        req = self._sync(r)
        max_spec = min(k, self.max_model_len - n - 1)
        if max_spec <= 0:
            return Draft()
        draft, out_g = np.empty(max_spec, dtype=np.int32), np.empty(max_spec, dtype=np.int32)
        scratch = np.empty(max_spec, dtype=np.int32)
        nl, score_l, _ = req.tree.speculate(row, n, max_spec, self.factor, self.min_prob, draft, scratch)
        ng, score_g = 0, 0.0
        if self.global_tree is not None and self.global_tree.live:
            ng, score_g, _ = self.global_tree.speculate(row, n, max_spec, self.factor, self.min_prob, out_g, scratch)
        if score_g > score_l:
            self.last_source[b] = "global"
            return Draft(out_g[:ng].tolist())
        self.last_source[b] = "local" if nl else "none"
        return Draft(draft[:nl].tolist())

    def _sync(self, r: DraftRequest) -> _Request:
        """The request's local tree caught up to its context (restarted from it where the context does
        not continue the tree's tokens)."""
        req = self.requests.get(r.slot)
        if req is None:
            raise unknown_slot(self, r.slot)
        n, row = r.n, r.ctx
        if req.length > n or not np.array_equal(req.tokens(), row[:req.length]):
            self.start_request(r.slot, row[:n].copy())
            return self.requests[r.slot]
        if n > req.length:
            req.tree.extend(row[req.length:n])
        return req


PROPOSERS = {"suffix": SuffixProposer}
