"""specctl.recommend.candidates: smaller models judged for draft_model by tokenizer and predicted gain."""

from __future__ import annotations

import pytest

from specctl.config import SpecConfig
from specctl.recommend.cost import CROSS_TOKENIZER_PENALTY, best_k, get_workload, ngram_prediction, predicted_speedup
from specctl.recommend.flowchart import recommend
from specctl.recommend.probe import probe_plan
from tests.recommend.builders import evidence, llama, q


def test_same_family_small_model_gives_draft_model(target, tmp_path, tiny_model_dir):
    small = llama(tmp_path / "cands" / "small", layers=1, tokenizer=tiny_model_dir)
    rec = recommend(str(target), candidates=[str(small)], workload="rag")  # copies the prompt, ngram weak (x1.11)
    c = rec.candidates[0]
    assert c.tokenizer == "same" and c.verdict == "draft" and c.rho_estimate < 0.5
    assert c.predicted_speedup == pytest.approx(best_k(0.7, c.rho_estimate)[1])
    assert q(rec, "Is there a smaller model") == "yes" and q(rec, "Is ρ in the sweet spot") == "yes"
    assert q(rec, "Does small beat ngram on rag") == "yes"
    assert rec.choice.method == "draft_model" and rec.choice.layer == 3
    assert rec.choice.config == {"method": "draft_model", "model": str(small), "num_speculative_tokens": c.best_k}
    assert rec.alternatives[0].method == "ngram"  # rag copies the prompt: ngram is the rival to compare
    assert "ρ≈" in evidence(rec.tree)[0].reason
    # ... or both: ngram first, the draft model where it has nothing, with each part's predicted gain
    hyb = rec.alternatives[1]
    assert hyb.method == "hybrid" and hyb.layer == 3 and hyb.runnable
    assert [p["method"] for p in hyb.config["proposers"]] == ["ngram", "draft_model"]
    assert hyb.config["proposers"][1] == rec.choice.config
    assert f"predicted x{c.predicted_speedup:.2f}" in hyb.reason and hyb.reason.count("predicted x") == 2
    SpecConfig.from_dict(hyb.config)  # a config specctl takes as it is
    assert "--speculative-config" in hyb.commands["specctl_bench"]
    run, _ = probe_plan(rec)
    assert any(label == "hybrid:ngram+draft_model" for label, _ in run)  # --probe measures it too


def test_ngram_beats_a_draft_model_on_code_editing(target, tmp_path, tiny_model_dir):
    """On code editing prompt lookup copies long runs of the prompt (bench: 2.8-3.4x on Qwen2.5-Coder-1.5B,
    against 1.8x for the 0.5B draft): its prior predicts more than the draft model, so ngram is the pick,
    and the hybrid and the draft model are the alternatives."""
    small = llama(tmp_path / "cands" / "small", layers=1, tokenizer=tiny_model_dir)
    rec = recommend(str(target), candidates=[str(small)], workload="code")
    c = rec.candidates[0]
    ngram = predicted_speedup(get_workload("code").ngram_alpha, 0.0, 10)
    assert ngram == pytest.approx(ngram_prediction(get_workload("code-edit"), 10)) and ngram > 2.5
    assert c.verdict == "draft" and 1.1 < c.predicted_speedup < ngram
    assert q(rec, "Is ρ in the sweet spot") == "yes" and q(rec, "Does small beat ngram on code") == "no"
    assert rec.choice.method == "ngram" and rec.choice.layer == 1 and f"x{ngram:.2f}" in rec.choice.reason
    assert [a.method for a in rec.alternatives] == ["hybrid", "draft_model"]
    assert rec.alternatives[1].config["model"] == str(small)
    # a workload whose output does not copy the prompt keeps the draft model
    assert recommend(str(target), candidates=[str(small)], workload="chat").choice.method == "draft_model"


def test_same_family_but_rho_too_high_falls_through(target, tmp_path, tiny_model_dir):
    near = llama(tmp_path / "cands" / "near", layers=3, tokenizer=tiny_model_dir)
    rec = recommend(str(target), candidates=[str(near)], workload="chat")
    assert q(rec, "Is there a smaller model") == "yes" and q(rec, "Is ρ in the sweet spot") == "no"
    assert "ρ too close to 1" in rec.candidates[0].reason and rec.choice.method == "ngram"


def test_bigger_model_is_not_a_draft(target, tmp_path, tiny_model_dir):
    big = llama(tmp_path / "cands" / "big", layers=6, tokenizer=tiny_model_dir)
    rec = recommend(str(target), candidates=[str(big)])
    assert "not smaller than the target" in rec.candidates[0].reason
    assert q(rec, "Is there a smaller model") == "no" and rec.choice.method == "ngram"


