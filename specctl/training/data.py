"""Training data for every trainer (Medusa, EAGLE, MTP): records, prompts, self-distillation, and
tokenisation with a loss mask on the response tokens.

Record files (``read_records``), one JSON object a line in ``.jsonl`` (or a JSON array in ``.json``):

    {"prompt": "...", "response": "..."}                 (also "completion", "output", "answer")
    {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}
    {"conversations": [{"from": "human", "value": "..."}, {"from": "gpt", "value": "..."}]}  (ShareGPT)
    {"text": "..."}                                      (plain text: every token is learnt)

A record with ``"prompt_ids"`` and ``"response_ids"`` (lists of token ids, as ``self_distill`` writes
them) is tokenised as exactly those ids, the response learnt: a self-distillation cache is data as it is.

``.txt``/``.py``/``.md`` files are plain text; a folder is read recursively. A bad line raises ``DataError``
naming the file and line. The learnt tokens are the assistant turns (to the end-of-turn token, rendered with
the target's chat template), or all of a text.

Self-distillation (``self_distill``): the target answers prompts itself through the batched engine
(``offline.generate_batch``, what ``serve`` runs: greedy output is the target's own, bit for bit), its exact
token ids kept, each answer appended to a JSONL cache as written (OUTPUT/data/self_distill.jsonl,
``distill_cache``: an ordinary record file), so an interrupted run continues where it stopped.

What it does not know: models' internals, heads, losses. torch is imported only where needed.
"""

from __future__ import annotations

import json
import os
import random
import zlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from specctl import chat
from specctl.errors import DataError

TEXT_SUFFIXES = (".txt", ".py", ".md", ".rst")
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
         "model": "assistant", "bard": "assistant", "bing": "assistant", "system": "system", "tool": "tool"}
_SHAPES = ('{"prompt": ..., "response": ...}, {"messages": [...]}, {"conversations": [{"from": "human", "value": ...}, '
           '...]} or {"text": ...}')
_FIX = f"each line must be one JSON object: {_SHAPES}"  # .jsonl
_FIX_JSON = f"give a JSON array of objects, each {_SHAPES}"  # .json


@dataclass
class Record:
    """One training item, before tokenisation."""

    messages: list[dict] | None = None  # chat turns; the assistant turns are learnt
    text: str | None = None  # plain text; every token is learnt
    prompt_ids: list[int] | None = None  # exact ids (self-distillation): the prompt ...
    response_ids: list[int] | None = None  # ... and the response, which is learnt
    source: str = ""  # "file, line N": where it came from


@dataclass
class Example:
    """One tokenised training sequence."""

    input_ids: list[int]  # [T]
    loss_mask: list[int]  # [T] 1 where the token is learnt (a response token)
    source: str = ""


# --------------------------------------------------------------------------- reading records

def read_records(path: str | Path, flag: str = "--data") -> list[Record]:
    """All records of a file or folder (see the module docstring); DataError with the line on bad input.
    ``flag``: the option the path came from, which a missing path's error names."""
    path = Path(path).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in (".jsonl", ".json", *TEXT_SUFFIXES))
        if not files:
            raise DataError(f"{path} holds no .jsonl/.json/.txt/.py/.md files", f"point {flag} at a data file or a folder of them")
        return [r for f in files for r in read_records(f, flag)]
    if not path.is_file():
        raise DataError(f"data file {path} does not exist", f"check the path given to {flag}")
    try:
        text = path.read_text(encoding="utf-8-sig")  # a byte-order mark (Windows editors write one) is dropped
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"cannot read {path} ({e})", "give a readable UTF-8 file") from None
    if path.suffix == ".jsonl":
        out = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                where = f"{path}, line {n}"
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{where}: invalid JSON ({e.msg})", _FIX) from None
                out.append(parse_record(obj, where))
        if not out:
            raise DataError(f"{path} holds no records", _FIX)
        return out
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: invalid JSON ({e.msg} at line {e.lineno})", f"{_FIX_JSON} (or one a line in .jsonl)") from None
        items = data if isinstance(data, list) else [data]
        if not items:
            raise DataError(f"{path} holds no records", _FIX_JSON)
        return [parse_record(obj, f"{path}, item {i}", _FIX_JSON) for i, obj in enumerate(items, 1)]
    return [Record(text=text, source=str(path))]


