"""method "hybrid": n-gram first, a draft model where it has nothing; lossless, counted per part."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from specctl.config import SpecConfig
from specctl.errors import ConfigError
from specctl.runtime.decoder import SamplingParams, SpecDecoder
from specctl.runtime.proposers import DraftRequest, build_proposer
from specctl.runtime.proposers.hybrid import HybridProposer
from specctl.runtime.loading import load_model
from specctl.runtime.runner import TargetRunner
from specctl.testing import exact_marginals, null_tv_quantile, tv

MAX_LEN = 192


@pytest.fixture(scope="module")
def folders(tiny_model_factory, tmp_path_factory):
    """(target, draft): a tiny llama whose greedy output loops, and a perturbed copy as its draft."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = tiny_model_factory(seed=1, initializer_range=0.05)
    draft = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.02 * p.abs().mean() * torch.randn(p.shape, generator=g))
    out = tmp_path_factory.mktemp("hybrid-draft")
    draft.save_pretrained(out)
    AutoTokenizer.from_pretrained(target).save_pretrained(out)
    return target, out


@pytest.fixture(scope="module")
def target(folders):
    return load_model(folders[0], dtype="float32")


def hybrid(draft_dir, min_match: int = 2, k: int = 4, policy: str = "first") -> SpecConfig:
    return SpecConfig.from_dict({"method": "hybrid", "hybrid_min_match": min_match, "policy": policy, "proposers": [
        {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
        {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 3}]})


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(6, 128, int(rng.integers(5, 12))).tolist() for _ in range(n)]


def test_config_is_validated_with_the_fix_named(folders):
    c = hybrid(folders[1])
    assert c.policy == "first" and c.hybrid_min_match == 2 and c.num_speculative_tokens == 4
    assert [s.method for s in c.sub_configs()] == ["ngram", "draft_model"]
    for bad, needle in ((dict(proposers=[]), "non-empty list"), (dict(proposers=[{"method": "sufix"}]), "did you mean"),
                        (dict(proposers=[{"method": "ngram"}], policy="best"), "unknown hybrid policy"),
                        (dict(proposers=[{"method": "ngram"}], hybrid_min_match=0), "hybrid_min_match"),
                        (dict(proposers=[{"method": "hybrid", "proposers": [{"method": "ngram"}]}]), "itself a hybrid"),
                        (dict(proposers=["ngram"]), "must be a JSON object")):
        with pytest.raises(ConfigError, match=needle):
            SpecConfig.from_dict({"method": "hybrid", **bad})
    with pytest.raises(ConfigError, match="hybrid options"):
        SpecConfig.from_dict({"method": "ngram", "proposers": [{"method": "ngram"}]})


@pytest.fixture
def work_clock(target, monkeypatch):
    """A deterministic clock in place of ``time.perf_counter``: it moves only when a model runs, by a
    fixed cost per forward and per row (the target 0.02 s + 1 ms a row; the draft model 0.3 of that, as
    a 0.5B drafting for a 1.5B). ``score`` then weighs the parts alike on a loaded CI machine and alone
    (on real time, a loaded machine once made the draft model look nearly free: n-gram drafted once)."""
    from types import SimpleNamespace

    clock = SimpleNamespace(t=0.0)
    run = TargetRunner.run

    def charged(self, tokens, *a, **kw):
        clock.t += (0.02 + 0.001 * tokens.shape[1]) * (1.0 if self.model is target.model else 0.3)
        return run(self, tokens, *a, **kw)

    monkeypatch.setattr(TargetRunner, "run", charged)
    monkeypatch.setattr("time.perf_counter", lambda: clock.t)
    return clock


