"""specctl.bench.suite in-process on tiny models: labels, one row per configuration, HF peers per draft.

Target: the conftest's tiny llama (character-level tokenizer, vocab 128). Drafts: ``same``, another
tiny llama over the same tokenizer (seed 1), and ``other``, a tiny llama over a different tokenizer
(the same characters in another order, vocabulary 130), which transformers can only use through
universal assisted generation and specctl through a vocabulary mapping.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specctl.bench.labels import config_labels, draft_name
from specctl.bench.suite import run_bench
from specctl.config import SpecConfig
from specctl.runtime.decoder import SamplingParams
from specctl.runtime.loading import load_model

OTHER_VOCAB = 130


def _other_tokenizer():
    """The conftest's characters, specials first, the printable ones in reverse order: other ids."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    from tests.conftest import TINY_SPECIAL_TOKENS

    chars = ["\n", "\t"] + [chr(c) for c in range(126, 31, -1)]
    tokens = list(TINY_SPECIAL_TOKENS) + chars
    raw = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[], unk_token="<unk>"))
    raw.decoder = decoders.Fuse()
    raw.add_special_tokens(list(TINY_SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", unk_token="<unk>", bos_token="<s>",
                                   eos_token="<|im_end|>")


@pytest.fixture(scope="module")
def drafts(tiny_model_factory, tmp_path_factory):
    """{"same": folder, "other": folder} (see the module docstring)."""
    from tests.conftest import TINY_CHAT_TEMPLATE, build_tiny_hf_model

    same = tiny_model_factory(seed=1, num_hidden_layers=1)  # smaller than the target: a draft as big never drafts
    other = tmp_path_factory.mktemp("draft-other-tok")
    build_tiny_hf_model(seed=2, vocab_size=OTHER_VOCAB, num_hidden_layers=1).save_pretrained(other)
    tok = _other_tokenizer()
    tok.chat_template = TINY_CHAT_TEMPLATE
    tok.save_pretrained(other)
    return {"same": same, "other": other}


@pytest.fixture(scope="module")
def target(tiny_model_dir):
    return load_model(tiny_model_dir, dtype="float32")


@pytest.fixture
def prompts(tmp_path):
    p = tmp_path / "prompts.jsonl"
    p.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in ("abc abc abc abc", "the cat sat on the mat")))
    return str(p)


def _draft(model: str, k: int = 3) -> SpecConfig:
    return SpecConfig.from_dict({"method": "draft_model", "model": model, "num_speculative_tokens": k})


# --------------------------------------------------------------------------- labels


def test_labels_name_the_draft():
    cfgs = [_draft("qwen2.5-coder-0.5b"), _draft("smollm2-135m"), SpecConfig(method="ngram").validated()]
    assert config_labels(cfgs) == ["draft_model:qwen2.5-coder-0.5b", "draft_model:smollm2-135m", "ngram"]


def test_sparse_attn_labels_name_the_algorithm():
    cfgs = [SpecConfig(method="sparse_attn", sparse_attn_algorithm=a).validated() for a in ("streamingllm", "vegas")]
    assert config_labels(cfgs) == ["sparse_attn:streamingllm", "sparse_attn:vegas"]


def test_labels_from_paths(tmp_path):
    folder = tmp_path / "my-draft"
    folder.mkdir()
    assert draft_name(str(folder) + "/") == "my-draft"
    assert draft_name("/models/d.gguf") == "d"
    assert draft_name("SmolLM2-135M") == "smollm2-135m"
    assert config_labels([_draft(str(folder))]) == ["draft_model"]  # the method alone where it is unique
    assert config_labels([_draft(str(folder)), _draft("smollm2-135m")]) == ["draft_model:my-draft",
                                                                           "draft_model:smollm2-135m"]