def parse_record(obj, where: str, fix: str = _FIX) -> Record:
    """One JSON object -> Record, or DataError naming ``where`` (with ``fix``: the file type's hint)."""
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}", fix)
    if "conversations" in obj or "messages" in obj:
        key = "conversations" if "conversations" in obj else "messages"
        turns = obj[key]
        if not isinstance(turns, list) or not turns:
            raise DataError(f"{where}: \"{key}\" must be a non-empty list of turns", fix)
        msgs = []
        for i, t in enumerate(turns):
            role = t.get("from", t.get("role")) if isinstance(t, dict) else None
            content = t.get("value", t.get("content")) if isinstance(t, dict) else None
            if not isinstance(role, str) or role.lower() not in ROLES or not isinstance(content, str):
                raise DataError(f"{where}: turn {i} needs a known role (human/gpt/user/assistant/system) and string content",
                                fix)
            msgs.append({"role": ROLES[role.lower()], "content": content})
        if not any(m["role"] == "assistant" and m["content"] for m in msgs):
            raise DataError(f"{where}: no assistant (gpt) turn to learn from", "each conversation needs an answer")
        pi, ri = obj.get("prompt_ids"), obj.get("response_ids")
        if _int_list(pi) and _int_list(ri) and ri:  # a self-distilled answer: keep the exact token ids
            return Record(messages=msgs, prompt_ids=list(pi), response_ids=list(ri), source=where)
        return Record(messages=msgs, source=where)
    if "prompt" in obj:
        resp_key = next((k for k in ("response", "completion", "output", "answer") if k in obj), None)
        if resp_key is None:
            raise DataError(f"{where}: \"prompt\" without \"response\"", fix)
        p, r = obj["prompt"], obj[resp_key]
        if not isinstance(p, str) or not isinstance(r, str) or not r:
            raise DataError(f"{where}: \"prompt\" and \"{resp_key}\" must be strings (a non-empty response)", fix)
        return Record(messages=[{"role": "user", "content": p}, {"role": "assistant", "content": r}], source=where)
    if "text" in obj:
        if not isinstance(obj["text"], str) or not obj["text"]:
            raise DataError(f"{where}: \"text\" must be a non-empty string", fix)
        return Record(text=obj["text"], source=where)
    raise DataError(f"{where}: no \"prompt\"/\"response\", \"messages\", \"conversations\" or \"text\" key", fix)


def _int_list(x) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


# --------------------------------------------------------------------------- prompts

def load_prompts(spec: str, hold_out: int = 0) -> list:
    """Requests (``specctl.workloads.Request``) to self-distill from.

    ``spec``: a built-in workload name (code-edit, sharegpt, agentic: ``self_distill_workloads``), whose
    first ``hold_out`` prompts (seed 0: those ``specctl bench -n N`` runs for N <= hold_out) are left out,
    together with any other prompt on the same function; a ``.txt`` file (one prompt a line); or a ``.jsonl``."""
    from specctl.workloads import WORKLOADS, Request, load_workload

    if spec in WORKLOADS:
        reqs = load_workload(spec, None, 0)
        held = reqs[:hold_out]
        funcs = {(r.meta.get("module"), r.meta.get("function")) for r in held if r.meta.get("function")}
        return [r for r in reqs[hold_out:] if (r.meta.get("module"), r.meta.get("function")) not in funcs]
    check_prompt_source(spec)
    path = Path(spec).expanduser()
    if path.suffix == ".txt":
        lines = [x for x in path.read_text(encoding="utf-8-sig").splitlines() if x.strip()]
        return [Request(id=f"{path.stem}:{i}", messages=[{"role": "user", "content": x}], workload=str(path))
                for i, x in enumerate(lines, 1)]
    return load_workload(str(path))