@pytest.mark.parametrize("policy", ["first", "score", "tree"])
def test_greedy_equals_plain_with_both_parts_drafting_and_counted(target, folders, policy, work_clock):
    """Copying fires where the output repeats what came before, the draft model drafts elsewhere
    (or, policy tree, both drafts go in one tree): the output is plain greedy's, each part's
    drafts and acceptances are counted to it (one part per step: they add up to the request's
    totals). Between its drafts the draft model falls behind (the n-gram steps' tokens) and catches
    up; the output stays exact."""
    prop = build_proposer(hybrid(folders[1], policy=policy), MAX_LEN, target=target)
    assert isinstance(prop, HybridProposer) and prop.names == ["ngram", "draft_model"]
    sources = []  # per verified step: the parts credited with it
    inner = prop.credit

    def spy(*a, **kw):
        out = inner(*a, **kw)
        sources.append("+".join(out))
        return out

    prop.credit = spy
    prop.clock = time.perf_counter  # the work clock (the hybrid kept the real one when it was built)
    spec = SpecDecoder(TargetRunner(target.model, MAX_LEN), prop, 4)
    plain = SpecDecoder(TargetRunner(target.model, MAX_LEN))
    totals = {}
    for p in _prompts(8, 0):
        sp = SamplingParams(max_new_tokens=48, ignore_eos=True)
        sources.clear()
        want, got = plain.generate(p, sp), spec.generate(p, sp)
        assert got.token_ids == want.token_ids
        parts = got.by_proposer
        if policy != "tree":
            assert sum(s.num_drafts for s in parts.values()) == got.stats.num_drafts
            assert sum(s.num_draft_tokens for s in parts.values()) == got.stats.num_draft_tokens
            assert sum(s.num_accepted_tokens for s in parts.values()) == got.stats.num_accepted_tokens
        else:  # a part's accepted tokens are the accepted path's agreement with its own draft
            assert all(s.num_accepted_tokens <= got.stats.num_accepted_tokens for s in parts.values())
            totals["merged"] = totals.get("merged", 0) + sources.count("ngram+draft_model")
        for name, s in parts.items():
            t = totals.setdefault(name, [0, 0])
            t[0] += s.num_drafts
            t[1] += s.num_accepted_tokens
        # the model drafted after n-gram steps it sat out: it caught up and stayed exact
        if "ngram" in sources and "draft_model" in sources[sources.index("ngram"):] and policy != "tree":
            totals["caught_up"] = totals.get("caught_up", 0) + 1
    assert totals["ngram"][0] > 10 and totals["draft_model"][0] > 10  # each part drafted on some steps
    assert totals["ngram"][1] > 0 and totals["draft_model"][1] > 0  # and had drafts accepted
    if policy == "tree":
        assert totals["merged"] > 10  # steps whose tree held both parts' drafts
    else:
        assert totals.get("caught_up", 0) >= 2


def test_min_match_decides_who_drafts(target, folders):
    """hybrid_min_match 1: n-gram wins every step it has any match; a very high one hands every
    step to the draft model (the last part drafts at any length)."""
    p = _prompts(1, 3)[0]
    sp = SamplingParams(max_new_tokens=40, ignore_eos=True)
    want = SpecDecoder(TargetRunner(target.model, MAX_LEN)).generate(p, sp).token_ids
    counts = {}
    for m in (1, 99):
        prop = build_proposer(hybrid(folders[1], min_match=m), MAX_LEN, target=target)
        got = SpecDecoder(TargetRunner(target.model, MAX_LEN), prop, 4).generate(p, sp)
        assert got.token_ids == want
        counts[m] = {n: s.num_drafts for n, s in got.by_proposer.items()}
    assert counts[99].get("ngram", 0) == 0 and counts[99]["draft_model"] > 0
    assert counts[1].get("ngram", 0) > counts[99].get("ngram", 0)


def test_batched_greedy_equals_plain(target, folders, run_batched):
    prompts = _prompts(6, 5)
    sp = SamplingParams(max_new_tokens=32, ignore_eos=True)
    plain = SpecDecoder(TargetRunner(target.model, MAX_LEN))
    dec = SpecDecoder(TargetRunner(target.model, MAX_LEN), build_proposer(hybrid(folders[1]), MAX_LEN, target=target), 4)
    sizes = {}  # part -> the number of requests in each of its calls
    for i, part in enumerate(dec.proposer.subs):
        def counted(requests, ks, _orig=part.propose, _i=i):
            sizes.setdefault(_i, []).append(len(requests))
            return _orig(requests, ks)
        part.propose = counted
    got = run_batched(dec, prompts, [sp] * len(prompts), slots=3)
    assert [r.token_ids for r in got] == [plain.generate(p, sp).token_ids for p in prompts]
    assert {n for r in got for n in r.by_proposer} == {"ngram", "draft_model"}
    # a part drafts for every request that asks it in a step in one call (the draft model: one batched forward)
    assert max(sizes[0]) > 1 and max(sizes[1]) > 1


