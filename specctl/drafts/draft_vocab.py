"""EAGLE-3's reduced draft vocabulary: the N most frequent target ids of some text, sorted;
``d2t[i] = target_id - i`` (int64, target = i + d2t[i]) and ``t2d`` bool over the target vocabulary,
the layout vLLM and SGLang load (``build_draft_vocab(tok, data, N)``; ``reduced_vocab_from_counts``
from counts the trainer already has).

What it does not know: the draft network (``specctl.drafts.eagle``), tokenizers beyond ``tok(texts)``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from specctl.errors import DataError


@dataclass
class DraftVocab:
    """EAGLE-3's reduced draft vocabulary (arXiv 2503.01840): N target ids a draft head predicts over."""

    d2t: torch.Tensor  # [N] int64: target id of draft id i = i + d2t[i]
    t2d: torch.Tensor  # [V_target] bool: target id is in the draft vocabulary
    num_tokens_counted: int = 0  # tokens of the data the frequencies came from
    coverage: float = 0.0  # fraction of those tokens whose id is in the draft vocabulary

    @property
    def draft_vocab_size(self) -> int:
        return int(self.d2t.numel())

    @property
    def target_ids(self) -> torch.Tensor:
        """[N] int64, ascending: the target id of each draft id."""
        return self.d2t + torch.arange(self.d2t.numel(), dtype=torch.int64)


def reduced_vocab_from_counts(counts: torch.Tensor, draft_vocab_size: int,
                              always: Iterable[int] = ()) -> DraftVocab:
    """counts: [V_target] token frequencies -> the ``draft_vocab_size`` most frequent ids (ties: lower id).

    ``always`` (e.g. stop tokens) are kept whatever their count; when the data names fewer distinct
    ids than asked, the lowest unseen ids fill the rest so that the size is exactly as asked.
    """
    counts = counts.to(torch.int64).flatten()
    V = counts.numel()
    if not 0 < draft_vocab_size <= V:
        raise DataError(f"draft vocabulary size {draft_vocab_size} is outside [1, {V}] (the target vocabulary)",
                        f"pass --draft-vocab-size between 1 and {V}")
    key = counts.clone()
    forced = torch.tensor(sorted({int(i) for i in always if 0 <= int(i) < V}), dtype=torch.int64)
    if forced.numel() > draft_vocab_size:
        raise DataError(f"{forced.numel()} special tokens do not fit in a draft vocabulary of {draft_vocab_size}",
                        "raise --draft-vocab-size")
    big = int(counts.max()) + 1 if V else 1
    key[forced] = big  # forced ids outrank every counted id
    # stable sort by descending key: equal counts keep ascending id order
    order = torch.sort(-key, stable=True).indices
    chosen = torch.sort(order[:draft_vocab_size]).values  # [N] ascending target ids
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[chosen] = True
    total = int(counts.sum())
    return DraftVocab(chosen - torch.arange(draft_vocab_size, dtype=torch.int64), t2d, total,
                      float(counts[chosen].sum()) / total if total else 0.0)


TEXT_CHUNK = 1 << 20  # characters of a plain-text file read (and tokenized) at a time


def _binary(path: Path) -> bool:
    """A file whose first 8 KiB hold a NUL byte or are not UTF-8 (a model's weights, an archive...)."""
    with open(path, "rb") as f:
        head = f.read(8192)
    if b"\0" in head:
        return True
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        return e.start < len(head) - 3  # not merely a character cut at the end of the sample
    return False


