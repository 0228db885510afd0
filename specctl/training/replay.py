"""What bench will measure, from the target's states: greedy decoding replayed (EAGLE, Medusa, any draft
that reads the target's hidden states).

``evaluate`` (eagle_ttt) scores the draft teacher-forced: every row's chain at once, the TTT unroll. A
tree cannot be scored that way (its branches are the draft's own guesses, which the unroll never runs),
and bench drafts through the proposer (its KV cache, the fused bf16 kernels where the target runs them),
not through the training module. ``replay_acceptance`` runs the proposer itself over held-out sequences
whose answers are the target's own greedy output, as the decoder would, with each target forward replaced
by the states the trainer cached for those positions:

- after the prompt (the prefill emitted the answer's first token), the proposer has the target's states of
  positions [0, P) and drafts from row P (a chain of k, or its tree);
- the verification accepts the longest drafted path that the answer continues (the target's greedy
  tokens), and emits one more (the target's own next token);
- the proposer is told (``on_verified``) and given the states of the positions just verified, and the
  walk goes on from P + accepted + 1, to the end of the answer.

Its mean acceptance length (1 + accepted draft tokens per drafting step) is what ``specctl bench``
measures on the same prompts with the same draft configuration at concurrency 1, up to the draft's
bf16 rounding and the answers bench cuts at ``--max-new-tokens``. It costs the draft's forwards only.
"""

from __future__ import annotations

import numpy as np
import torch

from specctl.runtime.proposers.base import DraftRequest
from specctl.runtime.requests import SamplingParams
from specctl.runtime.tree_budget import accepted_nodes

# The EAGLE tree that train-eagle's replay and the recipe's bench (benchmarks/draft_recipe.py) both run: EAGLE-2's
# dynamic tree, 5 deep, the 4 likeliest children of each node grown, at most 16 nodes verified.
TREE = {"num_speculative_tokens": 5, "speculative_eagle_topk": 4, "speculative_num_draft_tokens": 16}


def accepted_length(ids: list[int], parents: list[int] | None, truth: list[int]) -> int:
    """The draft tokens a greedy verification accepts: the longest path of the draft (a chain, or a tree
    by ``parents``, -1 for the root's children) that ``truth`` (the target's tokens from the draft's first
    position on) starts with."""
    chain = list(range(-1, len(ids) - 1))
    return sum(accepted_nodes(ids, chain if parents is None else parents, truth, len(truth)))


def answer_start(mask) -> int:
    """The first learnt position of a sequence's loss mask: its answer's first token (the length where none)."""
    return next((t for t, m in enumerate(mask) if m), len(mask))


@torch.inference_mode()
def replay_acceptance(proposer, sequences: list[tuple[list[int], int, torch.Tensor, torch.Tensor | None]],
                      k: int, max_new_tokens: int | None = None, slot: int = 0) -> dict:
    """Greedy decoding replayed over ``sequences``: (tokens, start, hidden [n, H], aux [n, A*H] or None), where
    tokens[start:] is the target's greedy answer (start: the first answer token's position, the prompt before
    it) and hidden/aux the target's states at every position. ``max_new_tokens``: the requests' limit as bench
    runs them (a draft leaves room for the token its verification adds, as the decoder's do); None: each
    answer's own length. Returns the mean acceptance length (1 + accepted / drafting steps), the steps, draft
    tokens verified and accepted."""
    steps = accepted = drafted = 0
    for tokens, start, hidden, aux in sequences:
        n = len(tokens)
        if start < 1 or start >= n:
            continue
        limit = max_new_tokens or n - start
        ctx = np.asarray(tokens, dtype=np.int32)
        proposer.start_request(slot, ctx[:start])
        proposer.set_sampling(slot, SamplingParams(max_new_tokens=limit, temperature=0.0))
        P = start  # positions [0, P) are in the target's cache; row P is the last emitted token

        def feed(a: int, b: int) -> None:
            if proposer.needs_hidden_states:
                proposer.on_target_hidden(slot, hidden[None, a:b], None if aux is None else aux[None, a:b])

        feed(0, P)
        while P + 1 < n:
            room = limit - (P + 1 - start)  # tokens the request may still emit
            req = DraftRequest(slot, ctx, P + 1, hidden[None, P - 1])  # the state that emitted row P (Medusa reads it)
            d = proposer.propose([req], [min(k, room - 1)]).drafts[0] if room > 1 else None
            if d is None:
                break
            truth = tokens[P + 1:]
            a = accepted_length(list(d.ids), d.parents, truth) if len(d) else 0
            if len(d):
                steps, accepted, drafted = steps + 1, accepted + a, drafted + len(d)
            proposer.on_verified(slot, a, truth[:a + 1])
            feed(P, min(P + a + 1, n))
            P += a + 1
        proposer.end_request(slot)
    return {"mean_acceptance_length": 1.0 + accepted / steps if steps else 1.0, "steps": steps,
            "draft_tokens": drafted, "accepted_tokens": accepted}


def replay_eagle(draft, loaded, source, idx: list[int], k: int, tree: dict | None = None, max_new_tokens: int | None = None,
                 max_len: int = 4096) -> dict:
    """``replay_acceptance`` of an EAGLE draft (the module training holds, or a loaded export) beside the
    ``loaded`` target, over the sequences ``idx`` of a ``StateSource`` (their answer rows by its masks): a chain
    of ``k``, or with ``tree`` (``TREE``'s keys) EAGLE-2's tree, unpriced (the whole tree is verified)."""
    from specctl.config import SpecConfig
    from specctl.runtime.proposers.eagle import EagleProposer, Eagle3Proposer

    cls = Eagle3Proposer if draft.version == 3 else EagleProposer
    cfg = SpecConfig(method=cls.method, model="(in memory)", **{"num_speculative_tokens": k, **(tree or {})})
    was = draft.training
    draft.eval()
    try:
        proposer = cls(cfg, target=loaded, max_model_len=max_len, draft=draft)
        seqs = []
        for i in idx:
            st = source.batch([i], prompt_rows=0.0)
            n = int(st["lengths"][0])
            start = answer_start(source.masks[i]) if source.masks is not None else 0
            seqs.append((list(source.seqs[i]), start, st["hidden"][0, :n], st["aux"][0, :n] if "aux" in st else None))
        return replay_acceptance(proposer, seqs, int(cfg.num_speculative_tokens), max_new_tokens)
    finally:
        draft.train(was)


def replay_records(proposer, loaded, records, k: int, max_new_tokens: int | None = None, seq_len: int = 4096) -> dict:
    """``replay_acceptance`` over chat records whose answers are the target's own greedy ones (the recipe's
    held-out file: the target's answers to bench's prompts), the target's states computed here, one forward
    a record (the proposer's ``aux_layers`` included)."""
    from specctl.training import data as D
    from specctl.training.eagle_states import target_states

    seqs = []
    for r in records:
        for e in D.encode(loaded.tokenizer, r, seq_len, loaded.stop_token_ids):
            start = answer_start(e.loss_mask)
            st = target_states(loaded.model, torch.tensor([e.input_ids]), tuple(proposer.aux_layers))
            seqs.append((list(e.input_ids), start, st["hidden"][0], st["aux"][0] if "aux" in st else None))
    return replay_acceptance(proposer, seqs, k, max_new_tokens)