@pytest.mark.parametrize("which,policy", [("ngram", "first"), ("draft_model", "first"), ("draft_model", "score"),
                                          ("draft_model", "tree")])
def test_sampling_keeps_the_target_distribution(target, folders, which, policy):
    """Sampled with each part drafting (a prompt n-gram matches, one it does not): tokens 2 and 3
    emitted are distributed exactly as plain sampling's (exact marginals by enumeration; the
    threshold is the 99.9% quantile of a correct sampler's TV with as many samples). A sampled
    request under policy tree gets chains (trees are verified greedily)."""
    temperature, N = 0.1, 800
    if which == "ngram":  # the model's own loop, so n-gram matches at once
        x = _prompts(1, 9)[0]
        prompt = x + SpecDecoder(TargetRunner(target.model, MAX_LEN)).generate(
            x, SamplingParams(max_new_tokens=30, ignore_eos=True)).token_ids
    else:
        prompt = list(range(10, 19))  # no repeated pair: nothing for n-gram
    prop = build_proposer(hybrid(folders[1], k=2, policy=policy), MAX_LEN, target=target)
    spec = SpecDecoder(TargetRunner(target.model, MAX_LEN), prop, 2)
    params = SamplingParams(max_new_tokens=4, temperature=temperature, ignore_eos=True)
    (_, m2, m3), dropped = exact_marginals(target.model, prompt, temperature, depth=3)
    assert dropped < 0.01, dropped
    V = target.model.args.vocab_size
    sec, third = torch.zeros(V), torch.zeros(V)
    drafts, acc = {}, 0
    for i in range(N):
        res = spec.generate(prompt, params, torch.Generator().manual_seed(i))
        sec[res.token_ids[1]] += 1
        third[res.token_ids[2]] += 1
        for n, s in res.by_proposer.items():
            drafts[n] = drafts.get(n, 0) + s.num_draft_tokens
            acc += s.num_accepted_tokens if n == which else 0
    assert drafts.get(which, 0) > N // 2, drafts  # the part under test made the first step's draft
    assert 0.05 < acc / drafts[which] < 0.98, acc / drafts[which]  # accepted and recovered tokens both occur
    assert tv(sec / N, m2) < null_tv_quantile(m2, N) + dropped
    assert tv(third / N, m3) < null_tv_quantile(m3, N) + dropped


def test_merge_tree_shares_prefixes():
    from specctl.runtime.proposers.base import Draft
    from specctl.runtime.proposers.hybrid import merge_tree

    chain, other = Draft([5, 6, 7]), Draft([5, 9])
    tree = Draft([5, 8, 6, 4], None, [-1, -1, 0, 2])  # 5 > 6 > 4, and 8
    tokens, parents = merge_tree([chain, other, tree])
    assert tokens == [5, 6, 7, 9, 8, 4] and parents == [-1, 0, 1, 0, -1, 1]


def _measure(prop, i: int, plain_s: float, per_row_s: float, draft_s: float, rows: int = 5) -> None:
    """Part i's controller learns a plain step, a verification over ``rows`` tokens and its own drafting."""
    c = prop.parts[i].acceptance
    for _ in range(3):
        c.observe_costs(0, 1, plain_s)
        c.observe_costs(rows - 1, rows, plain_s + per_row_s * (rows - 1) + draft_s, draft_s)


def test_score_asks_the_best_measured_part_first(target, folders):
    """Policy score: a part never measured is tried once a plain step is measured; after that the parts whose
    draft beats a plain step go first by expected accepted tokens per second of a step, and a part that does
    not is not asked."""
    prop = build_proposer(hybrid(folders[1], policy="score"), MAX_LEN, target=target)
    assert prop.chooses_draft_length and prop._order(4, 0) == []  # no step measured: nothing to weigh a draft by
    prop.observe_step(0, 0, 1, 0.05, 0.0)  # a plain step
    assert prop._order(4, 0) == [(0, 4), (1, 3)]  # both unmeasured: in order
    _measure(prop, 0, 0.05, 0.001, 1e-5)
    _measure(prop, 1, 0.05, 0.001, 0.02, rows=4)
    for _ in range(20):  # n-gram's drafts rejected at once, the model's accepted three deep
        prop.parts[0].observe(4, 0)
        prop.parts[1].observe(3, 3)
    assert [i for i, _ in prop._order(4, 0)] == [1]  # n-gram cannot pay now (it probes later)
    for _ in range(40):  # n-gram right too: free and as good, it goes first again
        prop.parts[0].observe(4, 4)
    assert [i for i, _ in prop._order(4, 0)] == [0, 1]
    for _ in range(40):  # the model rejected: its 0.4 of a plain step per draft never pays
        prop.parts[1].observe(3, 0)
    assert [i for i, _ in prop._order(4, 0)] == [0]


