"""TargetRunner: the target model, its preallocated KV cache, and the cache length.

``forward(tokens)`` runs new tokens at positions [length, length+T) and advances ``length``;
``rollback(n)`` sets ``length = n`` in O(1): the rejected slots stay in memory and are overwritten
by the next forward (positions are written, never appended). Nothing is re-prefilled.

What it does not know: drafting, verification, sampling, tokenizers.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from specctl.errors import UsageError
from specctl.modeling import VERIFY_ROWS, KVCache, Segment, Transformer

class TargetOut(NamedTuple):
    """What one target forward gives a request, as a value: logits [1, T', V] (T' = T, or 1 for a
    prompt whose last row only is wanted), the final-normed hidden states [1, T, H] the LM head read,
    and the inputs of the aux layers asked for [1, T, A*H] (EAGLE-3's), or None."""

    logits: torch.Tensor
    hidden: torch.Tensor
    aux: torch.Tensor | None = None


def tree_attention_mask(parents: list[int]) -> torch.Tensor:
    """[N+1, N+1] bool: node i attends to node j iff j is i or an ancestor of i (the root included)."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


def tree_depths(parents: list[int]) -> list[int]:
    """Depth of each node of a tree given parent-first (parents[0] = -1 is the root, depth 0)."""
    depths = [0] * len(parents)
    for i in range(1, len(parents)):
        depths[i] = depths[parents[i]] + 1
    return depths


def check_compilable(model: Transformer) -> None:
    """torch.compile runs torch's own kernels: not a model packed for specctl's C++ bf16 CPU path."""
    if model.cpu_kernels is not None:
        raise UsageError("--compile needs torch's own kernels, and this bf16 CPU model runs specctl's C++ ones",
                         "drop --compile (the C++ decode step is already fused), or use --dtype float32, "
                         "a GPU, or --kernels torch")


class TargetRunner:
    """One model + one KV cache of ``max_len`` positions for ``batch`` rows (rows advance together)."""

    def __init__(self, model: Transformer, max_len: int, batch: int = 1, compile: bool = False):
        p = model.embed.weight
        if p.device.type == "cpu":
            # Subnormal floats take a slow microcode path on x86: bf16 attention over a long-tailed
            # softmax produces many of them, making decode up to 3x slower. Flushing them to zero
            # changes no greedy choice that is not already a tie at the 1e-38 scale.
            torch.set_flush_denormal(True)
        self.model = model
        self.max_len = max_len
        self.cache = KVCache(model.args, batch, max_len, p.dtype, p.device)
        self.device = p.device
        self.length = 0
        self._kept: tuple | None = None  # (ids, its TargetOut) of a prompt kept (keep_prompt)
        # compile: one-token steps run Transformer.decode_step through torch.compile (static shapes;
        # CUDA graphs on a GPU). Needs torch's own linears: not the packed AMX/C++ bf16 CPU path.
        self._step = None
        if compile:
            check_compilable(model)
            mode = "reduce-overhead" if p.device.type == "cuda" else None
            self._step = torch.compile(model.decode_step, mode=mode, fullgraph=True, dynamic=False)

    @property
    def vocab_size(self) -> int:
        return self.model.args.vocab_size

    def reset(self) -> None:
        self.length = 0
        self.cache.scored = 0  # a new request: no attention recorded for it yet

    def keep_prompt(self, ids: list[int], out: TargetOut) -> None:
        """The cache now holds prompt ``ids`` at [0, len(ids)) (``out``: its forward's, logits of its last
        row); a later request with the same prompt may take them back (``reuse_prompt``) until something
        is written below len(ids)."""
        self._kept = (list(ids), TargetOut(out.logits, out.hidden[:, -1:], None if out.aux is None else out.aux[:, -1:]))

    def reuse_prompt(self, ids: list[int]) -> TargetOut | None:
        """The kept prompt's forward output (its last row), the cache set to hold it, if ``ids`` is that
        prompt; else None."""
        kept = self._kept
        if kept is None or kept[0] != list(ids):
            return None
        self.length = len(ids)
        return kept[1]

    @torch.inference_mode()
    def run(self, tokens: torch.Tensor, logits: str = "all", parents: list[int] | None = None,
            aux_layers: tuple[int, ...] = (), scores: bool = False) -> TargetOut:
        """tokens [1, T] at the cache's length (a chain, or with ``parents`` a draft tree as in
        ``forward_tree``) -> their TargetOut (logits of every row, or of the last for "last").
        ``scores``: a chain of several rows or a prompt records its attention weights in the cache
        (``KVCache.scores``, what Vegas ranks by)."""
        seg = self.segment(tokens, parents)
        if seg.n == 1 and parents is None and self._step is not None:
            pos = torch.tensor([seg.start], device=self.device)
            out = TargetOut(*self._step(tokens.to(self.device), pos, self.cache.k, self.cache.v, aux_layers))
        else:
            out = TargetOut(*self.model(tokens.to(self.device), seg.start, self.cache, seg.mask,
                                        logits="all" if parents is not None else logits,
                                        positions=seg.positions, aux_layers=aux_layers, scores=scores))
        self._advance(seg)
        return out

    def forward(self, tokens: torch.Tensor, logits: str = "all") -> torch.Tensor:
        """tokens: [B, T] int64 -> logits [B, T, V] ("all") or [B, 1, V] ("last")."""
        return self.run(tokens, logits).logits

    def _advance(self, seg: Segment) -> None:
        """After a forward of ``seg``: the cache holds its rows (its hidden states are the forward's output,
        ``TargetOut.hidden``: nothing is kept here)."""
        self.length = seg.start + seg.n

    @torch.inference_mode()
    def greedy(self, logits: torch.Tensor, hidden: torch.Tensor, candidates: int = 4,
               margins: list | None = None) -> torch.Tensor:
        """logits [B, T, V] of a forward -> argmax token ids [B, T] (``hidden`` [B, >= T, H]: that
        forward's hidden states, its ``TargetOut.hidden``).

        ``margins``, when given, is extended with row 0's top-1 minus top-2 score per position
        (how close each choice was to a tie).

        In fp32 this is a plain argmax. In bf16/fp16 the LM head's output is rounded to 8 bits of
        mantissa (steps of 0.125 at logit 20), so near-ties are common; the top ``candidates``
        logits are recomputed in fp32 from the same hidden states (a few dot products) and the
        argmax is taken over those. Plain decoding and verification use this same function.
        """
        if logits.dtype == torch.float32:
            if margins is not None:
                top2 = logits[0].topk(2, dim=-1).values
                margins.extend((top2[:, 0] - top2[:, 1]).tolist())
            return logits.argmax(-1)
        T = logits.shape[1]
        h = hidden[:, -T:].float()  # [B, T, H]
        cand = logits.topk(candidates, dim=-1).indices  # [B, T, c]
        w = self.model.head_weight[cand].float()  # [B, T, c, H]
        exact = (h[:, :, None, :] * w).sum(-1)  # [B, T, c]: a per-row reduction, independent of T
        if margins is not None:
            top2 = exact[0].topk(2, dim=-1).values
            margins.extend((top2[:, 0] - top2[:, 1]).tolist())
        return cand.gather(-1, exact.argmax(-1, keepdim=True)).squeeze(-1)

    @torch.inference_mode()
    def forward_tree(self, tokens: torch.Tensor, parents: list[int]) -> torch.Tensor:
        """A draft tree: tokens [1, N+1], node 0 the last emitted token, node i's parent parents[i]
        (parents[0] = -1). Node i goes to cache slot length+i at position length+depth(i) and sees
        the prefix and its ancestors. Returns logits [1, N+1, V]; ``compact`` then keeps a path."""
        return self.run(tokens, parents=parents).logits

    def segment(self, tokens: torch.Tensor, parents: list[int] | None = None, last_only: bool = False) -> Segment:
        """Where tokens [1, T] go in this runner's cache and what they attend to: a chain at its
        length (causal, within the sliding window), or a draft tree as in ``forward_tree``; checks
        that they fit. ``forward``, ``forward_tree`` and ``forward_batch`` all start here."""
        start, T = self.length, tokens.shape[1]
        kept = self._kept
        if kept is not None and start < len(kept[0]):
            self._kept = None  # this forward overwrites the kept prompt
        if start + T > self.max_len:
            if parents is not None:
                raise UsageError(f"draft tree of {T} nodes does not fit in the cache ({self.max_len})",
                                 "raise --max-model-len or use a smaller speculative_token_tree")
            raise UsageError(f"sequence of {start + T} tokens exceeds the runner's max length {self.max_len}",
                             "raise --max-model-len or lower --max-new-tokens")
        if parents is not None:
            tree = tree_attention_mask(parents)
            mask = torch.ones(T, start + T, dtype=torch.bool)
            mask[:, start:] = tree
            pos = start + torch.tensor(tree_depths(parents), dtype=torch.float32)
            return Segment(self.cache, start, T, mask.to(self.device), pos.to(self.device), tree.to(self.device))
        mask = None
        window = self.model.args.sliding_window
        if T > 1 or (window is not None and start + T > window):
            q_pos = torch.arange(start, start + T, device=self.device)[:, None]
            k_pos = torch.arange(start + T, device=self.device)[None, :]
            mask = k_pos <= q_pos  # [T, start+T] causal
            if window is not None:
                mask &= k_pos > q_pos - window
        return Segment(self.cache, start, T, mask, last_only=last_only)

    def compact(self, start: int, path: list[int]) -> None:
        """Keep an accepted tree path: the keys/values of slots start+path[j] move to start+j, the
        cache then holds start+len(path) positions (a path's depths are 0, 1, 2, ..., so the
        rotary positions they were computed at are already right)."""
        src = torch.tensor([start + i for i in path], device=self.device)
        dst = torch.arange(start, start + len(path), device=self.device)
        for cache in (self.cache.k, self.cache.v):  # [layers, B, n_kv, max_len, hd]
            cache[:, :, :, dst] = cache[:, :, :, src]
        self.length = start + len(path)

    def rollback(self, length: int) -> None:
        """Keep the first ``length`` positions of the cache (O(1): only the length changes)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"rollback to {length} outside [0, {self.length}]")
        self.length = length


