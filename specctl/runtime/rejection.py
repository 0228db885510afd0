"""The verifier: speculative rejection sampling (Leviathan et al., arXiv 2211.17192), as pure functions.

Terms, used the same way everywhere in specctl (and in vLLM's RejectionSampler):
  p = the target's distribution, q = the draft's distribution.
  accepted  : draft token x_i kept, with probability min(1, p_i(x_i) / q_i(x_i)).
  recovered : at the first rejection i, a token sampled from norm(max(p_i - q_i, 0)).
  bonus     : when all k drafts are accepted, one more token sampled from p_k.
Each step therefore emits (num accepted + 1) tokens, and the emitted sequence is distributed exactly
as sampling from p one token at a time. Greedy (temperature 0) is the limit: accept while the draft
equals argmax p, then emit argmax p.

A deterministic draft (ngram, suffix) has no probabilities: q is one-hot at the draft token, so a
draft token is accepted with probability p(x), and the recovered distribution is p with x removed.
Such drafts are verified by ``coupled_verify``: the target's token at each position is sampled first,
from p with that position's own uniform (``keyed_uniforms``: a hash of the request's seed and the
position), and a draft token is accepted iff it equals it. That is the same rule (accepted with
probability p(x); on rejection the sample is p's conditioned on not x, i.e. p with x removed), and it
makes every emitted token the one plain sampling with the same seed emits at that position: seeded
output is the same whatever the draft length, the batch or the method (among deterministic drafts),
token for token.

Shapes: B requests, k = max draft length in the batch (rows padded with -1), V = vocabulary.
Example with k = 3, one row: draft [a, b, c], target argmax [a, b, d, e]
  -> accepted a, b; c != d so d is the recovered token -> output [a, b, d, -1], num_emitted 3.
"""

from __future__ import annotations

import torch

PAD = -1