def test_score_asks_a_probing_part_first(target, folders):
    """A part written off (n-gram's drafts rejected) probes now and then, and its probe is asked before a part
    that pays and always drafts (which would otherwise win every step, so that the probe never ran); the
    probes come further apart while they fail."""
    prop = build_proposer(hybrid(folders[1], policy="score"), MAX_LEN, target=target)
    _measure(prop, 0, 0.05, 0.001, 1e-5)
    _measure(prop, 1, 0.05, 0.001, 0.02, rows=4)
    for _ in range(20):
        prop.parts[0].observe(4, 0)
        prop.parts[1].observe(3, 3)
    firsts = [prop._order(4, 0)[0][0] for _ in range(200)]
    probes = [j for j, i in enumerate(firsts) if i == 0]
    assert len(probes) >= 3 and all(i == 1 for j, i in enumerate(firsts) if j not in probes)
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps == sorted(gaps) and gaps[-1] > gaps[0], gaps  # the wait doubles while the probes fail


class _CostlyDraft:
    """A deterministic stand-in for a draft model that never wins: each call charges the clock for its
    drafting and for the context it must catch up on first, reading a prompt charges per token, and
    its drafts are always wrong."""

    method, reads_prompt, needs_hidden_states, aux_layers, learns_across_requests = "draft_model", True, False, (), False
    draft_cost = 0.3

    def __init__(self, clock, read_s: float = 0.0005):
        """``read_s``: seconds a context token read (a fortieth of the simulation's plain step, as
        Qwen2.5-Coder-0.5B reads for the 1.5B on a CPU)."""
        self.clock, self.read, self.n, self.charged, self.prompt_tokens_read = clock, {}, {}, 0.0, 0
        self.read_s = read_s

    def _charge(self, s):
        self.clock.t += s
        self.charged += s

    def start_request(self, slot, prompt_ids):
        self.read[slot], self.n[slot] = 0, len(prompt_ids)

    def on_prefill(self, slot, upto, batch=1):
        self._charge(self.read_s * (upto - self.read[slot]))
        self.prompt_tokens_read += upto - self.read[slot]
        self.read[slot] = upto

    def backlog(self, slot):
        return self.n[slot] - self.read[slot]

    def catch_up_seconds(self, slot):
        return self.read_s * self.backlog(slot)  # what reading it charges (a real draft model measures its reads)

    def propose(self, requests, ks):
        from specctl.runtime.proposers.base import Draft, DraftBatch

        (r,), (k,) = requests, ks
        self._charge(0.015 * k + self.read_s * self.backlog(r.slot))
        self.read[r.slot] = self.n[r.slot]
        return DraftBatch([Draft([1] * k)])  # token 1 never comes

    def on_verified(self, slot, num_accepted, emitted):
        self.n[slot] += len(emitted)

    def set_sampling(self, *a): pass
    def bind_target(self, *a): pass
    def end_request(self, slot): pass
    def on_target_hidden(self, *a): pass


class _RightDraft(_CostlyDraft):
    """A stand-in draft model that is always right (it knows the text) and reads nothing."""

    def __init__(self, clock, text):
        super().__init__(clock, 0.0)
        self.text = text

    def propose(self, requests, ks):
        from specctl.runtime.proposers.base import Draft, DraftBatch

        (r,), (k,) = requests, ks
        return DraftBatch([Draft(self.text[r.n:r.n + k])])


