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

import numpy as np
import torch

from specctl.runtime.controller import BatchGuard, DraftLengthController, PooledAcceptance
from specctl.runtime.proposers.base import Draft, Proposer
from specctl.runtime.rejection import (
    keyed_uniforms,
    logits_to_probs,
    sample_with_uniforms,
)
from specctl.runtime.requests import DecodeState, GenerationResult, SamplingParams  # noqa: F401 (here as before)
from specctl.runtime.runner import TargetOut, TargetRunner, forward_batch
from specctl.runtime.verify import Block, StepOutcome, verify


def _fail(st: DecodeState, e: BaseException) -> None:
    st.error, st.finish = e, "error"


CATCH_UP_WEIGHED = 16  # a draft about to catch up on more context than this (a prompt it skipped) weighs the reading first
EXPLORE_POSITIONS = 8  # pooled draft positions tried before every new request of a batch may draft
PACE_EMA = 0.25  # weight of a step's emitted tokens in a request's pace


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
        self._tree_rows: dict[int, int] = {}  # a draft tree's rows and relative step cost by depth, shared alike
        self._tree_costs: dict[int, float] = {}
        self._clock = 0  # batched steps so far: the requests' controllers probe on its multiples together
        self._pooled = PooledAcceptance()  # acceptance over this decoder's requests: a new request's prior
        # batched steps draft only while it pays (no probes where drafting again means reading skipped prompts)
        self._guard = BatchGuard(probe=not proposer.reads_prompt) if self.adaptive else None
        self._own_length = proposer is not None and proposer.chooses_draft_length
        # the target layers whose inputs each forward returns for the proposer (EAGLE-3's), and no others
        self.aux_layers = tuple(proposer.aux_layers) if proposer is not None else ()
        # and the attention weights of its verify blocks and prompts, in each request's cache (Vegas)
        self.scores = proposer is not None and proposer.attention_scores
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
        read = self._reads_prompt(1, st)
        kept = st.runner.reuse_prompt(prompt_ids) if self.reuse_prefill else None
        if kept is not None:
            self.prefilled(st, st.n_ctx, kept, read)
            return st
        while st.prefilling:
            n = self.next_chunk(st, prefill_chunk)
            out = st.runner.run(self.prefill_tokens(st, n), logits="last", aux_layers=self.aux_layers,
                                scores=self.scores)
            if self.reuse_prefill and st.n_prefilled + n == st.n_ctx:
                st.runner.keep_prompt(prompt_ids, out)
            self.prefilled(st, n, out, read)
        return st

    @staticmethod
    def next_chunk(st: DecodeState, prefill_chunk: int | None) -> int:
        """How many prompt tokens the request's next prefill forward carries."""
        left = st.n_ctx - st.n_prefilled
        return left if prefill_chunk is None else min(left, prefill_chunk)

    def prefill_tokens(self, st: DecodeState, n: int) -> torch.Tensor:
        """The request's next n prompt tokens [1, n]."""
        return torch.from_numpy(st.ctx[:, st.n_prefilled:st.n_prefilled + n].astype(np.int64))

    def prefilled(self, st: DecodeState, n: int, out: TargetOut, read_prompt: bool = True, batch: int = 1) -> list[int]:
        """n more prompt tokens are in the cache (``out``: their forward's, logits [1, 1, V] of the last
        one); after the prompt's last chunk, the first token is chosen and emitted (returned).
        ``read_prompt``: the proposer reads the chunk too (``on_prefill``; off where the batch is not
        drafting); ``batch``: the requests in flight the request will decode among."""
        runner, params, logits = st.runner, st.params, out.logits
        st.n_prefilled += n
        if self.proposer is not None and read_prompt:
            self.proposer.on_prefill(st.slot, st.n_prefilled, batch)
        if self.proposer is not None and self.proposer.needs_hidden_states:
            self.proposer.on_target_hidden(st.slot, out.hidden, out.aux)
        if st.n_prefilled < st.n_ctx:
            return []
        if self.proposer is not None and self.proposer.needs_hidden_states:
            st.hidden = out.hidden[:, -1]
        if params.greedy:
            margins = st.margins if params.record_margins else None
            first = int(runner.greedy(logits, out.hidden, margins=margins)[0, -1])
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
        costs every request measures (a draft tree's by depth too), and the proposer's cost hint until
        drafting is measured."""
        return DraftLengthController(self.k, alpha=self._pooled.prior(), costs=self._costs,
                                     draft_hint=self.proposer.draft_cost, tree_rows=self._tree_rows,
                                     tree_costs=self._tree_costs)

    def _reads_prompt(self, batch: int, st: DecodeState | None = None) -> bool:
        """Whether a request joining a batch of ``batch`` has its draft read the prompt now: drafting is
        on at that size (the guard), and the cost model expects a new request to draft there (a draft
        model that would not pay in a batch whose verification is already costly reads nothing; it
        catches up if drafting turns on later). For the request ``st``, the reading must also pay back:
        the seconds its drafts are expected to save over its ``max_tokens`` exceed the draft's measured
        reading of what it has not read (``DraftLengthController.reading_pays``; before the draft has read
        anything, its size's estimate); where they do not, the request is left undrafted for good (catching
        up later would cost the same reading for fewer tokens). ``batch`` counts the requests in flight, those
        still reading their prompts included: alone, a draft not yet measured reads, to be measured; in a
        batch it is weighed like any other, so requests that arrive together do not each pay its reading."""
        if st is not None and st.undrafted:
            return False
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
        if st is not None and self.proposer.reads_prompt:
            pays = self._reading_pays(st, batch, c)
            if pays is None:
                return False  # in a batch, nothing measured to weigh the reading by: not now (it catches up if it drafts)
            if not pays:
                st.undrafted = True
                return False
        # in a batch (by the cost hint until measured), or alone after earlier requests measured drafting:
        # read only where a draft would pay (it catches up if drafting turns on later)
        return c.best_len(batch) > 0

    def _reading_pays(self, st: DecodeState, batch: int, c: DraftLengthController) -> bool | None:
        """Whether the draft's reading of what it has not read of the request (its measured seconds per
        token, else its size's estimate) is paid back by its drafts over the request's remaining tokens at
        ``batch`` (``c.reading_pays``); None while a plain step is unmeasured (nothing to weigh it by)."""
        return c.reading_weighed(self.proposer.catch_up_seconds(st.slot), self.proposer.backlog(st.slot),
                                 st.room, batch)

    def step(self, st: DecodeState) -> list[int]:
        """One propose -> verify -> rollback step. Returns the tokens emitted (sets st.finish)."""
        out = self.step_batch([st])[0]
        if st.error is not None:
            raise st.error
        return out

    def step_batch(self, states: list[DecodeState], max_draft: int | None = None,
                   prefills: list[tuple[DecodeState, int]] = (), in_flight: int = 0,
                   hold: frozenset[int] = frozenset()) -> list[list[int]]:
        """One step for each of many requests (each with its own runner and proposer slot), as data:
        plan (each request's draft length), draft (one proposer call for all), forward (one target
        forward for every request's block and the prefill chunks riding along), verify (a
        ``StepOutcome`` per request), commit (roll back, tell the proposer, the observers), emit. A
        request's tokens are those its own ``step`` would give (bit for bit on the row-independent CPU
        paths). Returns the tokens each request emitted (sets its ``finish``); a request whose drafting
        or verification fails ends with ``finish = "error"`` and the exception in ``error``.

        ``prefills``: (request, n) pairs whose next n prompt tokens ride in the same forward (chunked
        prefill); their first token, once a prompt is complete, follows the decoding requests' lists.
        ``in_flight``: the requests the engine holds (decoding, and prefilling whether or not a chunk of
        theirs rides in this step): the batch a prompt read now will decode among. ``hold``: indices of
        ``states`` that do not draft this step (their controllers not asked: ``Scheduler`` holds the requests
        of an offline job's last wave that would end before it does anyway)."""
        t_step = time.perf_counter()
        guard = self._guard if len(states) > 1 else None
        guarded_off = guard is not None and not guard.drafts(len(states))
        ks = self._plan(states, 0 if guarded_off else max_draft, hold)
        blocks = self._draft(states, ks)
        out: list[list[int]] = [[] for _ in list(states) + list(prefills)]
        outs = self._forward(states, blocks, prefills)
        if outs is None:
            return out
        for i, oc in verify(states, blocks, outs).items():
            try:
                if isinstance(oc, Exception):
                    raise oc
                out[i] = self.commit(states[i], blocks[i], outs[i], oc)
            except Exception as e:  # noqa: BLE001 - this request fails, the batch goes on
                _fail(states[i], e)
        joins = max(in_flight, len(states) + 1)
        for j, (st, n) in enumerate(prefills):
            try:  # a joiner of a batch that is not drafting (its guard; the scheduler's max_draft = 0), or whose
                # reading would not pay back, reads nothing
                read = max_draft != 0 and self._reads_prompt(joins, st)
                out[len(states) + j] = self.prefilled(st, n, outs[len(states) + j], read, joins)
            except Exception as e:  # noqa: BLE001
                _fail(st, e)
        drafted = any(len(b.draft) > 0 for b in blocks.values())
        if guard is not None and not prefills and (drafted or guarded_off):  # a step the guard can read
            guard.observe(len(states), drafted, sum(len(out[i]) for i in blocks), time.perf_counter() - t_step)
        return out

    # ------------------------------------------------------------------ plan
    def _plan(self, states: list[DecodeState], max_draft: int | None,
              hold: frozenset[int] = frozenset()) -> dict[int, int]:
        """Each unfinished request's draft length this step: its room, ``max_draft``, its controller.
        While the draft is unproven (little acceptance pooled yet), one new request a step tries it and
        the others wait for its evidence: requests that arrive together do not each pay a lazy draft's
        catch-up over their prompts (MTP, EAGLE, a draft model) to find a bad draft bad."""
        ks: dict[int, int] = {}
        self._clock += 1
        prior, explore, explorer = self._pooled.prior(), len(states) > 1 and self._pooled.tried < EXPLORE_POSITIONS, False
        for i, st in enumerate(states):
            fresh = st.controller is not None and st.controller.fresh
            if fresh:
                st.controller.restart_prior(prior)
            try:
                k = self._draft_len(st, 0 if i in hold else max_draft, len(states))
            except Exception as e:  # noqa: BLE001 - this request fails, the batch goes on
                _fail(st, e)
                continue
            if k is not None:
                if fresh and explore and k > 0:
                    k, explorer = (0 if explorer else k), True
                ks[i] = k
        return ks

    def _draft_len(self, st: DecodeState, max_draft: int | None = None, batch: int = 1) -> int | None:
        """How many tokens the request drafts this step (None: it has finished)."""
        room = st.room
        if st.finish is not None or room <= 0:
            st.finish = st.finish or "length"
            return None
        k = min(self.k, room - 1) if not st.undrafted else 0
        if max_draft is not None:
            k = min(k, max_draft)
        if st.controller is not None and k > 0 and not self._own_length:
            catch_up = (self.proposer.catch_up_seconds(st.slot) or 0.0) if self.proposer.reads_prompt else 0.0
            k = min(k, st.controller.draft_len(batch, self._clock, catch_up))
            if (k > 0 and self.proposer.reads_prompt and self.proposer.backlog(st.slot) > CATCH_UP_WEIGHED
                    and st.controller.best_len(batch) > 0 and self._reading_pays(st, batch, st.controller) is False):
                st.undrafted, k = True, 0  # catching up on a prompt it skipped would not pay back: as in the prefill
        return k

    # ------------------------------------------------------------------ draft
    def _draft(self, states: list[DecodeState], ks: dict[int, int]) -> dict[int, Block]:
        """One proposer call for every request that drafts; each request's block of rows for the
        forward, charged its share of the drafting time."""
        drafting = [i for i, k in ks.items() if k > 0]
        drafts: dict[int, Draft] = {}
        t0 = t1 = time.perf_counter()
        if drafting:
            try:
                reqs = [states[i].draft_request() for i in drafting]
                for r, i in zip(reqs, drafting):  # what a row costs: a draft tree keeps the nodes worth it
                    if states[i].controller is not None:
                        r.row_price = states[i].controller.row_price(len(states))
                batch = self.proposer.propose(reqs, [ks[i] for i in drafting])
                drafts, read = dict(zip(drafting, batch.drafts)), batch.read_seconds
            except Exception as e:  # noqa: BLE001 - the draft failed: every request in it ends
                for i in drafting:
                    _fail(states[i], e)
                    ks.pop(i)
                read = 0.0
            # each request's share of the drafting, its reading of context it had not read left out (priced apart)
            t1 = t0 + max(time.perf_counter() - t0 - read, 0.0) / len(drafting)
        blocks = {}
        for i in ks:
            st, d = states[i], drafts.get(i, Draft())
            if i in drafts and not len(d) and st.controller is not None and not self._own_length:
                st.controller.probe_unused()  # a probe that found nothing to draft is due again
            if d.is_tree and not st.params.greedy:
                _fail(st, ValueError("draft trees are verified greedily only; the proposer must send a chain when sampling"))
                continue
            space = st.runner.max_len - st.runner.length - 1
            if d.is_tree and len(d) > space:  # near the cache's end: the first nodes (parents come first) still fit
                d = Draft(d.ids[:max(space, 0)], None, d.parents[:max(space, 0)])
            last = torch.tensor([[st.last]], dtype=torch.long)
            tokens = torch.cat([last, torch.tensor([d.ids], dtype=torch.long)], 1) if len(d) else last
            blocks[i] = Block(tokens, d, st.runner.length, t0, t1 if i in drafts else t0)
        return blocks

    # ------------------------------------------------------------------ forward
    def _forward(self, states: list[DecodeState], blocks: dict[int, Block],
                 prefills: list[tuple[DecodeState, int]]) -> dict[int, TargetOut] | None:
        """One target forward over every block and prefill chunk: its outputs by request index (prefill
        chunks after the states, at len(states) + j). None when nothing ran (or it failed: every
        request in it ends)."""
        if not blocks and not prefills:
            return None
        fed = [states[i] for i in blocks] + [st for st, _ in prefills]
        chunk_rows = sum(n for _, n in prefills)
        rows = sum(b.tokens.shape[1] for b in blocks.values()) + chunk_rows
        t = time.perf_counter()
        try:
            outs = forward_batch([st.runner for st in fed],
                                 [b.tokens for b in blocks.values()] + [self.prefill_tokens(st, n) for st, n in prefills],
                                 [b.parents for b in blocks.values()] + [None] * len(prefills),
                                 [False] * len(blocks) + [True] * len(prefills), self.aux_layers, self.scores)
        except Exception as e:  # noqa: BLE001 - the forward failed: every request in it ends
            for st in fed:
                _fail(st, e)
            return None
        t = time.perf_counter() - t
        for b in blocks.values():
            b.rows, b.forward_s, b.batch, b.prefill_rows = rows, t, len(blocks), chunk_rows
        keys = list(blocks) + [len(states) + j for j in range(len(prefills))]
        return dict(zip(keys, outs))

    # ------------------------------------------------------------------ commit
    def commit(self, st: DecodeState, block: Block, out: TargetOut, oc: StepOutcome) -> list[int]:
        """Apply a verification: keep the block's accepted rows in the target's cache (a chain rolls
        back in O(1), a tree's path is compacted), hand the kept rows' states to the proposer, tell the
        observers, emit the tokens."""
        runner = st.runner
        if oc.tree:
            runner.compact(block.base, oc.kept)
        else:
            runner.rollback(block.base + len(oc.kept))  # the last token + the accepted drafts are valid
        if self.proposer is not None and self.proposer.needs_hidden_states:
            idx = torch.tensor(oc.kept, device=out.hidden.device)
            hidden = out.hidden[:, idx]
            st.hidden = hidden[:, -1]  # the row that produced the step's final token
            self.proposer.on_target_hidden(st.slot, hidden, None if out.aux is None else out.aux[:, idx])
        if oc.margins is not None:
            st.margins.extend(oc.margins[:len(oc.emitted)])
        for observe in self.observers:
            observe(st, block, oc)
        if self.proposer is not None:
            self.proposer.on_verified(st.slot, oc.accepted, oc.emitted)
        st.steps += 1
        st.pace += PACE_EMA * (len(oc.emitted) - st.pace)
        return self._emit(st, oc.emitted)

    # ------------------------------------------------------------------ observers
    @property
    def observers(self):
        """What learns from each verified step, in order: the request's stats (and a hybrid's parts'),
        its draft-length controller with the pooled acceptance, the proposer's own timing."""
        return (self._count, self._control, self._time_proposer)

    def _count(self, st: DecodeState, block: Block, oc: StepOutcome) -> None:
        # the sub-proposers that made the draft (a hybrid's; it also scores its shadow drafts)
        parts = self.proposer.credit(st.slot, oc.num_draft, oc.accepted, oc.emitted) if self.proposer is not None else {}
        st.count(oc.num_draft, oc.accepted, parts)

    def _control(self, st: DecodeState, block: Block, oc: StepOutcome) -> None:
        if st.controller is None:
            return
        if block.prefill_rows:  # the forward read prompt chunks too: its time is theirs, not a verification's
            st.controller.observe_acceptance(oc.num_draft, oc.accepted)
        else:  # a tree's drafting is not d draft tokens' worth (one draft call per level, n nodes): the whole
            # step counts, keyed by its depth (its forward alone prices a row)
            st.controller.observe(oc.num_draft, oc.accepted, block.rows, block.step_seconds(),
                                  block.t1 - block.t0, oc.nodes if oc.tree else None, block.batch)
        self._pooled.observe(oc.num_draft, oc.accepted)

    def _time_proposer(self, st: DecodeState, block: Block, oc: StepOutcome) -> None:
        if self.proposer is not None:
            self.proposer.observe_step(st.slot, oc.nodes, block.rows,
                                       None if block.prefill_rows else block.step_seconds(), block.t1 - block.t0,
                                       block.batch)

    def finish(self, st: DecodeState) -> GenerationResult:
        """End the request (the proposer may learn from it) and return its result."""
        if self.proposer is not None:
            self.proposer.end_request(st.slot)
        return st.result()

    @staticmethod
    def _emit(st: DecodeState, tokens: list[int]) -> list[int]:
        """Append tokens up to a stop token or the length limit; returns what was appended."""
        room = st.room
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