def greedy_verify(
    draft_token_ids: torch.Tensor,  # [B, k] int, padded with -1
    num_draft_tokens: torch.Tensor,  # [B] int
    target_argmax: torch.Tensor,  # [B, k+1] int, argmax p at each position
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (output_token_ids [B, k+1] padded with -1, num_emitted [B] = accepted + 1)."""
    B, k = draft_token_ids.shape
    pos = torch.arange(k, device=draft_token_ids.device)
    valid = pos[None, :] < num_draft_tokens[:, None]  # [B, k]
    match = (draft_token_ids == target_argmax[:, :k]) & valid  # [B, k]
    # number accepted = length of the leading run of matches
    num_accepted = torch.cumprod(match.to(torch.int32), dim=1).sum(dim=1)  # [B]
    return _assemble(target_argmax, num_accepted)


def _assemble(next_tokens: torch.Tensor, num_accepted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Output = the first num_accepted+1 entries of next_tokens [B, k+1] (rest -1).

    Positions < num_accepted hold accepted draft tokens (equal to the draft there), position
    num_accepted holds the recovered or bonus token.
    """
    k1 = next_tokens.shape[1]
    pos = torch.arange(k1, device=next_tokens.device)
    keep = pos[None, :] <= num_accepted[:, None]
    return torch.where(keep, next_tokens, torch.full_like(next_tokens, PAD)), num_accepted + 1


def rejection_sample(
    draft_token_ids: torch.Tensor,  # [B, k] int, padded with -1
    num_draft_tokens: torch.Tensor,  # [B] int
    draft_probs: torch.Tensor | None,  # [B, k, V] float, q; None = deterministic (one-hot) drafts
    target_probs: torch.Tensor,  # [B, k+1, V] float, p (already temperature/top-p processed)
    generator: torch.Generator | list[torch.Generator | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stochastic verification. Returns (output_token_ids [B, k+1] padded -1, num_emitted [B]).

    ``generator``: one for the whole batch, or a list with each row's own (each request of a batch
    samples from its own generator, which then draws exactly what that row verified alone draws: its
    num_draft_tokens uniforms, then its one token)."""
    B, k = draft_token_ids.shape
    dev = target_probs.device
    pos = torch.arange(k, device=dev)
    valid = pos[None, :] < num_draft_tokens[:, None]  # [B, k]
    safe_ids = draft_token_ids.clamp(min=0).long()  # [B, k]

    p_draft = target_probs[:, :k].gather(-1, safe_ids[..., None]).squeeze(-1)  # [B, k] p(x_i)
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.gather(-1, safe_ids[..., None]).squeeze(-1)  # [B, k] q(x_i)
    per_row = isinstance(generator, (list, tuple))
    if per_row:
        u = torch.ones(B, k, device=dev, dtype=torch.float32)  # past a row's drafts: never accepted (valid masks it)
        for b, g in enumerate(generator):
            n = int(num_draft_tokens[b])
            u[b, :n] = torch.rand((1, n), generator=g, device=dev, dtype=torch.float32)[0]
    else:
        u = torch.rand(p_draft.shape, generator=generator, device=dev, dtype=torch.float32)
    # accept iff u < p/q  (written as u*q < p so q = 0 never divides)
    accept = (u * q_draft.float() < p_draft.float()) & valid
    num_accepted = torch.cumprod(accept.to(torch.int32), dim=1).sum(dim=1)  # [B]

    # Distribution of the token after the accepted run: recovered (rejection) or bonus (all accepted).
    rows = torch.arange(B, device=dev)
    p_next = target_probs[rows, num_accepted].float()  # [B, V]
    rejected = num_accepted < num_draft_tokens  # [B]
    if rejected.any():
        idx = num_accepted.clamp(max=max(k - 1, 0))
        if draft_probs is None:
            q_next = torch.zeros_like(p_next)
            q_next.scatter_(1, safe_ids[rows, idx][:, None], 1.0)
        else:
            q_next = draft_probs[rows, idx].float()
        residual = (p_next - q_next).clamp(min=0)
        norm = residual.sum(-1, keepdim=True)
        # p == q exactly gives a zero residual; rejection then had probability 0, keep p to stay finite.
        residual = torch.where(norm > 0, residual / norm.clamp(min=1e-30), p_next)
        p_next = torch.where(rejected[:, None], residual, p_next)
    if per_row:
        sampled = torch.cat([torch.multinomial(p_next[b:b + 1], 1, generator=g)[:, 0] for b, g in enumerate(generator)])
    else:
        sampled = torch.multinomial(p_next, 1, generator=generator).squeeze(1)  # [B]

    next_tokens = torch.cat([draft_token_ids, torch.full((B, 1), PAD, dtype=draft_token_ids.dtype, device=dev)], 1)
    next_tokens = next_tokens.long()
    next_tokens[rows, num_accepted] = sampled
    return _assemble(next_tokens, num_accepted)


_M64 = (1 << 64) - 1


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def keyed_uniforms(key: int, start: int, n: int) -> torch.Tensor:
    """Uniforms in [0, 1) for sequence positions start .. start + n - 1 of a request keyed ``key`` (its
    seed): each a hash of (key, position) alone (splitmix64, 53 bits), so a position's draw does not
    depend on how the tokens before it were produced. float64 [n]."""
    k = _splitmix64(key & _M64)
    return torch.tensor([(_splitmix64(k ^ (t & _M64)) >> 11) * 2.0 ** -53 for t in range(start, start + n)],
                        dtype=torch.float64)


def sample_with_uniforms(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of probs [N, V] by inverse CDF at u [N] (float64 in [0, 1)): the first token
    whose cumulative probability exceeds u times the row's total. Never a zero-probability token."""
    p = probs.double()
    cdf = p.cumsum(-1)
    x = (u.to(cdf.device, torch.float64) * cdf[:, -1]).unsqueeze(-1)
    idx = torch.searchsorted(cdf, x, right=True).squeeze(-1)
    last = p.shape[-1] - 1 - (p > 0).flip(-1).to(torch.int8).argmax(-1)  # the last token with p > 0
    return torch.minimum(idx, last)


def coupled_verify(
    draft_token_ids: torch.Tensor,  # [B, k] int, padded with -1; deterministic drafts (q one-hot)
    num_draft_tokens: torch.Tensor,  # [B] int
    target_probs: torch.Tensor,  # [B, k+1, V] float, p
    u: torch.Tensor,  # [B, k+1] float64: the uniforms of the k+1 positions (keyed_uniforms)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stochastic verification of deterministic drafts, coupled to plain sampling (module docstring):
    the target's token x_i ~ p_i at each position from its own uniform, drafts accepted while they equal
    it, then x at the first mismatch (or the bonus position). Returns (output [B, k+1] padded -1, num_emitted).
    A row's positions past its first mismatch are not sampled (an inverse CDF over the vocabulary each)."""
    B, k1, _ = target_probs.shape
    dev = draft_token_ids.device
    x = torch.full((B, k1), PAD, dtype=torch.long, device=dev)
    live = torch.arange(B, device=dev)  # rows whose drafts matched every position so far
    for i in range(k1):
        x[live, i] = sample_with_uniforms(target_probs[live.to(target_probs.device), i], u[live.cpu(), i]).to(dev)
        if i == k1 - 1:
            break
        live = live[(i < num_draft_tokens[live]) & (draft_token_ids[live, i] == x[live, i])]
        if live.numel() == 0:
            break
    return greedy_verify(draft_token_ids, num_draft_tokens, x)


def logits_to_probs(
    logits: torch.Tensor,  # [..., V]
    temperature: float,
    top_k: int | None = None,
    top_p: float | None = None,
) -> torch.Tensor:
    """Target (or draft) distribution after temperature, top-k and top-p, in fp32. temperature > 0."""
    logits = logits.float() / temperature
    if top_k is not None and 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = cum - sorted_logits.softmax(-1) > top_p  # keep the smallest prefix reaching top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.softmax(logits, dim=-1)


def greedy_tree_verify(tokens: list[int], parents: list[int], target_argmax: list[int]) -> tuple[list[int], list[int]]:
    """tokens [N+1] (root first), target_argmax [N+1] (the target's choice after each node) ->
    (accepted path of node indices starting at the root, emitted tokens = accepted drafts + the next one).

    From the root, move to the child whose token is the target's choice there, while one exists.
    """
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        if p >= 0:
            children.setdefault(p, []).append(i)
    path = [0]
    while True:
        want = target_argmax[path[-1]]
        nxt = next((c for c in children.get(path[-1], []) if tokens[c] == want), None)
        if nxt is None:
            break
        path.append(nxt)
    return path, [tokens[i] for i in path[1:]] + [target_argmax[path[-1]]]