def test_a_written_off_free_part_is_measured_in_the_shadow(target):
    """n-gram written off (its drafts rejected) behind a model part that drafts every step: n-gram still
    drafts each step unverified, its drafts are scored on the tokens the step emits, and once they prove right
    it is asked first again (before this, it waited for probes, each further apart)."""
    from types import SimpleNamespace

    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    prop = HybridProposer(SpecConfig.from_dict({"method": "hybrid", "proposers": [ngram, ngram]}), target=target,
                          max_model_len=MAX_LEN + 600, clock=lambda: 0.0)
    text = list(range(10, 23)) * 12
    prop.subs[1] = _RightDraft(SimpleNamespace(t=0.0), text)
    prop.parts[1] = type(prop.parts[1])(4, 0.3)
    _measure(prop, 0, 0.05, 0.001, 1e-5)
    _measure(prop, 1, 0.05, 0.001, 0.02)
    for _ in range(20):
        prop.parts[0].observe(4, 0)
        prop.parts[1].observe(4, 4)
    ctx = np.array([text], dtype=np.int32)
    n = 40
    prop.start_request(0, ctx[0, :n])
    prop.set_sampling(0, SamplingParams(max_new_tokens=100))
    prop.on_prefill(0, n)
    firsts = []
    for _ in range(20):
        firsts.append(prop._order(4, 0)[0][0])
        d = prop.propose([DraftRequest(0, ctx[0], n)], [4])
        nd = int(d.num_tokens[0])
        emitted = text[n:n + nd + 1]
        prop.credit(0, nd, nd, emitted)
        prop.on_verified(0, nd, emitted)
        n += len(emitted)
    assert firsts[0] == 1 and firsts[-3:] == [0, 0, 0], firsts


def test_an_unmeasured_model_part_reads_one_request_prompt_at_a_time(target):
    """Requests arriving together: the unmeasured model part reads the first one's prompt only (to be measured
    on it), not all of theirs; if that request ends before it drafted, the next new prompt is read instead."""
    from types import SimpleNamespace

    ngram = {"method": "ngram", "num_speculative_tokens": 4}
    prop = HybridProposer(SpecConfig.from_dict({"method": "hybrid", "proposers": [ngram, ngram]}), target=target,
                          max_model_len=MAX_LEN + 600, clock=lambda: 0.0)
    prop.subs[1] = costly = _CostlyDraft(SimpleNamespace(t=0.0))
    prop.parts[1] = type(prop.parts[1])(3, costly.draft_cost)
    prop.reads_prompt = True
    for slot in (0, 1, 2):
        prop.start_request(slot, np.arange(100, 150, dtype=np.int32))
        prop.on_prefill(slot, 50)
    assert costly.prompt_tokens_read == 50 and costly.read == {0: 50, 1: 0, 2: 0}
    prop.end_request(0)
    prop.start_request(3, np.arange(100, 140, dtype=np.int32))
    prop.on_prefill(3, 40)
    assert costly.read[3] == 40 and costly.read[1] == costly.read[2] == 0


def _simulate(prop, clock, requests: int = 10, new: int = 120) -> float:
    """Decode ``requests`` repetitive texts through ``prop`` as the decoder does, charging the clock
    0.02 s a plain step and 0.001 s a verified row beyond it; returns the clock's total."""
    from specctl.runtime.proposers.ngram import NgramProposer  # noqa: F401 (the real n-gram part)

    rng = np.random.default_rng(0)
    for r in range(requests):
        pattern = [10 + (7 * r + j) % 50 for j in range(13)]
        text = []
        while len(text) < 600:  # the pattern, and now and then new text n-gram lookup cannot draft
            text += pattern * 2 + rng.integers(60, 128, 6).tolist()
        prompt = text[:60]
        ctx = np.zeros((1, MAX_LEN + 600), dtype=np.int32)
        ctx[0, :len(prompt)] = prompt
        n = len(prompt)
        prop.start_request(0, ctx[0, :n])
        prop.set_sampling(0, SamplingParams(max_new_tokens=new))
        prop.on_prefill(0, n)
        while n < len(prompt) + new:
            t0 = clock.t
            d = prop.propose([DraftRequest(0, ctx[0], n)], [4])
            draft_s = clock.t - t0
            nd = int(d.num_tokens[0])
            drafted = d.token_ids[0, :nd].tolist()
            acc = 0
            while acc < nd and drafted[acc] == text[n + acc]:
                acc += 1
            emitted = text[n:n + acc + 1]
            clock.t += 0.02 + 0.001 * nd
            prop.credit(0, nd, acc, emitted)
            prop.observe_step(0, nd, nd + 1, clock.t - t0, draft_s)
            prop.on_verified(0, acc, emitted)
            ctx[0, n:n + len(emitted)] = emitted
            n += len(emitted)
        prop.end_request(0)
    return clock.t


