"""`specctl bench --concurrency N`: aggregate throughput under load, plain and every method.

For each workload, each N and each configuration (the baseline first), the workload's prompts run
through the continuous-batching scheduler (``specctl.runtime.scheduler``) with N KV slots, all
queued at once: up to N requests decode together, one target forward per step, and a finished
request's slot goes to the next waiting one. The workload is closed (an offline job: nothing arrives
after it), so its last wave drafts only for the requests that set its end (``Scheduler.closed``).
Reported per row: total generated tokens over the wall time (aggregate tok/s), the speedup over the
baseline at the same N and the scaling over the baseline at N = 1 (when measured), time to first
token (from the moment it was queued) and inter-token latency (between a request's successive
token-bearing steps), median and p99, and
how many outputs equal the baseline's at the same N token for token (greedy). Beside the scaling,
its roof, measured in the same run: N one-row forwards against one N-row forward (``forward_roof``:
what reading the weights once for N rows allows; prefill, scheduling and uneven lengths explain
the rest of the gap).

Each measurement (workload x N x configuration) runs on a fresh decoder with a fresh proposer,
built after the warm-up: nothing learnt at one N (a suffix tree of the earlier answers to the same
prompts, pooled acceptance, measured costs) carries into the next. Prompts that do not fit the
model's context with ``max_new_tokens`` are refused before anything runs.

``interleave="steps"`` (the default): every configuration has a scheduler and N KV slots of its own,
and they take one engine step each in turn (``lockstep``), so that a drift of a noisy machine hits all
alike, step by step; each row's clock counts its own steps only (its wall time, TTFT from the queueing,
ITL). ``interleave="prompts"``: one configuration after the other, on one set of KV slots.

``runs`` > 1: each N is measured in rounds, every configuration once a round in the same order (the
baseline first), so a drift of the machine's speed (a shared host) falls on every configuration alike. A
row's tok/s is the median over rounds (min and max beside it), its speedup the median of each round's
ratio to that round's baseline, its outputs counted equal only if every round's equal its round's
baseline's, and its other figures (TTFT, ITL, drafts) the median round's.
"""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import torch

from specctl.bench.memory import tensor_bytes
from specctl.bench.labels import config_labels
from specctl.bench.suite import (BASELINE, _Proposers, check_context, check_interleave, machine_header, part_names,
                                 prompt_where)
from specctl.workloads import load_workload, render_prompt
from specctl.config import SpecConfig
from specctl.runtime.decoder import SamplingParams, SpecDecoder
from specctl.runtime.metrics import SpecStats
from specctl.runtime.loading import LoadedModel
from specctl.runtime.runner import TargetRunner, forward_batch
from specctl.runtime.scheduler import Request, Scheduler


def _pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


class LoadRun:
    """One row's measurement: all ``prompts`` queued at once on a scheduler over ``runners``, stepped by
    the caller. Its clock counts its own steps only (TTFT from the queueing at 0, ITL between a request's
    token-bearing steps, the wall time), so that rows stepped in turn (``lockstep``) are each timed by
    their own work. ``parts``: a hybrid's sub-proposer names, each in ``by_proposer`` even if it never drafted."""

    def __init__(self, decoder: SpecDecoder, runners: list[TargetRunner], prompts: list[list[int]],
                 params: SamplingParams, seed: int, disable_by_batch_size: int | None = None,
                 max_num_batched_tokens: int | None = 2048, parts: list[str] = ()):
        self.decoder = decoder
        self.sched = Scheduler(decoder, runners, disable_by_batch_size=disable_by_batch_size,
                               max_num_batched_tokens=max_num_batched_tokens)
        self.reqs = [Request(p, params, seed=None if params.greedy else seed + i) for i, p in enumerate(prompts)]
        for r in self.reqs:
            r.t_arrival = 0.0
            self.sched.add(r)
        self.sched.closed = True  # a closed workload: its last wave holds what cannot end it sooner
        self.parts = list(parts)
        self.clock = 0.0
        self.last: dict[int, float] = {}
        self.ttft: list[float] = []
        self.itl: list[float] = []
        self.out: dict = {r.id: None for r in self.reqs}

    @property
    def done(self) -> bool:
        return self.sched.idle

    def step(self) -> None:
        t0 = time.perf_counter()
        updates = self.sched.step()
        self.clock += time.perf_counter() - t0
        now = self.clock
        for u in updates:
            if u.tokens:
                rid = u.request.id
                if rid not in self.last:
                    self.ttft.append(now - u.request.t_arrival)
                else:
                    self.itl.append(now - self.last[rid])
                self.last[rid] = now
            if u.finish is not None:
                if u.error is not None:
                    raise RuntimeError(f"request failed in the batch: {u.error}")
                self.out[u.request.id] = u.result

    def result(self) -> dict:
        results = [self.out[r.id] for r in self.reqs]
        wall, sched = self.clock, self.sched
        ntok = sum(len(r.token_ids) for r in results)
        drafts = sum(r.stats.num_draft_tokens for r in results)
        by_part: dict[str, SpecStats] = {n: SpecStats() for n in self.parts}
        for r in results:
            for name, s in r.by_proposer.items():
                by_part[name] = by_part.get(name, SpecStats()).merge(s)
        acc = sum(r.stats.num_accepted_tokens for r in results)
        return {
            "tokens": ntok, "wall_s": wall, "tokens_per_s": ntok / wall if wall > 0 else 0.0,
            "ttft_p50_s": _pct(self.ttft, 50), "ttft_p99_s": _pct(self.ttft, 99),
            "itl_p50_s": _pct(self.itl, 50), "itl_p99_s": _pct(self.itl, 99),
            "mean_batch": float(np.mean(sched.batch_sizes)) if sched.batch_sizes else 0.0, "steps": sched.steps,
            "acceptance_rate": acc / drafts if drafts else None, "num_draft_tokens": drafts,
            "by_proposer": {n: s.to_dict() for n, s in by_part.items()},
            "outputs": [r.token_ids for r in results],
        }


