"""specctl.bench.concurrency in-process on the tiny model: each N is measured from a fresh state."""

from __future__ import annotations

import json

import pytest

from specctl.bench.concurrency import run_concurrency
from specctl.config import SpecConfig
from specctl.runtime.decoder import SamplingParams
from specctl.runtime.loading import load_model

# a part that never drafts here: a 30-token n-gram cannot repeat in prompts + answers this short
NEVER = {"method": "ngram", "prompt_lookup_min": 30, "prompt_lookup_max": 30, "num_speculative_tokens": 4}


@pytest.fixture(scope="module")
def target(tiny_model_dir):
    return load_model(tiny_model_dir, dtype="float32")


def _row(rows, n, method):
    return next(r for r in rows if r["concurrency"] == n and r["method"] == method)


def test_each_concurrency_level_starts_with_a_fresh_proposer(target, tmp_path):
    """suffix (and a hybrid holding it) at N=2 measures the same whether N=1 ran before it or not: the
    N=2 pass must not replay N=1's answers to the same prompts from the suffix cache. Fixed k, greedy:
    the drafts are deterministic, so the counts are equal, not just close."""
    p = tmp_path / "p.jsonl"
    p.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in ("hello there friend", "the quick brown fox", "zq wx ab")))
    configs = [SpecConfig(method="suffix", num_speculative_tokens=4).validated(),
               SpecConfig.from_dict({"method": "hybrid", "proposers": [NEVER, {"method": "suffix", "num_speculative_tokens": 4}]})]
    params = SamplingParams(max_new_tokens=24, stop_token_ids=target.stop_token_ids)
    _, alone = run_concurrency(target, configs, [str(p)], 3, params, [2], adaptive=False)
    _, after = run_concurrency(target, configs, [str(p)], 3, params, [1, 2], adaptive=False)
    for method in ("suffix", "hybrid"):
        a, b = _row(alone, 2, method), _row(after, 2, method)
        assert b["identical_to_baseline"] == 3
        assert (b["num_draft_tokens"], b["acceptance_rate"]) == (a["num_draft_tokens"], a["acceptance_rate"]), method
        # N=1 measured the same prompts from the same fresh state as the N=2 run alone did its own
        assert _row(after, 1, method)["acceptance_rate"] is not None
    # a hybrid's part that never drafted still has its entry (zeros)
    parts = _row(after, 2, "hybrid")["by_proposer"]
    assert list(parts) == ["ngram", "suffix"] and parts["ngram"]["num_drafts"] == 0


def test_a_prompt_longer_than_the_context_is_refused_before_running(tiny_model_factory, tmp_path, monkeypatch):
    from specctl.bench import concurrency
    from specctl.errors import UsageError

    short = load_model(tiny_model_factory(max_position_embeddings=64), dtype="float32")
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"prompt": "short"}) + "\n" + json.dumps({"prompt": "x" * 80}) + "\n")
    ran = []
    monkeypatch.setattr(concurrency, "run_level", lambda *a, **k: ran.append(1))
    with pytest.raises(UsageError, match=r"p\.jsonl line 2: the prompt is \d+ tokens, over the model's context of 64"):
        run_concurrency(short, [], [str(p)], 2, SamplingParams(max_new_tokens=8), [1])
    assert not ran


