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

Which request a context row belongs to: the decoder passes a request's own context buffer (the
array whose view ``start_request`` received), so a row is matched to its slot by that buffer;
otherwise row b is slot b. A row whose tokens do not continue its slot's tree restarts that slot's
tree from the row (drafts are then only less informed, never wrong: verification is lossless).

What it does not know: verification, models, tokenizers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specctl.config import SpecConfig
from specctl.kernels.suffix import SuffixTree
from specctl.runtime.proposers.base import DraftOutput, Proposer


@dataclass
class _Request:
    tree: SuffixTree  # local tree: one growing sequence, prompt + generated tokens
    prompt_len: int
    buffer: np.ndarray | None  # the context buffer [1, max_len] this request was started from, if known

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
        buffer = prompt_ids.base if isinstance(prompt_ids, np.ndarray) and prompt_ids.base is not None else None
        self.requests[slot] = _Request(tree, prompt.size, buffer)

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
    def propose(self, token_ids, num_tokens, k, hidden_states=None, slots=None) -> DraftOutput:
        batch = token_ids.shape[0]
        draft = np.full((batch, max(k, 0)), -1, dtype=np.int32)  # [batch, k]
        num = np.zeros(batch, dtype=np.int32)  # [batch]
        out_g = np.empty(max(k, 1), dtype=np.int32)
        scratch = np.empty(max(k, 1), dtype=np.int32)
        self.last_source = ["none"] * batch
        for b in range(batch):
            n = int(num_tokens[b])
            row = token_ids[b]
            req = self._sync(token_ids, b, n, None if slots is None else int(slots[b]))
            max_spec = min(k, self.max_model_len - n - 1)
            if max_spec <= 0:
                continue
            nl, score_l, _ = req.tree.speculate(row, n, max_spec, self.factor, self.min_prob, draft[b], scratch)
            ng, score_g = 0, 0.0
            if self.global_tree is not None and self.global_tree.live:
                ng, score_g, _ = self.global_tree.speculate(row, n, max_spec, self.factor, self.min_prob, out_g, scratch)
            if score_g > score_l:
                draft[b, :ng] = out_g[:ng]
                draft[b, ng:] = -1
                num[b], self.last_source[b] = ng, "global"
            else:
                draft[b, nl:] = -1
                num[b], self.last_source[b] = nl, "local" if nl else "none"
        return DraftOutput(torch.from_numpy(draft).long(), torch.from_numpy(num).long(), None)

    def _sync(self, token_ids: np.ndarray, b: int, n: int, slot: int | None = None) -> _Request:
        """Row b's request, its local tree caught up to token_ids[b, :n].

        The slot named by the caller, else the one whose buffer is the decoder's; any other row b
        is slot b. A slot is trusted only if the row continues its tokens (else it restarts from
        the row).
        """
        row = token_ids[b]
        req = None
        if slot is not None:
            req = self.requests.get(slot)
            if req is not None and (req.length > n or not np.array_equal(req.tokens(), row[:req.length])):
                req = None
        elif token_ids.shape[0] == 1:
            slot = next((s for s, r in self.requests.items() if r.buffer is token_ids), None)
            req = self.requests.get(slot) if slot is not None else None
        if req is None and slot is None:
            slot = b
            req = self.requests.get(slot)
            if req is not None and (req.length > n or not np.array_equal(req.tokens(), row[:req.length])):
                req = None
        if req is None or req.length > n:
            self.start_request(slot, row[:n].copy())
            return self.requests[slot]
        if n > req.length:
            req.tree.extend(row[req.length:n])
        return req


PROPOSERS = {"suffix": SuffixProposer}
