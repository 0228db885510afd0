"""The Proposer interface every draft method implements, and the DraftOutput it returns.

A proposer sees the request state (all token ids so far; the target's hidden states when it sets
``needs_hidden_states``) and proposes up to k tokens per request. It knows nothing about
verification: the decode loop verifies, rolls the target back, and calls ``on_verified`` so a
stateful proposer (a draft model with its own KV cache, a suffix tree) can follow.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specctl.runtime.rejection import logits_to_probs


@dataclass
class DraftOutput:
    token_ids: torch.Tensor  # [batch, k] int64, padded with -1
    num_tokens: torch.Tensor  # [batch] int64, valid draft tokens per request (may be 0)
    probs: torch.Tensor | None = None  # [batch, k, vocab] q; None = deterministic draft (one-hot)
    # A draft tree instead of a chain (batch 1, greedy only): parents[i] is the draft index of draft
    # i's parent, -1 for the last emitted token. None = a chain. Verified by SpecDecoder's tree step.
    parents: list[int] | None = None


def batch_draft(drafts: list[tuple[list[int], torch.Tensor | None]], k: int, vocab: int, device) -> DraftOutput:
    """A batch's DraftOutput from each request's (draft ids, q [n, vocab] or None): ids padded with -1
    to k; q where any request sampled, with one-hot rows for the deterministic drafts among them."""
    B = len(drafts)
    out = torch.full((B, k), -1, dtype=torch.long)
    num = torch.zeros(B, dtype=torch.long)
    for b, (ids, _) in enumerate(drafts):
        out[b, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        num[b] = len(ids)
    probs = None
    if any(q is not None for _, q in drafts):
        probs = torch.zeros(B, k, vocab, dtype=torch.float32, device=device)  # [B, k, V]
        for b, (ids, q) in enumerate(drafts):
            n = len(ids)
            if q is not None:
                probs[b, :n] = q[:n]
            elif n:  # a deterministic row among sampled ones: q one-hot at its tokens
                probs[b, torch.arange(n), out[b, :n].to(device)] = 1.0
    return DraftOutput(out, num, probs)


@dataclass
class DraftSampling:
    """How a request samples (from SamplingParams), kept per slot by proposers that draft from a model."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    generator: torch.Generator | None = None

    def pick(self, logits: torch.Tensor, q_rows: list, generator: torch.Generator | None = None) -> int:
        """The next draft token from logits [V]: sampled as the request samples (its q, [V], appended
        to ``q_rows``; the request's generator, else ``generator``), else the argmax."""
        if self.temperature > 0:
            p = logits_to_probs(logits, self.temperature, self.top_k, self.top_p)  # [V]
            q_rows.append(p)
            return int(torch.multinomial(p, 1, generator=self.generator or generator))
        return int(torch.argmax(logits))