def test_a_model_part_that_never_wins_costs_about_nothing(target):
    """A hybrid of n-gram and a draft model whose drafts are never accepted (a deterministic cost
    stand-in, not a timing) spends within a few percent of n-gram alone: the model is measured, found
    not to pay, not asked again but for rare probes, and stops reading the later requests' prompts."""
    from types import SimpleNamespace

    def config(parts):
        return SpecConfig.from_dict({"method": "hybrid", "proposers": parts})

    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    clock_a = SimpleNamespace(t=0.0)
    alone = HybridProposer(config([ngram]), target=target, max_model_len=MAX_LEN + 600, clock=lambda: clock_a.t)
    t_alone = _simulate(alone, clock_a)

    for read_s in (0.0005, 0.002):
        clock_b = SimpleNamespace(t=0.0)
        both = HybridProposer(config([ngram, ngram]), target=target, max_model_len=MAX_LEN + 600, clock=lambda: clock_b.t)
        both.subs[1] = costly = _CostlyDraft(clock_b, read_s)
        both.parts[1] = type(both.parts[1])(3, costly.draft_cost)
        both.reads_prompt = True
        t_both = _simulate(both, clock_b)
        # unmeasured, it read the first prompt in the prefill, was tried (where n-gram had nothing) and
        # measured, at either reading cost; found not to pay, it never followed a later request's prompt
        assert costly.charged > 0, (read_s, costly.charged)
        assert t_both <= 1.03 * t_alone, (t_both, t_alone, costly.charged)
        assert costly.prompt_tokens_read == 60, costly.prompt_tokens_read




def test_a_model_part_reads_a_new_prompt_only_where_it_pays_back_against_the_best_other_part(target):
    """A draft-model part that wins and pays follows a new request's prompt (200 tokens, 0.2 s of its reading)
    only where its drafts are expected to save more than that over the request's max_tokens against the best
    other part: not where n-gram drafts as well and cheaper, nor over 4 new tokens (a deterministic cost
    stand-in, not a timing)."""
    from types import SimpleNamespace

    from specctl.runtime.controller import DRAFT

    ngram = {"method": "ngram", "num_speculative_tokens": 4}
    prop = HybridProposer(SpecConfig.from_dict({"method": "hybrid", "proposers": [ngram, ngram]}), target=target,
                          max_model_len=MAX_LEN + 600, clock=lambda: 0.0)
    prop.subs[1] = costly = _CostlyDraft(SimpleNamespace(t=0.0), read_s=0.001)
    prop.parts[1] = type(prop.parts[1])(4, costly.draft_cost)
    prop.reads_prompt = True
    model = prop.parts[1]
    model.acceptance.costs.update({1: 0.02, 5: 0.021, DRAFT: 0.002})
    for _ in range(50):
        model.observe(4, 4)  # every draft of the model accepted
    model.won = prop._steps = 1

    def reads(slot: int, ngram_accepts: int, new: int) -> bool:
        prop.parts[0] = part = type(prop.parts[0])(4, 0.0)
        part.acceptance.costs.update({1: 0.02, 5: 0.021, DRAFT: 1e-5})
        for _ in range(50):
            part.observe(4, ngram_accepts)
        prop.set_sampling(slot, SamplingParams(max_new_tokens=new))
        prop.start_request(slot, np.arange(100, 300, dtype=np.int32))
        prop.on_prefill(slot, 200)
        return costly.read[slot] == 200

    assert reads(0, 0, 128)  # n-gram finds nothing: ~1.8 s saved against plain, more than 0.2 s of reading
    assert not reads(1, 4, 128)  # n-gram drafts as well, at no cost: nothing to save against it
    assert not reads(2, 0, 4)  # 4 new tokens cannot pay a 200-token prompt's reading back