def test_different_tokenizer_is_not_same_family_but_an_alternative(target, tmp_path, word_tok_dir):
    other = llama(tmp_path / "cands" / "other", layers=1, tokenizer=word_tok_dir, arch="qwen2")
    rec = recommend(str(target), candidates=[str(other)], workload="chat")
    c = rec.candidates[0]
    assert c.tokenizer == "different" and c.overlap["draft_coverage"] < 0.1 and c.overlap["mode"] == "text"
    assert c.verdict == "alternative" and c.alpha_prior == pytest.approx(0.6 - CROSS_TOKENIZER_PENALTY)
    assert "another architecture (qwen2)" in c.reason
    assert q(rec, "Is there a smaller model") == "no" and rec.choice.method == "ngram"
    alt = rec.alternatives[0]
    assert alt.method == "draft_model" and alt.config["model"] == str(other)
    # vLLM refuses a draft_model whose vocabulary differs: no vLLM config or command, specctl's only
    assert alt.vllm_config is None and alt.commands["vllm"] is None
    assert "needs the target's vocabulary" in alt.vllm_unsupported and "build-vocab-map" in alt.vllm_unsupported
    assert alt.commands["specctl_serve"].startswith("specctl serve") and "draft_model" in alt.commands["specctl_flags"]
    SpecConfig.from_dict(alt.config)  # specctl takes it as it is (the vocabulary map is built at load)


def test_plain_model_given_as_draft_becomes_a_candidate(target, tmp_path, tiny_model_dir):
    small = llama(tmp_path / "d" / "small", layers=1, tokenizer=tiny_model_dir)
    rec = recommend(str(target), drafts=[str(small)], candidates=[])
    assert rec.drafts == [] and [c.path for c in rec.candidates] == [str(small)]
    assert rec.choice.method == "draft_model"


def test_catalogue_target_not_pulled_is_judged_from_metadata():
    rec = recommend("qwen2.5-coder-1.5b", workload="chat")  # empty cache: nothing pulled, nothing fetched
    assert rec.target.path is None and rec.target.arch == "qwen2" and rec.target.vocab_size == 151936
    by_name = {c.name: c for c in rec.candidates}
    assert set(by_name) == {"smollm2-135m", "qwen2.5-coder-0.5b"}  # (gemma-3-270m left the catalogue in 178545e)
    assert by_name["qwen2.5-coder-0.5b"].tokenizer == "same" and by_name["qwen2.5-coder-0.5b"].verdict == "draft"
    assert "not verified" in by_name["qwen2.5-coder-0.5b"].reason
    assert by_name["smollm2-135m"].tokenizer == "different"  # another vocabulary size (49152)
    assert rec.choice.method == "draft_model" and rec.choice.config["model"] == "qwen2.5-coder-0.5b"
    assert any("not pulled" in n for n in rec.notes)
    # vLLM knows no catalogue names: its command names both models by their Hugging Face ids
    assert rec.choice.vllm_config["model"] == "Qwen/Qwen2.5-Coder-0.5B-Instruct"
    assert rec.choice.commands["vllm"].startswith("vllm serve Qwen/Qwen2.5-Coder-1.5B-Instruct --speculative-config")


def test_other_tokenizer_predicted_higher_ranks_after_the_pick_and_says_why(target, tmp_path, tiny_model_dir,
                                                                          word_tok_dir):
    """The user's case (SmolLM2-135M, another vocabulary, predicted x1.31 for Qwen2.5-Coder-1.5B on chat, after
    the same-tokenizer 0.5B's x1.14): the flowchart takes the same-tokenizer draft first, by design, and the
    alternative's reason says so; vLLM cannot run the alternative, so it has no vLLM command."""
    same = llama(tmp_path / "cands" / "same", layers=2, tokenizer=tiny_model_dir)
    other = llama(tmp_path / "cands" / "other", layers=1, tokenizer=word_tok_dir)
    rec = recommend(str(target), candidates=[str(same), str(other)], workload="translation")
    by_name = {c.name: c for c in rec.candidates}
    s, o = by_name["same"], by_name["other"]
    assert s.verdict == "draft" and o.verdict == "alternative" and o.predicted_speedup > s.predicted_speedup
    assert rec.choice.method == "draft_model" and rec.choice.config["model"] == str(same)
    assert rec.choice.commands["vllm"] is not None  # the same-tokenizer pick keeps its vLLM command
    alt = next(a for a in rec.alternatives if a.config.get("model") == str(other))
    assert f"predicted above the pick, draft_model with same (x{s.predicted_speedup:.2f}), but ranked after it" in alt.reason
    assert "the flowchart takes a same-tokenizer draft" in alt.reason and "--probe measures both" in alt.reason
    assert alt.vllm_config is None and alt.commands["vllm"] is None and "vLLM refuses it" in alt.vllm_unsupported
    assert alt.to_dict()["vllm_unsupported"] == alt.vllm_unsupported
