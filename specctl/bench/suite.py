"""Run methods x workloads against the no-speculation baseline measured in the same run.

For each workload, every prompt is run by the baseline and by each method in lockstep
(``interleave="steps"``, the default): each has a KV cache of its own, and they take one decode
step each in turn, so that a drift of a noisy machine (a shared VM's read rate swings by 2x within
minutes) hits every method alike, step by step; each one's times are its own steps' (``lockstep``).
``interleave="prompts"`` runs them one after the other per prompt on one KV cache (and always with
``reuse_prefill``, which hands the baseline's cache over). A short warm-up generation runs first
(kernel compilation, allocator warm-up), outside the timings.

Speed is decode tokens/s: tokens after the first one, over the time after the first one (the
prompt's prefill is the same work for every method and is reported apart, as TTFT).

Rows are named by ``config_labels``: the method, and where several configurations share it, what
tells them apart (their draft, ``draft_model:smollm2-135m``, else the key that differs, else ``#N``).
Each draft model is loaded once, however many configurations use it. With ``peers=("hf",)``,
transformers' plain, prompt-lookup and assisted generation (one per distinct draft) run on the same
prompt ids right after specctl's (``specctl.bench.peers``).

Every measuring pass (each of ``runs``) starts from fresh decoders and proposers, built after the
warm-up: nothing one pass learnt (a suffix tree of earlier answers, pooled acceptance, measured
costs) carries into the next, nor from the warm-up into the first. Prompts that do not fit the
model's context with ``max_new_tokens`` are refused before anything runs (``check_context``).

``specctl recommend --probe`` measures through this same loop: with ``time_drafts`` each proposer
runs inside a ``DraftTimer`` and each row also holds the draft's own time and (drafted, accepted)
per step (``MethodRun.draft``), from which the probe estimates acceptance α and cost ratio ρ.
"""

from __future__ import annotations

import gc
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from specctl.bench.draft_timer import DraftTimer, DraftTiming
from specctl.bench.results import BASELINE, BenchReport, MethodRun, first_divergence  # noqa: F401 (here as before)
from specctl.bench.labels import config_labels, draft_name
from specctl.workloads import Request, load_workload, render_prompt, turn_messages
from specctl.config import SpecConfig
from specctl.errors import UsageError
from specctl.runtime.decoder import SamplingParams, SpecDecoder
from specctl.runtime.requests import GenerationResult
from specctl.runtime.metrics import SpecStats
from specctl.runtime.proposers import build_proposer
from specctl.runtime.loading import LoadedModel
from specctl.runtime.runner import TargetRunner

def _same_vocab(target: Path, draft: Path) -> bool:
    """Whether a draft folder has the target's tokenizer (what vLLM's draft_model needs)."""
    def vocab(p: Path):
        f = Path(p) / "tokenizer.json"
        return json.loads(f.read_text(encoding="utf-8")).get("model", {}).get("vocab") if f.is_file() else None

    a, b = vocab(target), vocab(draft)
    return a is not None and a == b


def machine_header(loaded: LoadedModel, max_new_tokens: int, temperature: float) -> dict:
    from specctl.kernels.cpu import name as cpu_name

    cpu = cpu_name()
    dev = loaded.device
    return {
        "model": str(loaded.path), "dtype": str(loaded.dtype).removeprefix("torch."), "device": str(dev),
        "machine": torch.cuda.get_device_name(dev) if dev.type == "cuda" else cpu,
        "threads": torch.get_num_threads(), "torch": torch.__version__,
        # the CPU path of bf16 linears: "amx", "avx512_bf16", "avx512", "avx2" (row-independent) or None (torch's kernels)
        "cpu_kernels": loaded.model.cpu_kernels,
        # "gguf": the weights are a GGUF's blocks as stored (--quantization gguf); "none": dense in ``dtype``
        "quantization": getattr(loaded.model, "quantization", None) or "none",
        "max_new_tokens": max_new_tokens, "temperature": temperature,
    }


def part_names(config: SpecConfig | None) -> list[str]:
    """A hybrid's sub-proposer names as its decoder credits them (``ngram``, ``draft_model``, ``ngram#2``);
    [] for any other configuration. Every part gets a row, also one that never drafted."""
    if config is None or config.method != "hybrid":
        return []
    from specctl.runtime.proposers.hybrid import sub_labels

    return sub_labels(config.sub_configs())


def prompt_where(workload: str, req: Request) -> str:
    """Where a prompt comes from, for an error: 'prompts.jsonl line 3' or 'workload chat, item mt-bench/81'."""
    line = req.meta.get("line")
    return f"{workload} line {line}" if line is not None else f"workload {workload}, item {req.id}"


def check_context(loaded: LoadedModel, prompts: list[tuple[str, int]], max_new_tokens: int) -> None:
    """Refuse, before anything runs, prompts (where, token count) that do not fit the model's context
    (``max_position_embeddings``) with ``max_new_tokens`` after them: positions past it are not a
    measurement of the model (one line names the first such prompt, its length, the limit, the fix)."""
    limit = int(loaded.model.args.max_position_embeddings)
    bad = [(w, n) for w, n in prompts if n + max_new_tokens > limit]
    if not bad:
        return
    (where, n), more = bad[0], (f" (and {len(bad) - 1} more prompts)" if len(bad) > 1 else "")
    what = f"the model's context of {limit} positions (max_position_embeddings of {loaded.name})"
    if n >= limit:
        raise UsageError(f"{where}: the prompt is {n} tokens, over {what}{more}",
                         f"use prompts shorter than {limit} tokens (drop or shorten this one), or a model with a "
                         f"longer context")
    room = limit - max(n for _, n in bad)
    raise UsageError(f"{where}: the prompt ({n} tokens) + --max-new-tokens {max_new_tokens} exceeds {what}{more}",
                     f"pass --max-new-tokens {room} or less, or shorter prompts" if room >= 2 else
                     "use shorter prompts")


def _turn_budget(where: str, n: int, max_new_tokens: int, limit: int, capacity: int, notice) -> int:
    """New tokens for a later turn whose prompt (``n`` tokens, the earlier answers in it) is only known
    once they are made: ``max_new_tokens``, or what is left of the model's context (``limit``) and of
    the caches (``capacity``), the same for every method and peer, and said (``notice``); a prompt that
    leaves no room is refused."""
    room = min(limit, capacity) - n
    if room < 1:
        raise UsageError(f"{where}: with the earlier answers the prompt is {n} tokens, no room left in the model's "
                         f"context of {limit} positions", "pass a smaller --max-new-tokens (shorter earlier answers)")
    if room >= max_new_tokens:
        return max_new_tokens
    if notice is not None:
        notice(f"{where}: the prompt with the earlier answers is {n} tokens; its answer is held to {room} new "
               f"tokens (the model's context is {limit} positions), for every method and peer")
    return room


@dataclass
class Entry:
    """One row source: a label, its configuration (None = the baseline) and the decoder that runs it."""

    label: str
    config: SpecConfig | None
    decoder: SpecDecoder | None  # the warm-up's; each measuring pass builds its own (run_bench's ``decoder``)


class _Proposers:
    """Builds proposers; every draft model is loaded once and shared (each proposer keeps its own caches)."""

    def __init__(self, loaded: LoadedModel, max_len: int, time_drafts: bool = False):
        self.loaded, self.max_len, self.time_drafts = loaded, max_len, time_drafts
        self.drafts: dict[tuple[str, str | None], LoadedModel] = {}  # (model, quantization) -> the loaded draft

    def build(self, c: SpecConfig):
        p = self._build(c)
        return DraftTimer(p) if self.time_drafts else p

    def _build(self, c: SpecConfig):
        if c.method != "draft_model":
            return build_proposer(c, self.max_len, target=self.loaded)
        from specctl.runtime.proposers.draft_model import DraftModelProposer, load_draft

        key = (c.model, c.own_quantization())
        if key not in self.drafts:  # as DraftModelProposer itself loads it (dense, or a GGUF run quantized)
            self.drafts[key] = load_draft(c, self.loaded)
        return DraftModelProposer(c, target=self.loaded, max_model_len=self.max_len, draft=self.drafts[key])


def run_bench(
    loaded: LoadedModel,
    configs: list[SpecConfig],
    workloads: list[str],
    num_prompts: int | None,
    params: SamplingParams,
    seed: int = 0,
    progress=None,  # callable(advance: int, description: str, total: int | None = None) or None
    adaptive: bool = True,
    peers: tuple[str, ...] = (),
    runs: int = 1,
    sweep_k: list[int] | None = None,
    compile: bool = False,
    peer_gguf: str | None = None,
    warn=None,  # callable(message: str): a peer that failed (its rows say so; the bench goes on)
    notice=None,  # callable(message: str): a later turn's answer held to the model's context
    reuse_prefill: bool = False,
    time_drafts: bool = False,
    on_build_error: Callable[[str, SpecConfig, Exception], None] | None = None,
    interleave: str = "steps",
) -> BenchReport:
    """Every prompt by the baseline, each configuration and each peer; ``progress`` is told the total first.

    ``sweep_k``: run every configuration once per k in it (rows share the label, differ in k);
    ``BenchReport.best_k`` then picks the fastest k per method and workload. ``compile``: one-token
    steps through torch.compile (``TargetRunner(compile=True)``). ``reuse_prefill``: a prompt is
    prefilled once (by the baseline); the methods after it take its keys/values over (SpecDecoder's
    ``reuse_prefill``), so their TTFT counts no prefill. ``time_drafts``: every proposer runs in a
    ``DraftTimer`` (the warm-up is not counted) and its row's ``draft`` holds what it measured.
    ``on_build_error(label, config, error)``: a configuration whose proposer cannot be built (a draft
    that does not load) is left out and reported there, instead of the error ending the run.
    ``interleave``: "steps" (the methods in lockstep, a KV cache each) or "prompts" (see the module docstring).
    """
    check_interleave(interleave)
    say = progress or (lambda advance, description, total=None: None)
    tok = loaded.tokenizer
    prompts: dict[str, list[tuple[Request, list[int]]]] = {}
    for w in workloads:
        prompts[w] = [(r, render_prompt(tok, r)) for r in load_workload(w, num_prompts, seed)]
    # every turn's prompt as it is at least (a later turn's, with empty earlier answers), before any run
    check_context(loaded, [(prompt_where(w, req) + (f" turn {len(req.followups) + 1}" if req.followups else ""),
                            len(ids) if not req.followups else
                            len(render_prompt(tok, replace(req, messages=turn_messages(req, [""] * len(req.followups))))))
                           for w, ps in prompts.items() for req, ids in ps], params.max_new_tokens)
    # a later turn holds the earlier answers: room for each, re-tokenized (at most ~2x the tokens made)
    longest = max(len(ids) if not req.followups else
                  len(render_prompt(tok, replace(req, messages=turn_messages(req, [""] * len(req.followups)))))
                  + len(req.followups) * (2 * params.max_new_tokens + 8)
                  for ps in prompts.values() for req, ids in ps)
    if sweep_k:
        variants = [(i, replace(c, num_speculative_tokens=k)) for i, c in enumerate(configs) for k in dict.fromkeys(sweep_k)]
    else:
        variants = list(enumerate(configs))
    max_k = max([v.num_speculative_tokens for _, v in variants], default=0)
    limit = int(loaded.model.args.max_position_embeddings)
    runner = TargetRunner(loaded.model, max_len=longest + params.max_new_tokens + max_k + 8, compile=compile)
    proposers = _Proposers(loaded, runner.max_len, time_drafts)

    def decoder(config: SpecConfig | None, proposer=None) -> SpecDecoder:
        """A fresh decoder: its own pooled acceptance and measured costs, and a fresh proposer (no suffix
        tree of earlier answers, no learnt part order); draft weights stay shared (``_Proposers``)."""
        if config is None:
            return SpecDecoder(runner, reuse_prefill=reuse_prefill)
        return SpecDecoder(runner, proposer or proposers.build(config), config.num_speculative_tokens,
                           adaptive=adaptive, reuse_prefill=reuse_prefill)

    entries = [Entry(BASELINE, None, decoder(None))]
    config_names = config_labels(configs)
    for i, v in variants:
        try:
            proposer = proposers.build(v)
        except Exception as e:  # reported and left out where the caller asks for it
            if on_build_error is None:
                raise
            on_build_error(config_names[i], v, e)
            continue
        entries.append(Entry(config_names[i], v, decoder(v, proposer)))  # warms up, then makes way

    groups = []  # peer engines: each has .peers and .run(peer, ids, max_new_tokens, stop_ids)
    if peers:
        from specctl.bench.peers import ExternalPeers, HFPeers
        from specctl.models import resolve_model

        dt = str(loaded.dtype).removeprefix("torch.")
        drafts: dict[Path, tuple[str, int]] = {}  # one assisted peer per distinct draft, named after it
        for c in configs:
            if c.method == "draft_model":
                drafts.setdefault(resolve_model(c.model, dtype=dt), (draft_name(c.model), c.num_speculative_tokens))
        names = dict(zip(drafts, _unique([n for n, _ in drafts.values()])))
        k = next((c.num_speculative_tokens for c in configs if c.method == "ngram"), 10)
        if "hf" in peers:
            groups.append(HFPeers(loaded.path, loaded.dtype, prompt_lookup_k=k, drafts=[(names[p], p) for p in drafts]))
        if "vllm" in peers:
            # vLLM drafts with the target's tokenizer only
            same = [(names[p], p, dk) for p, (_, dk) in drafts.items()
                    if _same_vocab(loaded.path, p)]
            groups.append(ExternalPeers("vllm", str(loaded.path), loaded.dtype, runner.max_len, k, same))
        if "llama.cpp" in peers:
            if peer_gguf is None:
                raise UsageError("--peer llama.cpp needs the model as a GGUF file",
                                 "pass --peer-gguf model.gguf (e.g. made by llama.cpp's convert_hf_to_gguf.py --outtype bf16)")
            if not Path(peer_gguf).is_file():
                raise UsageError(f"--peer-gguf {peer_gguf} does not exist", "pass the path of a .gguf file")
            groups.append(ExternalPeers("llama.cpp", str(peer_gguf), loaded.dtype, runner.max_len, k))
    inline = [g for g in groups if not getattr(g, "deferred", False)]
    all_peers = [(g, p) for g in groups for p in g.peers]
    deferred_jobs: list[tuple] = []  # run_peer's arguments: run after specctl's rows
    peer_rows: dict[int, list[MethodRun]] = {}  # id(peer) -> its rows so far
    failed: dict[int, str] = {}  # id(peer) -> why it failed: its rows say so, and the run goes on

    def fail(peer, e: Exception) -> None:
        """A peer that fails loses its rows (a part of a run is no figure), not the run: specctl's
        rows are measured, and the other peers go on."""
        msg = str(e) if isinstance(e, UsageError) else f"{type(e).__name__}: {e}"
        failed[id(peer)] = msg
        for run in peer_rows.get(id(peer), []):
            run.error = msg
            run.rep_tokens.clear()
            run.rep_s.clear()
        if warn is not None:
            warn(f"{peer.name}: {msg}")

    def run_peer(g, peer, run, ids, budget, base_res, rep, desc) -> None:
        """One prompt by one peer (up to ``budget`` new tokens), counted in ``run``; nothing once the peer has failed."""
        if id(peer) not in failed:
            say(0, desc)
            try:
                run.add(g.run(peer, ids, budget, loaded.stop_token_ids),
                        base_res if params.greedy else None, rep)
            except Exception as e:  # noqa: BLE001 - any engine failure
                fail(peer, e)
        say(1, desc)

    num_turns = sum(req.num_turns for reqs in prompts.values() for req, _ in reqs)
    total = num_turns * (len(entries) + sum(len(g.peers) for g in groups)) * runs
    say(0, "warm-up", total)
    # warm-up: every decoder once on a short prompt (numba compilation, first-call allocations)
    warm_ids = next(iter(prompts.values()))[0][1][:64]
    for e in entries:
        e.decoder.generate(warm_ids, SamplingParams(max_new_tokens=8, temperature=params.temperature), _gen(seed, loaded.device))
        _draft_timing(e.decoder)  # the warm-up's draft time is not counted
    for g in inline:
        for peer in g.peers:
            try:
                g.run(peer, warm_ids, 8, loaded.stop_token_ids)  # builds the engine (llama.cpp), warms it up
            except Exception as e:  # noqa: BLE001 - any engine failure
                fail(peer, e)

    for e in entries:  # the warm-up's decoders make way for each pass's own (a draft's memory is not held twice)
        e.decoder = None
    proposer = None
    gc.collect()

    runs_out: list[MethodRun] = []
    decs: list[SpecDecoder] = []
    # lockstep: a KV cache per method (the baseline's is the runner above); one after the other where
    # the baseline's prefill is handed over (reuse_prefill) or there is nothing to interleave
    lockstep_runners = ([runner] + [TargetRunner(loaded.model, max_len=runner.max_len, compile=compile) for _ in entries[1:]]
                        if interleave == "steps" and not reuse_prefill and len(entries) > 1 else None)
    for w, reqs in prompts.items():
        # one row per round of a multi-round workload (NAME@R) and per turn of a multi-turn one:
        # acceptance per round / turn is the point
        labels = list(dict.fromkeys(_label(w, req, t) for req, _ in reqs for t in range(1, req.num_turns + 1)))
        wruns = {lab: [MethodRun(e.label, lab, 0 if e.config is None else e.config.num_speculative_tokens,
                                 {} if e.config is None else e.config.to_dict(),
                                 by_proposer={n: SpecStats() for n in part_names(e.config)})
                       for e in entries] for lab in labels}
        peer_runs = {lab: [MethodRun(p.name, lab, p.kwargs.get("prompt_lookup_num_tokens", 0), p.config,
                                     error=failed.get(id(p)))
                           for _, p in all_peers] for lab in labels}
        for lab in labels:
            for (_, p), run in zip(all_peers, peer_runs[lab]):
                peer_rows.setdefault(id(p), []).append(run)
        for rep in range(runs):
            # every pass starts fresh (the warm-up's decoders included): a repetition, or the next
            # workload, does not find earlier answers in a suffix cache, nor start from their acceptance
            decs = []  # the last pass's go first
            decs = [decoder(e.config) for e in entries]
            for req, first_ids in reqs:
                answers: list[str] = []  # the baseline's answer to each turn so far
                for turn in range(1, req.num_turns + 1):
                    # turn t > 1 is asked after the model's own (the baseline's) earlier answers: every
                    # method and peer gets the same prompt ids
                    ids = first_ids if turn == 1 else render_prompt(tok, replace(req, messages=turn_messages(req, answers)))
                    lab, what = _label(w, req, turn), req.id if req.num_turns == 1 else f"{req.id} turn {turn}"
                    budget = params.max_new_tokens if turn == 1 else _turn_budget(
                        f"{prompt_where(w, req)} turn {turn}", len(ids), params.max_new_tokens, limit,
                        runner.max_len - max_k - 8, notice if rep == 0 else None)
                    baseline_res = None
                    jobs = [(dec, ids, replace(params, max_new_tokens=budget, record_margins=e.config is None and params.greedy),
                             _gen(seed, loaded.device)) for e, dec in zip(entries, decs)]
                    if lockstep_runners:
                        say(0, f"{lab} · every method in lockstep · {what}")
                        results = lockstep(jobs, lockstep_runners)
                    for i, (e, dec, run) in enumerate(zip(entries, decs, wruns[lab])):
                        if lockstep_runners:
                            res = results[i]
                        else:
                            say(0, f"{lab} · {e.label} · {what}")
                            res = dec.generate(*jobs[i][1:])
                        if e.config is None:
                            baseline_res = res
                            run.add(res, None, rep)
                        else:
                            run.add(res, baseline_res if params.greedy else None, rep, _draft_timing(dec))
                        say(1, f"{lab} · {e.label} · {what}")
                    for (g, peer), run in zip(all_peers, peer_runs[lab]):
                        job = (g, peer, run, ids, budget, baseline_res, rep, f"{lab} · {peer.name} · {what}")
                        if getattr(g, "deferred", False):
                            deferred_jobs.append(job)
                        else:
                            run_peer(*job)
                    if turn < req.num_turns:
                        answers.append(_answer_text(tok, baseline_res.token_ids, loaded.stop_token_ids))
        for lab in labels:
            runs_out.extend(wruns[lab] + peer_runs[lab])
    # vLLM / llama.cpp: peer by peer (one engine per mode at a time), the same prompts; specctl's
    # drafts and decoders are done with: their memory goes back first (a peer engine reserves its own)
    from specctl.bench.memory import tensor_bytes

    memory = {e.label: tensor_bytes(d.proposer, (loaded.model, runner)) for e, d in zip(entries, decs)}
    if deferred_jobs:
        entries.clear()
        decs = proposers = e = dec = None  # (the loop variables hold the last decoder too)
        gc.collect()
    try:
        for g in groups:
            for peer in g.peers:
                jobs = [j for j in deferred_jobs if j[0] is g and j[1] is peer]
                if jobs:
                    say(0, f"{peer.name} · loading")
                    try:
                        g.run(peer, warm_ids, 8, loaded.stop_token_ids)  # builds the engine, warms it up
                    except Exception as e:  # noqa: BLE001 - any engine failure
                        fail(peer, e)
                for job in jobs:
                    run_peer(*job)
            if hasattr(g, "close"):
                g.close()  # frees its memory before the next engine loads
    finally:
        for g in groups:
            if hasattr(g, "close"):
                g.close()
    header = machine_header(loaded, params.max_new_tokens, params.temperature)
    header["interleave"] = "steps" if lockstep_runners else "prompts"  # what ran, not only what was asked
    if sweep_k:
        header["sweep_k"] = list(dict.fromkeys(sweep_k))
    return BenchReport(header, runs_out, memory)


