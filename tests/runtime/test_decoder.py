"""SpecDecoder end to end on a tiny in-process llama (fp32, CPU).

Invariants: greedy with ngram speculation == greedy without (for several k and lookup sizes), and
that == transformers' ``generate(do_sample=False)``; stop tokens and max_new_tokens end generation
with the right finish_reason, also when a stop token lands inside a run of accepted drafts; sampling
is reproducible from a seed; and stochastic speculative decoding keeps the target distribution
(the 2nd and 3rd emitted tokens' empirical distributions match the exact marginals, computed by
enumerating prefixes with batched forwards).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specctl.config import SpecConfig
from specctl.errors import UsageError
from specctl.runtime.decoder import SamplingParams, SpecDecoder
from specctl.modeling import load_transformer
from specctl.runtime.proposers import Draft, Proposer, build_proposer
from specctl.runtime.runner import TargetRunner
from specctl.testing import emitted_histograms, exact_marginals, null_tv_quantile, tv

MAX_LEN = 160
NEW = 40
# Greedy equality is exact only away from ties: a [1, d] and a [1+k, d] forward round differently
# (~1e-6 on these logits), so prompts whose greedy path has a top-2 logit gap below this are skipped.
NEAR_TIE = 1e-4
NGRAM_SETTINGS = [(1, 1, 1), (3, 1, 3), (5, 2, 4), (8, 1, 8)]  # (k, prompt_lookup_min, prompt_lookup_max)


@pytest.fixture(scope="module")
def loopy_dir(tiny_model_factory):
    """A tiny llama with a small init (0.05): its greedy output falls into loops, so ngram drafts get accepted."""
    return tiny_model_factory(seed=1, initializer_range=0.05)


@pytest.fixture(scope="module")
def loopy_model(loopy_dir):
    return load_transformer(loopy_dir, torch.float32)


def ngram_decoder(runner: TargetRunner, k: int, min_n: int, max_n: int) -> SpecDecoder:
    cfg = SpecConfig.from_dict({"method": "ngram", "num_speculative_tokens": k,
                                "prompt_lookup_min": min_n, "prompt_lookup_max": max_n})
    return SpecDecoder(runner, build_proposer(cfg, max_model_len=runner.max_len), cfg.num_speculative_tokens)


def min_top2_gap(model, prompt: list[int], output: list[int]) -> float:
    """Smallest top1 - top2 logit gap over the positions that chose ``output`` greedily."""
    logits = TargetRunner(model, len(prompt) + len(output)).forward(torch.tensor([prompt + output]))
    top = logits[0, len(prompt) - 1:-1].topk(2, -1).values
    return float((top[:, 0] - top[:, 1]).min())


@pytest.fixture(scope="module")
def greedy_cases(loopy_model, repetitive_prompts):
    """(prompt, plain greedy output) for >= 20 tie-free repetitive prompts."""
    plain = SpecDecoder(TargetRunner(loopy_model, MAX_LEN))
    cases = []
    for prompt in repetitive_prompts(28, seed=0):
        res = plain.generate(prompt, SamplingParams(max_new_tokens=NEW))
        assert res.finish_reason == "length" and len(res.token_ids) == NEW
        assert res.num_steps == NEW - 1 and res.stats.num_drafts == 0  # plain: one token per step
        if min_top2_gap(loopy_model, prompt, res.token_ids) >= NEAR_TIE:
            cases.append((prompt, res.token_ids))
    assert len(cases) >= 20
    return cases


# --------------------------------------------------------------------------- greedy


@pytest.mark.parametrize("k,min_n,max_n", NGRAM_SETTINGS)
def test_greedy_speculative_equals_greedy_plain(loopy_model, greedy_cases, k, min_n, max_n):
    spec = ngram_decoder(TargetRunner(loopy_model, MAX_LEN), k, min_n, max_n)
    drafted = accepted = multi = 0
    for prompt, expected in greedy_cases:
        res = spec.generate(prompt, SamplingParams(max_new_tokens=NEW))
        assert res.token_ids == expected, prompt
        assert res.finish_reason == "length"
        s = res.stats
        # every step emits accepted + 1 tokens: the first token came from the prefill
        assert len(res.token_ids) == 1 + res.num_steps + s.num_accepted_tokens
        assert s.num_accepted_tokens <= s.num_draft_tokens <= k * s.num_drafts
        drafted += s.num_draft_tokens
        accepted += s.num_accepted_tokens
        multi += sum(s.num_accepted_tokens_per_pos[1:])
    assert drafted > 0 and accepted > 0
    if k > 1:
        assert multi > 0  # runs of several accepted drafts (then a bonus token) happened


def test_plain_greedy_equals_transformers_generate(loopy_dir, loopy_model, greedy_cases):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(loopy_dir, dtype=torch.float32).eval()
    for prompt, expected in greedy_cases[:6]:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW,
                              eos_token_id=None, pad_token_id=0)
        assert out[0, len(prompt):].tolist() == expected


def test_decoder_reuse_equals_fresh_decoder(loopy_model, greedy_cases):
    """A decoder (runner, context buffer) reused across requests leaks nothing between them."""
    spec = ngram_decoder(TargetRunner(loopy_model, MAX_LEN), 4, 1, 3)
    long_prompt, _ = max(greedy_cases, key=lambda c: len(c[0]))
    spec.generate(long_prompt, SamplingParams(max_new_tokens=NEW))
    for prompt, expected in greedy_cases[:3]:
        assert spec.generate(prompt, SamplingParams(max_new_tokens=NEW)).token_ids == expected


# --------------------------------------------------------------------------- stopping


@pytest.mark.parametrize("speculative", [False, True])
def test_stop_token_ends_generation(loopy_model, greedy_cases, speculative):
    runner = TargetRunner(loopy_model, MAX_LEN)
    dec = ngram_decoder(runner, 5, 1, 3) if speculative else SpecDecoder(runner)
    checked = 0
    for prompt, full in greedy_cases[:8]:
        for stop_at in (0, 3, 11, 25):
            stop = full[stop_at]
            first = full.index(stop)
            unused = next(t for t in range(128) if t not in full)  # a second stop id that never shows up
            res = dec.generate(prompt, SamplingParams(max_new_tokens=NEW, stop_token_ids=(unused, stop)))
            assert res.finish_reason == "stop"
            assert res.token_ids == full[:first + 1]  # the stop token is emitted, nothing after it
            ignored = dec.generate(prompt, SamplingParams(max_new_tokens=NEW, stop_token_ids=(stop,), ignore_eos=True))
            assert ignored.finish_reason == "length" and ignored.token_ids == full
            checked += 1
    assert checked == 32


class ScriptedProposer(Proposer):
    """Drafts the next k tokens of a known continuation; with ``wrong=True`` every draft is off by one.

    A mock proposer with designed drafts (nanochat's MockModel habit): all-accepted or all-rejected
    steps on demand, whatever the model.
    """

    method = "scripted"

    def __init__(self, prompt_len: int, continuation: list[int], wrong: bool = False):
        self.prompt_len, self.continuation, self.wrong = prompt_len, continuation, wrong

    def draft_one(self, r, k) -> Draft:
        done = r.n - self.prompt_len  # tokens emitted so far
        ids = self.continuation[done:done + k]
        if self.wrong:
            ids = [(t + 1) % 128 for t in ids]
        return Draft(ids)


@pytest.mark.parametrize("wrong", [False, True], ids=["all-accepted", "all-rejected"])
def test_scripted_drafts_keep_greedy_output(loopy_model, greedy_cases, wrong):
    prompt, full = greedy_cases[0]
    k = 4
    dec = SpecDecoder(TargetRunner(loopy_model, MAX_LEN), ScriptedProposer(len(prompt), full, wrong), k)
    res = dec.generate(prompt, SamplingParams(max_new_tokens=NEW))
    assert res.token_ids == full
    s = res.stats
    if wrong:
        assert s.num_accepted_tokens == 0 and res.num_steps == NEW - 1
    else:
        assert s.num_accepted_tokens == s.num_draft_tokens  # every draft accepted, a bonus each step
        assert res.num_steps == -(-(NEW - 1) // (k + 1))
        assert s.num_accepted_tokens_per_pos[0] == s.num_drafts > 0
        assert sum(s.num_accepted_tokens_per_pos) == s.num_accepted_tokens


def test_stop_token_inside_accepted_drafts(loopy_model, greedy_cases):
    """A stop token in the middle of a step's accepted run cuts the output right after it."""
    k = 4
    found = 0
    for prompt, full in greedy_cases[:10]:
        dec = SpecDecoder(TargetRunner(loopy_model, MAX_LEN), ScriptedProposer(len(prompt), full), k)
        # steps emit tokens 1..5, 6..10, ...: positions 1..4 (mod 5) are accepted drafts, 5 the bonus
        for pos in range(1, NEW):
            if (pos - 1) % (k + 1) in (0, 2) and full[pos] not in full[:pos]:
                res = dec.generate(prompt, SamplingParams(max_new_tokens=NEW, stop_token_ids=(full[pos],)))
                assert res.finish_reason == "stop" and res.token_ids == full[:pos + 1], pos
                assert res.stats.num_accepted_tokens >= (pos - 1) % (k + 1)
                found += 1
    assert found >= 5


@pytest.mark.parametrize("speculative", [False, True])
@pytest.mark.parametrize("max_new", [1, 2, 7, 13])
def test_max_new_tokens_ends_generation(loopy_model, greedy_cases, speculative, max_new):
    runner = TargetRunner(loopy_model, MAX_LEN)
    dec = ngram_decoder(runner, 6, 1, 3) if speculative else SpecDecoder(runner)
    for prompt, full in greedy_cases[:4]:
        res = dec.generate(prompt, SamplingParams(max_new_tokens=max_new))
        assert res.finish_reason == "length"
        assert res.token_ids == full[:max_new]  # never more than max_new_tokens, even mid-run of drafts


def test_length_and_empty_prompt_errors(loopy_model):
    dec = SpecDecoder(TargetRunner(loopy_model, 32))
    with pytest.raises(UsageError, match="max model length"):
        dec.generate([5] * 20, SamplingParams(max_new_tokens=13))
    assert len(dec.generate([5] * 20, SamplingParams(max_new_tokens=12)).token_ids) == 12  # exactly fits
    with pytest.raises(ValueError):
        dec.generate([], SamplingParams(max_new_tokens=4))


def test_speculation_fits_in_max_len_at_the_edge(loopy_model, greedy_cases):
    """prompt + max_new_tokens == max_len: drafting must never write past the cache."""
    prompt, full = greedy_cases[0]
    runner = TargetRunner(loopy_model, len(prompt) + NEW)
    res = ngram_decoder(runner, 8, 1, 8).generate(prompt, SamplingParams(max_new_tokens=NEW))
    assert res.token_ids == full and runner.length <= runner.max_len


# --------------------------------------------------------------------------- sampling


@pytest.mark.parametrize("speculative", [False, True])
def test_sampling_is_deterministic_given_a_seed(loopy_model, greedy_cases, speculative):
    runner = TargetRunner(loopy_model, MAX_LEN)
    dec = ngram_decoder(runner, 4, 1, 3) if speculative else SpecDecoder(runner)
    prompt = greedy_cases[0][0]
    params = SamplingParams(max_new_tokens=24, temperature=0.8, top_k=50, top_p=0.95)

    def run(seed):
        return dec.generate(prompt, params, torch.Generator().manual_seed(seed)).token_ids

    a = run(0)
    assert run(0) == a and len(a) == 24
    assert any(run(s) != a for s in (1, 2, 3))


def test_seeded_sampling_with_deterministic_drafts_equals_seeded_plain_sampling(loopy_model, greedy_cases):
    """Each position's token is drawn from its own keyed uniform (rejection.coupled_verify), so a seed gives
    the same tokens whatever drafts, k or draft-length controller ran, and some drafts are accepted."""
    runner = TargetRunner(loopy_model, MAX_LEN)
    params = SamplingParams(max_new_tokens=32, temperature=0.3)  # cool enough that the loops repeat
    suffix = SpecConfig.from_dict({"method": "suffix", "num_speculative_tokens": 6})
    decoders = [ngram_decoder(runner, k, 1, 3) for k in (1, 3, 6)] + [
        SpecDecoder(runner, build_proposer(SpecConfig.from_dict({"method": "ngram", "num_speculative_tokens": 5,
                                                                 "prompt_lookup_min": 1, "prompt_lookup_max": 3}),
                                           max_model_len=MAX_LEN), 5, adaptive=True),
        SpecDecoder(runner, build_proposer(suffix, max_model_len=MAX_LEN), 6)]
    plain = SpecDecoder(runner)
    accepted = 0
    for seed, (prompt, _) in enumerate(greedy_cases[:4]):
        want = plain.generate(prompt, params, torch.Generator().manual_seed(seed)).token_ids
        for dec in decoders:
            res = dec.generate(prompt, params, torch.Generator().manual_seed(seed))
            assert res.token_ids == want
            accepted += res.stats.num_accepted_tokens
    assert accepted > 0
    assert plain.generate(greedy_cases[0][0], params, torch.Generator().manual_seed(99)).token_ids != \
        plain.generate(greedy_cases[0][0], params, torch.Generator().manual_seed(0)).token_ids


def test_keyed_sampling_follows_the_distribution():
    """sample_with_uniforms at keyed_uniforms: the empirical distribution matches p (TV under the 99.9 %
    null bound), never a zero-probability token, and a position's draw depends on (key, position) only."""
    from specctl.runtime.rejection import keyed_uniforms, sample_with_uniforms

    p = torch.tensor([0.5, 0.0, 0.2, 0.25, 0.05, 0.0])
    n = 20000
    u = keyed_uniforms(7, 0, n)
    x = sample_with_uniforms(p.expand(n, -1), u)
    hist = torch.bincount(x, minlength=6).double() / n
    assert hist[1] == 0 and hist[5] == 0
    assert tv(hist, p.double()) < null_tv_quantile(p.double(), n)
    assert torch.equal(keyed_uniforms(7, 100, 5), u[100:105]) and not torch.equal(keyed_uniforms(8, 100, 5), u[100:105])


def test_stochastic_speculation_keeps_the_target_distribution(loopy_model):
    """Sampling with ngram drafts emits tokens distributed exactly as plain sampling (arXiv 2211.17192).

    The reference is exact: the marginals of the 2nd and 3rd tokens under plain sampling, computed by
    enumerating prefixes. The prompt is chosen (deterministically, among a few candidates) so that
    ngram's drafts are accepted often, so accepted, recovered and bonus tokens all occur. With
    max_new_tokens 4 and k 3 the first step verifies 2 drafts: the 2nd token is an accepted draft
    or a recovered token, the 3rd any of accepted / recovered / bonus / a later step's token.
    The threshold is the 99.9% quantile of the TV a correct sampler shows with as many samples;
    a verifier that recovers from p instead of norm(max(p - q, 0)) lands ~2-3x above it.
    """
    temperature, N, K = 0.1, 1000, 3
    V = loopy_model.args.vocab_size
    plain = SpecDecoder(TargetRunner(loopy_model, MAX_LEN))
    spec = ngram_decoder(TargetRunner(loopy_model, MAX_LEN), K, 1, 3)
    params = SamplingParams(max_new_tokens=4, temperature=temperature)
    candidates = []
    for seed in range(5):
        x = np.random.default_rng(seed).integers(6, 128, 6).tolist()
        candidates.append(x + plain.generate(x, SamplingParams(max_new_tokens=40)).token_ids)  # it loops

    def acceptance(prompt):
        s = [spec.generate(prompt, params, torch.Generator().manual_seed(10_000 + i)).stats for i in range(40)]
        return sum(x.num_accepted_tokens for x in s) / max(1, sum(x.num_draft_tokens for x in s))

    prompt = max(candidates, key=acceptance)
    (_, m2, m3), dropped = exact_marginals(loopy_model, prompt, temperature, depth=3)
    assert dropped < 0.01

    sec, third, drafted, accepted = emitted_histograms(spec, prompt, params, N, V)
    assert 0.2 < accepted / drafted < 0.95, accepted / drafted  # both accepts and rejections happen
    assert tv(sec, m2) < null_tv_quantile(m2, N) + dropped, tv(sec, m2)
    assert tv(third, m3) < null_tv_quantile(m3, N) + dropped, tv(third, m3)

    # the same check on plain sampling: the reference itself is what plain decoding samples
    sec, third, drafted, _ = emitted_histograms(plain, prompt, SamplingParams(max_new_tokens=3, temperature=temperature), N, V)
    assert drafted == 0
    assert tv(sec, m2) < null_tv_quantile(m2, N) + dropped
    assert tv(third, m3) < null_tv_quantile(m3, N) + dropped


def test_reuse_prefill_takes_over_the_prompt(tiny_model):
    """A second decoder on the same runner takes the prompt's keys/values over: no prompt forward, the
    same tokens; a different prompt, or a forward that overwrote the prompt, is prefilled again."""
    runner = TargetRunner(tiny_model, MAX_LEN)
    ng = build_proposer(SpecConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1).validated(), MAX_LEN)
    plain = SpecDecoder(runner, reuse_prefill=True)
    spec = SpecDecoder(runner, ng, 3, reuse_prefill=True)
    prompt, other = list(range(10, 40)), list(range(40, 70))
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    want = SpecDecoder(TargetRunner(tiny_model, MAX_LEN), ng, 3).generate(prompt, params).token_ids
    widths = []
    run = runner.run
    runner.run = lambda tokens, *a, **kw: (widths.append(tokens.shape[1]), run(tokens, *a, **kw))[1]
    plain.generate(prompt, params)
    assert widths[0] == len(prompt)
    widths.clear()
    assert spec.generate(prompt, params).token_ids == want
    assert max(widths) <= 4  # decode/verify forwards only: the prompt was taken over
    widths.clear()
    spec.generate(other, params)
    assert widths[0] == len(other)  # another prompt: prefilled
    runner.reset()
    runner.forward(torch.tensor([[1, 2, 3]]))  # writes below the kept prompt
    widths.clear()
    spec.generate(other, params)
    assert widths[0] == len(other)