def test_rounds_run_every_configuration_once_a_round_and_take_medians_of_ratios(target, tmp_path, monkeypatch):
    """--runs R with --concurrency: R rounds, each running plain, then each configuration, in that order; a row's
    speedup is the median of its per-round ratios to the same round's plain (a slow round slows them all alike),
    its tok/s the median over rounds, and its outputs equal only if every round's are."""
    from specctl.bench import concurrency

    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"prompt": "hello there"}) + "\n")
    configs = [SpecConfig(method="ngram", num_speculative_tokens=4).validated()]
    # round speeds: plain 10, 5 (the machine slowed), 10; ngram 12, 6.5, 11 (ratios 1.2, 1.3, 1.1)
    speeds = iter([10.0, 12.0, 5.0, 6.5, 10.0, 11.0])
    order = []

    def fake(runs):
        out = []
        for run in runs:
            order.append("plain" if run.decoder.proposer is None else run.decoder.proposer.method)
            out.append({"tokens_per_s": next(speeds) if len(order) > 2 else 1.0, "outputs": [[1, 2]], "steps": 3})
        return out

    real = concurrency.lockstep
    monkeypatch.setattr(concurrency, "lockstep", fake)
    for interleave in ("prompts", "steps"):
        order.clear()
        speeds = iter([10.0, 12.0, 5.0, 6.5, 10.0, 11.0])
        _, rows = run_concurrency(target, configs, [str(p)], 1, SamplingParams(max_new_tokens=6), [1], runs=3,
                                  interleave=interleave)
        assert order[2:] == ["plain", "ngram"] * 3  # after the two warm-up runs: plain first in each round
        ng = _row(rows, 1, "ngram")
        assert ng["runs"] == 3 and ng["tokens_per_s"] == 11.0 and (ng["tokens_per_s_min"], ng["tokens_per_s_max"]) == (6.5, 12.0)
        assert ng["speedup"] == pytest.approx(1.2)  # the median ratio, not the medians' 11 / 10
        assert ng["identical_to_baseline"] == 1
    monkeypatch.setattr(concurrency, "lockstep", real)
    _, rows = run_concurrency(target, configs, [str(p)], 1, SamplingParams(max_new_tokens=6), [1], runs=2)
    assert _row(rows, 1, "ngram")["runs"] == 2 and _row(rows, 1, "ngram")["identical_to_baseline"] == 1


def test_lockstep_under_load_gives_what_one_configuration_after_the_other_gives(target, tmp_path):
    """Every configuration's engine on KV slots of its own, one step each in turn: the same outputs, drafts
    and acceptance as running them one after the other (the steps are the same, only their order in time differs)."""
    p = tmp_path / "p.jsonl"
    p.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in ("a b c a b c a b", "the quick brown fox", "zq wx ab zq wx")))
    configs = [SpecConfig(method="ngram", num_speculative_tokens=3).validated(),
               SpecConfig.from_dict({"method": "hybrid", "proposers": [NEVER, {"method": "suffix", "num_speculative_tokens": 3}]})]
    params = SamplingParams(max_new_tokens=20, stop_token_ids=target.stop_token_ids)
    ha, a = run_concurrency(target, configs, [str(p)], 3, params, [2], adaptive=False, interleave="steps")
    hb, b = run_concurrency(target, configs, [str(p)], 3, params, [2], adaptive=False, interleave="prompts")
    assert (ha["interleave"], hb["interleave"]) == ("steps", "prompts")
    keys = ("method", "tokens", "num_draft_tokens", "acceptance_rate", "identical_to_baseline", "steps")
    assert [{k: r[k] for k in keys} for r in a] == [{k: r[k] for k in keys} for r in b]
    assert all(r["identical_to_baseline"] == 3 for r in a) and a[1]["num_draft_tokens"] > 0


def test_lockstep_under_load_times_each_row_by_its_own_steps_only(target, slow_ngram):
    """A configuration whose steps are slow does not slow the others' measured throughput, TTFT or ITL:
    each row's clock is the sum of its own engine steps, not the wall time of the rounds they took turns in."""
    from specctl.bench.concurrency import LoadRun, lockstep
    from specctl.runtime.decoder import SpecDecoder
    from specctl.runtime.runner import TargetRunner

    sets = [[TargetRunner(target.model, max_len=128) for _ in range(2)] for _ in range(2)]
    slow = slow_ngram  # a draft that costs 20 ms a call, whatever it drafts
    decs = [SpecDecoder(sets[0][0]), SpecDecoder(sets[1][0], slow, 3, adaptive=False)]
    prompts = [target.tokenizer(t)["input_ids"] for t in ("abc abc abc abc", "one two one two", "x y z")]
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    plain, slowed = lockstep([LoadRun(d, rs, prompts, params, 0) for d, rs in zip(decs, sets)])
    assert plain["outputs"] == slowed["outputs"]
    assert slow.calls >= 5 and slowed["wall_s"] >= slow.SLEEP_S * slow.calls
    # the plain steps between the slow ones are charged none of them
    assert plain["wall_s"] < slowed["wall_s"] / 4 and plain["ttft_p99_s"] <= plain["wall_s"]
    assert plain["itl_p99_s"] < slow.SLEEP_S <= slowed["itl_p99_s"]