def lockstep(runs: list[LoadRun]) -> list[dict]:
    """Step each unfinished run once in turn until all are done; each one's times are its own steps'."""
    while not all(r.done for r in runs):
        for r in runs:
            if not r.done:
                r.step()
    return [r.result() for r in runs]


def run_level(decoder: SpecDecoder, runners: list[TargetRunner], prompts: list[list[int]], params: SamplingParams,
              seed: int, disable_by_batch_size: int | None = None, max_num_batched_tokens: int | None = 2048,
              parts: list[str] = ()) -> dict:
    """All prompts through a scheduler over ``runners``, alone; returns the row's measures and outputs."""
    return lockstep([LoadRun(decoder, runners, prompts, params, seed, disable_by_batch_size,
                             max_num_batched_tokens, parts)])[0]


def forward_roof(runners: list[TargetRunner], n: int, context: int = 64, reps: int = 5) -> float:
    """The most plain decoding at n requests can gain over one: n x (one decode row's forward) / (n
    rows' forward), each row at ``context`` tokens of its own cache, best of ``reps``, measured now.
    A memory-bound forward reads the weights once for all rows (roof n); compute makes it less."""
    g = torch.Generator().manual_seed(0)
    vocab = runners[0].model.args.vocab_size

    def t(k: int) -> float:
        rs = runners[:k]
        for r in rs:
            r.reset()
        forward_batch(rs, [torch.randint(0, vocab, (1, context), generator=g) for _ in rs], last_only=[True] * k)
        best = float("inf")
        for _ in range(reps):
            for r in rs:
                r.rollback(context)
            toks = [torch.randint(0, vocab, (1, 1), generator=g) for _ in rs]
            s = time.perf_counter()
            forward_batch(rs, toks)
            best = min(best, time.perf_counter() - s)
        for r in rs:
            r.reset()
        return best

    return n * t(1) / t(n) if n > 1 else 1.0


