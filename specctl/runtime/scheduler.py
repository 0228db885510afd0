"""Continuous batching: requests join and leave between steps, and every step is one target forward.

    waiting (FIFO) ─► admit into a free KV slot
    prefilling ─► its prompt in chunks of ``max_num_batched_tokens`` tokens, riding in the steps'
              forwards (at most that many prompt tokens per step), then its first token
    running ─► step(): every running request drafts, one ragged forward verifies them all and
              carries the step's prefill chunks (``SpecDecoder.step_batch``), each request is
              verified and rolled back on its own
    finished / cancelled ─► the slot is free for the next waiting request

A pool of ``max_num_seqs`` TargetRunners (KV caches allocated once, ``max_model_len`` positions
each; rollback stays O(1) per request) and one SpecDecoder whose proposer keeps one slot per pool
slot. A request's tokens do not depend on what else is in the batch: on the row-independent CPU
paths its rows are computed bit for bit as if alone, and its sampling has its own generator.

vLLM's ``disable_by_batch_size``: no drafting in a step where at least that many requests run.
``max_num_batched_tokens`` (vLLM's name, and its default 2048): the prompt tokens one step may carry,
so that a long prompt delays the running decodes by at most one chunk per step. A prompt is always cut
at the same places (every ``max_num_batched_tokens`` tokens), whatever else runs, so its cache and its
output do not depend on the batch either; None prefills each prompt whole, alone, when it is admitted.
A step takes one whole chunk, first come first served, and the next waiting prompts' chunks only while
it holds at most ``PACK_TOKENS`` (256) prompt tokens: a ~600-token prompt is read in one forward (not
in three steps of 256, each with the running decodes), and sixteen short chat prompts arriving together
get their first tokens a few at a time, as each short step ends, not all at the end of one long step.
Median TTFT at 16 clients (Qwen2.5-Coder-0.5B, AMD EPYC Zen 4, docs/results/2026-12-06-prompt-heavy-serve.md):
code editing 3.7 s, against 7.1 s with every step packed up to 2048 and 12.8 s with 256-token chunks;
chat 1.1 s, against 2.8 s and 0.9 s.

An offline job (``run``, bench's load: every request queued at once, ``closed``) is done when its last
request is; in its last wave (nothing waits) drafting for a request that would end before the one
expected to end last, even decoding plainly, only lengthens the steps that one still needs (every
verified row is the whole batch's time), so such a request is held from drafting that step
(``last_wave_holds``; a request's expected steps left are its room over its pace, the tokens its steps
emit). A server is never closed: a request that ends early frees its slot for the next client's.

The scheduler is synchronous (``add``, ``step``, ``cancel``): the server's engine thread drives it
(``specctl.runtime.engine``) and so does ``specctl bench --concurrency``. Its waiting queue is the only
one: the server's handlers ``add`` and ``cancel`` into it from their threads, under the ``lock`` the
engine gives (held only while the queue changes, never across a forward). What it does not know:
threads beyond that lock, HTTP, tokenizers.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from specctl.runtime.decoder import DecodeState, GenerationResult, SamplingParams, SpecDecoder
from specctl.runtime.metrics import SpecStats
from specctl.runtime.runner import TargetRunner


@dataclass
class Request:
    """One request for the scheduler. ``seed`` seeds its sampling generator (None: random)."""

    prompt_ids: list[int]
    params: SamplingParams
    seed: int | None = None
    id: str = ""
    t_arrival: float = field(default_factory=time.perf_counter)
    cancelled: str | None = None  # set by ``cancel``: the reason ("abort", "stop")

    def __post_init__(self):
        self.id = self.id or f"req-{next(_ids)}"


_ids = itertools.count()
PACK_TOKENS = 256  # a step takes more than one prompt chunk only while it holds at most this many prompt tokens


def last_wave_holds(rooms: list[int], paces: list[float], more: list[float] = ()) -> frozenset[int]:
    """Indices of the decoding requests (``rooms``: tokens each may still emit; ``paces``: tokens a step of
    each emits) that would end before another is expected to even one token a step, so that drafting
    for them cannot bring the batch's end nearer. ``more``: the expected steps left of requests not yet
    decoding (a prompt being read: its whole room). The request expected to end last is never held."""
    left = [r / max(p, 1.0) for r, p in zip(rooms, paces)]
    ends = sorted(left + list(more), reverse=True)
    if len(ends) < 2:
        return frozenset()
    return frozenset(i for i, r in enumerate(rooms) if r < (ends[1] if left[i] == ends[0] else ends[0]))


@dataclass
class Update:
    """What one ``step`` did to a request: tokens appended, and (its last update) how it ended: the
    tokens of the step that ended it come in that same update."""

    request: Request
    tokens: list[int]
    state: DecodeState | None  # None when it failed before its prefill ended
    finish: str | None = None  # "stop" | "length" | "abort" | "error"; None while it runs
    error: str | None = None
    result: GenerationResult | None = None  # with ``finish``, where it ran
    spec: SpecStats = field(default_factory=SpecStats)  # what its steps counted since its last update
    parts: dict[str, SpecStats] = field(default_factory=dict)  # the same per hybrid part


def _update(req: "Request", tokens: list[int], st: DecodeState) -> Update:
    """An update of a running request, carrying what its steps counted since its last one."""
    return Update(req, tokens, st, None, None, None, *st.take_unreported())


class Scheduler:
    """FIFO admission into a fixed pool of KV slots, one batched step for every running request."""

    def __init__(self, decoder: SpecDecoder, runners: list[TargetRunner], disable_by_batch_size: int | None = None,
                 max_num_batched_tokens: int | None = None, lock=None):
        if not runners:
            raise ValueError("the scheduler needs at least one runner (KV slot)")
        if max_num_batched_tokens is not None and max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        self.chunk = max_num_batched_tokens
        self.prefilling: list[tuple[Request, DecodeState]] = []
        self.decoder = decoder
        self.runners = runners
        self.disable_by_batch_size = disable_by_batch_size
        self.waiting: deque[Request] = deque()
        self.lock = lock if lock is not None else contextlib.nullcontext()  # around every change of ``waiting``
        self.running: list[tuple[Request, DecodeState]] = []
        self._free = list(range(len(runners) - 1, -1, -1))  # pop() hands out slot 0 first
        self.steps = 0
        self.trace: list[tuple[int, int]] = []  # per step: (decoding requests, prompt tokens carried)
        self.closed = False  # set by an owner that adds no more requests (an offline job): see the docstring

    @property
    def max_num_seqs(self) -> int:
        return len(self.runners)

    @property
    def batch_sizes(self) -> list[int]:
        """Decoding requests per step that had any."""
        return [n for n, _ in self.trace if n]

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running and not self.prefilling

    def add(self, req: Request) -> None:
        with self.lock:
            self.waiting.append(req)

    def cancel(self, req: Request, reason: str = "abort") -> None:
        """Stop ``req`` at the next step (a waiting request never starts: its end is that step's update)."""
        with self.lock:
            if req.cancelled is None:
                req.cancelled = reason

    def step(self) -> list[Update]:
        """Admit what fits, then one batched step of every running request. Returns the updates."""
        updates: list[Update] = []
        this_step: dict[str, Update] = {}  # request id -> its update with tokens (a request that ends gets one)
        with self.lock:  # cancelled before it started: it ends here; then what fits is admitted
            kept = deque()
            for req in self.waiting:
                if req.cancelled is not None:
                    updates.append(Update(req, [], None, finish=req.cancelled))
                else:
                    kept.append(req)
            admitted = []
            while kept and len(admitted) < len(self._free):
                admitted.append(kept.popleft())
            self.waiting = kept
        for req in admitted:
            slot = self._free.pop()
            upd = self._start(req, slot)
            updates.append(upd)
            if upd.finish is not None:
                self._free.append(slot)
                continue
            this_step[req.id] = upd
            if upd.state.prefilling:
                self.prefilling.append((req, upd.state))
            else:
                self.running.append((req, upd.state))
        # this step's prompt chunks, first come first served: one whole chunk, and more only while the
        # step holds at most PACK_TOKENS prompt tokens (see the module docstring)
        chunks, carried = [], 0
        for req, st in self.prefilling:
            if req.cancelled is None and st.finish is None:
                n = self.decoder.next_chunk(st, self.chunk)
                if not chunks or carried + n <= min(PACK_TOKENS, self.chunk):
                    chunks.append((req, st, n))
                    carried += n
        stepping = [(r, st) for r, st in self.running if r.cancelled is None and st.finish is None]
        if stepping or chunks:
            cap = None
            if self.disable_by_batch_size is not None and len(stepping) >= self.disable_by_batch_size:
                cap = 0
            self.trace.append((len(stepping), sum(n for _, _, n in chunks)))
            hold = frozenset()
            if self.closed and not self.waiting and len(stepping) > 1:  # an offline job's last wave
                hold = last_wave_holds([st.room for _, st in stepping], [st.pace for _, st in stepping],
                                       [float(st.room) for r, st in self.prefilling if r.cancelled is None])
            emitted = self.decoder.step_batch([st for _, st in stepping], max_draft=cap,
                                              prefills=[(st, n) for _, st, n in chunks],
                                              in_flight=len(stepping) + len(self.prefilling), hold=hold)
            self.steps += 1
            for (req, st), toks in zip(stepping + [(r, s) for r, s, _ in chunks], emitted):
                if toks or (st.error is None and not st.prefilling):
                    updates.append(_update(req, toks, st))
                    this_step[req.id] = updates[-1]
        left = []  # prompts done (or ended) join the running requests
        for req, st in self.prefilling:
            (left if st.prefilling and st.error is None and req.cancelled is None else self.running).append((req, st))
        self.prefilling = left
        still = []
        for req, st in self.running:
            if req.cancelled is not None or st.finish is not None:
                upd = this_step.get(req.id)  # the step that ended it: its tokens come with the end
                if upd is None:
                    upd = _update(req, [], st)
                    updates.append(upd)
                upd.finish = "error" if st.error is not None else req.cancelled or st.finish
                upd.error = None if st.error is None else f"{type(st.error).__name__}: {st.error}"
                self._end(req, st, upd)
            else:
                still.append((req, st))
        self.running = still
        return updates

    def _start(self, req: Request, slot: int) -> Update:
        gen = None
        try:  # anything wrong with one request (its seed included) fails it, never the engine
            if not req.params.greedy:
                gen = torch.Generator(device=self.runners[slot].device)
                if req.seed is not None:
                    gen.manual_seed(req.seed)
                else:
                    gen.seed()
            if self.chunk is None:
                st = self.decoder.start(req.prompt_ids, req.params, gen, runner=self.runners[slot], slot=slot)
            else:  # prefilled chunk by chunk in the coming steps
                st = self.decoder.begin(req.prompt_ids, req.params, gen, runner=self.runners[slot], slot=slot)
        except Exception as e:  # noqa: BLE001 - this request fails, the others go on
            if self.decoder.proposer is not None:
                self.decoder.proposer.end_request(slot)
            return Update(req, [], None, finish="error", error=f"{type(e).__name__}: {e}")
        return _update(req, list(st.out), st)

    def _end(self, req: Request, st: DecodeState, upd: Update) -> None:
        upd.result = self.decoder.finish(st)
        self._free.append(st.slot)

    def run(self, requests: list[Request], closed: bool = True) -> list[GenerationResult]:
        """Every request to its end (all queued at once); results in the order given. ``closed``: an offline
        job, whose last wave drafts only for what sets its end (see the docstring); False steps them as a server."""
        for r in requests:
            self.add(r)
        self.closed = closed
        done: dict[str, GenerationResult] = {}
        while not self.idle:
            for u in self.step():
                if u.finish is not None:
                    if u.error is not None:
                        raise RuntimeError(f"request {u.request.id} failed: {u.error}")
                    done[u.request.id] = u.result
        return [done[r.id] for r in requests]
