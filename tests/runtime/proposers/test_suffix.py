"""SuffixProposer through the SpecDecoder on a tiny in-process llama (fp32, CPU), and on its own.

Invariants: greedy with suffix speculation == greedy without, for several settings, with drafts
accepted; the global cache (previous responses) raises acceptance on a repeated request and
``suffix_decoding_max_cached_requests`` bounds it FIFO (0 disables it); local drafts come from the
prompt and the output so far; drafts are deterministic, vary in length, and never run past
max_model_len.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specctl.config import SpecConfig
from specctl.runtime.decoder import SamplingParams, SpecDecoder
from specctl.modeling import load_transformer
from specctl.runtime.proposers import DraftRequest, build_proposer
from specctl.runtime.proposers.suffix import SuffixProposer
from specctl.runtime.runner import TargetRunner

MAX_LEN = 160
NEW = 40
NEAR_TIE = 1e-4  # see tests/runtime/test_decoder.py: prompts whose greedy path nearly ties are skipped


@pytest.fixture(scope="module")
def loopy_model(tiny_model_factory):
    """A tiny llama with a small init (0.05): its greedy output falls into loops, so drafts get accepted."""
    return load_transformer(tiny_model_factory(seed=1, initializer_range=0.05), torch.float32)


def min_top2_gap(model, prompt: list[int], output: list[int]) -> float:
    logits = TargetRunner(model, len(prompt) + len(output)).forward(torch.tensor([prompt + output]))
    top = logits[0, len(prompt) - 1:-1].topk(2, -1).values
    return float((top[:, 0] - top[:, 1]).min())


@pytest.fixture(scope="module")
def greedy_cases(loopy_model, repetitive_prompts):
    """(prompt, plain greedy output) for >= 20 tie-free prompts."""
    plain = SpecDecoder(TargetRunner(loopy_model, MAX_LEN))
    cases = []
    for prompt in repetitive_prompts(26, seed=5):
        res = plain.generate(prompt, SamplingParams(max_new_tokens=NEW))
        if min_top2_gap(loopy_model, prompt, res.token_ids) >= NEAR_TIE:
            cases.append((prompt, res.token_ids))
    assert len(cases) >= 20
    return cases


def suffix_config(**kw) -> SpecConfig:
    return SpecConfig.from_dict({"method": "suffix", **kw})


def suffix_decoder(model, adaptive: bool = False, **kw) -> SpecDecoder:
    cfg = suffix_config(**kw)
    runner = TargetRunner(model, MAX_LEN)
    return SpecDecoder(runner, build_proposer(cfg, max_model_len=runner.max_len), cfg.num_speculative_tokens,
                       adaptive=adaptive)


# --------------------------------------------------------------------------- registry and config


def test_registered_with_vllm_defaults():
    cfg = suffix_config()
    p = build_proposer(cfg, max_model_len=64)
    assert isinstance(p, SuffixProposer) and p.method == "suffix" and not p.needs_hidden_states
    assert (p.depth, p.max_cached, p.factor, p.min_prob) == (24, 10000, 1.0, 0.1)
    assert cfg.num_speculative_tokens == 16


# --------------------------------------------------------------------------- greedy equality


@pytest.mark.parametrize("settings", [
    {"num_speculative_tokens": 16},
    {"num_speculative_tokens": 4, "suffix_decoding_max_spec_factor": 2.0, "suffix_decoding_max_tree_depth": 8},
    {"num_speculative_tokens": 8, "suffix_decoding_min_token_prob": 0.0, "suffix_decoding_max_cached_requests": 0},
    {"num_speculative_tokens": 1, "suffix_decoding_max_cached_requests": 3},
    {"num_speculative_tokens": 16, "adaptive": True},
], ids=["defaults", "k4-factor2-depth8", "k8-minprob0-noglobal", "k1-cache3", "adaptive-k"])
def test_greedy_speculative_equals_greedy_plain(loopy_model, greedy_cases, settings):
    dec = suffix_decoder(loopy_model, **settings)
    k = dec.k
    drafted = accepted = multi = 0
    lengths = set()
    for prompt, expected in greedy_cases:
        res = dec.generate(prompt, SamplingParams(max_new_tokens=NEW))
        assert res.token_ids == expected, prompt
        s = res.stats
        assert len(res.token_ids) == 1 + res.num_steps + s.num_accepted_tokens
        assert s.num_accepted_tokens <= s.num_draft_tokens <= k * s.num_drafts
        drafted += s.num_draft_tokens
        accepted += s.num_accepted_tokens
        multi += sum(s.num_accepted_tokens_per_pos[1:])
        lengths.add(len(s.num_accepted_tokens_per_pos))
    assert drafted > 0 and accepted > 0
    if k > 1:
        assert multi > 0  # runs of several accepted drafts happened
    assert not dec.proposer.requests  # every request ended
    cached = settings.get("suffix_decoding_max_cached_requests", 10000)
    if cached:
        assert len(dec.proposer.global_tree.live) == min(cached, len(greedy_cases))
    else:
        assert dec.proposer.global_tree is None


# --------------------------------------------------------------------------- the global cache


def test_global_cache_raises_acceptance_on_a_repeated_request(loopy_model, greedy_cases):
    prompt, expected = max(greedy_cases, key=lambda c: len(set(c[1])))  # the least loopy output
    dec = suffix_decoder(loopy_model, num_speculative_tokens=8)
    first = dec.generate(prompt, SamplingParams(max_new_tokens=NEW))
    second = dec.generate(prompt, SamplingParams(max_new_tokens=NEW))
    assert first.token_ids == second.token_ids == expected
    # the second time the whole response is in the global tree: (nearly) every draft is accepted
    assert second.stats.acceptance_rate > first.stats.acceptance_rate
    assert second.stats.num_accepted_tokens > first.stats.num_accepted_tokens
    assert second.num_steps < first.num_steps
    assert second.stats.acceptance_rate > 0.8
    # without the global cache the repeat learns nothing
    off = suffix_decoder(loopy_model, num_speculative_tokens=8, suffix_decoding_max_cached_requests=0)
    a, b = (off.generate(prompt, SamplingParams(max_new_tokens=NEW)) for _ in range(2))
    assert a.stats.to_dict() == b.stats.to_dict() == first.stats.to_dict()


def test_end_request_caches_the_response_fifo():
    p = SuffixProposer(suffix_config(suffix_decoding_max_cached_requests=2), max_model_len=64)
    responses = [[20 + i, 30 + i, 40 + i] for i in range(4)]
    for i, resp in enumerate(responses):
        p.start_request(0, np.array([1, 2, 3], np.int32))
        p.on_verified(0, 0, resp[:1])
        p.on_verified(0, 1, resp[1:])
        p.end_request(0)
        live = [p.global_tree.tokens(s).tolist() for s in p.global_tree.live]
        assert live == responses[max(0, i - 1): i + 1]  # responses only (no prompt), the newest two
    p.end_request(5)  # unknown slot: nothing happens


def test_global_draft_wins_only_with_a_higher_score():
    cfg = suffix_config(num_speculative_tokens=8, suffix_decoding_max_spec_factor=4.0)

    def proposer_with_response(response):
        p = SuffixProposer(cfg, max_model_len=64)
        p.start_request(0, np.array([1], np.int32))
        p.on_verified(0, 0, response)
        p.end_request(0)
        return p

    def propose(p, tokens):
        ctx = np.zeros((1, 64), np.int32)
        ctx[0, :len(tokens)] = tokens
        p.start_request(0, ctx[0, :len(tokens)])
        d = p.propose([DraftRequest(0, ctx[0], len(tokens))], [8])
        assert d.probs is None
        return d[0].ids, p.last_source[0]

    # local "1 5 6": nothing follows 6 (score 0); global "9 5 6 7 8 9": 7 8 9 with probability 1 (score 3)
    assert propose(proposer_with_response([9, 5, 6, 7, 8, 9]), [1, 5, 6]) == ([7, 8, 9], "global")
    # local "5 6 1 2 3 5 6": "5 6" occurs twice, once at the end with nothing after: 1 2 3 5 6 at 1/2
    # each (score 2.5) beats the global tree's 7 (score 1)
    assert propose(proposer_with_response([5, 6, 7]), [5, 6, 1, 2, 3, 5, 6]) == ([1, 2, 3, 5, 6], "local")
    # the same sequence in both trees: equal scores keep the local draft
    assert propose(proposer_with_response([5, 6, 7, 5]), [5, 6, 7, 5]) == ([6, 7, 5], "local")


# --------------------------------------------------------------------------- rows, slots, limits


def test_an_unknown_slot_is_an_error_and_a_changed_context_restarts_its_tree():
    p = SuffixProposer(suffix_config(num_speculative_tokens=4, suffix_decoding_max_cached_requests=0), max_model_len=64)
    ctx = np.zeros((2, 64), np.int32)
    ctx[0, :6] = [1, 2, 3, 1, 2, 3]
    ctx[1, :5] = [7, 8, 7, 8, 7]
    with pytest.raises(KeyError, match="slot 0"):  # never a guess at which request a context is
        p.propose([DraftRequest(0, ctx[0], 6)], [4])
    p.start_request(0, ctx[0, :1])
    p.start_request(1, ctx[1, :1])
    d = p.propose([DraftRequest(0, ctx[0], 6), DraftRequest(1, ctx[1], 5)], [4, 4])
    # row 0: "1 2 3" occurs twice, so the 3-token match drafts 1 2 3 (1/2 each); row 1: "7 8 7" occurs
    # twice (overlapping), its earlier occurrence goes on 8 7; factor 1.0 caps shorter matches' drafts
    assert d.num_tokens.tolist() == [3, 2] and d[0].ids == [1, 2, 3] and d[1].ids == [8, 7]
    assert d.token_ids.tolist() == [[1, 2, 3], [8, 7, -1]]
    # slot 0's context changed under it: its tree restarts from the context
    ctx[0, :4] = [4, 4, 4, 4]
    d = p.propose([DraftRequest(0, ctx[0], 4), DraftRequest(1, ctx[1], 5)], [4, 4])
    assert d[0].ids == [4, 4]  # "4 4" (3x) -> 4 (2/3) -> 4 (2/3 * 1/2)
    assert p.requests[0].tokens().tolist() == [4, 4, 4, 4]


def test_each_request_keeps_its_slot(loopy_model, greedy_cases):
    """Two requests stepped alternately (as the server does), each in its own slot and buffer."""
    cfg = suffix_config(num_speculative_tokens=6)
    runners = [TargetRunner(loopy_model, MAX_LEN) for _ in range(2)]
    dec = SpecDecoder(runners[0], build_proposer(cfg, max_model_len=MAX_LEN), 6)
    (pa, ea), (pb, eb) = greedy_cases[:2]
    sa = dec.start(pa, SamplingParams(max_new_tokens=NEW), runner=runners[0], slot=3)
    sb = dec.start(pb, SamplingParams(max_new_tokens=NEW), runner=runners[1], slot=5)
    while sa.finish is None or sb.finish is None:
        for st in (sa, sb):
            if st.finish is None:
                dec.step(st)
    assert sa.out == ea and sb.out == eb
    assert set(dec.proposer.requests) == {3, 5}
    assert dec.proposer.requests[3].tokens().tolist() == pa + ea
    dec.finish(sa)
    dec.finish(sb)
    assert not dec.proposer.requests and len(dec.proposer.global_tree.live) == 2


def test_draft_never_passes_max_model_len():
    p = SuffixProposer(suffix_config(num_speculative_tokens=8, suffix_decoding_max_spec_factor=8.0), max_model_len=12)
    ctx = np.zeros((1, 12), np.int32)
    ctx[0, :8] = [1, 2, 3, 4, 1, 2, 3, 4]
    p.start_request(0, ctx[0, :1])
    for n, room in [(5, 6), (8, 3), (10, 1), (11, 0)]:
        d = p.propose([DraftRequest(0, ctx[0], n)], [8])
        assert len(d[0]) <= min(room, 8)


# --------------------------------------------------------------------------- the agentic workload
# (the workload that exercises suffix decoding; its tests live here with the method they serve)


def test_agentic_workload_is_one_template_over_real_functions():
    import ast

    from specctl.workloads import AGENTIC_SYSTEM, WORKLOADS, load_workload

    assert "agentic" in WORKLOADS
    reqs = load_workload("agentic", num_prompts=12, seed=0)
    assert len(reqs) == 12 and len({r.id for r in reqs}) == 12
    assert [r.messages for r in reqs] == [r.messages for r in load_workload("agentic", num_prompts=12, seed=0)]
    assert [r.id for r in load_workload("agentic", num_prompts=12, seed=1)] != [r.id for r in reqs]
    for r in reqs:
        system, user = r.messages
        assert r.workload == "agentic" and system == {"role": "system", "content": AGENTIC_SYSTEM}
        assert user["role"] == "user" and user["content"].startswith("Index this function.")
        assert f"Module: {r.meta['module']}\nFunction: {r.meta['function']}" in user["content"]
        assert f"```python\n{r.meta['code']}\n```" in user["content"]  # real code, verbatim
        assert ast.parse(r.meta["code"]).body[0].name == r.meta["function"].split(".")[-1]


def test_rounds_repeat_the_requests_round_after_round(tmp_path):
    from specctl.workloads import load_workload
    from specctl.errors import UsageError

    once = load_workload("agentic", num_prompts=3)
    three = load_workload("agentic@3", num_prompts=3)
    assert [r.id for r in three] == [r.id for r in load_workload("agentic", num_prompts=3, rounds=3)]
    assert len(three) == 9 and len({r.id for r in three}) == 9
    assert [r.meta["round"] for r in three] == [1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert [r.messages for r in three] == [r.messages for r in once] * 3
    assert [r.id for r in three[3:6]] == [f"{r.id}#r2" for r in once]
    assert [r.id for r in load_workload("agentic@1", num_prompts=3)] == [r.id for r in once]
    assert len(load_workload("code-edit@2", num_prompts=2)) == 4  # any workload
    p = tmp_path / "mine.jsonl"
    p.write_text('{"prompt": "hi"}\n')
    assert [r.id for r in load_workload(f"{p}@2")] == ["mine:1#r1", "mine:1#r2"]
    weird = tmp_path / "odd@2"  # an existing path is never split
    weird.write_text('{"prompt": "x"}\n')
    assert len(load_workload(str(weird))) == 1
    for bad in ("agentic@0", "agentc@2"):
        with pytest.raises(UsageError):
            load_workload(bad, num_prompts=1)
    with pytest.raises(UsageError):
        load_workload("agentic@2", num_prompts=1, rounds=3)