class _UnreadDraft(_CostlyDraft):
    """The costly stand-in before it has read anything: its reading is not measured yet."""

    def catch_up_seconds(self, slot):
        return None


def _unread_hybrid(target):
    """A hybrid of n-gram and the costly stand-in before it has read anything, and ``reads(slot, n, batch, new)``:
    whether a new request of an n-token prompt and ``new`` max_tokens, among ``batch``, has its prompt read."""
    from types import SimpleNamespace

    ngram = {"method": "ngram", "num_speculative_tokens": 4}
    prop = HybridProposer(SpecConfig.from_dict({"method": "hybrid", "proposers": [ngram, ngram]}), target=target,
                          max_model_len=4200, clock=lambda: 0.0)
    prop.subs[1] = costly = _UnreadDraft(SimpleNamespace(t=0.0))
    prop.parts[1] = model = type(prop.parts[1])(4, costly.draft_cost)
    prop.reads_prompt = True

    def reads(slot: int, n: int, batch: int, new: int = 512) -> bool:
        prop.set_sampling(slot, SamplingParams(max_new_tokens=new))
        prop.start_request(slot, np.arange(100, 100 + n, dtype=np.int32))
        prop.on_prefill(slot, n, batch)
        return costly.read[slot] == n

    return prop, costly, model, reads


def test_in_a_batch_an_unmeasured_model_part_reads_only_a_prompt_its_size_says_pays_back(target):
    """Eight requests in flight, the model part never measured (neither its drafting nor its reading): it is
    not made to read the first long prompt to be measured, as it is alone; it reads a prompt only where its
    size's estimate of the reading (READ_PRIOR of its cost hint per token) is paid back over the request's
    max_tokens at its prior's value, and until a plain step is measured it reads none (a deterministic cost
    stand-in, not a timing)."""
    from specctl.runtime.controller import READ_PRIOR

    prop, costly, model, reads = _unread_hybrid(target)
    assert not reads(0, 40, 8) and model.explorer is None  # no plain step measured: nothing to weigh by
    prop.parts[0].acceptance.costs.update({1: 0.02, 5: 0.021})
    for _ in range(50):
        prop.parts[0].observe(4, 0)  # n-gram finds nothing: the model part is weighed against plain steps
    model.acceptance.costs.update({1: 0.02, 5: 0.021})
    c = model.acceptance
    saved = 512 * c.plain_step_s(8) * (1 - 1 / c.best_value(8))
    assert 4000 * READ_PRIOR * costly.draft_cost * 0.02 > saved > 40 * READ_PRIOR * costly.draft_cost * 0.02
    assert not reads(1, 4000, 8) and model.explorer is None  # a long document: its reading would not pay back
    assert reads(2, 40, 8) and model.explorer == 2  # a short prompt: it does, and it is measured on it
    assert not reads(3, 40, 8)  # one request at a time measures it
    prop.end_request(2)
    # alone too, once a plain step is measured, the same weighing (at one request, where a verification costs less)
    alone = c.plain_step_s(1) * (1 - 1 / c.best_value(1))
    assert 512 * alone > 2000 * READ_PRIOR * costly.draft_cost * 0.02 > 64 * alone
    assert not reads(4, 2000, 1, new=64) and model.explorer is None  # 64 new tokens do not pay a document's reading
    assert reads(5, 2000, 1) and model.explorer == 5  # 512 do


def test_alone_before_anything_is_measured_a_model_part_explores_on_a_prompt_whose_reading_is_a_small_share(target):
    """The first request a hybrid ever sees, nothing measured: its unmeasured draft model reads the prompt to be
    measured on it only where its size's estimate of the reading (READ_PRIOR of its cost hint a token) is at most
    EXPLORE_READ of the request's max_tokens; a 3,000-token document for 128 new tokens is not read, and the next
    short prompt is (a deterministic cost stand-in, not a timing)."""
    from specctl.runtime.controller import READ_PRIOR
    from specctl.runtime.proposers.hybrid import EXPLORE_READ

    prop, costly, model, reads = _unread_hybrid(target)
    assert 3000 * READ_PRIOR * costly.draft_cost > EXPLORE_READ * 128 > 100 * READ_PRIOR * costly.draft_cost
    assert not reads(0, 3000, 1, new=128) and model.explorer is None and costly.charged == 0
    prop.end_request(0)
    assert reads(1, 100, 1, new=128) and model.explorer == 1