def test_labels_told_apart_by_the_one_key_that_differs_else_numbered():
    ng = [SpecConfig(method="ngram", num_speculative_tokens=k).validated() for k in (4, 8)]
    assert config_labels(ng) == ["ngram:k=4", "ngram:k=8"]
    assert config_labels([_draft("smollm2-135m", 3), _draft("smollm2-135m", 5)]) == [
        "draft_model:smollm2-135m:k=3", "draft_model:smollm2-135m:k=5"]
    # k and another key differ: both spelt out (as --speculative-config's help promises), not ngram / ngram#2
    two_keys = [SpecConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=3).validated(),
                SpecConfig(method="ngram", num_speculative_tokens=8, prompt_lookup_min=2, prompt_lookup_max=5).validated()]
    assert config_labels(two_keys) == ["ngram:k=4,prompt_lookup_max=3", "ngram:k=8,prompt_lookup_max=5"]
    same = [SpecConfig(method="ngram").validated() for _ in range(3)]
    assert config_labels(same) == ["ngram", "ngram#2", "ngram#3"]
    # nested settings (a hybrid's parts) are numbered, not dumped into the label
    hybrids = [SpecConfig.from_dict({"method": "hybrid", "proposers": [{"method": "ngram", "num_speculative_tokens": k},
                                                                       {"method": "suffix"}]}) for k in (3, 4)]
    assert config_labels(hybrids) == ["hybrid", "hybrid#2"]


# --------------------------------------------------------------------------- two drafts, peers per draft


def test_two_drafts_one_run_distinct_rows_and_assisted_peer_per_draft(target, drafts, prompts):
    cfgs = [_draft(str(drafts["same"])), _draft(str(drafts["other"]))]
    events = []
    # fixed k: each draft drafts whatever the machine's timings (adaptive, a draft as big as its target may
    # rightly never draft, and under a loaded CI machine it did not)
    report = run_bench(target, cfgs, [prompts], None, SamplingParams(max_new_tokens=10, stop_token_ids=target.stop_token_ids),
                       progress=lambda adv, desc, total=None: events.append((adv, total)), peers=("hf",), adaptive=False)
    rows = report.rows()
    same, other = drafts["same"].name, drafts["other"].name
    assert [r["method"] for r in rows] == [
        "baseline", f"draft_model:{same}", f"draft_model:{other}",
        "hf:plain", "hf:prompt-lookup", f"hf:assisted:{same}", f"hf:assisted:{other}"]
    by = {r["method"]: r for r in rows}
    assert by[f"draft_model:{same}"]["config"]["model"] == str(drafts["same"])
    assert by[f"draft_model:{other}"]["config"]["model"] == str(drafts["other"])
    assert by[f"hf:assisted:{same}"]["config"] == {"assistant_model": str(drafts["same"]),
                                                   "universal_assisted_generation": False}
    assert by[f"hf:assisted:{other}"]["config"] == {"assistant_model": str(drafts["other"]),
                                                    "universal_assisted_generation": True}
    for r in rows:
        assert r["requests"] == 2
        if r["method"] != "baseline":  # fp32 greedy: every method and peer reproduces the plain output
            assert r["identical_to_baseline"] == 2, r["method"]
    for lab in (f"draft_model:{same}", f"draft_model:{other}"):
        assert by[lab]["num_drafts"] > 0
        # the draft's weights (and its KV cache) are its extra memory; the baseline has none
        draft = load_model(drafts["same" if lab.endswith(same) else "other"], dtype="float32").model
        weights = sum(p.numel() * p.element_size() for p in draft.parameters()) / 2**20
        assert by[lab]["extra_memory_mib"] > weights
    assert by["baseline"]["extra_memory_mib"] == 0
    # the progress bar: told its total first, then advanced exactly that often
    assert events[0][1] == 2 * (3 + 4)
    assert sum(adv for adv, _ in events) == events[0][1]


def test_time_drafts_counts_each_step_and_a_draft_that_does_not_load_is_left_out(target, drafts, prompts, tmp_path):
    """recommend --probe's use of the loop: with time_drafts each row also holds the draft's time and
    (drafted, accepted) per step, matching its SpecStats (the warm-up is not counted); on_build_error
    is told of a draft that does not load, and the run goes on without it."""
    missing = str(tmp_path / "no-such-draft")
    failed = []
    # fixed k, as in the two-drafts test: a draft as big as its target drafts under the adaptive controller
    # only where the machine's timings happen to favour it
    report = run_bench(target, [_draft(str(drafts["same"])), _draft(missing)], [prompts], None,
                       SamplingParams(max_new_tokens=10, stop_token_ids=target.stop_token_ids), time_drafts=True,
                       on_build_error=lambda label, c, e: failed.append((label, c.model)), adaptive=False)
    assert failed == [("draft_model:no-such-draft", missing)]
    assert [r["method"] for r in report.rows()] == ["baseline", f"draft_model:{drafts['same'].name}"]
    base, run = report.runs
    assert base.draft is None  # the baseline drafts nothing
    assert run.stats.num_drafts > 0 and len(run.draft.steps) == run.stats.num_drafts
    assert sum(n for n, _ in run.draft.steps) == run.stats.num_draft_tokens
    assert sum(a for _, a in run.draft.steps) == run.stats.num_accepted_tokens
    assert 0 < run.draft.draft_s < run.decode_s and run.draft.k_asked >= run.stats.num_draft_tokens


