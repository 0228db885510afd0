"""sparse_attn (self-speculation over a subset of the target's own KV cache): greedy output equals
plain greedy output for both algorithms (fp32, bf16 on every CPU path, with skipped layers, in a
batch); drafting leaves the real cache bit for bit unchanged; with the whole cache selected the draft
is the target itself (every draft accepted); StreamingLLM's and Vegas's selections on hand-built
cases; the recorded attention scores never change the forward; sampling keeps the target's
distribution; bad keys get one-line errors."""

from __future__ import annotations

import pytest
import torch

from specctl.config import SpecConfig
from specctl.errors import ConfigError, UsageError
from specctl.runtime.decoder import SamplingParams, SpecDecoder
from specctl.modeling import attention_scores
from specctl.runtime.proposers import build_proposer
from specctl.runtime.proposers.sparse_attn import (SINK_TOKENS, draft_budget, streamingllm_positions,
                                                   vegas_positions)
from specctl.runtime.loading import load_model
from specctl.runtime.runner import TargetRunner
from specctl.testing import emitted_histograms, exact_marginals, null_tv_quantile, tv

MAX_LEN = 256
ALGOS = ("streamingllm", "vegas")


def config(algo: str, k: int = 4, min_tokens: int = 8, ratio: float = 0.1, **kw) -> SpecConfig:
    return SpecConfig(method="sparse_attn", num_speculative_tokens=k, sparse_attn_algorithm=algo,
                      sparse_attn_ratio=ratio, sparse_attn_min_tokens=min_tokens, **kw).validated()


@pytest.fixture(scope="module")
def target(tiny_model_factory):
    # a model whose attention is peaked enough that a sparse draft agrees with it often
    return load_model(tiny_model_factory("qwen2", seed=3, initializer_range=0.3), dtype="float32")