def test_a_draft_tree_s_measured_costs_are_every_request_s(loopy_model):
    """As the forward's costs, what a tree step of each depth was measured to cost is shared by the decoder's
    requests: a new request does not explore every depth again (a depth-5 tree step costs ~3 plain steps)."""
    dec = SpecDecoder(TargetRunner(loopy_model, 64), build_proposer(SpecConfig.from_dict({"method": "ngram"}), 64), 4)
    first, second = dec._controller(), dec._controller()
    first.observe(0, 0, 1, 0.1)
    first.observe(3, 1, 17, 0.28, None, 16)
    assert second.tree_rows == {3: 17} and second.tree_costs[3] == pytest.approx(2.8)


class WideTreeProposer(ScriptedProposer):
    """A tree of 16 nodes every step whatever k: the true continuation down one branch, wrong siblings beside it."""

    def draft_one(self, r, k) -> Draft:
        done = r.n - self.prompt_len
        ids, parents = [], []
        for depth, t in enumerate(self.continuation[done:done + 4]):
            for j in range(4):
                ids.append(t if j == 0 else (t + j) % 128)
                parents.append(-1 if depth == 0 else 4 * (depth - 1))
        return Draft(ids, None, parents)


def test_a_draft_tree_near_the_cache_s_end_is_cut_to_what_fits(loopy_model, greedy_cases):
    """A tree wider than the room left in the cache (Medusa's auto tree of 16 at the last tokens of a request)
    keeps its first nodes (parents come first) instead of failing the request; the output stays greedy's."""
    prompt, full = greedy_cases[0]
    dec = SpecDecoder(TargetRunner(loopy_model, len(prompt) + NEW), WideTreeProposer(len(prompt), full), 4)
    res = dec.generate(prompt, SamplingParams(max_new_tokens=NEW))
    assert res.finish_reason != "error" and res.token_ids == full
