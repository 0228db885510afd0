"""The Proposer interface every draft method implements: ``propose(requests, ks) -> DraftBatch``.

A proposer is called once per step with every request that drafts (``DraftRequest``: its slot, its
context, the target's hidden state where asked) and returns one ``Draft`` per request (a chain, or a
tree with per-row parents, with the draft's distributions where it sampled). It knows nothing about
verification: the decode loop verifies, rolls the target back, and calls ``on_verified`` so a
stateful proposer (a draft model with its own KV cache, a suffix tree) can follow.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from specctl.runtime.rejection import logits_to_probs

READ_TIMED = 16  # a draft's read of at least this many context tokens (a prompt, a catch-up) times ``catch_up_seconds``


def weight_bytes(model) -> int:
    """Bytes of a model's parameters (quantized blocks included): what a decode step reads."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


@dataclass
class DraftRequest:
    """One request to draft for. ``slot`` names it (mandatory: a proposer keeps per-request state by
    slot, and a slot it was never told about is an error, never a guess); ``ctx[:n]`` is its context
    (prompt + emitted tokens; the decoder's own buffer, not a copy); ``hidden`` [1, H] the target's
    final hidden state at the position that produced the last token (for proposers with
    ``needs_hidden_states``, else None); ``row_price``: what one more row of its verification costs, in
    its plain steps (the decoder's measurement; a tree proposer keeps the nodes worth it,
    ``specctl.runtime.tree_budget``)."""

    slot: int
    ctx: np.ndarray  # [>= n] int32
    n: int
    hidden: torch.Tensor | None = None
    row_price: float | None = None  # one more verified row's cost in plain steps (a draft tree's budget); None: unknown

    @property
    def tokens(self) -> np.ndarray:
        return self.ctx[:self.n]


@dataclass
class Draft:
    """One request's draft: a chain of ``ids``, or a tree when ``parents`` is given (``parents[i]``: the
    index of draft i's parent, -1 for the last emitted token; parents before children; verified
    greedily). ``q`` [len(ids), V]: the draft's distributions where it sampled (rejection sampling
    needs them); None = deterministic (one-hot at the draft token)."""

    ids: list[int] = field(default_factory=list)
    q: torch.Tensor | None = None
    parents: list[int] | None = None

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def is_tree(self) -> bool:
        return self.parents is not None and len(self.ids) > 0


@dataclass
class DraftBatch:
    """Every request's draft of one ``propose`` call, in request order, and their padded tensors.
    ``read_seconds``: of the call's time, what went to reading context the draft had not read (a prompt
    it skipped, the steps it sat out) rather than drafting: the decoder prices that reading apart
    (``Proposer.catch_up_seconds``), so one catch-up does not make drafting look dear."""

    drafts: list[Draft]
    read_seconds: float = 0.0

    def __len__(self) -> int:
        return len(self.drafts)

    def __getitem__(self, b: int) -> Draft:
        return self.drafts[b]

    @property
    def token_ids(self) -> torch.Tensor:
        """[B, k] int64, padded with -1 (k = the longest draft, at least 1)."""
        k = max([len(d) for d in self.drafts] + [1])
        out = torch.full((len(self.drafts), k), -1, dtype=torch.long)
        for b, d in enumerate(self.drafts):
            out[b, :len(d)] = torch.tensor(d.ids, dtype=torch.long)
        return out

    @property
    def num_tokens(self) -> torch.Tensor:
        """[B] int64: each request's draft length (may be 0)."""
        return torch.tensor([len(d) for d in self.drafts], dtype=torch.long)

    @property
    def probs(self) -> torch.Tensor | None:
        """[B, k, V] the draft distributions where any request sampled (one-hot rows for the
        deterministic drafts among them, zeros past each draft), else None."""
        sampled = [d.q for d in self.drafts if d.q is not None]
        if not sampled:
            return None
        k, V = self.token_ids.shape[1], sampled[0].shape[-1]
        out = torch.zeros(len(self.drafts), k, V, dtype=torch.float32, device=sampled[0].device)
        for b, d in enumerate(self.drafts):
            if d.q is not None:
                out[b, :len(d)] = d.q[:len(d)]
            elif len(d):
                out[b, torch.arange(len(d)), torch.tensor(d.ids, device=out.device)] = 1.0
        return out

    @property
    def parents(self) -> list[list[int] | None]:
        return [d.parents for d in self.drafts]


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