@torch.inference_mode()
def forward_batch(runners: list[TargetRunner], tokens: list[torch.Tensor], parents: list[list[int] | None] | None = None,
                  last_only: list[bool] | None = None, aux_layers: tuple[int, ...] = (),
                  scores: bool = False) -> list[TargetOut]:
    """One target forward over many requests, each with its own runner (KV cache and length):
    tokens[i] [1, T_i] at runners[i]'s length, a chain or (``parents[i]``) a draft tree, or a
    prompt whose last logits only are wanted (``last_only[i]``). The weights are read once for all
    rows; on the row-independent CPU paths each request's outputs equal, bit for bit, those of its
    own ``run``. Advances every runner as ``run`` would and returns each request's TargetOut
    (logits [1, T_i (or 1), V], hidden [1, T_i, H], the ``aux_layers``' inputs). All runners share
    one model. ``scores``: chains and prompts record their attention weights (``run``'s)."""
    n = len(runners)
    parents = parents or [None] * n
    last_only = last_only or [False] * n
    out: list[TargetOut | None] = [None] * n
    # Longer blocks (prompts) are prefill, which a forward of their own computes (SDPA attention):
    # run them alone so that a request's cache does not depend on the batch it arrived in.
    together = [i for i in range(n) if tokens[i].shape[1] <= VERIFY_ROWS]
    for i in range(n):
        if tokens[i].shape[1] > VERIFY_ROWS or len(together) == 1:
            out[i] = runners[i].run(tokens[i], "last" if last_only[i] else "all", parents[i], aux_layers, scores)
    if len(together) < 2:
        return out
    model = runners[together[0]].model
    segs = [runners[i].segment(tokens[i], parents[i], last_only[i]) for i in together]
    flat = torch.cat([tokens[i].reshape(-1) for i in together]).to(runners[together[0]].device)
    logits, hidden, aux = model.forward_ragged(flat, segs, aux_layers=aux_layers, scores=scores)
    lo = ho = 0
    for i, s in zip(together, segs):
        m = 1 if s.last_only else s.n
        h = hidden[ho:ho + s.n][None]
        out[i] = TargetOut(logits[lo:lo + m][None], h, None if aux is None else aux[ho:ho + s.n][None])
        runners[i]._advance(s)
        lo, ho = lo + m, ho + s.n
    return out