def test_hf_peers_use_each_drafts_model_and_tokenizer(tiny_model_dir, drafts):
    from specctl.bench.peers import HFPeers

    hf = HFPeers(tiny_model_dir, torch.float32, drafts=[("a", drafts["same"]), ("b", drafts["other"])])
    assert [p.name for p in hf.peers] == ["hf:plain", "hf:prompt-lookup", "hf:assisted:a", "hf:assisted:b"]
    a, b = hf.peers[2].kwargs, hf.peers[3].kwargs
    assert a["assistant_model"].config.vocab_size == 128 and "assistant_tokenizer" not in a
    assert b["assistant_model"].config.vocab_size == OTHER_VOCAB
    assert b["assistant_tokenizer"].get_vocab() != b["tokenizer"].get_vocab()
    assert b["tokenizer"] is hf.tokenizer
    # the two assistants are different models
    pa, pb = (next(x["assistant_model"].parameters()) for x in (a, b))
    assert pa.shape != pb.shape or not torch.equal(pa, pb)


# --------------------------------------------------------------------------- multi-turn (mt-bench)


def test_mt_bench_turn_two_follows_the_baselines_own_answer(target, tmp_path, monkeypatch):
    from specctl.bench import suite
    from specctl.workloads import data
    from specctl.runtime.decoder import SpecDecoder
    from specctl.runtime.runner import TargetRunner

    monkeypatch.setenv("SPECCTL_CACHE", str(tmp_path))
    qs = [{"question_id": 81 + i, "category": c, "turns": [f"write {c} {i}", f"now shorter {i}"]}
          for i, c in enumerate(["writing", "math"])]
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / data.MT_BENCH.file).write_text("".join(json.dumps(q) + "\n" for q in qs))
    seen = []
    real_render = suite.render_prompt
    monkeypatch.setattr(suite, "render_prompt", lambda tok, req: seen.append(req.messages) or real_render(tok, req))

    params = SamplingParams(max_new_tokens=12, stop_token_ids=target.stop_token_ids)
    events = []
    report = run_bench(target, [SpecConfig(method="ngram", num_speculative_tokens=3).validated()], ["mt-bench"], None,
                       params, progress=lambda adv, desc, total=None: events.append((adv, total)))
    rows = report.rows()
    assert [(r["workload"], r["method"]) for r in rows] == [
        ("mt-bench t1", "baseline"), ("mt-bench t1", "ngram"), ("mt-bench t2", "baseline"), ("mt-bench t2", "ngram")]
    assert all(r["requests"] == 2 and r["new_tokens"] > 0 for r in rows)
    assert all(r["identical_to_baseline"] == 2 for r in rows)
    assert events[0][1] == 2 * 2 * 2 and sum(a for a, _ in events) == 8  # 2 questions x 2 turns x 2 rows

    # turn 2 = turn 1, the target's own greedy answer to it, then the second question
    dec = SpecDecoder(TargetRunner(target.model, max_len=256))
    for q in qs:
        first = [{"role": "user", "content": q["turns"][0]}]
        out = dec.generate(real_render(target.tokenizer, _req(first)), params).token_ids
        if out and out[-1] in target.stop_token_ids:
            out = out[:-1]
        answer = target.tokenizer.decode(out, skip_special_tokens=True).strip()
        assert first + [{"role": "assistant", "content": answer}, {"role": "user", "content": q["turns"][1]}] in seen