def target_q(q_rows: list[torch.Tensor], target_ids: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
    """Sampled draft distributions over a draft vocabulary [n, N] (its ids in the target's: ``target_ids`` [N])
    -> over the target's vocabulary [n, vocab_size], zero outside the draft's; None for no rows."""
    if not q_rows:
        return None
    q = torch.zeros(len(q_rows), vocab_size, device=target_ids.device)
    q[:, target_ids] = torch.stack(q_rows).float()
    return q


class Proposer:
    """Base class: one subclass per method, in its own file (``<Method>Proposer``)."""

    method: str = ""
    needs_hidden_states: bool = False
    # the target layers whose inputs it wants beside the final hidden states (EAGLE-3's aux hidden
    # states, ascending): the decoder has the target return them, in ``on_target_hidden``'s aux
    aux_layers: tuple[int, ...] = ()
    # it ranks cached positions by the attention the target's verify forwards gave them (Vegas): the
    # decoder asks those forwards to record their weights (``scores=True``) in each request's KV cache
    attention_scores: bool = False
    learns_across_requests: bool = False  # e.g. suffix's global cache of earlier responses
    _read_s: float | None = None  # seconds per context token its reads take (``_timed_read``; None: unmeasured)
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

    def propose(self, requests: list[DraftRequest], ks: list[int]) -> DraftBatch:
        """Up to ``ks[b]`` draft tokens for each request (0: none this step): the one draft entry point,
        which the decoder calls once per step with every request of the batch. This default drafts one
        request at a time (``draft_one``); a method that drafts many at once (one batched draft forward
        per drafting step) overrides it."""
        return DraftBatch([self.draft_one(r, k) if k > 0 else Draft() for r, k in zip(requests, ks)])

    def draft_one(self, request: DraftRequest, k: int) -> Draft:
        """One request's draft of at most k > 0 tokens (for methods that use the default ``propose``)."""
        raise NotImplementedError

    def on_prefill(self, slot: int, upto: int, batch: int = 1) -> None:
        """The first ``upto`` prompt tokens of the request in ``slot`` are in the target's cache (called
        after each prefill chunk): a proposer with a prompt of its own to read (a draft model) reads
        along, chunk by chunk, so no single step carries a whole prompt's draft prefill. ``batch``: the
        requests in flight that this one will decode among."""

    def backlog(self, slot: int) -> int:
        """Context tokens the request in ``slot`` has that this proposer must read before it can draft
        (a draft model that skipped the prompt, or sat out steps another part won): what its next
        draft pays beyond drafting. 0 for proposers that read nothing of their own."""
        return 0

    def catch_up_seconds(self, slot: int) -> float | None:
        """Seconds its next draft for ``slot`` would spend reading its ``backlog`` first, at its measured
        seconds per context token (``_timed_read``; None: not measured yet). 0.0 with nothing to read (always,
        for proposers that read nothing)."""
        n = self.backlog(slot)
        return 0.0 if n == 0 else None if self._read_s is None else n * self._read_s

    def _timed_read(self, seconds: float, tokens: int) -> None:
        """A read of ``tokens`` context tokens (a prompt, a catch-up) took ``seconds``: one of READ_TIMED tokens
        or more moves the seconds per token ``catch_up_seconds`` prices a backlog at (an EMA)."""
        if tokens >= READ_TIMED:
            per = seconds / tokens
            self._read_s = per if self._read_s is None else self._read_s + 0.3 * (per - self._read_s)

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

    def observe_step(self, slot: int, num_draft: int, rows: int, seconds: float | None, draft_seconds: float,
                     batch: int = 1) -> None:
        """After ``slot``'s step (plain or drafted, after ``credit``): ``num_draft`` tokens drafted, the
        forward's ``rows`` (every request's, ``batch`` requests), the step's ``seconds`` (None where the
        forward also read prompt chunks: its time is theirs), ``draft_seconds`` of them drafting."""

    def credit(self, slot: int, num_draft: int, num_accepted: int, emitted: list[int]) -> dict[str, tuple[int, int]]:
        """After each of ``slot``'s verified steps (drafted or plain): its sub-proposers that drafted, each with
        (its draft tokens, how many were accepted) (hybrid); {} for a single proposer."""
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

    def _slot_of(self, r: DraftRequest):
        """The request's slot, or None where its target states do not reach the context's last token
        (the target holds n - 1 positions). A slot never started (``start_request``) is an error."""
        s = self.slots.get(r.slot)
        if s is None or not s.active:
            raise unknown_slot(self, r.slot)
        return s if self._target_len(s) == r.n - 1 else None


def unknown_slot(proposer: Proposer, slot: int) -> KeyError:
    """The error for a request a proposer was never told about (never a guess at which one it is)."""
    return KeyError(f"{type(proposer).__name__}: no request in slot {slot} (start_request was not called for it)")
