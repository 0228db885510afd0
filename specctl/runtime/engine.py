"""The serving engine: one thread that owns the model and runs the continuous-batching scheduler.

A pool of ``max_num_seqs`` TargetRunners (KV caches allocated once) and one SpecDecoder with its
proposer (pool slot i = proposer slot i), driven by ``specctl.runtime.scheduler.Scheduler``: each
round admits waiting requests in FIFO order into free slots (prefill + first token), then every
running request drafts and one target forward verifies them all. Results reach the HTTP side as
Events through a callback; the HTTP side stops a request through ``abort``.

What it does not know: HTTP, tokenizers, chat templates (``specctl.runtime.server``).
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass

import torch

from specctl.config import SpecConfig
from specctl.errors import UsageError
from specctl.runtime.decoder import SamplingParams, SpecDecoder
from specctl.runtime.metrics import SpecStats
from specctl.runtime.proposers import build_proposer
from specctl.runtime.loading import LoadedModel
from specctl.runtime.runner import TargetRunner, check_compilable
from specctl.runtime.scheduler import Request, Scheduler, Update

log = logging.getLogger("specctl.serve")


@dataclass
class Event:
    """Engine -> handler: new tokens; the last event carries the last tokens and why the request ended."""

    tokens: list[int]
    stats: SpecStats  # a copy, as of these tokens
    finish: str | None = None  # "stop" | "length" | "abort"; None while running
    error: str | None = None


@dataclass
class _Seen:
    """A running request as the metrics know it: when it last emitted tokens (None: not yet)."""

    t_last: float | None = None


class EngineRequest:
    """One request's link between its HTTP handler (event loop) and the engine thread."""

    _ids = itertools.count()

    def __init__(self, prompt_ids: list[int], params: SamplingParams, seed: int | None,
                 loop: asyncio.AbstractEventLoop, request_id: str | None = None):
        self.id = request_id or f"req-{next(self._ids)}"
        self.prompt_ids, self.params, self.seed = prompt_ids, params, seed
        self.loop = loop
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.abort_reason: str | None = None  # set by the handler side; the engine checks it every step
        self.done = False  # set by the engine (under its lock) before the last event is posted
        self.t_arrival = time.perf_counter()
        self.sched = Request(prompt_ids, params, seed, self.id, self.t_arrival)  # the scheduler's view


class QueueFull(RuntimeError):
    """The waiting queue is at --max-waiting: the server answers 429."""