class Proposer:
    """Base class: one subclass per method, in its own file (``<Method>Proposer``)."""

    method: str = ""
    needs_hidden_states: bool = False
    # the target layers whose inputs it wants beside the final hidden states (EAGLE-3's aux hidden
    # states, ascending): the decoder has the target return them, in ``on_target_hidden``'s aux
    aux_layers: tuple[int, ...] = ()
    learns_across_requests: bool = False  # e.g. suffix's global cache of earlier responses
    # drafts every running request in one call (``propose_batch``): one batched draft forward
    drafts_in_batch: bool = False
    reads_prompt: bool = False  # reads each prompt with a model of its own (``on_prefill``): a draft model
    # chooses each step's draft length itself (a hybrid weighing its parts): the decoder's controller
    # does not cut k (``set_adaptive`` says whether to adapt at all; ``observe_step`` gives the timings)
    chooses_draft_length: bool = False
    # a draft token's forward against a target forward over the same rows, before it is measured (the
    # controller's prior for drafting's cost; 0: free until measured, as n-gram lookup is)
    draft_cost: float = 0.0

    def start_request(self, slot: int, prompt_ids: np.ndarray) -> None:
        """A new request enters batch slot ``slot`` with its prompt (int32 [T])."""

    def set_sampling(self, slot: int, params, generator: torch.Generator | None = None) -> None:
        """The request in ``slot`` samples with ``params`` (SamplingParams); a drafting model may follow."""

    def bind_target(self, slot: int, runner) -> None:
        """The request in ``slot`` decodes with ``runner`` (a TargetRunner: the target's model and this
        request's KV cache), told before its prefill; a proposer that drafts with the target itself
        (sparse_attn) keeps it."""

    def propose(
        self,
        token_ids: np.ndarray,  # [batch, max_len] int32, row b valid up to num_tokens[b]
        num_tokens: np.ndarray,  # [batch] int32
        k: int,
        hidden_states: torch.Tensor | None = None,  # [batch, H] target's last hidden state, if asked
        slots=None,  # [batch] the slot of each row's request (the decoder passes it); None: matched by context
    ) -> DraftOutput:
        raise NotImplementedError

    def propose_batch(self, rows: list[tuple[np.ndarray, int, int | None]], ks: list[int],
                      hidden: list[torch.Tensor | None] | None = None) -> list[DraftOutput]:
        """Only with ``drafts_in_batch``: each (context ids [1, max_len], context length, slot) gets up
        to its k tokens, one DraftOutput of batch 1 per row, in order; ``hidden``: each row's
        ``hidden_states`` [1, H] as ``propose`` gets them (with ``needs_hidden_states``)."""
        raise NotImplementedError

    def on_prefill(self, slot: int, upto: int) -> None:
        """The first ``upto`` prompt tokens of the request in ``slot`` are in the target's cache (called
        after each prefill chunk): a proposer with a prompt of its own to read (a draft model) reads
        along, chunk by chunk, so no single step carries a whole prompt's draft prefill."""

    def backlog(self, slot: int) -> int:
        """Context tokens the request in ``slot`` has that this proposer must read before it can draft
        (a draft model that skipped the prompt, or sat out steps another part won): what its next
        draft pays beyond drafting. 0 for proposers that read nothing of their own."""
        return 0

    def on_target_hidden(self, slot: int, hidden: torch.Tensor, aux: torch.Tensor | None) -> None:
        """Only with ``needs_hidden_states``: the target's states of the rows now in its cache.

        Called after the prefill (every prompt row) and after each verification (the rows kept:
        the previous last token and the accepted drafts). hidden: [1, T, H] final-normed (what
        the LM head reads); aux: [1, T, A*H] the inputs of the layers in ``aux_layers``, or None.
        """

    def on_verified(self, slot: int, num_accepted: int, emitted: list[int]) -> None:
        """After verification: ``num_accepted`` drafts kept, ``emitted`` tokens appended."""

    def end_request(self, slot: int) -> None:
        """The request in ``slot`` finished (a proposer may learn from its output here)."""

    def set_adaptive(self, on: bool) -> None:
        """Whether the decoder adapts the draft length (``chooses_draft_length`` proposers then do it)."""

    def observe_step(self, slot: int, num_draft: int, rows: int, seconds: float, draft_seconds: float,
                     batch: int = 1) -> None:
        """After ``slot``'s step (plain or drafted, after ``credit``): ``num_draft`` tokens drafted, the
        forward's ``rows`` (every request's, ``batch`` requests), the step's ``seconds``, ``draft_seconds``
        of them drafting."""

    def credit(self, slot: int, num_draft: int, num_accepted: int, emitted: list[int]) -> dict[str, tuple[int, int]]:
        """After ``slot``'s step was verified: its sub-proposers that drafted, each with (its draft
        tokens, how many were accepted) (hybrid); {} for a single proposer."""
        return {}


class SlotProposer(Proposer):
    """A proposer that keeps each request's state in a slot of its own (a draft's caches, the target
    states it has seen, the request's sampling). Subclasses build a slot in ``_new_slot`` (an object
    with ``prompt``, ``sampling`` and ``active``), clear one in ``_reset_slot`` and say how many
    target positions a slot holds in ``_target_len``; the request life is here, once."""

    slots: dict

    def _new_slot(self):
        raise NotImplementedError

    def _reset_slot(self, s) -> None:
        """A slot is reused for a new request: forget the old one's state."""

    def _target_len(self, s) -> int:
        raise NotImplementedError

    def _slot(self, slot: int):
        s = self.slots.get(slot)
        if s is None:
            s = self.slots[slot] = self._new_slot()
        return s

    def start_request(self, slot: int, prompt_ids: np.ndarray) -> None:
        s = self._slot(slot)
        self._reset_slot(s)
        s.prompt = np.asarray(prompt_ids, dtype=np.int64).copy()
        s.active = True

    def set_sampling(self, slot: int, params, generator: torch.Generator | None = None) -> None:
        self._slot(slot).sampling = DraftSampling(float(params.temperature), params.top_k, params.top_p, generator)

    def end_request(self, slot: int) -> None:
        if slot in self.slots:
            self.slots[slot].active = False

    def _match_slot(self, row: np.ndarray, n: int, slot: int | None = None):
        """The request's slot when the caller names it (``slot``); else the active slot whose target
        states fit this context of n tokens (the target holds n - 1), told apart by prompt where
        several do; None if none."""
        if slot is not None:
            s = self.slots.get(slot)
            return s if s is not None and s.active and self._target_len(s) == n - 1 else None
        cands = [s for s in self.slots.values() if s.active and self._target_len(s) == n - 1]
        if len(cands) > 1:
            cands = [s for s in cands if np.array_equal(s.prompt, row[:len(s.prompt)])] or cands
        return cands[0] if cands else None