def run_concurrency(loaded: LoadedModel, configs: list[SpecConfig], workloads: list[str], num_prompts: int,
                    params: SamplingParams, levels: list[int], seed: int = 0, adaptive: bool = True,
                    progress=None, max_num_batched_tokens: int | None = 2048, runs: int = 1,
                    interleave: str = "steps") -> tuple[dict, list[dict]]:
    """(header, rows): one row per workload x N x configuration (the baseline first).
    ``interleave``: "steps" (every configuration's scheduler on N KV slots of its own, one engine step
    each in turn, ``lockstep``) or "prompts" (one configuration after the other)."""
    check_interleave(interleave)
    say = progress or (lambda advance, description, total=None: None)
    tok = loaded.tokenizer
    top = max(levels)
    reqs = {w: load_workload(w, max(num_prompts, top), seed) for w in workloads}
    prompts = {w: [render_prompt(tok, r) for r in rs] for w, rs in reqs.items()}
    check_context(loaded, [(prompt_where(w, r), len(ids)) for w in workloads for r, ids in zip(reqs[w], prompts[w])],
                  params.max_new_tokens)
    max_k = max([c.num_speculative_tokens for c in configs], default=0)
    max_len = max(len(p) for ps in prompts.values() for p in ps) + params.max_new_tokens + max_k + 8
    labels = [BASELINE] + config_labels(configs)
    spec = [None] + configs
    stepped = interleave == "steps" and len(spec) > 1
    # each configuration's KV slots: its own in lockstep (allocated, touched only as far as a prompt reaches),
    # else one set for all
    sets = ([[TargetRunner(loaded.model, max_len) for _ in range(top)] for _ in spec] if stepped
            else [[TargetRunner(loaded.model, max_len) for _ in range(top)]] * len(spec))
    runners = sets[0]
    every_runner = tuple({id(r): r for rs in sets for r in rs}.values())
    proposers = _Proposers(loaded, max_len)

    def decoder(c: SpecConfig | None, rs: list[TargetRunner]) -> SpecDecoder:
        """A fresh decoder and proposer (draft weights stay shared): no state from an earlier measurement."""
        if c is None:
            return SpecDecoder(rs[0])
        return SpecDecoder(rs[0], proposers.build(c), c.num_speculative_tokens, adaptive=adaptive)

    say(0, "warm-up", len(workloads) * len(levels) * len(spec) * runs)
    warm = [p[:32] for p in next(iter(prompts.values()))[:top]]
    for i, c in enumerate(spec):  # first-call costs (allocator, numba kernels, the batched shapes' kernels)
        # stay out of the first row: each configuration runs a short batch of `top` on a decoder then thrown away
        run_level(decoder(c, sets[i]), sets[i][:top], warm, replace(params, max_new_tokens=8), seed)
    say(0, "measuring the forward's roof")
    roof = {n: forward_roof(runners, n) for n in sorted(levels)}
    rows = []
    for w in workloads:
        base_at: dict[int, float] = {}  # N -> the baseline's median tok/s
        for n in sorted(levels):
            measured: dict[str, list[dict]] = {label: [] for label in labels}
            mem: dict[str, float] = {}
            for r in range(runs):
                rnd = f" · round {r + 1} of {runs}" if runs > 1 else ""
                # each N starts fresh: N=2 must not replay N=1's answers from a suffix cache
                decs = [decoder(c, rs) for c, rs in zip(spec, sets)]

                def load(i: int) -> LoadRun:
                    c = spec[i]
                    return LoadRun(decs[i], sets[i][:n], prompts[w], params, seed,
                                   None if c is None else c.disable_by_batch_size, max_num_batched_tokens, part_names(c))

                if stepped:
                    what = f"{w} · {n} concurrent · every configuration in lockstep{rnd}"
                    say(0, what)
                    for label, m in zip(labels, lockstep([load(i) for i in range(len(spec))])):
                        measured[label].append(m)
                    say(len(spec), what)
                else:
                    for i, label in enumerate(labels):
                        what = f"{w} · {n} concurrent · {label}{rnd}"
                        say(0, what)
                        measured[label].append(lockstep([load(i)])[0])
                        say(1, what)
                for label, dec in zip(labels, decs):  # after the run: a draft model's caches grow as it reads
                    mem[label] = tensor_bytes(dec.proposer, (loaded.model, *every_runner)) / 2**20
            base = measured[BASELINE]
            base_at[n] = float(np.median([m["tokens_per_s"] for m in base]))
            for label, c in zip(labels, spec):
                ms = measured[label]
                tps = [m["tokens_per_s"] for m in ms]
                mid = ms[int(np.argsort(tps)[len(tps) // 2])]  # the median round
                ratios = [m["tokens_per_s"] / b["tokens_per_s"] for m, b in zip(ms, base) if b["tokens_per_s"]]
                same = (min(sum(a == b for a, b in zip(m["outputs"], bm["outputs"])) for m, bm in zip(ms, base))
                        if params.greedy else None)
                one = base_at.get(1)
                rows.append({
                    "workload": w, "concurrency": n, "method": label,
                    "k": None if c is None else c.num_speculative_tokens,
                    "requests": len(mid["outputs"]),
                    **{key: v for key, v in mid.items() if key != "outputs"},
                    "tokens_per_s": float(np.median(tps)), "tokens_per_s_min": min(tps), "tokens_per_s_max": max(tps),
                    "runs": runs, "tokens_per_s_by_run": tps,
                    "speedup": float(np.median(ratios)) if ratios else None,
                    "scaling_vs_plain_1": float(np.median(tps)) / one if one else None,
                    "roof_vs_plain_1": roof[n],
                    "identical_to_baseline": same,
                    "extra_memory_mib": mem[label],
                })
    header = machine_header(loaded, params.max_new_tokens, params.temperature)
    header.update({"concurrency": sorted(levels),
                   "max_num_batched_tokens": max_num_batched_tokens, "runs": runs,
                   "interleave": "steps" if stepped else "prompts",
                   "draft_length": "adaptive (up to k)" if adaptive else "fixed k"})
    return header, rows
