"""Workloads: lists of chat requests to time speculative decoding on (``specctl bench``), to probe
with (``specctl recommend --probe``) and to self-distill from (the trainers' ``--self-distill``).

Built-in workloads (``WORKLOADS``), in the spirit of Spec-Bench (arXiv 2401.07851), all from real
data on the machine or in wheels (``specctl.workloads.data`` fetches those once into ``cache_dir()/data/``):

- ``code-edit``: rework real code. Functions and methods (25-70 lines) taken from a fixed list of
  Python standard-library modules, each wrapped in an edit instruction (rename an identifier, add
  type hints, add a docstring, convert to f-strings) whose answer is mostly a copy of the input,
  the case prompt-lookup / n-gram speculation exploits. Deterministic for a given Python and seed.
- ``humaneval``: code completion, the 164 HumanEval problems (signature + docstring) to complete.
- ``chat``: the 80 MT-Bench first-turn questions (8 categories).
- ``mt-bench``: multi-turn chat, both turns of each MT-Bench question. The second turn is asked
  after the model's own first answer (as Spec-Bench does): the request carries it in
  ``followups`` and the bench builds turn 2 with ``turn_messages`` from the answer it generated.
- ``summarize``: a long real document in the prompt (Spec-Bench's summarisation and RAG kinds):
  sections of the Python reference manual (``pydoc_data.topics``) to summarise, alternating with
  standard-library source files and a question about one function in them, to answer from the file.
- ``long-4k``, ``long-16k``, ``long-32k``: long-context question answering: whole standard-library
  source files, about 4k, 16k or 32k tokens of them, then a question about a function in the first
  file (explain it, quote it): the answer lies a whole context back (sparse_attn's case).
- ``doc-qa``: long-document questions (RAG, code review): a reference manual section or the start of a
  standard-library source file (4k-16k characters), then a question whose answer quotes it (entries it
  defines, grammar rules, subsection titles, sentences naming a term; signatures, a function found by
  its docstring, raise statements): the answer copies spans of the prompt. Deterministic for a seed.
- ``math``: the 270 CHAMP competition math problems (5 categories), solved step by step.
- ``sharegpt``: the first human turns of ShareGPT's 17,671 complete conversations (real users' chat,
  the prompts draft-training recipes start from; ``--self-distill sharegpt`` lets the target answer them).
  The evaluation workloads (chat, mt-bench, humaneval, math) are never training data.
- ``agentic``: one fixed tool-calling template (system prompt with the tool's JSON format and an
  example call) applied to different real standard-library functions, as an agent loop or a
  fixed-template batch job sends it; answers share most of their tokens with earlier answers, the
  case suffix decoding's cache of previous responses exploits.

Rounds: ``load_workload(name, num_prompts, seed, rounds=R)`` returns the selected requests R times,
round after round (ids get ``#r1`` .. ``#rR``, ``meta["round"]`` says which), the way a recurring
job resends them; a workload name may carry it as ``NAME@R`` (``agentic@10``), so
``specctl bench -w agentic@10`` runs 10 rounds with the CLI as it is.

Any other argument is read as a path to a ``.jsonl`` file of the user's own prompts, one object a
line: ``{"prompt": "..."}`` or ``{"messages": [{"role": ..., "content": ...}, ...]}``, with an
optional ``"id"``. ``render_prompt`` turns a request into token ids (``specctl.chat``). No torch import here: loading a workload stays cheap.
"""

from __future__ import annotations

import difflib
import json
import os
import random
from pathlib import Path

from specctl import chat
from specctl.errors import DataError, UsageError
from specctl.workloads.request import Request, _round_robin  # noqa: F401 (Request: here as before)

