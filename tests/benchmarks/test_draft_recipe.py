"""benchmarks/draft_recipe.py: every stage resumes without redoing finished work (a stage whose result
file exists is skipped; training resumes from its checkpoints with the settings it started with)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def recipe():
    spec = importlib.util.spec_from_file_location("draft_recipe", ROOT / "benchmarks" / "draft_recipe.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def args(method="eagle3"):
    return SimpleNamespace(model="tiny", method=method, lr=None, quick=True)


def test_finished_stages_are_skipped(recipe, tmp_path, monkeypatch):
    monkeypatch.setattr("subprocess.run", lambda *a, **k: pytest.fail("a finished stage ran again"))
    monkeypatch.setattr("specctl.runtime.loading.load_model", lambda *a, **k: pytest.fail("the model loaded again"))
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "done.json").write_text("{}")
    # as many conversations as the plan reads: one more or less would write the file anew from ShareGPT
    (tmp_path / "data" / "sharegpt-read.jsonl").write_text("{}\n" * recipe.QUICK.read_conversations)
    (tmp_path / "data" / "heldout.done").write_text("done\n")
    (tmp_path / "train.json").write_text(json.dumps({"export": "x-eagle3", "final": {}}))
    report = {"results": [{"workload": "chat", "method": "eagle3:k=3", "mean_acceptance_length": 2.5,
                           "identical_to_baseline": True}]}
    (tmp_path / "bench.json").write_text(json.dumps(report))
    files = recipe.stage_data(args(), recipe.QUICK, tmp_path)
    assert [f.name for f in files] == ["sharegpt-greedy.jsonl", "sharegpt-t0.8.jsonl", "sharegpt-read.jsonl"]
    assert [f.name for f in recipe.stage_data(args("medusa"), recipe.QUICK, tmp_path)][2:] == []  # EAGLE-3's alone
    assert recipe.stage_heldout(args(), recipe.QUICK, tmp_path) == tmp_path / "data" / "heldout.jsonl"
    assert recipe.stage_train(args(), recipe.QUICK, tmp_path, files)["export"] == "x-eagle3"
    assert recipe.stage_bench(args(), recipe.QUICK, tmp_path, "x-eagle3") == report
    (tmp_path / "replay.json").write_text(json.dumps({"chain": {"mean_acceptance_length": 2.4}}))
    assert recipe.stage_replay(args(), recipe.QUICK, tmp_path, "x-eagle3", tmp_path / "data" / "heldout.jsonl") == \
        {"chain": {"mean_acceptance_length": 2.4}}
    assert recipe.acceptance(report) == {"chat": {"eagle3:k=3": 2.5}}
    batched = {"results": [{"workload": "chat", "concurrency": 8, "method": "baseline", "k": None, "speedup": 1.0},
                           {"workload": "chat", "concurrency": 8, "method": "eagle3:k=3", "k": 3, "speedup": 1.1234}]}
    (tmp_path / "bench-c8.json").write_text(json.dumps(batched))
    assert recipe.stage_bench(args(), recipe.QUICK, tmp_path, "x-eagle3", concurrency=8) == batched
    assert recipe.speedups(batched) == {"chat": {"eagle3:k=3": 1.123}}  # plain's own row left out


def test_the_batched_bench_keeps_twice_as_many_prompts_as_slots(recipe, tmp_path, monkeypatch):
    ran = []

    def run(cmd, **_):
        ran.append(cmd)
        return SimpleNamespace(returncode=0, stdout=json.dumps({"results": []}))

    monkeypatch.setattr("subprocess.run", run)
    recipe.stage_bench(args(), recipe.QUICK, tmp_path, "x-eagle3", concurrency=8)
    cmd = ran[0]
    assert cmd[cmd.index("-c") + 1] == "8" and cmd[cmd.index("-n") + 1] == "16"
    assert (tmp_path / "bench-c8.json").is_file() and not (tmp_path / "bench.json").exists()


def test_training_resumes_from_its_checkpoints_with_the_settings_it_started_with(recipe, tmp_path):
    files = [tmp_path / "data" / "a.jsonl"]
    cmd = recipe.train_command(args(), recipe.QUICK, tmp_path, files)
    assert "--resume" not in cmd and "--eval-data" not in cmd and cmd[cmd.index("--steps") + 1] == "120"
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "heldout.jsonl").write_text("")
    cmd = recipe.train_command(args(), recipe.QUICK, tmp_path, files)
    assert cmd[cmd.index("--eval-data") + 1] == str(tmp_path / "data" / "heldout.jsonl")  # a fresh run evaluates on it
    ckpt = tmp_path / "train" / "checkpoints" / "step-0000020"
    ckpt.mkdir(parents=True)
    (ckpt / "training_config.json").write_text(json.dumps({"eval_data": []}))  # as the trainer saves it mid-run
    cmd = recipe.train_command(args(), recipe.QUICK, tmp_path, files)
    assert "--resume" in cmd and "--eval-data" not in cmd  # a run started without it resumes without it
    (ckpt / "training_config.json").write_text(json.dumps({"eval_data": ["h"]}))
    assert "--eval-data" in recipe.train_command(args(), recipe.QUICK, tmp_path, files)
    (ckpt / "training_config.json").unlink()  # an older layout: the output's own copy
    (tmp_path / "train" / "training_config.json").write_text(json.dumps({"eval_data": ["h"]}))
    assert "--eval-data" in recipe.train_command(args(), recipe.QUICK, tmp_path, files)
    medusa = recipe.train_command(args("medusa"), recipe.QUICK, tmp_path, files)
    assert medusa[3] == "train-medusa" and "--eval-data" not in medusa and "--cache-hidden-states" not in medusa
    # EAGLE-3 evaluates on the held-out answers every 40 steps; Medusa and MTP on their split five times a run
    every = lambda c: c[c.index("--eval-every") + 1]  # noqa: E731
    assert (every(cmd), every(medusa)) == ("40", "24")
    from dataclasses import replace
    assert every(recipe.train_command(args("mtp"), replace(recipe.QUICK, steps=50), tmp_path, files)) == "20"


def test_medusa_trains_on_an_eagle3_run_s_data_and_states(recipe, tmp_path):
    """--states-from: the EAGLE-3 run's data files as they are, its states cache read, the target's
    distribution learnt; a run whose data stage has not finished is refused."""
    eagle = tmp_path / "eagle"
    a = SimpleNamespace(model="tiny", method="medusa", lr=None, quick=True, states_from=eagle)
    with pytest.raises(SystemExit, match="no finished data stage"):
        recipe.stage_data(a, recipe.QUICK, tmp_path / "medusa")
    (eagle / "data").mkdir(parents=True)
    files = [str(eagle / "data" / n) for n in ("sharegpt-greedy.jsonl", "sharegpt-t0.8.jsonl", "sharegpt-read.jsonl")]
    (eagle / "data" / "done.json").write_text(json.dumps({"files": files}))
    got = recipe.stage_data(a, recipe.QUICK, tmp_path / "medusa")
    assert [str(f) for f in got] == files and not (tmp_path / "medusa" / "data").exists()
    cmd = recipe.train_command(a, recipe.QUICK, tmp_path / "medusa", got)
    assert cmd[cmd.index("--cache-hidden-states") + 1] == str(eagle / "states") and "--soft-labels" in cmd
    assert "--shared-lm-head" in cmd  # its 8k vocabulary as vLLM loads one (train-medusa refuses it otherwise)
    assert [cmd[i + 1] for i, x in enumerate(cmd) if x == "--data"] == files


def test_bench_measures_a_chain_and_for_eagle3_a_tree_of_16_nodes(recipe):
    c = recipe.bench_configs("eagle3", "d", 3)
    assert c["chain"]["num_speculative_tokens"] == 3 and c["tree"]["speculative_num_draft_tokens"] == 16
    m = recipe.bench_configs("medusa", "d", 3)
    assert m["tree"]["speculative_token_tree"] == "auto" and m["tree"]["speculative_num_draft_tokens"] == 16
    assert list(recipe.bench_configs("mtp", "d", 3)) == ["chain"]


def test_identical_to_plain_reads_the_counts_bench_reports(recipe):
    """bench's identical_to_baseline is a count of requests (None where not compared): every request
    equal is identical, one short is not."""
    rows = [{"requests": 4, "identical_to_baseline": 4}, {"requests": 4, "identical_to_baseline": None}]
    assert recipe.identical_to_plain({"results": rows})
    rows.append({"requests": 4, "identical_to_baseline": 3})
    assert not recipe.identical_to_plain({"results": rows})


def test_read_conversations_follow_the_answered_prompts_and_exclude_evaluation_prompts(recipe, tmp_path, monkeypatch):
    """The conversations the target reads are other ones than those it answers (those after them in the
    sharegpt workload's order, conversations without an answer skipped), as many as the plan says; one
    holding an evaluation prompt stops the stage, with nothing written."""
    from dataclasses import replace

    from specctl.errors import DataError
    from specctl.training import data as D
    from specctl.workloads import Request

    dialogues = [{"id": f"s{i}", "conversations": [{"from": "human", "value": f"question {i}?"},
                                                   {"from": "gpt", "value": f"answer {i}"}]} for i in range(8) if i != 4]
    monkeypatch.setattr("specctl.workloads.data.sharegpt_dialogues", lambda: dialogues)
    prompts = [Request(id=f"sharegpt/s{i}", messages=[{"role": "user", "content": f"question {i}?"}], workload="sharegpt")
               for i in (7, 6, 5, 4, 3, 2, 1, 0)]
    plan = replace(recipe.QUICK, greedy_prompts=2, sampled_prompts=1, read_conversations=3)
    path = tmp_path / "read.jsonl"
    recipe.write_read(plan, prompts, path)
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["s3", "s2", "s1"]  # after s7, s6, s5 (answered); s4 holds no answer
    assert all(D.parse_record(r, "x").messages[1]["role"] == "assistant" for r in rows)
    from specctl.workloads import data as W

    monkeypatch.setenv("SPECCTL_CACHE", str(tmp_path / "cache"))  # the evaluation sets the guard reads
    (tmp_path / "cache" / "data").mkdir(parents=True)
    question = "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences."
    (tmp_path / "cache" / "data" / W.MT_BENCH.file).write_text(json.dumps(
        {"question_id": 81, "category": "writing", "turns": [question, "Rewrite it."]}) + "\n")
    dialogues[3]["conversations"][0]["value"] = "Please: " + question  # s3, inside a longer prompt
    with pytest.raises(DataError, match="ShareGPT s3 holds an evaluation prompt"):
        recipe.write_read(plan, prompts, tmp_path / "other.jsonl")
    assert not (tmp_path / "other.jsonl").exists()


def test_the_budget_stated_up_front_grows_with_the_plan_and_the_target(recipe):
    """The time each stage is expected to take: the quick plan within an hour for the 0.5B, the full about
    three hours (at the rates of a CPU with native bf16); a larger target costs more, a CPU without bf16
    instructions more too; only EAGLE-3 caches states."""
    native = recipe.RATES_BY_CPU["native"]
    quick, full = (sum(recipe.budget(p, "eagle3", 24, 896, native).values()) for p in (recipe.QUICK, recipe.FULL))
    assert quick < 3600 < full <= 3.3 * 3600
    assert sum(recipe.budget(recipe.QUICK, "eagle3", 28, 1536, native).values()) > 2 * quick
    assert sum(recipe.budget(recipe.QUICK, "eagle3", 24, 896, recipe.RATES_BY_CPU["avx2"]).values()) > 1.5 * quick
    assert recipe.budget(recipe.QUICK, "medusa", 24, 896)["states"] == 0
    assert recipe.RATES is recipe.RATES_BY_CPU[recipe.cpu_rates()[0]]


def test_the_last_line_reads_every_trainer_s_summary(recipe):
    """train-eagle's summary names its export and its last evaluation; train-medusa's and train-mtp's their
    output folder and held-out split."""
    report = {"header": {"machine": "AMD EPYC"}, "results": [
        {"workload": "chat", "method": "m:k=3", "k": 3, "mean_acceptance_length": 1.5, "speedup": 1.1,
         "identical_to_baseline": 4, "requests": 4}]}
    eagle = recipe.result(args(), {"export": "/e", "final": {"decoding_acceptance_length": 1.6}, "wall_s": 9}, report, report)
    medusa = recipe.result(args("medusa"), {"output": "/m", "eval": {"acceptance_length": 1.7}}, report, {"results": []})
    mtp = recipe.result(args("mtp"), {"output": "/t", "eval": {"mean_acceptance_length": 1.8}, "seconds": 7}, report, report)
    assert [r["export"] for r in (eagle, medusa, mtp)] == ["/e", "/m", "/t"]
    assert [r["training_estimate"] for r in (eagle, medusa, mtp)] == [1.6, 1.7, 1.8]
    assert eagle["speedup"] == {"concurrency 1": {"chat": {"m:k=3": 1.1}}, "concurrency 8": {"chat": {"m:k=3": 1.1}}}
    assert eagle["cpu"] == "AMD EPYC" and eagle["identical_to_plain"] and eagle["train_s"] == 9
    assert mtp["train_s"] == 7  # train-mtp's summary says "seconds": it was null
    assert "training_estimate_tree" not in eagle
    # a run that replayed greedy decoding at its end: its chain and tree, what bench --fixed-k measures
    replayed = {"chain": {"mean_acceptance_length": 1.5, "k": 3}, "tree": {"mean_acceptance_length": 1.9}}
    eagle = recipe.result(args(), {"export": "/e", "final": {"decoding_acceptance_length": 1.6, "replay": replayed}},
                          report, report)
    assert (eagle["training_estimate"], eagle["training_estimate_tree"]) == (1.5, 1.9)


def test_a_run_given_more_conversations_reads_the_same_ones_first(recipe, tmp_path, monkeypatch):
    """--read-conversations on a finished data stage: the read file is written anew with as many, the same
    conversations first (their cached states are reused), the answered data left as it was."""
    from dataclasses import replace

    from specctl.workloads import Request

    dialogues = [{"id": f"s{i}", "conversations": [{"from": "human", "value": f"question {i}?"},
                                                   {"from": "gpt", "value": f"answer {i}"}]} for i in range(9)]
    monkeypatch.setattr("specctl.workloads.data.sharegpt_dialogues", lambda: dialogues)
    prompts = [Request(id=f"sharegpt/s{i}", messages=[{"role": "user", "content": f"question {i}?"}], workload="sharegpt")
               for i in range(9)]
    monkeypatch.setattr("specctl.training.data.load_prompts", lambda name: prompts)
    out = tmp_path / "run"
    (out / "data").mkdir(parents=True)
    (out / "data" / "done.json").write_text(json.dumps({"files": []}))
    few = replace(recipe.QUICK, greedy_prompts=2, sampled_prompts=1, read_conversations=2)
    files = recipe.stage_data(args(), few, out)
    ids = lambda: [json.loads(x)["id"] for x in files[-1].read_text().splitlines()]  # noqa: E731
    assert ids() == ["s3", "s4"]
    assert recipe.stage_data(args(), replace(few, read_conversations=5), out) == files
    assert ids() == ["s3", "s4", "s5", "s6", "s7"]


@pytest.mark.parametrize("method", ["eagle3", "medusa"])
def test_the_replay_stage_gives_each_bench_configuration_s_acceptance(recipe, method, trained_eagle, trained_medusa,
                                                                       tiny_model_dir, tmp_path):
    """Before bench runs, the held-out answers are decoded greedily through the proposer on the target's states,
    one figure per bench configuration (a chain, the tree), kept in OUT/replay.json; the last line reads them."""
    from specctl.runtime.decoder import SamplingParams, SpecDecoder
    from specctl.runtime.loading import load_model
    from specctl.runtime.runner import TargetRunner
    from tests.conftest import MEDUSA_NEW

    if method == "eagle3":
        model, export = tiny_model_dir, trained_eagle[3]["export"]
        prompts = [list(p) for p in load_model(model, dtype="bfloat16").tokenizer(trained_eagle["prompts"][:6])["input_ids"]]
    else:  # the recipe's Medusa tree is "auto": the heads' held-out rank accuracies, recorded as train-medusa does
        import shutil

        lm, cases, heads = trained_medusa
        export = shutil.copytree(heads, tmp_path / "heads")
        cfg = json.loads((export / "config.json").read_text())
        cfg.setdefault("specctl", {})["rank_accuracy"] = [[0.9, 0.05, 0.02], [0.8, 0.1, 0.03], [0.7, 0.1, 0.05]]
        (export / "config.json").write_text(json.dumps(cfg))
        model, export, prompts = lm.path, str(export), [p for p, _ in cases[:6]]
    lm = load_model(model, dtype="bfloat16")
    plain = SpecDecoder(TargetRunner(lm.model, 256))
    heldout = tmp_path / "heldout.jsonl"
    heldout.write_text("".join(json.dumps({"messages": [{"role": "user", "content": "-"}, {"role": "assistant", "content": "-"}],
                                           "prompt_ids": p, "response_ids": plain.generate(p, SamplingParams(max_new_tokens=MEDUSA_NEW)).token_ids}) + "\n"
                               for p in prompts))
    from dataclasses import replace

    plan = replace(recipe.QUICK, bench_tokens=MEDUSA_NEW)
    a = SimpleNamespace(model=str(model), method=method, lr=None, quick=True)
    got = recipe.stage_replay(a, plan, tmp_path, export, heldout)
    assert set(got) == set(recipe.bench_configs(method, export, plan.k))
    for r in got.values():
        assert r["steps"] > 0 and r["mean_acceptance_length"] == pytest.approx(1 + r["accepted_tokens"] / r["steps"])
    assert json.loads((tmp_path / "replay.json").read_text()) == got
    line = recipe.result(a, {"export": export}, {"results": []}, {"results": []}, got)
    assert line["training_estimate"] == got["chain"]["mean_acceptance_length"]
    assert line["training_estimate_tree"] == got["tree"]["mean_acceptance_length"]


def test_more_answers_come_from_the_back_of_the_list_and_extend_a_finished_run(recipe, tmp_path, monkeypatch):
    """--more-answers on a finished data stage: the target answers that many more prompts greedily, from the back
    of ShareGPT's list (apart from the answered and read ranges, which grow from its front), into a file of their
    own that the training data gains; done.json records it, so a second run does nothing again."""
    from dataclasses import replace

    from specctl.workloads import Request

    prompts = [Request(id=f"sharegpt/s{i}", messages=[{"role": "user", "content": f"question {i}?"}], workload="sharegpt")
               for i in range(9)]
    monkeypatch.setattr("specctl.training.data.load_prompts", lambda name: prompts)
    monkeypatch.setattr("specctl.models.resolve_model", lambda name, dtype=None: name)
    monkeypatch.setattr("specctl.runtime.loading.load_model", lambda path, dtype=None: "target")
    answered = []

    def distill(lm, reqs, *, max_new_tokens, temperature, cache, **kw):
        answered.append(([r.id for r in reqs], temperature, cache.name))
        return []
    monkeypatch.setattr("specctl.training.data.self_distill", distill)
    out = tmp_path / "run"
    (out / "data").mkdir(parents=True)
    (out / "data" / "done.json").write_text(json.dumps({"files": [], "seconds": 5.0}))
    plan = replace(recipe.QUICK, greedy_prompts=2, sampled_prompts=1, read_conversations=0)
    assert recipe.stage_data(args(), plan, out) and not answered  # finished: nothing to do
    files = recipe.stage_data(args(), replace(plan, more_answers=3), out)
    assert files[-1].name == "sharegpt-greedy-more.jsonl"
    assert answered[-1] == (["sharegpt/s8", "sharegpt/s7", "sharegpt/s6"], 0.0, "sharegpt-greedy-more.jsonl")
    assert json.loads((out / "data" / "done.json").read_text())["more_answers"] == 3
    n = len(answered)
    assert recipe.stage_data(args(), replace(plan, more_answers=3), out) == files and len(answered) == n
