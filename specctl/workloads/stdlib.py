"""Workloads built from the Python standard library on the machine: code-edit, agentic, summarize, long-*, doc-qa.

See ``specctl.workloads`` for what each one is; that module dispatches here by name. The
prompts are deterministic for a given Python and seed (a fixed list of modules, seeded choices).

What it does not know: the data in wheels, user prompt files, tokenizers. No torch import.
"""

from __future__ import annotations

import ast
import functools
import random
import re
import sysconfig
import textwrap
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from specctl.errors import DataError
from specctl.workloads.request import Request, _round_robin

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


def _stdlib_sources():
    """(module, source, parsed tree) of each CODE_MODULES file that exists and parses here."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for mod in CODE_MODULES:
        src_path = next((p for p in (stdlib / f"{mod}.py", stdlib / mod / "__init__.py") if p.is_file()), None)
        if src_path is None:
            continue
        try:
            source = src_path.read_text(encoding="utf-8")
            yield mod, source, ast.parse(source)
        except (OSError, SyntaxError, UnicodeDecodeError):
            continue


@functools.lru_cache(maxsize=1)
def _stdlib_functions() -> list[_Func]:
    out: list[_Func] = []
    for mod, source, tree in _stdlib_sources():
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


# --- summarize: a long real document in the prompt -----------------------------------------------

DOC_MIN_CHARS, DOC_MAX_CHARS = 3000, 10000  # about 800 to 2500 tokens
SUMMARY_INSTRUCTION = ("Summarise the following section of the Python documentation for a programmer who knows other "
                       "languages: one short paragraph, then its key rules as a bulleted list.")
QA_INSTRUCTION = ("Answer the question using only the document above.\n\nQuestion: what does `{name}` in module "
                  "`{module}` do, which parameters does it take, and what does it return? Quote its signature line.")


def _cut(text: str, limit: int) -> str:
    """``text`` up to its last paragraph break within ``limit`` characters (all of it when it fits)."""
    if len(text) <= limit:
        return text
    head = text[:limit]
    return head[:head.rfind("\n\n")] if "\n\n" in head else head


@functools.lru_cache(maxsize=1)
def _reference_sections() -> tuple[tuple[str, str], ...]:
    """(topic, text) of the Python reference manual sections shipped with the interpreter (pydoc_data)."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return ()
    out = []
    for name in sorted(topics):
        text = _cut(topics[name].strip(), DOC_MAX_CHARS)
        if len(text) >= DOC_MIN_CHARS:
            out.append((name, text))
    return tuple(out)


@functools.lru_cache(maxsize=1)
def _source_documents() -> tuple[tuple[str, str, tuple[str, ...]], ...]:
    """(module, excerpt, public functions defined in it): each CODE_MODULES file from its start, whole
    top-level statements up to DOC_MAX_CHARS."""
    out = []
    for mod, source, tree in _stdlib_sources():
        lines = source.splitlines()
        end, names = 0, []
        for node in tree.body:
            if len("\n".join(lines[:node.end_lineno])) > DOC_MAX_CHARS:
                break
            end = node.end_lineno
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names.append(node.name)
            elif isinstance(node, ast.ClassDef):
                names += [f"{node.name}.{n.name}" for n in node.body
                          if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and not n.name.startswith("_")]
        excerpt = "\n".join(lines[:end])
        names = [n for n in names if not n.split(".")[-1].startswith("_")]
        if len(excerpt) >= DOC_MIN_CHARS and names:
            out.append((mod.replace("/__init__", "").replace("/", "."), excerpt, tuple(names)))
    return tuple(out)


def _summarize(num_prompts: int | None, seed: int) -> list[Request]:
    """Reference sections to summarise and source files to answer from, alternating, each kind shuffled by seed."""
    rng = random.Random(seed)
    summaries = [
        Request(id=f"summarize/reference:{name}", workload="summarize",
                messages=[{"role": "user", "content": f"{SUMMARY_INSTRUCTION}\n\n{text}"}],
                meta={"task": "summary", "document": f"reference:{name}", "chars": len(text)})
        for name, text in _reference_sections()
    ]
    questions = []
    for module, excerpt, names in _source_documents():
        name = rng.choice(names)
        text = f"Document: {module}.py\n\n```python\n{excerpt}\n```\n\n" + QA_INSTRUCTION.format(name=name, module=module)
        questions.append(Request(id=f"summarize/source:{module}:{name}", workload="summarize",
                                 messages=[{"role": "user", "content": text}],
                                 meta={"task": "qa", "document": f"source:{module}", "function": name,
                                       "chars": len(excerpt)}))
    if not summaries and not questions:
        raise DataError(f"No documents of {DOC_MIN_CHARS}-{DOC_MAX_CHARS} characters found in the standard library at "
                        f"{sysconfig.get_paths()['stdlib']}", "Use a Python with its standard library sources installed")
    rng.shuffle(summaries)
    rng.shuffle(questions)
    return _round_robin([summaries, questions])[:num_prompts]


# --- long-4k / long-16k / long-32k: a long document and a question from its beginning -----------------

LONG_TOKENS = {"long-4k": 4096, "long-16k": 16384, "long-32k": 32768}
# Python source in a Qwen2.5 / Llama-3-style BPE: about 4.3 characters a token (3.9 to 4.6 measured on
# these documents with Qwen2.5-Coder's tokenizer); a document is cut to LONG_TOKENS * this many characters
CHARS_PER_TOKEN = 4.3
LONG_QUESTION = ("The files above are from the Python standard library. Explain what `{name}` in file `{file}` "
                 "does, step by step, then quote its complete source code.")
LONG_PROMPTS = 8


def _long_documents(tokens: int, num_prompts: int | None, seed: int) -> list[Request]:
    """Whole stdlib source files, in a seeded order, up to ``tokens`` tokens in all (the last file cut
    at a line), then a question about a function of the first file: the answer lies a whole context
    back, and quoting it copies from the prompt (long-context QA / RAG)."""
    sources = [(mod, src, tree) for mod, src, tree in _stdlib_sources()]
    if not sources:
        raise DataError(f"no standard-library sources found at {sysconfig.get_paths()['stdlib']}",
                        "use a Python with its standard library sources installed")
    limit = int(tokens * CHARS_PER_TOKEN)
    asked = [(m, t) for m, _, t in sources if _public_functions(t)]
    out = []
    for i in range(min(num_prompts or LONG_PROMPTS, len(asked))):
        rng = random.Random(seed * 1000 + i)
        first = asked[(seed + i * 7) % len(asked)]  # a different file for every prompt
        order = sources[:]
        rng.shuffle(order)
        order.sort(key=lambda x: x[0] != first[0])  # the asked-about file first
        parts, size = [], 0
        for mod, src, _ in order * (1 + limit // max(sum(len(s) for _, s, _ in order), 1)):
            block = f"# File: {mod.replace('/__init__', '')}.py\n{src}\n"
            if size + len(block) > limit:
                block = block[:limit - size]
                block = block[:block.rfind("\n") + 1]
            parts.append(block)
            size += len(block)
            if size >= limit - 200:
                break
        name = rng.choice(_public_functions(first[1]))
        file = first[0].replace("/__init__", "") + ".py"
        text = "".join(parts) + "\n" + LONG_QUESTION.format(name=name, file=file)
        out.append(Request(id=f"long-{tokens // 1024}k/{file}:{name}#{i}", workload=f"long-{tokens // 1024}k",
                           messages=[{"role": "user", "content": text}],
                           meta={"task": "long-qa", "file": file, "function": name, "chars": len(text)}))
    return out


def _public_functions(tree: ast.Module) -> list[str]:
    return [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and not n.name.startswith("_")]


_long_4k = functools.partial(_long_documents, LONG_TOKENS["long-4k"])
_long_16k = functools.partial(_long_documents, LONG_TOKENS["long-16k"])
_long_32k = functools.partial(_long_documents, LONG_TOKENS["long-32k"])


# --- doc-qa: a long document, then a question whose answer quotes it -------------------------------

QA_MIN_CHARS, QA_MAX_CHARS = 4000, 16000  # about 1k to 4k tokens (CHARS_PER_TOKEN)
DOC_QA_INSTRUCTION = "Answer the question using only the document above, quoting it exactly where asked."
DOC_QA_QUESTIONS = {  # template -> question; the first four ask about reference sections, the rest about source
    "entries": "List the names of the functions, methods and classes this section defines, in order, each with its "
               "entry line and the sentence of the document that defines it, quoted exactly.",
    "grammar": "Quote exactly the grammar rules this section gives (the lines with `::=`), in order; then, for each "
               "rule named on the left, quote the sentence of the document that explains what it defines.",
    "headings": "List the titles of this section's subsections, in order, each with the first sentence under it "
                "quoted exactly.",
    "term": "Which sentences of this section mention \"{target}\"? Quote each of them exactly, in order, then say in "
            "one sentence what the section says about \"{target}\".",
    "signatures": "List every top-level function and class in this file, in order, each with its `def` or `class` line "
                  "quoted exactly and the first line of its docstring quoted exactly (or \"no docstring\").",
    "lookup": "Which function in this file is described as \"{target}\"? Give its name, then quote its signature and "
              "its complete docstring exactly.",
    "raises": "Which functions in this file raise an exception? For each, quote its `def` line and every `raise` "
              "statement in it exactly, in file order.",
}
_ENTRY = re.compile(r"^((?:class )?[\w.]+\(.*\))\n\n   \S", re.M)  # "str.center(width[, fillchar])" above its text
_HEADING = re.compile(r"^(\S.*)\n[=-]{3,}$", re.M)  # a subsection title (the section's own is underlined with *)
_TERM = re.compile(r'"([^"\n]{2,30})"')  # code in running text: "async for", "__slots__"
_Tasks = dict[str, tuple[list[str], str | None]]  # template -> (quotes, the target the question names)


def _reference_tasks(doc: str, rng: random.Random) -> _Tasks:
    """template -> (the spans of ``doc`` its answer quotes, the term the question names) for a reference section."""
    out: _Tasks = {}
    if len(entries := _ENTRY.findall(doc)) >= 3:
        out["entries"] = (entries, None)
    if len(rules := [line.strip() for line in doc.splitlines() if "::=" in line]) >= 2:
        out["grammar"] = (rules, None)
    if len(titles := _HEADING.findall(doc)) >= 2:
        out["headings"] = (titles, None)
    counts = Counter(_TERM.findall(doc))
    if terms := sorted(t for t, c in counts.items() if 2 <= c <= 6 and t.strip() == t):
        term = rng.choice(terms)
        out["term"] = ([f'"{term}"'], term)
    return out


def _source_tasks(source: str, tree: ast.Module, doc: str, rng: random.Random) -> _Tasks:
    """The same for ``doc``, the start of ``source``: only definitions that lie whole in it are asked about."""
    lines, last = source.splitlines(), doc.count("\n") + 1
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef)
    tops = [n for n in tree.body if isinstance(n, (*kinds, ast.ClassDef)) and n.lineno <= last]  # its def line shown
    funcs = [n for n in tops if isinstance(n, kinds)] + [
        m for c in tops if isinstance(c, ast.ClassDef) for m in c.body if isinstance(m, kinds)]
    funcs = sorted((f for f in funcs if f.end_lineno <= last), key=lambda n: n.lineno)  # whole in the document
    out: _Tasks = {}
    if len(tops) >= 2:
        out["signatures"] = ([lines[n.lineno - 1] for n in tops], None)
    described = [(f, ast.get_docstring(f).splitlines()[0].strip()) for f in funcs if ast.get_docstring(f)]
    if described := [(f, s) for f, s in described if len(s) >= 20 and doc.count(s) == 1]:
        f, summary = rng.choice(described)
        out["lookup"] = ([lines[f.lineno - 1].strip(), summary], summary)
    raising = [[lines[f.lineno - 1].strip()] + [ast.get_source_segment(source, r) for r in ast.walk(f)
                                                if isinstance(r, ast.Raise)] for f in funcs]
    if raising := [q for quotes in raising if len(quotes) > 1 for q in quotes]:
        out["raises"] = (raising, None)
    return out