def test_a_later_turn_past_the_context_is_held_to_it_for_every_row(target, tmp_path, monkeypatch):
    """Turn 2's prompt holds turn 1's answer, so its length is known only then: where it leaves less than
    --max-new-tokens of the model's context, that turn's answer is held to what is left, for every row
    alike (said once), instead of running past max_position_embeddings."""
    from dataclasses import replace

    from specctl.workloads import data, load_workload, render_prompt, turn_messages

    monkeypatch.setenv("SPECCTL_CACHE", str(tmp_path))
    qs = [{"question_id": 81, "category": "writing", "turns": ["write a story", "now shorter"]}]
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / data.MT_BENCH.file).write_text(json.dumps(qs[0]) + "\n")
    req = load_workload("mt-bench", None, 0)[0]
    tok = target.tokenizer
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    first = tok.decode(_decoder(target).generate(render_prompt(tok, req), params).token_ids,
                       skip_special_tokens=True).strip()  # the baseline's answer to turn 1
    empty = len(render_prompt(tok, replace(req, messages=turn_messages(req, [""]))))
    n2 = len(render_prompt(tok, replace(req, messages=turn_messages(req, [first]))))
    limit = n2 + 5  # turn 2 fits with an empty answer and 12 new tokens (the check before the run), not with its own
    assert empty + 12 <= limit
    monkeypatch.setattr(target.model.args, "max_position_embeddings", limit)
    notices = []
    report = run_bench(target, [SpecConfig(method="ngram", num_speculative_tokens=3).validated()], ["mt-bench"], None,
                       params, notice=notices.append, runs=2)
    rows = {(r["workload"], r["method"]): r for r in report.rows()}
    assert len(notices) == 1 and "held to 5 new tokens" in notices[0]
    for m in ("baseline", "ngram"):
        assert rows[("mt-bench t1", m)]["new_tokens"] == 2 * 12
        assert rows[("mt-bench t2", m)]["new_tokens"] == 2 * 5
    assert rows[("mt-bench t2", "ngram")]["identical_to_baseline"] == 2


def _decoder(target):
    from specctl.runtime.decoder import SpecDecoder
    from specctl.runtime.runner import TargetRunner

    return SpecDecoder(TargetRunner(target.model, max_len=256))


def _req(messages):
    from specctl.workloads import Request

    return Request("r", messages, "test")


# --------------------------------------------------------------------------- --sweep-k


def test_sweep_k_runs_each_config_at_each_k_and_loads_a_draft_once(target, drafts, prompts, monkeypatch):
    import specctl.runtime.loading as loading_mod

    loads = []
    real_load = loading_mod.load_model
    monkeypatch.setattr(loading_mod, "load_model", lambda path, **kw: loads.append(path) or real_load(path, **kw))
    cfgs = [SpecConfig(method="ngram").validated(), _draft(str(drafts["same"]))]
    events = []
    report = run_bench(target, cfgs, [prompts], None, SamplingParams(max_new_tokens=10, stop_token_ids=target.stop_token_ids),
                       progress=lambda adv, desc, total=None: events.append((adv, total)), sweep_k=[1, 3, 1])
    rows = report.rows()
    d = "draft_model"  # one draft config: the method alone
    assert [(r["method"], r["k"]) for r in rows] == [("baseline", 0), ("ngram", 1), ("ngram", 3), (d, 1), (d, 3)]
    assert [r["config"].get("num_speculative_tokens") for r in rows[1:]] == [1, 3, 1, 3]
    assert all(r["identical_to_baseline"] == 2 for r in rows)
    assert len(loads) == 1  # one draft, however many k
    assert report.header["sweep_k"] == [1, 3]
    assert events[0][1] == 2 * 5 and sum(a for a, _ in events) == 10
    best = report.best_k()
    assert set(best) == {"ngram", d}
    for method, cells in best.items():
        cell = cells[prompts]
        by_k = {r["k"]: r["tokens_per_s"] for r in rows if r["method"] == method}
        assert cell["by_k"] == by_k
        assert cell["k"] == max(by_k, key=by_k.get) and cell["tokens_per_s"] == max(by_k.values())
        assert cell["speedup"] == next(r["speedup"] for r in rows if r["method"] == method and r["k"] == cell["k"])


def test_best_k_picks_the_fastest_k_per_method_and_workload():
    from specctl.bench.suite import BenchReport, MethodRun

    def run(method, workload, k, tps):
        r = MethodRun(method, workload, k, {})
        r.rep_tokens, r.rep_s = {0: 100}, {0: 100 / tps}
        return r

    report = BenchReport({}, [run("baseline", "a", 0, 10), run("ngram", "a", 2, 20), run("ngram", "a", 4, 30),
                              run("ngram", "a", 8, 25), run("hf:prompt-lookup", "a", 10, 50),
                              run("baseline", "b", 0, 10), run("ngram", "b", 2, 12), run("ngram", "b", 4, 11)])
    best = report.best_k()
    assert list(best) == ["ngram"]
    assert best["ngram"]["a"]["k"] == 4 and best["ngram"]["a"]["speedup"] == pytest.approx(3.0)
    assert best["ngram"]["a"]["by_k"] == pytest.approx({2: 20, 4: 30, 8: 25})
    assert best["ngram"]["b"]["k"] == 2


def test_speedup_is_the_median_of_each_repetitions_ratio_not_the_ratio_of_medians():
    """The machine's speed drifts between repetitions; within one, every method runs each prompt in
    turn. Rates per repetition: baseline 10, 20, 30 and the method 30, 22, 24: the ratios are 3.0, 1.1
    and 0.8, median 1.1, where the medians' ratio (24 / 20) says 1.2."""
    from specctl.bench.suite import BenchReport, MethodRun

    def run(method, rates):
        r = MethodRun(method, "a", 0, {})
        r.rep_tokens = {i: 120 for i in range(len(rates))}
        r.rep_s = {i: 120 / t for i, t in enumerate(rates)}
        return r

    row = next(r for r in BenchReport({}, [run("baseline", [10, 20, 30]), run("ngram", [30, 22, 24])]).rows()
               if r["method"] == "ngram")
    assert row["tokens_per_s"] == pytest.approx(24)
    assert row["speedup"] == pytest.approx(1.1) and row["speedup_vs_specctl_baseline"] == pytest.approx(1.1)
    assert row["runs"] == 3 and row["tokens_per_s_by_run"] == pytest.approx([30, 22, 24])


def test_request_speedup_counts_the_prompt_s_reading_that_decode_speed_leaves_out():
    """A draft model that reads the prompt in the prefill decodes faster (2x here) but its requests take
    longer in all: 1 s of prefill + 2 s of decode against plain's 0.5 + 4 s for 101 new tokens gives 2.0x
    over decode and 4.5 / 3 = 1.5x over the whole request, which ``request_speedup`` reports (per
    repetition, as ``speedup``)."""
    from specctl.bench.suite import BenchReport, MethodRun
    from specctl.runtime.requests import GenerationResult

    def run(method, prefill, decode):
        r = MethodRun(method, "a", 0, {})
        for rep in range(2):
            r.add(GenerationResult(list(range(101)), "length", prefill_s=prefill, decode_s=decode), None, rep)
        return r

    rows = BenchReport({}, [run("baseline", 0.5, 4.0), run("draft_model", 1.0, 2.0)]).rows()
    assert rows[0]["request_speedup"] == pytest.approx(1.0)
    assert rows[1]["speedup"] == pytest.approx(2.0) and rows[1]["request_speedup"] == pytest.approx(1.5)
    assert rows[1]["request_tokens_per_s_by_run"] == pytest.approx([101 / 3, 101 / 3])


# --------------------------------------------------------------------------- fresh state, sampling, context


def test_every_pass_starts_fresh_no_suffix_cache_across_runs_workloads_or_the_warm_up(target, prompts, tmp_path):
    """Two workloads with the same prompts, two runs each, suffix at a fixed k: every pass measures the
    same drafts. Before, the warm-up's answer and workload a's answers sat in the suffix cache that
    workload b (and run 1) drafted from."""
    again = tmp_path / "again.jsonl"
    again.write_text(Path(prompts).read_text())
    params = SamplingParams(max_new_tokens=16, stop_token_ids=target.stop_token_ids)
    one = run_bench(target, [SpecConfig(method="suffix", num_speculative_tokens=4).validated()], [prompts], None,
                    params, adaptive=False).rows()[1]
    rows = run_bench(target, [SpecConfig(method="suffix", num_speculative_tokens=4).validated()], [prompts, str(again)],
                     None, params, adaptive=False, runs=2).rows()
    a, b = (r for r in rows if r["method"] == "suffix")
    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert a[key] == b[key] == 2 * one[key], key
    assert a["identical_to_baseline"] == b["identical_to_baseline"] == 4


def test_sampled_outputs_are_not_compared_identical_is_null(target, prompts):
    params = SamplingParams(max_new_tokens=8, temperature=0.8, stop_token_ids=target.stop_token_ids)
    rows = run_bench(target, [SpecConfig(method="ngram", num_speculative_tokens=3).validated()], [prompts], None,
                     params).rows()
    base, ng = rows
    assert ng["identical_to_baseline"] is None and ng["first_divergence"] == []  # not 0: nothing was compared
    assert base["identical_to_baseline"] == 2