class Histogram:
    """A Prometheus histogram: cumulative counts at fixed bucket bounds, a sum and a count."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, x: float) -> None:
        self.sum += x
        self.counts[bisect.bisect_left(self.bounds, x)] += 1

    def cumulative(self) -> list[tuple[str, int]]:
        out, total = [], 0
        for b, c in zip([*map(str, self.bounds), "+Inf"], self.counts):
            total += c
            out.append((b, total))
        return out


# vLLM's buckets for time to first token and inter-token latency (seconds)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class EngineMetrics:
    """Counters over all requests (read by /metrics); updated by the engine thread."""

    def __init__(self):
        self.lock = threading.Lock()
        self.by_proposer: dict[str, SpecStats] = {}  # a hybrid's parts, by name
        self.ttft = Histogram(TTFT_BUCKETS)  # arrival -> first token
        self.itl = Histogram(ITL_BUCKETS)  # between a request's successive token-bearing steps
        self.spec = SpecStats()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: Counter[str] = Counter()  # finished_reason -> requests


class Engine:
    """The engine thread: a KV-cache pool, a FIFO queue, and batched stepping (see module doc)."""

    def __init__(self, loaded: LoadedModel, spec: SpecConfig | None, max_model_len: int, max_num_seqs: int = 8,
                 adaptive: bool = True, compile: bool = False, max_num_batched_tokens: int | None = 2048,
                 max_waiting: int | None = None):
        if max_num_seqs < 1:
            raise UsageError(f"--max-num-seqs must be >= 1, got {max_num_seqs}", "pass e.g. --max-num-seqs 8")
        if max_num_batched_tokens is not None and max_num_batched_tokens < 1:
            raise UsageError(f"--max-num-batched-tokens must be >= 1, got {max_num_batched_tokens}",
                             "pass e.g. --max-num-batched-tokens 256")
        if max_waiting is not None and max_waiting < 0:
            raise UsageError(f"--max-waiting must be >= 0, got {max_waiting}", "pass e.g. --max-waiting 64")
        self.max_num_batched_tokens, self.max_waiting = max_num_batched_tokens, max_waiting
        self.loaded, self.spec = loaded, spec
        self.compile = compile
        if compile:
            check_compilable(loaded.model)  # here, not in the engine thread: a usage error for the user
        self.max_model_len, self.max_num_seqs = max_model_len, max_num_seqs
        self.k = spec.num_speculative_tokens if spec is not None else 0
        self.adaptive = adaptive
        self.metrics = EngineMetrics()
        self.num_running = 0
        self._cv = threading.Condition()  # also the scheduler's lock around its waiting queue
        self._reqs: dict[str, EngineRequest] = {}  # every request not yet ended, by id
        self._seen: dict[str, _Seen] = {}  # id -> what the metrics have counted of it
        self._sched: Scheduler | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._ready = threading.Event()
        self.failure: BaseException | None = None
        self._torch_threads = torch.get_num_threads()  # per-thread setting: carried into the engine thread

    # ------------------------------------------------------------------ handler side (any thread)
    @property
    def num_waiting(self) -> int:
        return len(self._sched.waiting) if self._sched is not None else 0

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.failure is None

    def kv_cache_bytes(self) -> int:
        a = self.loaded.model.args
        elem = torch.finfo(self.loaded.dtype).bits // 8
        return 2 * a.num_layers * a.num_kv_heads * a.head_dim * self.max_model_len * elem * self.max_num_seqs

    def start(self) -> None:
        """Start the thread; returns once the pool is allocated and warmed up (raises its failure)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="specctl-engine", daemon=True)
            self._thread.start()
        self._ready.wait()
        if self.failure is not None:
            raise self.failure

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def submit(self, req: EngineRequest) -> None:
        """Queue ``req``; raises QueueFull when ``max_waiting`` requests already wait for a slot."""
        with self._cv:
            if not self.alive:
                raise RuntimeError(f"the engine is not running ({self.failure or 'stopped'})")
            if (self.max_waiting is not None
                    and self.num_running + self.num_waiting >= self.max_num_seqs + self.max_waiting):
                raise QueueFull(f"the server is at capacity: {self.num_running} requests running, "
                                f"{self.num_waiting} waiting (--max-waiting {self.max_waiting})")
            self._reqs[req.id] = req
            self._sched.add(req.sched)  # the one waiting queue: the scheduler admits it as a slot frees up
            self._cv.notify()

    def abort(self, req: EngineRequest, reason: str = "abort") -> None:
        """Stop ``req`` ("abort": client gone; "stop": a stop string matched). No-op once it ended."""
        with self._cv:
            if req.done:
                return
            if req.abort_reason is None:
                req.abort_reason = reason
            self._sched.cancel(req.sched, req.abort_reason)  # its end comes with the scheduler's next step
            self._cv.notify()

    def abort_all(self, reason: str = "abort") -> int:
        """End every request not yet ended (the server is shutting down): each gets its final event, so a
        stream ends with its last chunk and [DONE] instead of being cut. Returns how many."""
        with self._cv:
            reqs = list(self._reqs.values())
        for r in reqs:
            self.abort(r, reason)
        return len(reqs)

    # ------------------------------------------------------------------ engine thread
    def _setup(self) -> None:
        torch.set_num_threads(self._torch_threads)
        # TargetRunner's constructor also sets this thread's flush-denormal mode (per thread on x86).
        runners = [TargetRunner(self.loaded.model, self.max_model_len, compile=self.compile) for _ in range(self.max_num_seqs)]
        proposer = None
        if self.spec is not None:
            proposer = build_proposer(self.spec, self.max_model_len, target=self.loaded)
            self.k = self.spec.num_speculative_tokens  # as the draft set it (Medusa's heads, MTP's layers)
        self._decoder = SpecDecoder(runners[0], proposer, self.k, adaptive=self.adaptive)
        self._sched = Scheduler(self._decoder, runners,
                                disable_by_batch_size=None if self.spec is None else self.spec.disable_by_batch_size,
                                max_num_batched_tokens=self.max_num_batched_tokens, lock=self._cv)
        vocab = self.loaded.model.args.vocab_size
        if self.max_model_len >= 24 and vocab > 16:  # warm-up: allocator, numba kernels, first-call costs
            self._decoder.generate([8, 9, 10, 11, 12, 13] * 2, SamplingParams(max_new_tokens=8, ignore_eos=True))

    def _run(self) -> None:
        try:
            self._setup()
        except BaseException as e:  # noqa: BLE001 - reported by start()
            self.failure = e
            self._ready.set()
            return
        self._ready.set()
        sched = self._sched
        try:
            while True:
                with self._cv:
                    while not (self._stopping or not sched.idle):
                        self._cv.wait()
                    if self._stopping:
                        break
                updates = sched.step()
                for u in updates:
                    self._publish(u)
                self.num_running = len(sched.running) + len(sched.prefilling)
        except BaseException as e:  # noqa: BLE001 - a bug in the loop itself: fail every request, stop
            log.exception("engine thread failed")
            self.failure = e
        why = "the server is shutting down" if self.failure is None else f"engine failure: {self.failure}"
        for r, st in sched.running + sched.prefilling:
            self._decoder.finish(st)
            self._close(self._reqs.get(r.id), Event([], st.stats.copy(), finish="abort",
                                                    error=None if self.failure is None else why))
        with self._cv:
            left = [self._reqs.get(r.id) for r in sched.waiting]
            sched.waiting.clear()
        for req in left:
            self._close(req, Event([], SpecStats(), finish="abort", error=why))
        self.num_running = 0

    def _publish(self, u: Update) -> None:
        """One scheduler update -> metrics, the request's events and (last one) its end."""
        req = self._reqs.get(u.request.id)
        st = u.state
        if st is not None:
            now = time.perf_counter()
            seen = self._seen.get(u.request.id)
            m = self.metrics
            with m.lock:
                if seen is None:  # admitted
                    m.prompt_tokens += len(u.request.prompt_ids)
                    seen = self._seen[u.request.id] = _Seen()
                # what the request's steps (and a hybrid's parts) counted since its last update
                m.spec = m.spec.merge(u.spec)
                for name, s in u.parts.items():
                    m.by_proposer[name] = m.by_proposer.get(name, SpecStats()).merge(s)
                m.generation_tokens += len(u.tokens)
                if u.tokens:
                    if seen.t_last is None:
                        m.ttft.observe(now - u.request.t_arrival)
                    else:
                        m.itl.observe(now - seen.t_last)
            if u.tokens:
                seen.t_last = now
            if u.tokens and u.finish is None:
                self._post(req, Event(u.tokens, st.stats.copy()))
        if u.finish is None:
            return
        self._seen.pop(u.request.id, None)
        reason = u.finish
        if u.error is not None:
            log.warning("request %s failed: %s", u.request.id, u.error)
        # a request's last tokens come with its end (a handler tells a final stop token from the others)
        self._close(req, Event(list(u.tokens), st.stats.copy() if st is not None else SpecStats(),
                               finish="abort" if u.error is not None else reason, error=u.error))
        if u.result is not None and st is not None:
            s = u.result.stats
            log.info("%s: %d prompt + %d new tokens, %s, %.1f tok/s decode, %.2f mean acceptance length, "
                     "queued %.2fs", u.request.id, len(u.request.prompt_ids), len(u.result.token_ids),
                     u.error or reason, u.result.decode_tokens_per_s, s.mean_acceptance_length,
                     st.t_start - u.request.t_arrival)

    def _close(self, req: "EngineRequest | None", ev: Event) -> None:
        if req is None:
            return
        with self._cv:
            if req.done:
                return
            req.done = True
            self._reqs.pop(req.id, None)
            self._count_finished("error" if ev.error else ev.finish)
            self._cv.notify()
        self._post(req, ev)

    def _count_finished(self, reason: str) -> None:
        with self.metrics.lock:
            self.metrics.finished[reason] += 1

    @staticmethod
    def _post(req: EngineRequest, ev: Event) -> None:
        try:
            req.loop.call_soon_threadsafe(req.queue.put_nowait, ev)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass
