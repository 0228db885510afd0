"""Continuous batching: a request's output does not depend on the batch it runs in.

Requests of different lengths join and leave mid-run (more requests than KV slots); each one's
tokens equal those of the same request run alone: greedy (plain, ngram, suffix) in fp32 and on
every bf16 CPU path, and seeded sampling (its own generator: with the existing statistical test of
rejection sampling, the batched output keeps the target distribution).
"""

from __future__ import annotations

import time

import pytest
import torch

from specctl.config import SpecConfig
from specctl.runtime.decoder import SamplingParams, SpecDecoder
from specctl.modeling import load_transformer
from specctl.runtime.proposers import build_proposer
from specctl.runtime.proposers.base import Draft, DraftBatch, Proposer
from specctl.runtime.runner import TargetRunner
from specctl.runtime.scheduler import Request, Scheduler

MAX_LEN = 160
NEW = [24, 40, 9, 33, 17, 40, 5, 28]  # max_new_tokens per request: they leave at different steps


def _prompts(repetitive_prompts):
    return repetitive_prompts(len(NEW), seed=11)


def _decoder(model, method: str | None, k: int = 4) -> SpecDecoder:
    if method is None:
        return SpecDecoder(TargetRunner(model, MAX_LEN))
    cfg = SpecConfig.from_dict({"method": method, "num_speculative_tokens": k})
    return SpecDecoder(TargetRunner(model, MAX_LEN), build_proposer(cfg, MAX_LEN), k)


def _batched(model, method, prompts, params, slots=3, seeds=None, **kw):
    dec = _decoder(model, method)
    sched = Scheduler(dec, [TargetRunner(model, MAX_LEN) for _ in range(slots)], **kw)
    reqs = [Request(p, pr, seed=None if seeds is None else seeds[i]) for i, (p, pr) in enumerate(zip(prompts, params))]
    return sched.run(reqs), sched


def _alone(model, method, prompts, params, seeds=None):
    out = []
    for i, (p, pr) in enumerate(zip(prompts, params)):
        dec = _decoder(model, method)
        gen = None if seeds is None else torch.Generator().manual_seed(seeds[i])
        out.append(dec.generate(p, pr, gen))
    return out


@pytest.mark.parametrize("method", [None, "ngram", "suffix"])
def test_batched_greedy_equals_each_request_alone_fp32(tiny_model, repetitive_prompts, method):
    prompts = _prompts(repetitive_prompts)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in NEW]
    got, sched = _batched(tiny_model, method, prompts, params)
    want = _alone(tiny_model, None, prompts, params)  # plain greedy: what every method must give
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    # requests joined and left mid-run: the batch grew to the pool's 3 slots and shrank again
    assert max(sched.batch_sizes) == 3 and sched.batch_sizes[-1] < 3
    if method is not None:
        assert sum(r.stats.num_accepted_tokens for r in got) > 10  # drafts were verified in the batch


@pytest.mark.parametrize("method", [None, "ngram"])
def test_batched_greedy_equals_each_request_alone_bf16(tiny_model_factory, repetitive_prompts, bf16_path, method):
    folder = tiny_model_factory("qwen2", initializer_range=0.05, hidden_size=128, intermediate_size=256)
    model = load_transformer(folder, torch.bfloat16)
    prompts = _prompts(repetitive_prompts)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True, record_margins=True) for n in NEW]
    got, _ = _batched(model, method, prompts, params, slots=4)
    want = _alone(model, None, prompts, params)
    for g, w in zip(got, want):
        if bf16_path == "torch" and g.token_ids != w.token_ids:  # the documented weaker guarantee
            i = next(i for i, (a, b) in enumerate(zip(g.token_ids, w.token_ids)) if a != b)
            assert w.margins[i] <= 2 ** -5
        else:
            assert g.token_ids == w.token_ids


@pytest.mark.parametrize("method", [None, "ngram"])
def test_seeded_sampling_in_a_batch_equals_alone(tiny_model, repetitive_prompts, method):
    prompts = _prompts(repetitive_prompts)
    params = [SamplingParams(max_new_tokens=n, temperature=0.8, ignore_eos=True) for n in NEW]
    seeds = list(range(100, 100 + len(NEW)))
    got, _ = _batched(tiny_model, method, prompts, params, slots=4, seeds=seeds)
    want = _alone(tiny_model, method, prompts, params, seeds=seeds)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert len({tuple(r.token_ids) for r in got}) == len(NEW)


def test_disable_by_batch_size_stops_drafting_in_large_batches(tiny_model, repetitive_prompts):
    prompts = _prompts(repetitive_prompts)[:4]
    params = [SamplingParams(max_new_tokens=40, ignore_eos=True) for _ in prompts]
    got, sched = _batched(tiny_model, "ngram", prompts, params, slots=4, disable_by_batch_size=2)
    want = _alone(tiny_model, None, prompts, params)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    # 4 requests of 40 tokens run together: no step drafts while 2 or more run, so every one
    # decodes plainly, one token a step
    assert sched.batch_sizes[0] == 4 and sum(r.stats.num_draft_tokens for r in got) == 0
    assert all(r.num_steps == 39 for r in got)


def test_cancelling_one_request_leaves_the_others_alone(tiny_model, repetitive_prompts):
    prompts = _prompts(repetitive_prompts)[:3]
    params = [SamplingParams(max_new_tokens=30, ignore_eos=True) for _ in prompts]
    sched = Scheduler(_decoder(tiny_model, "ngram"), [TargetRunner(tiny_model, MAX_LEN) for _ in range(3)])
    reqs = [Request(p, pr) for p, pr in zip(prompts, params)]
    for r in reqs:
        sched.add(r)
    tokens = {r.id: [] for r in reqs}
    finish = {}
    for step in range(200):
        for u in sched.step():
            tokens[u.request.id] += u.tokens
            if u.finish:
                finish[u.request.id] = u.finish
        if step == 2:
            sched.cancel(reqs[1])
        if sched.idle:
            break
    want = _alone(tiny_model, None, prompts, params)
    assert finish == {reqs[0].id: "length", reqs[1].id: "abort", reqs[2].id: "length"}
    assert tokens[reqs[0].id] == want[0].token_ids and tokens[reqs[2].id] == want[2].token_ids
    assert tokens[reqs[1].id] == want[1].token_ids[:len(tokens[reqs[1].id])] and len(tokens[reqs[1].id]) < 30


def test_a_failing_request_ends_alone(tiny_model, repetitive_prompts):
    prompts = _prompts(repetitive_prompts)[:2]
    too_long = SamplingParams(max_new_tokens=MAX_LEN)  # prompt + max_new_tokens > the slot's length
    ok = SamplingParams(max_new_tokens=10, ignore_eos=True)
    sched = Scheduler(_decoder(tiny_model, None), [TargetRunner(tiny_model, MAX_LEN) for _ in range(2)])
    bad, good = Request(prompts[0], too_long), Request(prompts[1], ok)
    sched.add(bad)
    sched.add(good)
    ends = {}
    while not sched.idle:
        for u in sched.step():
            if u.finish:
                ends[u.request.id] = (u.finish, u.error)
    assert ends[bad.id][0] == "error" and "max model length" in ends[bad.id][1]
    assert ends[good.id] == ("length", None)


@pytest.mark.parametrize("chunk", [16, 100])
def test_chunked_prefill_never_stalls_the_decodes_and_changes_no_token(tiny_model_factory, repetitive_prompts,
                                                                       bf16_path, chunk):
    """Long prompts join while others decode: every step carries at most one chunk of prompt
    tokens, the running requests emit tokens in every step, and each request's output equals it
    alone with its prompt cut at the same places (bit for bit on the row-independent paths)."""
    folder = tiny_model_factory("qwen2", initializer_range=0.05, hidden_size=128, intermediate_size=256)
    model = load_transformer(folder, torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    short = _prompts(repetitive_prompts)[:2]
    long_ = [torch.randint(6, 128, (n,), generator=g).tolist() for n in (90, 130)]
    prompts = short + long_
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True, record_margins=True) for n in (30, 30, 8, 8)]
    dec = _decoder(model, "ngram")
    sched = Scheduler(dec, [TargetRunner(model, MAX_LEN) for _ in range(4)], max_num_batched_tokens=chunk)
    reqs = [Request(p, pr) for p, pr in zip(prompts, params)]
    for r in reqs[:2]:
        sched.add(r)
    got = {r.id: [] for r in reqs}
    emitted_in_step = []
    while not sched.idle:
        if sched.steps == 3:  # the long prompts arrive while the short ones decode
            sched.add(reqs[2])
            sched.add(reqs[3])
        ups = sched.step()
        for u in ups:
            got[u.request.id] += u.tokens
        emitted_in_step.append({u.request.id for u in ups if u.tokens})
    assert all(rows <= chunk for _, rows in sched.trace)
    assert sum(rows for _, rows in sched.trace) == sum(len(p) for p in prompts)
    prefill_steps = [i for i, (n, rows) in enumerate(sched.trace) if rows and n]
    assert prefill_steps, "no prompt chunk rode along with running decodes"
    for i in prefill_steps:  # a running request got its tokens in that same step
        assert emitted_in_step[i] & {reqs[0].id, reqs[1].id}
    for r, p, pr in zip(reqs, prompts, params):
        want = _decoder(model, None).start(p, pr, prefill_chunk=chunk)
        plain = SpecDecoder(want.runner)
        while want.finish is None:
            plain.step(want)
        if bf16_path == "torch" and got[r.id] != want.out:
            i = next(i for i, (a, b) in enumerate(zip(got[r.id], want.out)) if a != b)
            assert want.margins[i] <= 2 ** -5
        else:
            assert got[r.id] == want.out


def test_adaptive_batch_stays_lossless_and_the_guard_measures_both_modes(tiny_model, repetitive_prompts):
    """An adaptive decoder in a batch: the batch guard switches drafting on and off between steps,
    and every request's greedy output is still the plain one."""
    prompts = _prompts(repetitive_prompts)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in NEW]
    cfg = SpecConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4})
    dec = SpecDecoder(TargetRunner(tiny_model, MAX_LEN), build_proposer(cfg, MAX_LEN), 4, adaptive=True)
    got = Scheduler(dec, [TargetRunner(tiny_model, MAX_LEN) for _ in range(3)]).run(
        [Request(p, pr) for p, pr in zip(prompts, params)])
    want = _alone(tiny_model, None, prompts, params)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert dec._guard._spec and dec._guard._plain  # both modes measured at some batch size


class _WrongDraft(Proposer):
    """Drafts k copies of a token the target never emits next (a draft that is always rejected), and
    records which slots drafted in each call."""

    def __init__(self, vocab_size: int):
        self.calls: list[tuple[int, int]] = []  # (step, slot) of each request's draft
        self.step = 0
        self.V = vocab_size

    def propose(self, requests, ks):
        self.calls += [(self.step, r.slot) for r in requests]
        return DraftBatch([Draft([(int(r.ctx[r.n - 1]) * 7 + 1) % self.V] * k) for r, k in zip(requests, ks)])


@pytest.mark.parametrize("explore", [8, 0])
def test_an_unproven_draft_is_tried_by_one_new_request_a_step(tiny_model, repetitive_prompts, monkeypatch, explore):
    """Requests that decode together with a draft nobody has measured: while the pooled acceptance
    rests on fewer than EXPLORE_POSITIONS positions, at most one request drafts for the first time in
    a step, and a request that has not drafted yet starts from the acceptance pooled so far, so a
    draft that is always rejected is not proven bad by every request (each first draft of a lazy
    draft costs its catch-up over the prompt). Without the rule (0), they all try at once."""
    import specctl.runtime.decoder as decoder_mod
    from specctl.runtime.controller import DRAFT, DraftLengthController

    monkeypatch.setattr(decoder_mod, "EXPLORE_POSITIONS", explore)
    # the costs below hold for the whole run: learned from this machine's timings, a loaded machine's
    # slow steps made drafting look dear to one request and cheap to the next (two first drafts in a step)
    monkeypatch.setattr(DraftLengthController, "observe_costs", lambda self, *a, **k: None)
    # and every step's timing is the same on any machine (the batch guard times steps too): a clock that
    # moves 1 ms a reading
    ticks = iter(range(1, 10**9))
    monkeypatch.setattr(time, "perf_counter", lambda: next(ticks) * 1e-3)
    prompts = _prompts(repetitive_prompts)[:6]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    prop = _WrongDraft(tiny_model.args.vocab_size)
    dec = SpecDecoder(TargetRunner(tiny_model, MAX_LEN), prop, 2, adaptive=True)
    dec._costs.update({t: 0.01 + 1e-5 * t for t in (1, 2, 3, 6, 9, 18)})  # verification is cheap
    dec._costs[DRAFT] = 1e-4  # and so is drafting
    states = []
    for slot, p in enumerate(prompts):  # all prefilled, then decoding together from the same step
        st = dec.begin(p, params, None, TargetRunner(tiny_model, MAX_LEN), slot)
        dec.prefilled(st, len(p), st.runner.run(dec.prefill_tokens(st, len(p)), logits="last"))
        states.append(st)
    while any(st.finish is None for st in states):
        prop.step += 1
        dec.step_batch([st for st in states if st.finish is None])
    want = _alone(tiny_model, None, prompts, [params] * len(prompts))
    assert [dec.finish(st).token_ids for st in states] == [r.token_ids for r in want]
    first: dict[int, int] = {}  # slot -> the step of its first draft
    for step, slot in prop.calls:
        first.setdefault(slot, step)
    per_step = [list(first.values()).count(s) for s in set(first.values())]
    if explore:
        assert max(per_step) == 1 and len(first) < len(prompts)
    else:
        assert max(per_step) == len(prompts)


def test_a_step_that_also_reads_prompt_chunks_teaches_the_controller_no_costs(tiny_model):
    """A decode step that carries another request's prompt chunk takes the chunk's time: were it learned as
    the verification's cost over those rows, a batch's plain step would look ten times dearer than it is (and
    a draft's reading would seem to pay). Only steps without prompt rows are learned; acceptance is
    learned from both."""
    cfg = SpecConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4})
    dec = SpecDecoder(TargetRunner(tiny_model, MAX_LEN), build_proposer(cfg, MAX_LEN), 4, adaptive=True)
    a = dec.start([5, 6, 7, 8, 5, 6, 7], SamplingParams(max_new_tokens=8), runner=TargetRunner(tiny_model, MAX_LEN), slot=0)
    b = dec.begin(list(range(10, 40)), SamplingParams(max_new_tokens=8), runner=TargetRunner(tiny_model, MAX_LEN), slot=1)
    dec.step_batch([a], prefills=[(b, 30)], in_flight=2)
    assert not b.prefilling and a.controller.costs == {} and dec._controller().costs == {}
    dec.step_batch([a, b])
    assert a.controller.costs and all(t < 30 for t in a.controller.costs)


def test_a_step_reads_one_whole_chunk_and_more_prompts_only_while_it_holds_few_tokens(tiny_model):
    """Prompts that arrive together: a step takes the first waiting chunk whole (up to
    max_num_batched_tokens), and the next prompts' chunks only while it holds at most PACK_TOKENS
    prompt tokens, first come first served (a prompt that would pass it waits, a shorter one behind
    it rides along)."""
    from specctl.runtime.scheduler import PACK_TOKENS

    assert PACK_TOKENS == 256
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(6, 128, (n,), generator=g).tolist() for n in (120, 100, 300, 30)]
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    sched = Scheduler(_decoder(tiny_model, None), [TargetRunner(tiny_model, 480) for _ in range(4)],
                      max_num_batched_tokens=2048)
    results = sched.run([Request(p, params) for p in prompts])
    # step 1: 120 + 100 + 30 (300 more would pass 256); step 2: the 300-token prompt whole, in one forward
    assert [rows for _, rows in sched.trace if rows] == [120 + 100 + 30, 300]
    assert [len(r.token_ids) for r in results] == [4] * 4


def test_last_wave_holds_what_would_end_before_the_batch_does_anyway():
    from specctl.runtime.scheduler import last_wave_holds

    assert last_wave_holds([64] * 8, [1.0] * 8) == frozenset()  # level: every request may draft
    assert last_wave_holds([64, 64, 64], [4.0, 4.0, 4.0]) == frozenset()  # all drafting well: all keep on
    # three drafted ahead (50 tokens left, 3 a step) of two that draft nothing (63 left, one a step): the
    # three would end before them even decoding plainly, so their drafts only lengthen the others' steps
    assert last_wave_holds([50, 50, 50, 63, 63], [3.0, 3.0, 3.0, 1.0, 1.0]) == {0, 1, 2}
    assert last_wave_holds([64, 40], [4.0, 1.0]) == frozenset()  # 64 plain steps > 40: drafting ends it sooner
    assert last_wave_holds([30, 40], [4.0, 1.0]) == {0}
    assert last_wave_holds([60], [1.0], [64.0]) == {0}  # a prompt still being read will end after it
    assert last_wave_holds([60], [1.0]) == frozenset()  # alone: it is the batch's end


@pytest.mark.parametrize("closed", [True, False])
def test_an_offline_job_s_last_wave_drafts_only_for_what_sets_its_end(tiny_model, repetitive_prompts, closed):
    """Two requests decoding together, one of 12 tokens, one of 48. In an offline job (``run``: nothing more
    will come) the short one ends long before the other even decoding plainly, so it never drafts; a server
    (open: a slot freed early is the next client's) drafts for both. Greedy output equals plain either way."""
    ps = _prompts(repetitive_prompts)
    prompts = [ps[1], ps[4]]  # alone, n-gram drafts for both within their lengths
    params = [SamplingParams(max_new_tokens=12, ignore_eos=True), SamplingParams(max_new_tokens=48, ignore_eos=True)]
    sched = Scheduler(_decoder(tiny_model, "ngram"), [TargetRunner(tiny_model, MAX_LEN) for _ in range(2)])
    reqs = [Request(p, pr) for p, pr in zip(prompts, params)]
    got = sched.run(reqs, closed=closed)
    assert [r.token_ids for r in got] == [r.token_ids for r in _alone(tiny_model, None, prompts, params)]
    short, long = (r.stats.num_draft_tokens for r in got)
    assert long > 0
    assert (short == 0) if closed else (short > 0)
