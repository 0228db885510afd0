"""Verification of a step's drafts, as data: each request's ``Block`` (its rows in the step's forward and
its draft) goes in, its ``StepOutcome`` (the rows to keep, the tokens to emit) comes out, which the
decoder's ``commit`` applies. Chains of one sampling mode are verified in one call of the verifier
(``specctl.runtime.rejection``) over the whole batch; trees each down their own tree.

What it does not know: drafting, the cache (``commit`` keeps the rows), scheduling.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch

from specctl.runtime.proposers.base import Draft
from specctl.runtime.rejection import (
    coupled_verify,
    greedy_tree_verify,
    greedy_verify,
    keyed_uniforms,
    logits_to_probs,
    rejection_sample,
)
from specctl.runtime.requests import DecodeState
from specctl.runtime.runner import TargetOut, tree_depths


@dataclass
class Block:
    """One request's rows in a step's target forward: ``tokens`` [1, 1+d] (the last emitted token, then
    the draft: a chain, or a tree's nodes), the draft itself, the cache length before the step, and the
    times the controller weighs (drafting t0..t1, the forward, its own verification)."""

    tokens: torch.Tensor
    draft: Draft
    base: int
    t0: float = 0.0
    t1: float = 0.0
    rows: int = 0  # rows of the whole forward it rode in (every request's)
    batch: int = 1  # requests decoding in that forward
    prefill_rows: int = 0  # prompt rows read in that forward too (its time is then mostly theirs)
    forward_s: float = 0.0  # that forward's seconds
    t_done: float = 0.0  # when its verification started

    @functools.cached_property
    def parents(self) -> list[int] | None:
        """The forward's tree over the block's rows (node 0 = the last token), or None for a chain (derived
        once: the forward, the verification and the outcome read it)."""
        if not self.draft.is_tree:
            return None
        return [-1] + [p + 1 for p in self.draft.parents[:len(self.draft)]]

    def step_seconds(self) -> float:
        """Its drafting, the forward, and its own verification so far: what the controller weighs."""
        return (self.t1 - self.t0) + self.forward_s + (time.perf_counter() - self.t_done)


@dataclass
class StepOutcome:
    """What one request's verification decided, which ``commit`` applies and the observers count:
    the block rows whose keys/values stay (0 = the last token, then the accepted drafts: a tree's
    path), the tokens to emit (the accepted drafts and the recovered or bonus token)."""

    kept: list[int]
    emitted: list[int]
    num_draft: int  # draft positions verified (a tree: its depth)
    nodes: int  # draft tokens forwarded (a tree: every node)
    tree: bool = False
    margins: list[float] | None = None

    @property
    def accepted(self) -> int:
        return len(self.kept) - 1


def verify(states: list[DecodeState], blocks: dict[int, Block],
           outs: dict[int, TargetOut]) -> dict[int, StepOutcome | Exception]:
    """Every request's verification, a ``StepOutcome`` by request index (or the exception that failed
    it): greedy chains in one ``greedy_verify``, deterministic drafts of sampling requests in one
    ``coupled_verify`` (coupled to plain sampling), sampled drafts in one ``rejection_sample`` (each
    row with its request's generator), a tree down its own tree along the target's choices. Lossless
    every way. A request's rows are verified from its own forward outputs only."""
    res: dict[int, StepOutcome | Exception] = {}
    chains: dict[str, list] = {"greedy": [], "coupled": [], "sampled": []}  # (i, target row or p [1+d, V])
    for i, block in blocks.items():
        block.t_done = time.perf_counter()
        st, out = states[i], outs[i]
        try:
            p = st.params
            if p.greedy:
                margins = [] if p.record_margins else None
                target = st.runner.greedy(out.logits, out.hidden, margins=margins)[0]  # [1+d]
                if block.parents is not None:
                    res[i] = _tree_outcome(block, target, margins)
                else:
                    chains["greedy"].append((i, target, margins))
            else:
                probs = logits_to_probs(out.logits[0], p.temperature, p.top_k, p.top_p)  # [1+d, V]
                chains["coupled" if block.draft.q is None else "sampled"].append((i, probs, None))
        except Exception as e:  # noqa: BLE001 - this request fails, the batch goes on
            res[i] = e
    for mode, rows in chains.items():
        if not rows:
            continue
        try:
            res.update(_verify_chains(mode, states, blocks, rows))
        except Exception as e:  # noqa: BLE001 - every request of this verification fails
            res.update({i: e for i, _, _ in rows})
    return res

def _tree_outcome(block: Block, target: torch.Tensor, margins: list[float] | None) -> StepOutcome:
    path, emitted = greedy_tree_verify(block.tokens[0].tolist(), block.parents, target.tolist())
    margins = None if margins is None else [margins[j] for j in path]  # emitted[m] is row path[m]'s choice
    return StepOutcome(path, emitted, max(tree_depths(block.parents)), len(block.draft), True, margins)

def _verify_chains(mode: str, states: list[DecodeState], blocks: dict[int, Block],
                   rows: list[tuple[int, torch.Tensor, list | None]]) -> dict[int, StepOutcome]:
    """One verification call for every chain of ``mode``: drafts padded to the longest, each row's
    count beside it (the verifier takes [B, k]); targets (argmax ids, or p) padded likewise."""
    idx = [i for i, _, _ in rows]
    nds = [len(blocks[i].draft) for i in idx]
    k = max(nds)
    dev = rows[0][1].device
    draft = torch.full((len(idx), k), -1, dtype=torch.long, device=dev)
    for b, i in enumerate(idx):
        draft[b, :nds[b]] = blocks[i].tokens[0, 1:].to(dev)
    num = torch.tensor(nds, device=dev)
    if mode == "greedy":
        target = torch.zeros(len(idx), k + 1, dtype=torch.long, device=dev)
        for b, (_, t, _) in enumerate(rows):
            target[b, :t.shape[0]] = t
        out_ids, n_emit = greedy_verify(draft, num, target)
    else:
        V = rows[0][1].shape[-1]
        p = torch.zeros(len(idx), k + 1, V, dtype=rows[0][1].dtype, device=dev)
        for b, (_, probs, _) in enumerate(rows):
            p[b, :probs.shape[0]] = probs
        if mode == "coupled":  # each position's uniform keyed by the request's seed (rejection.keyed_uniforms)
            u = torch.zeros(len(idx), k + 1, dtype=torch.float64)
            for b, i in enumerate(idx):
                u[b, :nds[b] + 1] = keyed_uniforms(states[i].key, states[i].n_ctx, nds[b] + 1)
            out_ids, n_emit = coupled_verify(draft, num, p, u)
        else:
            q = torch.zeros(len(idx), k, V, dtype=torch.float32, device=dev)
            for b, i in enumerate(idx):
                q[b, :nds[b]] = blocks[i].draft.q[:nds[b]].to(dev)
            out_ids, n_emit = rejection_sample(draft, num, q, p, [states[i].generator for i in idx])
    out = {}
    for b, (i, _, margins) in enumerate(rows):
        n = int(n_emit[b])
        out[i] = StepOutcome(list(range(n)), out_ids[b, :n].tolist(), nds[b], nds[b], False, margins)
    return out
