"""The decode loop: prefill, then [propose -> verify -> rollback -> observe] until a stop.

    prompt ─► prefill ─► [ propose(k) ─► forward(last + draft) ─► verify ─► rollback ─► stats ]*

With no proposer it is plain decoding through the very same path (a draft of length 0), which is
the no-speculation baseline bench compares against. ``step`` advances one request; ``step_batch``
advances many (each with its own runner, i.e. KV cache, and proposer slot) with one target forward
for all of them, which the continuous-batching scheduler drives; a request's tokens are the same
either way.

Index arithmetic of one step, worked: the cache holds L tokens; ``last`` (emitted, not yet in the
cache) and d drafts are fed at positions L..L+d, giving d+1 target distributions. If n drafts are
accepted, positions L..L+n hold valid keys, so the cache is rolled back to L+1+n and the step's
final token (recovered or bonus) becomes the next ``last``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from specctl.runtime.controller import BatchGuard, DraftLengthController, PooledAcceptance
from specctl.runtime.metrics import SpecStats
from specctl.runtime.proposers.base import DraftOutput, Proposer
from specctl.runtime.rejection import (
    coupled_verify,
    greedy_tree_verify,
    greedy_verify,
    keyed_uniforms,
    logits_to_probs,
    rejection_sample,
    sample_with_uniforms,
)
from specctl.runtime.runner import TargetRunner, forward_batch, tree_depths


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_k: int | None = None
    top_p: float | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    record_margins: bool = False  # greedy only: keep the top-1 minus top-2 logit gap of each token

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass
class GenerationResult:
    token_ids: list[int]  # the new tokens
    finish_reason: str  # "stop" or "length"
    stats: SpecStats = field(default_factory=SpecStats)
    prefill_s: float = 0.0  # prompt forward + first token
    decode_s: float = 0.0  # every later token
    num_steps: int = 0  # target forwards after prefill
    margins: list[float] = field(default_factory=list)  # [len(token_ids)] when record_margins
    by_proposer: dict[str, SpecStats] = field(default_factory=dict)  # hybrid: stats per sub-proposer

    @property
    def decode_tokens_per_s(self) -> float:
        n = len(self.token_ids) - 1
        return n / self.decode_s if self.decode_s > 0 and n > 0 else 0.0


@dataclass
class DecodeState:
    """One request in flight: its runner (KV cache), token buffer, output and counters."""

    runner: TargetRunner
    slot: int
    params: SamplingParams
    generator: torch.Generator | None
    ctx: np.ndarray  # [1, max_len] int32: prompt + emitted tokens, for the proposer
    n_ctx: int
    stop: set
    last: int = -1  # emitted, not yet in the KV cache
    out: list[int] = field(default_factory=list)
    margins: list[float] = field(default_factory=list)
    stats: SpecStats = field(default_factory=SpecStats)
    finish: str | None = None
    steps: int = 0
    t_start: float = 0.0
    t_first: float = 0.0
    controller: DraftLengthController | None = None
    hidden: torch.Tensor | None = None  # [1, H] target's final hidden state at the position that produced `last`
    error: BaseException | None = None  # what ended it, when a step failed (finish is then "error")
    n_prefilled: int = 0  # prompt tokens already in the KV cache (the prompt is n_ctx until the first token)
    by_proposer: dict[str, SpecStats] = field(default_factory=dict)  # hybrid: stats per sub-proposer
    key: int = 0  # sampling: the seed that keys each position's draw (rejection.keyed_uniforms)

    @property
    def prefilling(self) -> bool:
        return not self.out and self.finish is None

    def result(self) -> GenerationResult:
        t_end = time.perf_counter()
        return GenerationResult(self.out, self.finish or "length", self.stats, self.t_first - self.t_start,
                                t_end - self.t_first, self.steps, self.margins[: len(self.out)], self.by_proposer)


_EMPTY = torch.empty((1, 0), dtype=torch.long)
_ZERO = torch.zeros(1, dtype=torch.long)


def _fail(st: DecodeState, e: BaseException) -> None:
    st.error, st.finish = e, "error"


@dataclass
class _Plan:
    """One request's part of a step: the tokens its verify forward carries ([1, 1+nd]: the last
    emitted token, then the draft), the draft chain (or the tree's ``parents``), the cache length
    before the step, and when drafting started and ended."""

    tokens: torch.Tensor
    t0: float
    t1: float
    draft_ids: torch.Tensor = _EMPTY
    num_draft: torch.Tensor = _ZERO
    draft_probs: torch.Tensor | None = None
    parents: list[int] | None = None
    base: int = 0
    rows: int = 0  # rows of the whole forward it rode in (every request's)
    batch: int = 1  # requests decoding in that forward
    forward_s: float = 0.0  # that forward's seconds
    t_done: float = field(default_factory=time.perf_counter)  # reset when its verification starts

    def step_seconds(self) -> float:
        """Its drafting, the forward, and its own verification so far: what the controller weighs."""
        return (self.t1 - self.t0) + self.forward_s + (time.perf_counter() - self.t_done)


EXPLORE_POSITIONS = 8  # pooled draft positions tried before every new request of a batch may draft


class SpecDecoder:
    """Runs requests through a TargetRunner with an optional Proposer (None = plain decoding).

    ``generate`` runs one request to the end. ``start`` + ``step`` run it a step at a time (a
    server streams and interleaves requests this way; each request then brings its own runner,
    i.e. its own KV cache, and proposer slot).
    """

    def __init__(self, runner: TargetRunner, proposer: Proposer | None = None, num_speculative_tokens: int = 0,
                 adaptive: bool = False, reuse_prefill: bool = False):
        self.runner = runner
        # ``start``: a prompt whose keys/values the runner's cache still holds (the same prompt, run by
        # another decoder on the same runner: bench's methods one after another) is not prefilled again,
        # unless the proposer reads the target's states of the prompt
        self.reuse_prefill = reuse_prefill and not (proposer is not None and proposer.needs_hidden_states)
        self.proposer = proposer
        self.k = num_speculative_tokens if proposer is not None else 0
        self.adaptive = adaptive and self.k > 0
        self._costs: dict[int, float] = {}  # forward time by token count, shared by this decoder's requests
        self._clock = 0  # batched steps so far: the requests' controllers probe on its multiples together
        self._pooled = PooledAcceptance()  # acceptance over this decoder's requests: a new request's prior
        # batched steps draft only while it pays (no probes where drafting again means reading skipped prompts)
        self._guard = BatchGuard(probe=not proposer.reads_prompt) if self.adaptive else None
        self._own_length = proposer is not None and proposer.chooses_draft_length
        if proposer is not None:
            proposer.set_adaptive(self.adaptive)

    def generate(self, prompt_ids: list[int], params: SamplingParams,
                 generator: torch.Generator | None = None) -> GenerationResult:
        state = self.start(prompt_ids, params, generator)
        while state.finish is None:
            self.step(state)
        return self.finish(state)

    def start(self, prompt_ids: list[int], params: SamplingParams, generator: torch.Generator | None = None,
              runner: TargetRunner | None = None, slot: int = 0, prefill_chunk: int | None = None) -> DecodeState:
        """Prefill the prompt (in one forward, or in chunks of ``prefill_chunk`` tokens as the batched
        scheduler cuts it) and emit the first token."""
        st = self.begin(prompt_ids, params, generator, runner, slot)
        read = self._reads_prompt(1)
        kept = st.runner.reuse_prompt(prompt_ids) if self.reuse_prefill else None
        if kept is not None:
            self.prefilled(st, st.n_ctx, kept, read)
            return st
        while st.prefilling:
            n = self.next_chunk(st, prefill_chunk)
            logits = st.runner.forward(self.prefill_tokens(st, n), logits="last")
            if self.reuse_prefill and st.n_prefilled + n == st.n_ctx:
                st.runner.keep_prompt(prompt_ids, logits)
            self.prefilled(st, n, logits, read)
        return st

    @staticmethod
    def next_chunk(st: DecodeState, prefill_chunk: int | None) -> int:
        """How many prompt tokens the request's next prefill forward carries."""
        left = st.n_ctx - st.n_prefilled
        return left if prefill_chunk is None else min(left, prefill_chunk)

    def prefill_tokens(self, st: DecodeState, n: int) -> torch.Tensor:
        """The request's next n prompt tokens [1, n]."""
        return torch.from_numpy(st.ctx[:, st.n_prefilled:st.n_prefilled + n].astype(np.int64))

    def prefilled(self, st: DecodeState, n: int, logits: torch.Tensor, read_prompt: bool = True) -> list[int]:
        """n more prompt tokens are in the cache (``logits`` [1, 1, V]: the last one's); after the
        prompt's last chunk, the first token is chosen and emitted (returned). ``read_prompt``: the
        proposer reads the chunk too (``on_prefill``; off where the batch is not drafting)."""
        runner, params = st.runner, st.params
        st.n_prefilled += n
        if self.proposer is not None and read_prompt:
            self.proposer.on_prefill(st.slot, st.n_prefilled)
        if self.proposer is not None and self.proposer.needs_hidden_states:
            self.proposer.on_target_hidden(st.slot, runner.last_hidden, runner.last_aux)
        if st.n_prefilled < st.n_ctx:
            return []
        if self.proposer is not None and self.proposer.needs_hidden_states:
            st.hidden = runner.last_hidden[:, -1]
        if params.greedy:
            first = int(runner.greedy(logits, margins=st.margins if params.record_margins else None)[0, -1])
        else:
            probs = logits_to_probs(logits[0, -1], params.temperature, params.top_k, params.top_p)
            first = int(sample_with_uniforms(probs[None], keyed_uniforms(st.key, st.n_ctx, 1))[0])
        out = self._emit(st, [first])
        st.t_first = time.perf_counter()
        return out

    def begin(self, prompt_ids: list[int], params: SamplingParams, generator: torch.Generator | None = None,
              runner: TargetRunner | None = None, slot: int = 0) -> DecodeState:
        """A request's state, its runner reset and its proposer slot told, before any prefill."""
        runner = runner or self.runner
        T = len(prompt_ids)
        if T == 0:
            raise ValueError("empty prompt")
        if T + params.max_new_tokens > runner.max_len:
            from specctl.errors import UsageError

            raise UsageError(
                f"prompt ({T} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds the max model length {runner.max_len}",
                "lower --max-new-tokens or raise --max-model-len",
            )
        ctx = np.zeros((1, runner.max_len), dtype=np.int32)
        ctx[0, :T] = prompt_ids
        # the target returns the layer inputs this decoder's proposer asked for (EAGLE-3), and no others
        runner.model.aux_layers = self.proposer.aux_layers if self.proposer is not None else ()
        st = DecodeState(runner, slot, params, generator, ctx, T,
                         set() if params.ignore_eos else set(params.stop_token_ids))
        if not params.greedy:  # the generator's seed (a request's "seed"), or one from torch's global RNG
            st.key = generator.initial_seed() if generator is not None else int(torch.randint(0, 2**62, ()))
        if self.adaptive:
            st.controller = self._controller()
        runner.reset()
        st.t_start = time.perf_counter()  # the prefill: the proposer's reading of the prompt counts in it
        if self.proposer is not None:
            self.proposer.set_sampling(slot, params, generator)
            self.proposer.start_request(slot, ctx[0, :T])
            self.proposer.bind_target(slot, runner)
        return st

    def _controller(self) -> DraftLengthController:
        """A new request's draft-length controller: the decoder's pooled acceptance as its prior, the
        costs every request measures, and the proposer's cost hint until drafting is measured."""
        return DraftLengthController(self.k, alpha=self._pooled.prior(), costs=self._costs,
                                     draft_hint=self.proposer.draft_cost)

    def _reads_prompt(self, batch: int) -> bool:
        """Whether a request joining a batch of ``batch`` has its draft read the prompt now: drafting is
        on at that size (the guard), and the cost model expects a new request to draft there (a draft
        model that would not pay in a batch whose verification is already costly reads nothing; it
        catches up if drafting turns on later)."""
        if self._guard is None:
            return True
        if not self._guard.drafts_likely(batch):
            return False
        if self._own_length:  # a hybrid: each part reads the prompt while it pays (its on_prefill decides)
            return True
        c = self._controller()
        if not c.may_pay(batch):  # a draft as costly as the target: its reading of the prompt would be waste
            return False
        if batch <= 1 and c._draft_cost() is None:
            return True  # alone, drafting unmeasured: it drafts, and gets measured
        # in a batch (by the cost hint until measured), or alone after earlier requests measured drafting:
        # read only where a draft would pay (it catches up if drafting turns on later)
        return c.best_len(batch) > 0

    def step(self, st: DecodeState) -> list[int]:
        """One propose -> verify -> rollback step. Returns the tokens emitted (sets st.finish)."""
        out = self.step_batch([st])[0]
        if st.error is not None:
            raise st.error
        return out

    def step_batch(self, states: list[DecodeState], max_draft: int | None = None,
                   prefills: list[tuple[DecodeState, int]] = ()) -> list[list[int]]:
        """One step for each of many requests (each with its own runner and proposer slot): every
        request drafts (at most ``max_draft`` tokens, when given), then one target forward verifies
        all of them (``runner.forward_batch``), then each request is verified and rolled back on its
        own. A request's tokens are those its own ``step`` would give (bit for bit on the
        row-independent CPU paths: its rows are computed as if alone). Returns the tokens each
        request emitted (sets its ``finish``). A request whose drafting or verification fails ends
        with ``finish = "error"`` and the exception in ``error``; the others go on.

        ``prefills``: (request, n) pairs whose next n prompt tokens ride in the same forward (chunked
        prefill); their first token, once a prompt is complete, follows the decoding requests' lists
        in the result."""
        t_step = time.perf_counter()
        guard = self._guard if len(states) > 1 else None
        guarded_off = guard is not None and not guard.drafts(len(states))
        if guarded_off:
            max_draft = 0
        plans = self._plan_all(states, max_draft)
        live = [i for i, p in enumerate(plans) if p is not None]
        out: list[list[int]] = [[] for _ in list(states) + list(prefills)]
        if not live and not prefills:
            return out
        fed = [states[i] for i in live] + [st for st, _ in prefills]
        rows = sum(plans[i].tokens.shape[1] for i in live) + sum(n for _, n in prefills)
        t_fwd = time.perf_counter()
        try:
            logits = forward_batch([st.runner for st in fed],
                                   [plans[i].tokens for i in live] + [self.prefill_tokens(st, n) for st, n in prefills],
                                   [plans[i].parents for i in live] + [None] * len(prefills),
                                   [False] * len(live) + [True] * len(prefills))
        except Exception as e:  # noqa: BLE001 - the forward failed: every request in it ends
            for st in fed:
                _fail(st, e)
            return out
        t_fwd = time.perf_counter() - t_fwd
        for i, lg in zip(live, logits):
            plans[i].rows, plans[i].forward_s, plans[i].batch = rows, t_fwd, len(live)
            try:
                out[i] = self._complete(states[i], plans[i], lg)
            except Exception as e:  # noqa: BLE001
                _fail(states[i], e)
        # a request joining a batch that is not drafting leaves its draft's prompt unread (caught up if drafting resumes)
        read_prompt = self._reads_prompt(len(states) + 1)
        for j, ((st, n), lg) in enumerate(zip(prefills, logits[len(live):])):
            try:
                out[len(states) + j] = self.prefilled(st, n, lg, read_prompt)
            except Exception as e:  # noqa: BLE001
                _fail(st, e)
        drafted = any(plans[i].tokens.shape[1] > 1 for i in live)
        if guard is not None and not prefills and (drafted or guarded_off):  # a step the guard can read
            guard.observe(len(states), drafted, sum(len(out[i]) for i in live), time.perf_counter() - t_step)
        return out

    def _draft_len(self, st: DecodeState, max_draft: int | None = None, batch: int = 1) -> int | None:
        """How many tokens the request drafts this step (None: it has finished)."""
        room = st.params.max_new_tokens - len(st.out)
        if st.finish is not None or room <= 0:
            st.finish = st.finish or "length"
            return None
        k = min(self.k, room - 1)
        if max_draft is not None:
            k = min(k, max_draft)
        if st.controller is not None and k > 0 and not self._own_length:
            k = min(k, st.controller.draft_len(batch, self._clock))
        return k

    def _plan_k(self, st: DecodeState, k: int) -> "_Plan":
        """The request's own draft of up to k tokens, and its plan."""
        t0 = time.perf_counter()  # the controller weighs the whole step: drafting (t0..t1) and verifying
        d = self.proposer.propose(st.ctx, np.array([st.n_ctx], dtype=np.int32), k, st.hidden, slots=[st.slot]) \
            if k > 0 else None
        return self._plan_from(st, d, t0, time.perf_counter())

    def _plan_from(self, st: DecodeState, d: DraftOutput | None, t0: float, t1: float) -> "_Plan":
        """The verify forward's tokens: the last emitted token, then the draft (a chain or a tree)."""
        params = st.params
        last = torch.tensor([[st.last]], dtype=torch.long)
        if d is not None:
            nd = int(d.num_tokens[0])
            if d.parents is not None and nd > 0:
                if not params.greedy:
                    raise ValueError("draft trees are verified greedily only; the proposer must send a chain when sampling")
                parents = [-1] + [p + 1 for p in d.parents[:nd]]  # node 0 = the last token, draft i = node i+1
                return _Plan(torch.cat([last, d.token_ids[:, :nd]], 1), t0, t1, parents=parents, base=st.runner.length)
            if nd > 0:
                return _Plan(torch.cat([last, d.token_ids[:, :nd]], 1), t0, t1, d.token_ids[:, :nd], d.num_tokens,
                             None if d.probs is None else d.probs[:, :nd], base=st.runner.length)
        return _Plan(last, t0, t0 if d is None else t1, base=st.runner.length)

    def _plan_all(self, states: list[DecodeState], max_draft: int | None) -> list["_Plan | None"]:
        """Every request's plan; a proposer that drafts for many at once (``propose_batch``: one draft
        forward per drafting step for all) does so, and each request is charged its share of the time."""
        plans: list[_Plan | None] = [None] * len(states)
        ks: dict[int, int] = {}
        self._clock += 1
        # while the draft is unproven (little acceptance pooled yet), one new request a step tries it
        # and the others wait for its evidence: requests that arrive together do not each pay a lazy
        # draft's catch-up over their prompts (MTP, EAGLE, a draft model) to find a bad draft bad
        prior, explore, explorer = self._pooled.prior(), len(states) > 1 and self._pooled.tried < EXPLORE_POSITIONS, False
        for i, st in enumerate(states):
            fresh = st.controller is not None and st.controller.fresh
            if fresh:
                st.controller.restart_prior(prior)
            try:
                k = self._draft_len(st, max_draft, len(states))
            except Exception as e:  # noqa: BLE001 - this request fails, the batch goes on
                _fail(st, e)
                continue
            if k is not None:
                if fresh and explore and k > 0:
                    k, explorer = (0 if explorer else k), True
                ks[i] = k
        drafting = [i for i, k in ks.items() if k > 0]
        together = len(drafting) > 1 and self.proposer.drafts_in_batch
        if together:
            t0 = time.perf_counter()
            try:
                ds = self.proposer.propose_batch([(states[i].ctx, states[i].n_ctx, states[i].slot) for i in drafting],
                                                 [ks[i] for i in drafting], [states[i].hidden for i in drafting])
            except Exception as e:  # noqa: BLE001 - the batched draft failed: every request in it ends
                for i in drafting:
                    _fail(states[i], e)
                    ks.pop(i)
                ds = []
            share = (time.perf_counter() - t0) / max(len(drafting), 1)
            for i, d in zip(drafting, ds):
                plans[i] = self._plan_from(states[i], d, t0, t0 + share)
        for i, k in ks.items():  # the rest draft on their own (or not at all)
            if plans[i] is None:
                try:
                    plans[i] = self._plan_k(states[i], k)
                except Exception as e:  # noqa: BLE001
                    _fail(states[i], e)
        return plans

    def _complete(self, st: DecodeState, plan: "_Plan", logits: torch.Tensor) -> list[int]:
        """Verify one request's forward (logits [1, 1+nd, V]), roll back, tell the proposer."""
        plan.t_done = time.perf_counter()
        if plan.parents is not None:
            return self._tree_step(st, plan, logits)
        runner, params = st.runner, st.params
        draft_ids, num_draft, draft_probs = plan.draft_ids, plan.num_draft, plan.draft_probs
        nd = draft_ids.shape[1]
        dev = logits.device  # verify where the target's logits are (drafts may come from the host)
        draft_ids, num_draft = draft_ids.to(dev), num_draft.to(dev)
        if params.greedy:
            margins = [] if params.record_margins else None
            out_ids, n_emit = greedy_verify(draft_ids, num_draft, runner.greedy(logits, margins=margins))
        else:
            probs = logits_to_probs(logits, params.temperature, params.top_k, params.top_p)
            if draft_probs is None:  # deterministic drafts (or none): coupled to plain sampling, position by position
                u = keyed_uniforms(st.key, st.n_ctx, probs.shape[1])[None]
                out_ids, n_emit = coupled_verify(draft_ids, num_draft, probs, u)
            else:
                out_ids, n_emit = rejection_sample(draft_ids, num_draft, draft_probs.to(dev), probs, st.generator)
        n = int(n_emit[0])
        emitted = out_ids[0, :n].tolist()
        if st.controller is not None:
            st.controller.observe(nd, n - 1, plan.rows, plan.step_seconds(), plan.t1 - plan.t0)
            self._pooled.observe(nd, n - 1)
        if params.record_margins and params.greedy:
            st.margins.extend(margins[:n])
        runner.rollback(plan.base + n)  # last + (n-1) accepted drafts are valid
        if self.proposer is not None and self.proposer.needs_hidden_states:
            st.hidden = runner.last_hidden[:, n - 1]  # row n-1 produced the step's final token
            aux = runner.last_aux
            self.proposer.on_target_hidden(st.slot, runner.last_hidden[:, :n], None if aux is None else aux[:, :n])
        st.stats.observe(nd, n - 1)
        self._observe_parts(st, nd, n - 1, emitted)
        if self.proposer is not None:
            self.proposer.observe_step(st.slot, nd, plan.rows, plan.step_seconds(), plan.t1 - plan.t0, plan.batch)
        if self.proposer is not None:
            self.proposer.on_verified(st.slot, n - 1, emitted)
        st.steps += 1
        return self._emit(st, emitted)

    def _tree_step(self, st: DecodeState, plan: "_Plan", logits: torch.Tensor) -> list[int]:
        """Greedy verification of a draft tree (Medusa / EAGLE-2 style), forwarded over every node
        with a tree mask: from the last token, follow the child that is the target's own choice
        while one exists; keep that path's keys/values. Lossless: every emitted token is the
        target's greedy choice given the tokens before it."""
        runner, parents, tokens = st.runner, plan.parents, plan.tokens
        path, emitted = greedy_tree_verify(tokens[0].tolist(), parents, runner.greedy(logits)[0].tolist())
        depth = max(tree_depths(parents))
        if st.controller is not None:
            # a tree's drafting is not d draft tokens' worth (one draft call per level, n nodes): the
            # whole step counts, keyed by the nodes verified
            st.controller.observe(depth, len(path) - 1, plan.rows, plan.step_seconds())
            self._pooled.observe(depth, len(path) - 1)
        runner.compact(plan.base, path)
        if self.proposer.needs_hidden_states:
            idx = torch.tensor(path, device=runner.last_hidden.device)
            hidden = runner.last_hidden[:, idx]
            aux = runner.last_aux
            st.hidden = hidden[:, -1]
            self.proposer.on_target_hidden(st.slot, hidden, None if aux is None else aux[:, idx])
        st.stats.observe(depth, len(path) - 1)
        self._observe_parts(st, depth, len(path) - 1, emitted)
        self.proposer.observe_step(st.slot, len(parents) - 1, plan.rows, plan.step_seconds(), plan.t1 - plan.t0,
                                   plan.batch)
        self.proposer.on_verified(st.slot, len(path) - 1, emitted)
        st.steps += 1
        return self._emit(st, emitted)

    def _observe_parts(self, st: DecodeState, num_draft: int, num_accepted: int, emitted: list[int]) -> None:
        """Count the step's draft for the sub-proposers that made it (a hybrid's; nothing otherwise)."""
        if self.proposer is None or num_draft <= 0:
            return
        for name, (d, a) in self.proposer.credit(st.slot, num_draft, num_accepted, emitted).items():
            st.by_proposer.setdefault(name, SpecStats()).observe(d, a)

    def finish(self, st: DecodeState) -> GenerationResult:
        """End the request (the proposer may learn from it) and return its result."""
        if self.proposer is not None:
            self.proposer.end_request(st.slot)
        return st.result()

    @staticmethod
    def _emit(st: DecodeState, tokens: list[int]) -> list[int]:
        """Append tokens up to a stop token or the length limit; returns what was appended."""
        room = st.params.max_new_tokens - len(st.out)
        taken = []
        for tok in tokens[:room]:
            taken.append(tok)
            st.ctx[0, st.n_ctx] = tok
            st.n_ctx += 1
            if tok in st.stop:
                st.finish = "stop"
                break
        st.out.extend(taken)
        st.last = st.out[-1]
        if st.finish is None and len(st.out) >= st.params.max_new_tokens:
            st.finish = "length"
        return taken