def read_texts(path: str | Path, on_skip=None) -> Iterator[str]:
    """Text of a data file: .jsonl / .json (every string value, e.g. prompt, text, messages[].content),
    any other file as plain text (in chunks of about ``TEXT_CHUNK`` characters, cut at line ends), or
    every file of a folder (recursively, sorted; hidden files and folders, and files that are not text,
    are skipped: ``on_skip(path, why)`` hears of each). A binary file given by name is an error."""
    path = Path(path)
    if path.is_dir():
        for f in sorted(p for p in path.rglob("*") if p.is_file()):
            if any(part.startswith(".") for part in f.relative_to(path).parts):
                continue
            if _binary(f):
                if on_skip is not None:
                    on_skip(f, "not text")
                continue
            yield from read_texts(f)
        return
    if not path.is_file():
        raise DataError(f"no such data file {path}", "pass --data a .jsonl, .json or text file, or a folder")
    try:
        if _binary(path):
            raise DataError(f"{path} is not a text file", "pass --data a .jsonl, .json or text file, or a folder of them")
        if path.suffix == ".jsonl":
            with open(path, encoding="utf-8", errors="replace") as f:
                for n, line in enumerate(f, 1):
                    if line.strip():
                        try:
                            obj = json.loads(line)
                        except json.JSONDecodeError as e:
                            raise DataError(f"{path}:{n} is not valid JSON ({e.msg})", "fix or remove that line") from None
                        yield from _strings(obj)
        elif path.suffix == ".json":
            text = path.read_text(encoding="utf-8", errors="replace")
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                raise DataError(f"{path} is not valid JSON ({e.msg} at line {e.lineno})", "fix the file") from None
            yield from _strings(obj)
        else:
            with open(path, encoding="utf-8", errors="replace") as f:
                rest = ""
                while chunk := f.read(TEXT_CHUNK):
                    text = rest + chunk
                    cut = text.rfind("\n") + 1  # whole lines now, the rest with the next chunk
                    if cut == 0 and len(text) < 4 * TEXT_CHUNK:
                        rest = text
                        continue
                    cut = cut or len(text)
                    yield text[:cut]
                    rest = text[cut:]
                if rest:
                    yield rest
    except OSError as e:
        raise DataError(f"cannot read {path} ({e.strerror})", "check the path and its permissions") from None


def _strings(obj) -> Iterator[str]:
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            if k not in ("id", "role", "category", "question_id", "task_id"):
                yield from _strings(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _strings(v)


def count_tokens(tok, texts: Iterable[str], vocab_size: int | None = None, batch: int = 256) -> torch.Tensor:
    """[vocab_size] int64 frequency of each id in the tokenization of ``texts`` (no special tokens added)."""
    V = vocab_size or len(tok)
    counts = torch.zeros(V, dtype=torch.int64)
    buf: list[str] = []

    def flush():
        if buf:
            for ids in tok(buf, add_special_tokens=False)["input_ids"]:
                t = torch.tensor([i for i in ids if i < V], dtype=torch.int64)
                counts.index_add_(0, t, torch.ones_like(t))
            buf.clear()

    chars = 0
    for text in texts:
        buf.append(text)
        chars += len(text)
        if len(buf) >= batch or chars >= 4 * TEXT_CHUNK:  # bounded: a tokenizer holds every piece of a batch
            flush()
            chars = 0
    flush()
    return counts


def build_draft_vocab(tok, data: str | Path | Iterable[str], draft_vocab_size: int,
                      vocab_size: int | None = None, always: Iterable[int] | None = None,
                      on_skip=None) -> DraftVocab:
    """EAGLE-3's d2t/t2d for target tokenizer ``tok`` from a data file/folder (or texts).

    ``vocab_size``: the target model's vocabulary (default ``len(tok)``); ``always``: ids kept whatever
    their frequency (default: the tokenizer's special tokens). ``train-eagle`` calls this.
    """
    texts = read_texts(data, on_skip) if isinstance(data, (str, Path)) else data
    counts = count_tokens(tok, texts, vocab_size)
    if int(counts.sum()) == 0:
        raise DataError("the data holds no text to count tokens in", "pass --data a file with prompts or text")
    if always is None:
        always = getattr(tok, "all_special_ids", []) or []
    return reduced_vocab_from_counts(counts, draft_vocab_size, always)