WORKLOADS: dict[str, str] = {
    "code-edit": "Rework real Python stdlib functions (rename, type hints, docstring, f-strings); "
    "answers mostly copy the input.",
    "humaneval": "Code completion: the 164 HumanEval problems (signature and docstring to complete).",
    "chat": "MT-Bench first-turn questions: 80 prompts over 8 categories (writing, roleplay, reasoning, ...).",
    "mt-bench": "Multi-turn chat: both MT-Bench turns, turn 2 after the model's own turn-1 answer (one row per turn).",
    "summarize": "A long real document in the prompt: Python reference sections to summarise, stdlib source "
    "files to answer a question from (summarisation / RAG).",
    "doc-qa": "Long-document questions (RAG / code review): a reference section or stdlib source file of 1k-4k "
    "tokens, then a question whose answer quotes it.",
    "math": "Math reasoning: the 270 CHAMP competition problems (5 categories), solved step by step.",
    "sharegpt": "Real users' chat: first human turns of ShareGPT's 17,671 conversations (draft training data).",
    "agentic": "One tool-calling template over real stdlib functions (agent loop / batch job); "
    "NAME@R repeats any workload for R rounds.",
    "long-4k": "Long context: about 4k tokens of stdlib source files, then a question about a function "
    "in the first one (answer: explain and quote it).",
    "long-16k": "Long context: the same with about 16k tokens of documents.",
    "long-32k": "Long context: the same with about 32k tokens of documents.",
}


def turn_messages(request: Request, answers: list[str]) -> list[dict]:
    """The messages of turn ``len(answers) + 1``: the first turn's, then each answer and the next user turn.

    E.g. turns [q1, q2], answers [a1] -> [user q1, assistant a1, user q2].
    """
    if len(answers) > len(request.followups):
        raise ValueError(f"{request.id} has {request.num_turns} turns, got {len(answers)} answers")
    msgs = [dict(m) for m in request.messages]
    for answer, question in zip(answers, request.followups):
        msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": question}]
    return msgs


def load_workload(name_or_path: str, num_prompts: int | None = None, seed: int = 0,
                  rounds: int | None = None) -> list[Request]:
    """The requests of a built-in workload or a ``.jsonl`` file; at most ``num_prompts`` of them.

    ``rounds`` (or a ``@R`` suffix on the name): the same requests R times over, round-major.
    """
    if num_prompts is not None and num_prompts <= 0:
        raise UsageError(f"--num-prompts must be positive, got {num_prompts}", "pass 1 or more")
    name_or_path, named_rounds = _split_rounds(name_or_path)
    if rounds is not None and named_rounds is not None and rounds != named_rounds:
        raise UsageError(f"rounds given twice ({rounds} and @{named_rounds})", "Give the rounds once")
    if rounds is None:
        rounds = 1 if named_rounds is None else named_rounds
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds <= 0:
        raise UsageError(f"rounds must be a positive integer, got {rounds!r}", "Pass e.g. agentic@10 for 10 rounds")
    return _repeat(_load_once(name_or_path, num_prompts, seed), rounds)


def _split_rounds(name_or_path: str) -> tuple[str, int | None]:
    """'agentic@10' -> ('agentic', 10); an existing path is taken as it is."""
    head, at, tail = name_or_path.rpartition("@")
    if not at or not tail.isdigit() or not head or os.path.exists(name_or_path):
        return name_or_path, None
    return head, int(tail)


def _repeat(reqs: list[Request], rounds: int) -> list[Request]:
    if rounds == 1:
        return reqs
    return [Request(id=f"{r.id}#r{k}", messages=[dict(m) for m in r.messages], workload=r.workload,
                    meta={**r.meta, "round": k}, followups=list(r.followups))
            for k in range(1, rounds + 1) for r in reqs]


def _load_once(name_or_path: str, num_prompts: int | None, seed: int) -> list[Request]:
    loader = _loader(name_or_path)
    if loader is not None:
        return loader(num_prompts, seed)
    if name_or_path.endswith(".jsonl") or os.sep in name_or_path or "/" in name_or_path or os.path.exists(name_or_path):
        reqs = _load_jsonl(Path(name_or_path))
        return reqs if num_prompts is None else reqs[:num_prompts]
    close = difflib.get_close_matches(name_or_path, list(WORKLOADS), n=1)
    hint = f"Did you mean '{close[0]}'? " if close else ""
    raise UsageError(
        f"Unknown workload '{name_or_path}'",
        f"{hint}Choose one of: {', '.join(WORKLOADS)}, or give a path to a .jsonl file of prompts",
    )


def render_prompt(tokenizer, request: Request) -> list[int]:
    """Token ids of ``request``'s messages (``specctl.chat.render``)."""
    return chat.render(tokenizer, request.messages)


# --- user prompts from a .jsonl file -----------------------------------------------------------

_JSONL_FIX = 'Each line must be one JSON object: {"prompt": "..."} or {"messages": [{"role": "user", "content": "..."}]}'


def _load_jsonl(path: Path) -> list[Request]:
    if not path.is_file():
        raise DataError(f"Prompt file {path} does not exist", f"Check the path, or use a built-in workload: {', '.join(WORKLOADS)}")
    try:
        lines = path.read_text(encoding="utf-8-sig").splitlines()  # a byte-order mark (Windows editors) is dropped
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"Cannot read prompt file {path}: {e}", "Give a readable UTF-8 .jsonl file") from e
    reqs: list[Request] = []
    seen: set[str] = set()
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}, line {lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: invalid JSON ({e.msg})", _JSONL_FIX) from e
        if not isinstance(obj, dict):
            raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}", _JSONL_FIX)
        if "messages" in obj:
            msgs = obj["messages"]
            if not isinstance(msgs, list) or not msgs or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in msgs
            ):
                raise DataError(f"{where}: \"messages\" must be a non-empty list of {{\"role\": str, \"content\": str}}", _JSONL_FIX)
            messages = [{"role": m["role"], "content": m["content"]} for m in msgs]
        elif "prompt" in obj:
            if not isinstance(obj["prompt"], str) or not obj["prompt"]:
                raise DataError(f"{where}: \"prompt\" must be a non-empty string", _JSONL_FIX)
            messages = [{"role": "user", "content": obj["prompt"]}]
        else:
            raise DataError(f"{where}: missing key \"prompt\" or \"messages\"", _JSONL_FIX)
        rid = obj.get("id", f"{path.stem}:{lineno}")
        if not isinstance(rid, (str, int)) or isinstance(rid, bool):
            raise DataError(f"{where}: \"id\" must be a string or an integer", "Give each line a unique string id, or omit it")
        if str(rid) in seen:
            raise DataError(f"{where}: duplicate id {rid!r}", "Give each line a unique id, or omit it")
        seen.add(str(rid))
        reqs.append(Request(id=str(rid), messages=messages, workload=str(path), meta={"line": lineno}))
    if not reqs:
        raise DataError(f"Prompt file {path} holds no prompts", _JSONL_FIX)
    return reqs


# --- chat and mt-bench: MT-Bench -----------------------------------------------------------------


def _mt_bench_picked(num_prompts: int | None, seed: int) -> list[dict]:
    """MT-Bench questions round-robin over categories (file order), shuffled within each by seed."""
    from specctl.workloads.data import mt_bench_questions

    by_cat: dict[str, list[dict]] = {}
    for r in mt_bench_questions():
        by_cat.setdefault(r["category"], []).append(r)
    rng = random.Random(seed)
    for qs in by_cat.values():
        rng.shuffle(qs)
    return _round_robin(list(by_cat.values()))[:num_prompts]


def _chat(num_prompts: int | None, seed: int) -> list[Request]:
    """MT-Bench first turns."""
    return [
        Request(id=f"mt-bench/{r['id']}", messages=[{"role": "user", "content": r["turns"][0]}], workload="chat",
                meta={"category": r["category"]})
        for r in _mt_bench_picked(num_prompts, seed)
    ]


def _mt_bench(num_prompts: int | None, seed: int) -> list[Request]:
    """MT-Bench, every turn: the first as the messages, the later ones as followups."""
    return [
        Request(id=f"mt-bench/{r['id']}", messages=[{"role": "user", "content": r["turns"][0]}], workload="mt-bench",
                meta={"category": r["category"]}, followups=list(r["turns"][1:]))
        for r in _mt_bench_picked(num_prompts, seed)
    ]