def _doc_qa(num_prompts: int | None, seed: int) -> list[Request]:
    """Reference sections and source files alternating, each of 4k-16k characters (cut at a blank line), with a
    question whose answer quotes the document: within each kind, templates round-robin, distinct documents first."""
    rng = random.Random(seed)
    try:
        from pydoc_data.topics import topics
    except ImportError:
        topics = {}
    docs = [[], []]  # (document id, prompt head, document, tasks) of reference sections, then of source files
    for name in sorted(topics):
        doc = _cut(topics[name].strip(), QA_MAX_CHARS)
        head = f'Document: the Python reference manual, section "{name}"\n\n{doc}'
        docs[0].append((f"reference:{name}", head, doc, _reference_tasks(doc, rng)))
    for mod, source, tree in _stdlib_sources():
        module = mod.replace("/__init__", "").replace("/", ".")
        doc = _cut(source, QA_MAX_CHARS).rstrip("\n")
        head = f"Document: {module}.py\n\n```python\n{doc}\n```"
        docs[1].append((f"source:{module}", head, doc, _source_tasks(source, tree, doc, rng)))
    kinds = []
    for kind in docs:
        by_template: dict[str, list] = {}
        for doc_id, head, doc, tasks in kind:
            if len(doc) >= QA_MIN_CHARS:
                for template, (quotes, target) in tasks.items():
                    by_template.setdefault(template, []).append((doc_id, head, doc, template, quotes, target))
        for template in sorted(by_template):
            rng.shuffle(by_template[template])
        firsts, rest, seen = [], [], set()
        for task in _round_robin([by_template[t] for t in sorted(by_template)]):
            (rest if task[0] in seen else firsts).append(task)
            seen.add(task[0])
        kinds.append(firsts + rest)
    if not any(kinds):
        raise DataError(f"No documents of {QA_MIN_CHARS}-{QA_MAX_CHARS} characters found in the standard library at "
                        f"{sysconfig.get_paths()['stdlib']}", "Use a Python with its standard library sources installed")
    return [
        Request(id=f"doc-qa/{doc_id}/{template}", workload="doc-qa",
                messages=[{"role": "user", "content": f"{head}\n\n{DOC_QA_INSTRUCTION}\n\nQuestion: "
                                                      + DOC_QA_QUESTIONS[template].format(target=target)}],
                meta={"task": template, "document": doc_id, "chars": len(doc), "quotes": quotes, "target": target})
        for doc_id, head, doc, template, quotes, target in _round_robin(kinds)[:num_prompts]
    ]