def test_each_request_is_drafted_for_by_its_own_acceptance(target, folders):
    """A part that pays on most requests (pooled) stops drafting for one whose text its drafts miss, as the
    decoder's own controller is per request; a request not yet drafted for follows the pooled record."""
    prop = build_proposer(hybrid(folders[1], policy="score"), MAX_LEN, target=target)
    _measure(prop, 0, 0.05, 0.01, 1e-5)  # a verified row costs a fifth of a plain step
    _measure(prop, 1, 0.05, 0.01, 0.02, rows=4)
    for _ in range(20):  # n-gram right on requests 0 and 2, the model's drafts rejected
        prop.parts[0].observe(4, 4, 0)
        prop.parts[0].observe(4, 4, 2)
        prop.parts[1].observe(3, 0)
    for _ in range(6):  # request 1: n-gram's drafts rejected at once
        prop.parts[0].observe(4, 0, 1)
    assert prop.parts[0].acceptance.best_len() > 0  # pooled, it still pays
    assert [i for i, _ in prop._order(4, 0)] == [0] and [i for i, _ in prop._order(4, 3)] == [0]
    assert prop._order(4, 1) == []  # not for request 1
    prop.end_request(1)
    assert [i for i, _ in prop._order(4, 1)] == [0]  # the slot's next request starts from the pooled record


def test_a_model_part_must_beat_what_the_request_s_lookup_has_been_giving(target, folders):
    """Where n-gram has been quoting a request's prompt (its own record there beats the model's draft), the model is
    not asked when n-gram finds nothing: the plain step is followed by n-gram's next quote, which the model's tokens
    would only take over at a forward's cost. On a request where n-gram misses, the model drafts."""
    prop = build_proposer(hybrid(folders[1], policy="score"), MAX_LEN, target=target)
    _measure(prop, 0, 0.05, 0.001, 1e-5)
    _measure(prop, 1, 0.05, 0.001, 0.02, rows=4)
    for _ in range(20):
        prop.parts[0].observe(4, 4, 0)  # request 0: n-gram quotes
        prop.parts[0].observe(4, 0, 1)  # request 1: n-gram misses
        prop.parts[1].observe(3, 3)  # the model: right, at 0.4 of a plain step a draft
    assert prop.parts[1].acceptance.best_value() > 1.0  # the model beats a plain step
    assert [i for i, _ in prop._order(4, 0)] == [0]  # not n-gram's record on request 0
    assert prop._order(4, 1)[0][0] == 1  # but on request 1, first


def test_in_a_batch_catching_up_weighs_in_the_request_s_share_of_a_step(target, folders):
    """A part's catching up stalls the whole step, so in a batch of B it counts in the request's share of a plain
    step (a / B + b), not in a step alone: the same seconds weigh more, and an unmeasured model part that would be
    tried alone (catching up within EXPLORE_CATCH_UP steps) is not tried among 8 requests."""
    from specctl.runtime.proposers.hybrid import EXPLORE_CATCH_UP

    prop = build_proposer(hybrid(folders[1], policy="score"), MAX_LEN, target=target)
    part, sub = prop.parts[1], prop.subs[1]
    for _ in range(3):  # a step of one row 50 ms, each further row 2 ms: a request's share among 8 is 8 ms
        part.acceptance.observe_costs(0, 1, 0.05)
        part.acceptance.observe_costs(0, 5, 0.058)
    assert part.acceptance._draft_cost() is None  # the model part has not drafted yet
    assert part.catch_up_steps(100, 0.1, 1) == pytest.approx(2.0)
    assert part.catch_up_steps(100, 0.1, 8) == pytest.approx(12.5)
    sub.backlog, sub.catch_up_seconds = (lambda slot: 100), (lambda slot: 0.1)
    assert 2.0 <= EXPLORE_CATCH_UP < 12.5
    prop._batch[0] = 1
    assert 1 in [i for i, _ in prop._order(4, 0)]  # alone: tried, to be measured
    prop._batch[0] = 8
    assert 1 not in [i for i, _ in prop._order(4, 0)]  # among 8: its reading would stall every request's step