def check_prompt_source(spec: str) -> None:
    """What ``load_prompts`` refuses, said before any model loads: an evaluation workload, a missing prompt file
    or a folder, an unknown workload."""
    import difflib

    from specctl.errors import UsageError
    from specctl.workloads import WORKLOADS

    path, (name, at, rounds) = Path(spec).expanduser(), spec.rpartition("@")
    if spec.partition("@")[0] in EVALUATION_WORKLOADS:  # NAME@ROUNDS too
        raise DataError(f"--self-distill {spec} is an evaluation workload (specctl bench measures drafts on it)",
                        "train on other prompts, e.g. --self-distill sharegpt --distill-max-prompts 2000")
    if spec in WORKLOADS or path.is_file() or (at and name in WORKLOADS and rounds.isdigit()):  # a file or NAME@R
        return
    takes = self_distill_workloads()
    if path.exists() or path.suffix in (".txt", ".jsonl") or os.sep in spec or "/" in spec:
        raise DataError(f"prompt file {path} {'is a folder' if path.is_dir() else 'does not exist'}",
                        f"check the path, or give a workload --self-distill takes: {', '.join(takes)}")
    close = difflib.get_close_matches(spec, takes, n=1)
    raise UsageError(f"unknown workload '{spec}' for --self-distill",
                     f"{f'did you mean {close[0]}? ' if close else ''}use one of {', '.join(takes)}, or a .jsonl/.txt prompt file")


def self_distill_workloads() -> list[str]:
    """The built-in workloads --self-distill takes: all but the evaluation workloads (``EVALUATION_WORKLOADS``)."""
    from specctl.workloads import WORKLOADS

    return [n for n in WORKLOADS if n not in EVALUATION_WORKLOADS]


