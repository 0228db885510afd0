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