def test_prompts_over_the_models_context_are_refused_before_any_run(tiny_model_factory, tmp_path, monkeypatch):
    """max_position_embeddings 64: a prompt over it, or one that fits only without --max-new-tokens, is
    refused in one line naming the prompt, its length, the limit and the fix; nothing runs."""
    from specctl.bench import suite
    from specctl.errors import UsageError

    short = load_model(tiny_model_factory(max_position_embeddings=64), dtype="float32")
    generated = []
    monkeypatch.setattr(suite.SpecDecoder, "generate", lambda *a, **k: generated.append(1))
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps({"prompt": "y" * 30}) + "\n")
    n = len(suite.render_prompt(short.tokenizer, suite.load_workload(str(p))[1]))
    assert 30 < n < 64 - 8
    with pytest.raises(UsageError, match=rf"p\.jsonl line 2: the prompt \({n} tokens\) \+ --max-new-tokens 40 exceeds "
                                         rf"the model's context of 64 .*pass --max-new-tokens {64 - n} or less") as e:
        run_bench(short, [SpecConfig(method="ngram").validated()], [str(p)], None, SamplingParams(max_new_tokens=40))
    assert "\n" not in str(e.value)
    p.write_text(json.dumps({"prompt": "z" * 70}) + "\n")
    with pytest.raises(UsageError, match=r"p\.jsonl line 1: the prompt is \d+ tokens, over the model's context of 64"):
        run_bench(short, [], [str(p)], None, SamplingParams(max_new_tokens=8))
    assert not generated


# --------------------------------------------------------------------------- lockstep


def test_lockstep_gives_each_method_what_one_after_the_other_gives(target, drafts, prompts):
    """The methods in lockstep (a KV cache each) make the same tokens, drafts and acceptance as one after
    the other on one cache: the steps are the same, only their order in time differs."""
    cfgs = [SpecConfig(method="ngram", num_speculative_tokens=3).validated(), _draft(str(drafts["same"])),
            SpecConfig.from_dict({"method": "hybrid", "proposers": [{"method": "ngram", "num_speculative_tokens": 3},
                                                                   {"method": "draft_model", "model": str(drafts["same"]),
                                                                    "num_speculative_tokens": 3}]})]
    params = SamplingParams(max_new_tokens=12, stop_token_ids=target.stop_token_ids)
    a = run_bench(target, cfgs, [prompts], None, params, adaptive=False, interleave="steps").rows()
    b = run_bench(target, cfgs, [prompts], None, params, adaptive=False, interleave="prompts").rows()
    keys = ("method", "new_tokens", "num_drafts", "num_draft_tokens", "num_accepted_tokens", "identical_to_baseline")
    assert [{k: r[k] for k in keys} for r in a] == [{k: r[k] for k in keys} for r in b]
    assert all(r["identical_to_baseline"] == 2 for r in a)
    assert a[2]["num_drafts"] > 0  # the draft model drafted: its cache is its own in lockstep too


def test_lockstep_times_each_method_by_its_own_steps_only(target, slow_ngram):
    """A method whose steps are slow does not slow the others' measured speed: each result's decode
    time is the sum of its own steps, not the wall time of the round they took turns in."""
    from specctl.bench.suite import lockstep
    from specctl.runtime.decoder import SpecDecoder
    from specctl.runtime.runner import TargetRunner

    runners = [TargetRunner(target.model, max_len=128) for _ in range(2)]
    slow = slow_ngram  # a draft that costs 20 ms a call, whatever it drafts
    decs = [SpecDecoder(runners[0]), SpecDecoder(runners[0], slow, 3, adaptive=False)]
    ids = target.tokenizer("abc abc abc abc")["input_ids"]
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    plain, slowed = lockstep([(d, ids, params, None) for d in decs], runners)
    assert plain.token_ids == slowed.token_ids == decs[0].generate(ids, params).token_ids
    # every slow call is >= 20 ms, all in the slowed one's steps; the plain steps between them are charged none of it
    assert slow.calls >= 5 and slowed.decode_s >= slow.SLEEP_S * slow.calls
    assert plain.decode_s < slowed.decode_s / 4