def prompts(n: int, length: int = 60, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        base = torch.randint(6, 128, (12,), generator=g).tolist()
        out.append((base * 8)[:length])  # loops: the recent window and the top positions carry it
    return out


def decoders(target, cfg, max_len=MAX_LEN):
    runner = TargetRunner(target.model, max_len)
    prop = build_proposer(cfg, max_len, target=target)
    return SpecDecoder(runner), SpecDecoder(runner, prop, cfg.num_speculative_tokens), prop


@pytest.mark.parametrize("algo", ALGOS)
def test_greedy_equals_plain(target, algo):
    plain, spec, _ = decoders(target, config(algo))
    drafted = accepted = 0
    for p in prompts(6):
        params = SamplingParams(max_new_tokens=40, ignore_eos=True)
        got = spec.generate(p, params)
        assert got.token_ids == plain.generate(p, params).token_ids
        drafted += got.stats.num_draft_tokens
        accepted += got.stats.num_accepted_tokens
    assert drafted > 0 and 0 < accepted < drafted, (accepted, drafted)  # the sparse draft is right, not always


def test_skipping_layers_stays_lossless(target):
    plain, spec, prop = decoders(target, config("streamingllm", sparse_attn_skip_layers=[1]))
    assert prop.layers == [0]
    for p in prompts(3, seed=5):
        params = SamplingParams(max_new_tokens=30, ignore_eos=True)
        assert spec.generate(p, params).token_ids == plain.generate(p, params).token_ids


@pytest.mark.parametrize("algo", ALGOS)
def test_whole_cache_selected_is_the_target_itself(target, algo):
    """A budget covering the whole context: the draft is the target's own greedy continuation."""
    plain, spec, _ = decoders(target, config(algo, min_tokens=MAX_LEN))
    for p in prompts(3, seed=2):
        got = spec.generate(p, SamplingParams(max_new_tokens=30, ignore_eos=True))
        assert got.stats.num_accepted_tokens == got.stats.num_draft_tokens > 0


@pytest.mark.parametrize("algo", ALGOS)
def test_drafting_leaves_the_real_cache_unchanged(target, algo):
    _, spec, prop = decoders(target, config(algo))
    p = prompts(1, length=80)[0]
    st = spec.start(p, SamplingParams(max_new_tokens=20, ignore_eos=True))
    spec.step(st)  # one verification (Vegas then ranks by its scores)
    runner = st.runner
    k0, v0, n0 = runner.cache.k.clone(), runner.cache.v.clone(), runner.length
    d = prop.propose([st.draft_request()], [4])
    assert int(d.num_tokens[0]) == 4
    assert torch.equal(runner.cache.k, k0) and torch.equal(runner.cache.v, v0) and runner.length == n0
    assert prop.slots[st.slot].selected < n0  # it did attend to a subset


def test_streamingllm_window():
    assert streamingllm_positions(100, 30).tolist() == list(range(SINK_TOKENS)) + list(range(86, 100))
    assert streamingllm_positions(100, 10).tolist() == list(range(10))  # the budget is all sinks
    assert streamingllm_positions(20, 30).tolist() == list(range(20))  # everything fits
    assert draft_budget(4096, 0.05, 256) == 256 and draft_budget(16384, 0.05, 256) == 820
    assert draft_budget(100, 0.05, 256) == 100


def test_vegas_takes_the_top_scored_positions_and_the_recent_ones():
    scores = torch.zeros(2, 40)
    scores[0, [3, 17, 9, 30]] = torch.tensor([5.0, 4.0, 3.0, 2.0])
    scores[1, [1, 2, 25]] = torch.tensor([1.0, 9.0, 3.0])
    scores[:, 36:] = 100.0  # beyond the ranked range: not candidates (they come in as recent)
    sel = vegas_positions(scores, valid=36, length=39, budget=3)
    assert sel[0].tolist() == [3, 9, 17, 36, 37, 38]
    assert sel[1].tolist() == [1, 2, 25, 36, 37, 38]
    assert vegas_positions(scores, valid=4, length=6, budget=5)[0].tolist() == [0, 1, 2, 3, 4, 5]


def test_scores_are_attention_weights_and_change_nothing(target):
    """Recording scores leaves every output bit for bit as it was; each recorded row's weights sum to
    one per query head (over rows and heads: 2 * heads); a one-row decode step records nothing."""
    model, a = target.model, target.model.args
    ids = torch.tensor([prompts(1, length=72)[0]])
    outs = []
    for keep in (False, True):
        runner = TargetRunner(model, MAX_LEN)
        outs.append((runner.run(ids[:, :64], logits="last", scores=keep).logits,))
        assert (runner.cache.scores is not None) == keep  # asked for, or not there at all
        if keep:
            assert runner.cache.scored == 64  # a prompt: every position is ranked
        outs[-1] += (runner.run(ids[:, 64:69], scores=keep).logits,)
        if keep:
            before = runner.cache.scores.clone()
        outs[-1] += (runner.run(ids[:, 69:70], scores=keep).logits,)  # a plain decode step
    assert all(torch.equal(x, y) for x, y in zip(outs[0], outs[1]))
    cache = runner.cache
    assert torch.equal(cache.scores, before) and cache.scored == 65  # the verify block's first row and before
    torch.testing.assert_close(cache.ranking(69).sum(-1), torch.full((a.num_layers,), 2.0 * a.num_heads))
    # one layer's scores against attention computed directly from the cached keys
    x = model.embed(ids[:, 64:69])
    cos, sin = model.rope(64, 5, x.dtype)
    ref = attention_scores(model.layers[0], x, cos, sin, cache.k[0], 64)
    torch.testing.assert_close(cache.scores[0, :, :, :69], ref)


def test_fused_kernel_writes_the_same_scores(tiny_model_factory):
    """On the fused CPU path the attention kernel writes the weights while it attends (no second pass):
    the same as the recomputed ones to bf16 rounding, and the outputs unchanged bit for bit."""
    from specctl.kernels import cpu, decode_layer
    from specctl.modeling import Segment

    if decode_layer.load() is None:
        pytest.skip(cpu.why_not(cpu.AMX, built=False))
    loaded = load_model(tiny_model_factory("qwen2", seed=3, initializer_range=0.3, hidden_size=128,
                                           intermediate_size=256, num_attention_heads=4, num_key_value_heads=2),
                        dtype="bfloat16")
    model = loaded.model
    assert all(b.fused for b in model.layers)
    ids = torch.tensor(prompts(1, length=100)[0])
    out = []
    for keep in (False, True):
        runner = TargetRunner(model, MAX_LEN)
        runner.forward(ids[None, :90], logits="last")
        seg = Segment(runner.cache, 90, 6, runner.segment(ids[None, 90:96]).mask)
        out.append(model.forward_ragged(ids[90:96], [seg], scores=keep)[0])
    assert torch.equal(out[0], out[1])
    cache = runner.cache
    assert cache.scored == 91
    torch.testing.assert_close(cache.ranking(96).sum(-1), torch.full((model.args.num_layers,), 2.0 * model.args.num_heads),
                               rtol=1e-3, atol=1e-3)
    # the recomputed weights of layer 0 (its input: the embeddings)
    x = model.embed(ids[None, 90:96])
    cos, sin = model.rope(90, 6, x.dtype)
    ref = attention_scores(model.layers[0], x, cos, sin, cache.k[0], 90)
    torch.testing.assert_close(cache.scores[0, :, :, :96], ref, rtol=0.1, atol=0.02)  # q rounds differently
    # a request alone (runner.forward) takes the same kernel path
    got = []
    for keep in (False, True):
        runner = TargetRunner(model, MAX_LEN)
        got.append((runner.run(ids[None, :90], logits="last", scores=keep).logits,
                    runner.run(ids[None, 90:96], scores=keep).logits))
    assert all(torch.equal(x, y) for x, y in zip(*got))
    torch.testing.assert_close(runner.cache.scores[:, :, :, :96], cache.scores[:, :, :, :96])


def test_batched_equals_alone(target, run_batched):
    plain, spec, _ = decoders(target, config("vegas"))
    ps = prompts(6, seed=7)
    params = [SamplingParams(max_new_tokens=24 + 3 * i, ignore_eos=True) for i in range(6)]
    got = run_batched(spec, ps, params, slots=3)
    for p, pr, r in zip(ps, params, got):
        assert r.token_ids == plain.generate(p, pr).token_ids


def test_greedy_equals_plain_in_bf16(tiny_model_factory, bf16_path):
    target = load_model(tiny_model_factory("qwen2", seed=3, initializer_range=0.3), dtype="bfloat16")
    runner = TargetRunner(target.model, MAX_LEN)
    for algo in ALGOS:
        cfg = config(algo)
        plain, spec = SpecDecoder(runner), SpecDecoder(runner, build_proposer(cfg, MAX_LEN, target=target), 4)
        for p in prompts(3, seed=9):
            want = plain.generate(p, SamplingParams(max_new_tokens=30, ignore_eos=True, record_margins=True))
            got = spec.generate(p, SamplingParams(max_new_tokens=30, ignore_eos=True))
            if bf16_path == "torch" and got.token_ids != want.token_ids:  # the documented weaker guarantee
                i = next(i for i, (x, y) in enumerate(zip(got.token_ids, want.token_ids)) if x != y)
                assert want.margins[i] <= 2 ** -5
            else:
                assert got.token_ids == want.token_ids


def test_sampling_keeps_the_target_distribution(target):
    temperature, N = 0.4, 800
    cfg = config("vegas", k=2, min_tokens=12, ratio=0.05)
    spec = SpecDecoder(TargetRunner(target.model, MAX_LEN), build_proposer(cfg, MAX_LEN, target=target), 2)
    prompt = prompts(1, length=24, seed=4)[0]
    (_, m2, m3), dropped = exact_marginals(target.model, prompt, temperature, depth=3)
    assert dropped < 0.01, dropped
    params = SamplingParams(max_new_tokens=4, temperature=temperature, ignore_eos=True)
    sec, third, drafted, accepted = emitted_histograms(spec, prompt, params, N, target.model.args.vocab_size)
    assert 0.05 < accepted / drafted < 0.98, accepted / drafted  # accepted and recovered tokens both occur
    assert tv(sec, m2) < null_tv_quantile(m2, N) + dropped
    assert tv(third, m3) < null_tv_quantile(m3, N) + dropped


@pytest.mark.parametrize("cfg,needle", [
    ({"sparse_attn_algorithm": "quest"}, "unknown sparse_attn_algorithm 'quest'"),
    ({"sparse_attn_ratio": 1.5}, "sparse_attn_ratio must be in (0.0, 1.0]"),
    ({"sparse_attn_ratio": 0}, "sparse_attn_ratio must be in (0.0, 1.0], got 0"),
    ({"sparse_attn_min_tokens": 0}, "sparse_attn_min_tokens must be >= 1"),
    ({"sparse_attn_skip_layers": [1, 1]}, "sparse_attn_skip_layers must be a list of distinct"),
    ({"sparse_attn_skip_layers": "some"}, "sparse_attn_skip_layers must be a list of distinct"),
    ({"model": "x"}, "takes no 'model'"),
])
def test_bad_keys(cfg, needle):
    with pytest.raises(ConfigError, match=None) as e:
        SpecConfig.from_dict({"method": "sparse_attn", **cfg})
    assert needle in e.value.problem


def test_keys_of_another_method_are_refused():
    with pytest.raises(ConfigError) as e:
        SpecConfig.from_dict({"method": "ngram", "sparse_attn_ratio": 0.1})
    assert "sparse_attn" in e.value.problem


def test_defaults_are_the_rfcs():
    c = SpecConfig.from_dict({"method": "sparse_attn"})
    assert (c.sparse_attn_algorithm, c.sparse_attn_ratio, c.sparse_attn_min_tokens, c.num_speculative_tokens) == \
        ("streamingllm", 0.05, 256, 4)


def test_a_layer_the_target_lacks_is_refused(target):
    with pytest.raises(UsageError) as e:
        build_proposer(config("streamingllm", sparse_attn_skip_layers=[7]), MAX_LEN, target=target)
    assert "layer 7" in e.value.problem


def test_auto_skip_tries_each_candidate_then_keeps_the_fastest(target):
    from specctl.runtime.proposers.sparse_attn import _SkipChooser, skip_candidates

    assert skip_candidates(24) == [[], list(range(16, 22)), list(range(14, 22)), list(range(10, 22))]
    ch = _SkipChooser(24)
    picks = []
    for _ in range(4 * ch.TRIES):  # each drafts in turn; skipping 8 layers accepts as much, for less time
        c = ch.pick()
        picks.append(c)
        ch.observe(c, 4, {0: 1.0, 1: 0.8, 2: 0.6, 3: 0.4}[c])
        ch.verified(c, {0: 3, 1: 3, 2: 3, 3: 0}[c])
    assert sorted(set(picks)) == [0, 1, 2, 3]
    assert ch.best() == 2  # half the layers skipped is cheapest but accepts nothing
    assert [ch.pick() for _ in range(5)].count(2) >= 4
    plain, spec, prop = decoders(target, config("streamingllm", sparse_attn_skip_layers="auto"))
    for p in prompts(4, seed=6):  # lossless whatever it picks
        params = SamplingParams(max_new_tokens=30, ignore_eos=True)
        assert spec.generate(p, params).token_ids == plain.generate(p, params).token_ids
    assert sum(prop.chooser.steps) > 0