INTERLEAVE = ("steps", "prompts")


def check_interleave(interleave: str) -> None:
    if interleave not in INTERLEAVE:
        raise UsageError(f"--interleave must be steps or prompts, got {interleave!r}", "pass --interleave steps or --interleave prompts")


def lockstep(jobs: list[tuple], runners: list[TargetRunner]) -> list[GenerationResult]:
    """Run each job (decoder, prompt ids, params, generator) on its own runner, one step each in turn.

    Each one's prefill runs whole, one after the other; then every unfinished request takes one decode
    step (one target forward and its drafting) per round. A result's times are its own: its prefill, and
    the sum of its own steps (never another's), so that every method's tok/s is measured over the same
    stretches of the machine's drifts. Outputs are what ``generate`` gives: the steps are the same."""
    states = [dec.start(ids, p, g, runner=r) for (dec, ids, p, g), r in zip(jobs, runners)]
    own = [0.0] * len(jobs)
    while any(st.finish is None for st in states):
        for i, ((dec, *_), st) in enumerate(zip(jobs, states)):
            if st.finish is None:
                t0 = time.perf_counter()
                dec.step(st)
                own[i] += time.perf_counter() - t0
    out = []
    for (dec, *_), st, s in zip(jobs, states, own):
        res = dec.finish(st)
        res.decode_s = s
        out.append(res)
    return out


def _draft_timing(decoder: SpecDecoder) -> DraftTiming | None:
    """What the decoder's DraftTimer counted since it was last asked (None: its proposer is not timed)."""
    return decoder.proposer.take() if isinstance(decoder.proposer, DraftTimer) else None


def _answer_text(tokenizer, token_ids: list[int], stop_ids) -> str:
    """An answer as the next turn's assistant message: decoded, without the stop token."""
    if token_ids and token_ids[-1] in set(stop_ids):
        token_ids = token_ids[:-1]
    return tokenizer.decode(token_ids, skip_special_tokens=True).strip()


def _unique(names: list[str]) -> list[str]:
    """['a', 'b', 'a'] -> ['a', 'b', 'a#2']."""
    out: list[str] = []
    for n in names:
        lab, i = n, 2
        while lab in out:
            lab, i = f"{n}#{i}", i + 1
        out.append(lab)
    return out


def _gen(seed: int, device) -> torch.Generator:
    """The sampling generator of a request, on the target's device (torch samples there)."""
    return torch.Generator(device=device).manual_seed(seed)


def _label(workload: str, req: Request, turn: int = 1) -> str:
    """The row a request's turn counts in: 'agentic@3' round 2 -> 'agentic@3 r2'; 'mt-bench' turn 2 -> 'mt-bench t2'."""
    r = req.meta.get("round")
    lab = f"{workload} r{r}" if r is not None and "@" in workload else workload
    return f"{lab} t{turn}" if req.num_turns > 1 else lab