# --- humaneval: code completion ------------------------------------------------------------------

HUMANEVAL_INSTRUCTION = ("Complete the following Python function. Reply with the complete function (signature, "
                         "docstring and body) in a ```python block.")


def _humaneval(num_prompts: int | None, seed: int) -> list[Request]:
    """HumanEval problems in a seeded order, each as a completion instruction around its prompt."""
    from specctl.workloads.data import humaneval_problems

    rows = humaneval_problems()
    random.Random(seed).shuffle(rows)
    return [
        Request(id=p["id"], workload="humaneval",
                messages=[{"role": "user", "content": f"{HUMANEVAL_INSTRUCTION}\n\n```python\n{p['prompt'].strip()}\n```"}],
                meta={"entry_point": p["entry_point"], "code": p["prompt"]})
        for p in rows[:num_prompts]
    ]


# --- math: CHAMP competition problems ------------------------------------------------------------

MATH_INSTRUCTION = ("Solve the following math problem. Reason step by step, then give the final answer on the last "
                    "line as \"Answer: <answer>\".")


def _math(num_prompts: int | None, seed: int) -> list[Request]:
    """CHAMP problems round-robin over categories (file order), shuffled within each by seed."""
    from specctl.workloads.data import champ_problems

    by_cat: dict[str, list[dict]] = {}
    for p in champ_problems():
        by_cat.setdefault(p["category"], []).append(p)
    rng = random.Random(seed)
    for ps in by_cat.values():
        rng.shuffle(ps)
    return [
        Request(id=f"champ/{p['id']}", workload="math",
                messages=[{"role": "user", "content": f"{MATH_INSTRUCTION}\n\n{p['problem']}"}],
                meta={"category": p["category"], "answer": p["answer"]})
        for p in _round_robin(list(by_cat.values()))[:num_prompts]
    ]


# --- sharegpt: real users' chat, the drafts' training prompts -------------------------------------

SHAREGPT_MAX_CHARS = 6000  # longer first turns (pasted documents) are left out: the recipes cut answers at ~2k tokens


def _sharegpt(num_prompts: int | None, seed: int) -> list[Request]:
    """ShareGPT first human turns in a seeded order (one per conversation, very long ones left out)."""
    from specctl.workloads.data import sharegpt_conversations

    rows = [r for r in sharegpt_conversations() if len(r["turns"][0]) <= SHAREGPT_MAX_CHARS]
    random.Random(seed).shuffle(rows)
    return [Request(id=f"sharegpt/{r['id']}", workload="sharegpt",
                    messages=[{"role": "user", "content": r["turns"][0]}]) for r in rows[:num_prompts]]


_LOADERS = {
    "code-edit": "stdlib", "humaneval": _humaneval, "chat": _chat, "mt-bench": _mt_bench,
    "summarize": "stdlib", "math": _math, "agentic": "stdlib", "sharegpt": _sharegpt,
    "long-4k": "stdlib", "long-16k": "stdlib", "long-32k": "stdlib", "doc-qa": "stdlib",
}
assert set(_LOADERS) == set(WORKLOADS)
_STDLIB_NAMES = ("CODE_MODULES", "MIN_LINES", "MAX_LINES", "AGENTIC_SYSTEM", "AGENTIC_USER", "SUMMARY_INSTRUCTION",
                 "QA_INSTRUCTION", "DOC_MIN_CHARS", "DOC_MAX_CHARS")


def _loader(name: str):
    loader = _LOADERS.get(name)
    if loader == "stdlib":
        from specctl.workloads import stdlib

        return getattr(stdlib, "_" + name.replace("-", "_"))
    return loader


def __getattr__(name: str):
    """The stdlib workloads' constants, importable from here as before they moved (PEP 562)."""
    if name in _STDLIB_NAMES:
        from specctl.workloads import stdlib

        return getattr(stdlib, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