def self_distill(loaded, requests: list, *, max_new_tokens: int, temperature: float = 0.0, seed: int = 0,
                 seq_len: int | None = None, cache: Path | None = None, samples: int = 1, batch_rows: int = 32,
                 progress: Callable[[str, int, int], None] = lambda *a: None,
                 log: Callable[[str], None] = lambda m: None) -> list[Record]:
    """The target (a LoadedModel) answers each request with the own runtime; returns Records with exact ids.

    Prompts are sorted by length and answered ``batch_rows`` rows at a time through the batched
    engine (``offline.generate_batch``): on a CPU a batch step reads the weights once for every row,
    so 32 answers cost a few times one. ``samples`` > 1 (with temperature > 0): that many
    sampled answers per prompt. Answers are appended to ``cache`` as they are done, so an interrupted
    run resumes where it stopped.
    """
    import torch

    if samples > 1 and temperature <= 0:
        from specctl.errors import UsageError

        raise UsageError("several answers per prompt need sampling", "set --distill-temperature > 0 (e.g. 0.7)")

    from specctl.runtime.offline import generate_batch

    settings = {"model": str(loaded.path), "dtype": str(loaded.dtype).removeprefix("torch."),
                "max_new_tokens": max_new_tokens, "temperature": temperature, "seed": seed}
    if samples > 1:
        settings["samples"] = samples
    done = _read_cache(cache, settings) if cache is not None else {}
    prompts, skipped = [], 0
    for req in requests:
        ids = chat.render(loaded.tokenizer, req.messages)
        room = max_new_tokens if seq_len is None else min(max_new_tokens, seq_len - len(ids))
        if room < min(8, max_new_tokens):  # no room left for a useful answer
            skipped += 1
            continue
        prompts.append((req, ids, room))
    if skipped:
        log(f"self-distillation: {skipped} prompt(s) longer than the sequence length left out")
    todo = sorted((p for p in prompts if p[0].id not in done), key=lambda p: len(p[1]))
    if prompts:
        log(f"self-distillation: the target answers {len(todo)} prompt(s), {len(prompts) - len(todo)} answered "
            f"already{f' (in {cache})' if cache is not None else ''}")
    per_batch = max(1, batch_rows // samples)
    fh = None
    if cache is not None and todo:
        cache.parent.mkdir(parents=True, exist_ok=True)
        torn = cache.is_file() and cache.stat().st_size > 0 and not cache.read_bytes().endswith(b"\n")
        fh = open(cache, "a", encoding="utf-8")
        if torn:  # a crash mid-line: end that line, so the next answer starts a line of its own
            fh.write("\n")
    try:
        for i in range(0, len(todo), per_batch):
            group = todo[i:i + per_batch]
            gen = torch.Generator(device=loaded.model.embed.weight.device).manual_seed(
                seed * 1_000_003 + zlib.crc32(group[0][0].id.encode()))
            answers = generate_batch(loaded.model, [ids for _, ids, _ in group for _ in range(samples)],
                                     [room for _, _, room in group for _ in range(samples)],
                                     temperature=temperature, stop_token_ids=loaded.stop_token_ids, generator=gen)
            for j, (req, ids, _) in enumerate(group):
                rows = []
                for response, finish in answers[j * samples:(j + 1) * samples]:
                    text = loaded.tokenizer.decode(response, skip_special_tokens=True)
                    rows.append({"id": req.id, "messages": req.messages + [{"role": "assistant", "content": text}],
                                 "prompt_ids": ids, "response_ids": response, "finish_reason": finish,
                                 "settings": settings})
                done[req.id] = rows
                if fh is not None:
                    fh.write("".join(json.dumps(row) + "\n" for row in rows))
            if fh is not None:
                fh.flush()
            progress("self-distill", min(i + per_batch, len(todo)), len(todo))
    finally:
        if fh is not None:
            fh.close()
    out = []
    for req, _, _ in prompts:
        for row in done[req.id]:
            out.append(Record(messages=row["messages"], prompt_ids=row["prompt_ids"], response_ids=row["response_ids"],
                              source=f"self-distilled {req.id}"))
    return out


def _read_cache(path: Path, settings: dict) -> dict[str, dict]:
    """Answers already in the cache for these settings (a torn last line from a crash is ignored)."""
    if not path.is_file():
        return {}
    out = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and row.get("settings") == settings and "response_ids" in row:
            out.setdefault(row["id"], []).append(row)
    return out


# --------------------------------------------------------------------------- tokenisation

def encode(tokenizer, record: Record, seq_len: int, stop_ids=()) -> list[Example]:
    """A record -> examples of at most ``seq_len`` tokens (a long text is cut into several).

    Chat: each assistant turn's tokens are learnt, up to and including the first stop token in it
    (what the template adds after the end-of-turn token is never generated). A record with nothing
    left to learn gives no example.
    """
    stop = set(stop_ids)
    if record.prompt_ids is not None:
        ids = list(record.prompt_ids) + list(record.response_ids)
        mask = [0] * len(record.prompt_ids) + [1] * len(record.response_ids)
    elif record.text is not None:
        ids = tokenizer(record.text)["input_ids"]
        out = []
        for s in range(0, max(1, len(ids) - 1), seq_len):
            chunk = ids[s:s + seq_len]
            if len(chunk) >= 4:
                out.append(Example(chunk, [1] * len(chunk), record.source))
        return out
    elif chat.has_template(tokenizer):
        msgs = record.messages
        ids = chat.template_ids(tokenizer, msgs, False)
        mask = [0] * len(ids)
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            start = len(chat.template_ids(tokenizer, msgs[:i], True)) if i else 0
            end = len(chat.template_ids(tokenizer, msgs[:i + 1], False))
            for j in range(start, min(end, len(ids))):
                mask[j] = 1
                if ids[j] in stop:
                    break
    else:  # no template: turns joined by blank lines
        ids, mask = [], []
        for m in record.messages:
            piece = tokenizer.encode(m["content"] + "\n\n", add_special_tokens=not ids)
            ids += piece
            mask += [int(m["role"] == "assistant")] * len(piece)
    ids, mask = ids[:seq_len], mask[:seq_len]
    return [Example(ids, mask, record.source)] if any(mask[1:]) else []


EVALUATION_WORKLOADS = ("chat", "mt-bench", "humaneval", "math")  # what bench measures drafts on


class EvaluationGuard:
    """Refuses training data that holds an evaluation prompt (an MT-Bench turn, a HumanEval prompt, a
    CHAMP problem, alone or inside a longer prompt): a draft trained on them measures what it memorised.

    Checked against the evaluation sets in the cache (``specctl bench`` fetches them on first use;
    ``fetch=True`` fetches them now). A text's word 8-grams are looked up against each evaluation
    prompt's first eight words, then the whole prompt is compared: linear in the data's size.
    """

    def __init__(self, fetch: bool = False):
        from specctl.workloads.data import evaluation_texts

        self.texts = evaluation_texts(fetch)
        self.heads: dict[tuple, list[str]] = {}
        for t in self.texts:
            self.heads.setdefault(tuple(t.split()[:8]), []).append(t)

    def find(self, text: str) -> str | None:
        """The evaluation set ``text`` holds a prompt of, or None."""
        from specctl.workloads.data import normalise

        if not self.texts:
            return None
        norm = normalise(text)
        words = norm.split()
        for i in range(max(1, len(words) - 7)):
            for t in self.heads.get(tuple(words[i:i + 8]), ()):
                if t in norm:
                    return self.texts[t]
        return None

    def check(self, text: str, where: str) -> None:
        found = self.find(text)
        if found is not None:
            raise DataError(f"{where} holds an evaluation prompt ({found}): a draft trained on it is measured on what "
                            "it memorised", "remove it from the training data (train on e.g. --self-distill sharegpt)")


def check_not_evaluation(records: list[Record], prompts: list = (), guard: EvaluationGuard | None = None) -> None:
    """DataError when a record's user/system turn or a prompt to self-distill holds an evaluation prompt."""
    guard = guard or EvaluationGuard()
    for r in records:
        texts = [r.text] if r.text is not None else [m["content"] for m in r.messages or () if m["role"] != "assistant"]
        for t in texts:
            guard.check(t, r.source or "a training record")
    for req in prompts:
        for m in req.messages:
            if m["role"] != "assistant":
                guard.check(m["content"], f"self-distillation prompt {req.id}")


def distill_requests(cfg) -> list:
    """The prompts of every cfg.self_distill source (each after its hold-out, at most
    cfg.distill_max_prompts of it), a prompt met twice kept once. An evaluation workload is refused."""
    requests, seen = [], set()
    for spec in cfg.self_distill:
        check_prompt_source(spec)
        for r in load_prompts(spec, cfg.hold_out)[:cfg.distill_max_prompts]:
            if r.id not in seen:
                seen.add(r.id)
                requests.append(r)
    return requests


DISTILL_CACHE = Path("data") / "self_distill.jsonl"
_OLD_DISTILL_CACHES = (Path("self_distill.jsonl"), Path("checkpoint") / "self_distill.jsonl")  # before data/
DISTILL_CACHES = (DISTILL_CACHE, *_OLD_DISTILL_CACHES)


def distill_cache(output: str | Path) -> Path:
    """A run's self-distillation cache, output/data/self_distill.jsonl; one left by an older specctl
    (train-eagle's output/self_distill.jsonl, train-mtp's output/checkpoint/self_distill.jsonl) is moved there."""
    path = Path(output) / DISTILL_CACHE
    if not path.exists():
        for old in _OLD_DISTILL_CACHES:
            if (Path(output) / old).is_file():
                path.parent.mkdir(parents=True, exist_ok=True)
                os.replace(Path(output) / old, path)
                break
    return path


def distill_records(cfg, loaded, *, seq_len: int | None, log: Callable[[str], None] = lambda m: None,
                    progress: Callable[[str, int, int], None] = lambda *a: None) -> list[Record]:
    """The target's answers to the cfg.self_distill prompts (cached in the run's data/ folder)."""
    if not cfg.self_distill:
        return []
    requests = distill_requests(cfg)
    check_not_evaluation([], requests)
    return self_distill(loaded, requests, max_new_tokens=cfg.max_new_tokens,
                        temperature=cfg.distill_temperature, seed=cfg.seed, seq_len=seq_len,
                        samples=cfg.distill_samples, cache=distill_cache(cfg.output), progress=progress, log=log)


def build_examples(cfg, loaded, log: Callable[[str], None] = lambda m: None,
                   progress: Callable[[str, int, int], None] = lambda *a: None,
                   records: list[Record] | None = None) -> list[Example]:
    """Every training sequence of a run: cfg.data records (read here unless given), then the
    self-distilled answers to cfg.self_distill."""
    if records is None:
        records = [r for path in cfg.data for r in read_records(path)]
    records = list(records)
    check_not_evaluation(records)
    if records:
        log(f"{len(records)} record(s) from {', '.join(map(str, cfg.data))}")
    records += distill_records(cfg, loaded, seq_len=cfg.seq_len, log=log, progress=progress)
    examples = [e for r in records for e in encode(loaded.tokenizer, r, cfg.seq_len, loaded.stop_token_ids)]
    if not examples:
        if any(encode(loaded.tokenizer, r, 1 << 30, loaded.stop_token_ids) for r in records[:64]):
            raise DataError(f"no training sequence has tokens to learn: at --seq-len {cfg.seq_len} every one is cut "
                            "before its response starts (the prompt and chat template fill it)",
                            "raise --seq-len (e.g. --seq-len 1024)")
        raise DataError("no training sequence has tokens to learn", "check that the data has responses (assistant turns)")
    return examples


def split(examples: list[Example], eval_split: float, seed: int) -> tuple[list[Example], list[Example]]:
    """(train, eval): a seeded shuffle; eval gets round(eval_split * n) examples, at least one when asked and n >= 2."""
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    n_eval = 0 if eval_split <= 0 or len(examples) < 2 else max(1, round(eval_split * len(examples)))
    return [examples[i] for i in sorted(order[n_eval:])], [examples[i] for i in sorted(order[:n_eval])]


def top_tokens(examples: list[Example], n: int, vocab_size: int, always=()):
    """The n most frequent learnt tokens (plus ``always``), as a sorted LongTensor of vocabulary ids."""
    import torch

    counts = Counter(t for e in examples for t, m in zip(e.input_ids, e.loss_mask) if m)
    keep = dict.fromkeys(t for t in always if 0 <= t < vocab_size)  # an ordered set
    ranked = [t for t, _ in counts.most_common() if 0 <= t < vocab_size]
    for t in ranked + list(range(vocab_size)):  # fewer distinct tokens than n: fill with the lowest ids
        if len(keep) >= n:
            break
        keep.setdefault(t)
    return torch.tensor(sorted(list(keep)[:n]), dtype=torch.long)


def coverage(examples: list[Example], token_map) -> float:
    """Fraction of the learnt tokens inside ``token_map``."""
    inside = set(token_map.tolist())
    toks = [t for e in examples for t, m in zip(e.input_ids, e.loss_mask) if m]
    return sum(t in inside for t in toks) / max(1, len(toks))


def write_prompt_file(requests: list, path: str | Path) -> Path:
    """Write requests as a .jsonl prompt file ({"id", "messages"} a line), atomically."""
    from specctl.files import write_text_atomic

    return write_text_atomic(path, "".join(json.dumps({"id": r.id, "messages": r.messages}) + "\n" for r in requests))
