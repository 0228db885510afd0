"""Vocabulary maps: a draft speaking a different tokenizer (and the file that also carries EAGLE-3's
reduced draft vocabulary, ``specctl.drafts.draft_vocab``).

What it does:
  - ``token_bytes(tok)``: the byte string each token id stands for, with the tokenizer's spelling
    undone: byte-level BPE's printable stand-ins ('Ġ' = space, 'Ċ' = newline, ...), sentencepiece's
    '▁' space marker and its ``<0xNN>`` byte tokens. Added/special tokens stand for their content.
  - ``build_vocab_map(draft_tok, target_tok)``: the token-level intersection. A draft id maps to the
    target id with the same byte string (a token of the same kind, normal or added, first), else to
    -1. Worked example, GPT-2 style draft -> sentencepiece target:
        draft 'Ġhello' = b' hello'  -> target '▁hello' = b' hello'
        draft 'Ċ'      = b'\\n'      -> target '<0x0A>' = b'\\n'
        draft 'Ġhelloworld' (no such target token) -> -1, suppressed when drafting.
  - ``tokenizer_fingerprint(tok)``: sha256 of the vocabulary (every id's token string, added tokens
    marked), stored in every map file so that a map is never applied to another pair of tokenizers.
  - Save/load as safetensors (tensors + string metadata) or JSON (by the file suffix), atomically.

What it does not know: models, drafting, verification (``proposers/draft_model.py`` applies a map).
It imports torch but never transformers: tokenizers are passed in.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specctl.drafts.draft_vocab import DraftVocab
from specctl.errors import DataError
from specctl.files import write_bytes_atomic

FORMAT = "specctl-vocab-map"
VERSION = 1
SUPPRESSED = -1  # draft_to_target entry of a draft token outside the intersection

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


# --------------------------------------------------------------------------- token byte strings

def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (byte-level BPE spells every byte with one of these)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


_UNICODE_TO_BYTE = {c: b for b, c in _bytes_to_unicode().items()}


def _component_types(state: dict | None) -> set[str]:
    """Every ``type`` in a tokenizers component's JSON state (Sequence members included)."""
    out: set[str] = set()
    if isinstance(state, dict):
        if "type" in state:
            out.add(state["type"])
            if state["type"] == "Replace" and "▁" in json.dumps(state.get("pattern"), ensure_ascii=False):
                out.add("Metaspace")
        for v in state.values():
            if isinstance(v, list):
                for x in v:
                    out |= _component_types(x)
            elif isinstance(v, dict):
                out |= _component_types(v)
    return out


def tokenizer_scheme(tok) -> str:
    """How the tokenizer spells bytes: "byte_level" (GPT-2 'Ġ'), "sentencepiece" ('▁', <0xNN>) or "plain"."""
    backend = getattr(tok, "backend_tokenizer", None)
    kinds: set[str] = set()
    if backend is not None:
        for comp in (backend.decoder, backend.pre_tokenizer):
            if comp is not None:
                try:
                    kinds |= _component_types(json.loads(comp.__getstate__()))
                except Exception:  # noqa: BLE001 - a component without JSON state tells us nothing
                    pass
    if "ByteLevel" in kinds:
        return "byte_level"
    if "Metaspace" in kinds or "ByteFallback" in kinds:
        return "sentencepiece"
    # A slow tokenizer or an unusual pipeline: look at the tokens themselves.
    vocab = tok.get_vocab()
    sample = list(vocab)[:5000]
    if sum(t.startswith("Ġ") for t in sample) > 0.02 * len(sample):
        return "byte_level"
    if sum("▁" in t for t in sample) > 0.02 * len(sample):
        return "sentencepiece"
    return "plain"


def _id_to_token(tok) -> list[str | None]:
    """[len(tok)] token string per id (None for an id the tokenizer does not define)."""
    vocab = tok.get_vocab()
    n = max(len(tok), max(vocab.values(), default=-1) + 1)
    table: list[str | None] = [None] * n
    for t, i in vocab.items():
        table[i] = t
    return table


def _added_ids(tok) -> set[int]:
    return set(tok.get_added_vocab().values())


def token_bytes(tok) -> list[bytes | None]:
    """[len(tok)] the byte string each id stands for, spelling undone (see the module docstring).

    Added (special) tokens stand for their content's UTF-8; None marks an id without a token.
    """
    scheme = tokenizer_scheme(tok)
    added = _added_ids(tok)
    out: list[bytes | None] = []
    for i, t in enumerate(_id_to_token(tok)):
        if t is None:
            out.append(None)
        elif i in added:
            out.append(t.encode("utf-8"))
        elif scheme == "byte_level":
            try:
                out.append(bytes(_UNICODE_TO_BYTE[c] for c in t))
            except KeyError:  # a character outside the byte table: the token is literal text
                out.append(t.encode("utf-8"))
        elif scheme == "sentencepiece":
            m = _BYTE_TOKEN.match(t)
            out.append(bytes([int(m.group(1), 16)]) if m else t.replace("▁", " ").encode("utf-8"))
        else:
            out.append(t.encode("utf-8"))
    return out


def tokenizer_fingerprint(tok) -> str:
    """sha256 (hex) of the vocabulary: every id's token string, added tokens marked. Same vocab, same hash."""
    added = _added_ids(tok)
    table = _id_to_token(tok)
    h = hashlib.sha256()
    h.update(f"{len(table)}\n".encode())
    for i, t in enumerate(table):
        h.update(f"{i}\t{'A' if i in added else 'N'}\t{t}\n".encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def span_agreement(target_lens: list[int], draft_lens: list[int]) -> float:
    """Fraction of target tokens whose byte span is also one draft token's span, both texts aligned at
    their end. The most a token-level intersection can accept: a target token cut elsewhere by the
    draft's tokenizer is never proposed. Example: target [b'(n', b'):'] vs draft [b'(', b'n', b'):'] -> 0.5.
    """
    def spans(lens: list[int]) -> set[tuple[int, int]]:
        out, end = set(), 0
        for n in reversed(lens):
            out.add((end, end + n))
            end += n
        return out

    t = spans(target_lens)
    return len(t & spans(draft_lens)) / len(t) if t else 1.0


def boundary_agreement(draft_tok, target_tok, text: str) -> float:
    """``span_agreement`` of the two tokenizations of ``text`` (see there)."""
    tb, db = token_bytes(target_tok), token_bytes(draft_tok)
    t = [len(tb[i] or b"") for i in target_tok.encode(text, add_special_tokens=False)]
    d = [len(db[i] or b"") for i in draft_tok.encode(text, add_special_tokens=False)]
    return span_agreement(t, d)


def _tokenizer_name(tok) -> str:
    return Path(str(getattr(tok, "name_or_path", "") or "")).name or "tokenizer"


# --------------------------------------------------------------------------- the map

@dataclass
class VocabMap:
    """A draft -> target token map (token-level intersection) and/or an EAGLE-3 reduced vocabulary.

    Both tokenizers' fingerprints travel with it: ``check_pair`` refuses any other pair.
    """

    target_fingerprint: str
    target_vocab_size: int
    draft_fingerprint: str | None = None  # None: the file holds only an EAGLE-3 reduced vocabulary
    draft_to_target: torch.Tensor | None = None  # [V_draft] int64, target id or -1 (outside the intersection)
    draft_vocab: DraftVocab | None = None
    draft_name: str | None = None  # None with no draft tokenizer, as draft_fingerprint (saved as "" in metadata)
    target_name: str = ""
    info: dict = field(default_factory=dict)  # how it was built (schemes, data file), for the report

    # ------------------------------------------------------------------ overlap
    @property
    def draft_vocab_size(self) -> int:
        return 0 if self.draft_to_target is None else int(self.draft_to_target.numel())

    @property
    def num_shared(self) -> int:
        """Draft ids inside the intersection."""
        return 0 if self.draft_to_target is None else int((self.draft_to_target >= 0).sum())

    @property
    def draft_coverage(self) -> float:
        """Fraction of the draft vocabulary that maps to a target token."""
        return self.num_shared / self.draft_vocab_size if self.draft_vocab_size else 0.0

    @property
    def target_coverage(self) -> float:
        """Fraction of the target vocabulary some draft token maps to."""
        if self.draft_to_target is None or not self.target_vocab_size:
            return 0.0
        return int(torch.unique(self.draft_to_target[self.draft_to_target >= 0]).numel()) / self.target_vocab_size

    def target_to_draft(self) -> torch.Tensor:
        """[V_target] int64: a draft id per target id (the lowest, when several share it), else -1."""
        out = torch.full((self.target_vocab_size,), SUPPRESSED, dtype=torch.int64)
        if self.draft_to_target is not None:
            ids = torch.nonzero(self.draft_to_target >= 0).flatten().flip(0)  # descending: the lowest writes last
            out[self.draft_to_target[ids]] = ids
        return out

    def overlap(self) -> dict:
        """The overlap report: counts and coverages (draft side and target side)."""
        rep = {"draft": self.draft_name, "target": self.target_name,
               "draft_fingerprint": self.draft_fingerprint, "target_fingerprint": self.target_fingerprint,
               "target_vocab_size": self.target_vocab_size}
        if self.draft_to_target is not None:
            rep.update(draft_vocab_size=self.draft_vocab_size, shared_tokens=self.num_shared,
                       draft_coverage=self.draft_coverage, target_coverage=self.target_coverage)
        if self.draft_vocab is not None:
            dv = self.draft_vocab
            rep["eagle3_draft_vocab"] = {"draft_vocab_size": dv.draft_vocab_size,
                                         "tokens_counted": dv.num_tokens_counted, "data_coverage": dv.coverage}
        rep.update(self.info)
        return rep

    # ------------------------------------------------------------------ the pair
    def check_pair(self, draft_fingerprint: str | None, target_fingerprint: str, where: str = "the vocab map") -> None:
        """Raise a one-line DataError unless this map was built for exactly this (draft, target) pair."""
        built = f"draft {self.draft_name or '?'} -> target {self.target_name or '?'}"
        fix = "rebuild it for this pair: specctl build-vocab-map --draft DRAFT --target TARGET --output MAP"
        if draft_fingerprint is not None and self.draft_fingerprint is None:
            raise DataError(f"{where} holds no draft -> target token map (only an EAGLE-3 draft vocabulary)", fix)
        if (draft_fingerprint, target_fingerprint) == (self.target_fingerprint, self.draft_fingerprint) \
                and draft_fingerprint != target_fingerprint:
            raise DataError(f"{where} was built for the opposite direction ({built}); draft and target are swapped",
                            fix)
        if target_fingerprint != self.target_fingerprint:
            raise DataError(f"{where} was built for {built}, but the target tokenizer differs "
                            f"(fingerprint {target_fingerprint[:12]}, map expects {self.target_fingerprint[:12]})", fix)
        if draft_fingerprint is not None and draft_fingerprint != self.draft_fingerprint:
            raise DataError(f"{where} was built for {built}, but the draft tokenizer differs "
                            f"(fingerprint {draft_fingerprint[:12]}, map expects {self.draft_fingerprint[:12]})", fix)

    def check_tokenizers(self, draft_tok, target_tok, where: str = "the vocab map") -> None:
        """``check_pair`` with the fingerprints of two tokenizers (``draft_tok`` may be None)."""
        self.check_pair(None if draft_tok is None else tokenizer_fingerprint(draft_tok),
                        tokenizer_fingerprint(target_tok), where)

    # ------------------------------------------------------------------ files
    def save(self, path: str | Path) -> Path:
        """Write atomically: JSON when the name ends in .json, else safetensors."""
        path = Path(path)
        meta = {"format": FORMAT, "version": str(VERSION), "target_fingerprint": self.target_fingerprint,
                "target_vocab_size": str(self.target_vocab_size), "draft_fingerprint": self.draft_fingerprint or "",
                "draft_name": self.draft_name or "", "target_name": self.target_name, "info": json.dumps(self.info)}
        tensors: dict[str, torch.Tensor] = {}
        if self.draft_to_target is not None:
            tensors["draft_to_target"] = self.draft_to_target.to(torch.int64).contiguous()
        if self.draft_vocab is not None:
            tensors["d2t"] = self.draft_vocab.d2t.to(torch.int64).contiguous()
            tensors["t2d"] = self.draft_vocab.t2d.to(torch.bool).contiguous()
            meta["eagle3"] = json.dumps({"num_tokens_counted": self.draft_vocab.num_tokens_counted,
                                         "coverage": self.draft_vocab.coverage})
        if path.suffix == ".json":
            doc = dict(meta, version=VERSION, target_vocab_size=self.target_vocab_size, info=self.info)
            doc.pop("eagle3", None)
            for name, t in tensors.items():
                doc[name] = t.tolist()
            if self.draft_vocab is not None:
                doc["eagle3"] = json.loads(meta["eagle3"])
            data = json.dumps(doc).encode()
        else:
            from safetensors.torch import save

            data = save(tensors, metadata=meta)
        write_bytes_atomic(path, data)
        return path

    @classmethod
    def load(cls, path: str | Path) -> "VocabMap":
        path = Path(path)
        if not path.is_file():
            raise DataError(f"no vocab map at {path}", "build one with specctl build-vocab-map --output MAP")
        bad = DataError(f"{path} is not a specctl vocab map", "build one with specctl build-vocab-map --output MAP")
        try:
            if path.suffix == ".json":
                doc = json.loads(path.read_text())
                meta = doc
                tensors = {k: torch.tensor(doc[k], dtype=torch.bool if k == "t2d" else torch.int64)
                           for k in ("draft_to_target", "d2t", "t2d") if k in doc}
                eagle3 = doc.get("eagle3") or {}
                info = doc.get("info") or {}
            else:
                from safetensors import safe_open

                with safe_open(str(path), framework="pt") as fh:
                    meta = fh.metadata() or {}
                    tensors = {k: fh.get_tensor(k) for k in fh.keys()}
                eagle3 = json.loads(meta.get("eagle3") or "{}")
                info = json.loads(meta.get("info") or "{}")
            if meta.get("format") != FORMAT:
                raise bad
            if int(meta.get("version", 0)) > VERSION:
                raise DataError(f"{path} was written by a newer specctl (format version {meta['version']})",
                                "upgrade specctl or rebuild the map")
            dv = None
            if "d2t" in tensors:
                dv = DraftVocab(tensors["d2t"], tensors["t2d"], int(eagle3.get("num_tokens_counted", 0)),
                                float(eagle3.get("coverage", 0.0)))
            return cls(meta["target_fingerprint"], int(meta["target_vocab_size"]), meta.get("draft_fingerprint") or None,
                       tensors.get("draft_to_target"), dv, meta.get("draft_name") or None, meta.get("target_name", ""), info)
        except DataError:
            raise
        except Exception:  # noqa: BLE001 - any unreadable file is the same problem for the user
            raise bad from None


def build_vocab_map(draft_tok, target_tok, draft_name: str | None = None, target_name: str | None = None,
                    target_vocab_size: int | None = None) -> VocabMap:
    """The token-level intersection of two tokenizers by decoded byte string (see the module docstring).

    ``target_vocab_size``: the target model's vocabulary when larger than its tokenizer (padded heads).
    A draft token maps to a target token of the same kind first (added/special to added, normal to
    normal), then of the other kind; among several target ids with the same bytes (sentencepiece's
    '▁' and '<0x20>'), a normal token is preferred over a byte-fallback token, then the lowest id.
    """
    d_bytes, t_bytes = token_bytes(draft_tok), token_bytes(target_tok)
    d_added, t_added = _added_ids(draft_tok), _added_ids(target_tok)
    t_table = _id_to_token(target_tok)
    normal: dict[bytes, int] = {}
    byte_tokens: dict[bytes, int] = {}
    added: dict[bytes, int] = {}
    for i, b in enumerate(t_bytes):
        if b is None:
            continue
        if i in t_added:
            added.setdefault(b, i)
        elif t_table[i] is not None and _BYTE_TOKEN.match(t_table[i]):
            byte_tokens.setdefault(b, i)
        else:
            normal.setdefault(b, i)
    for b, i in byte_tokens.items():
        normal.setdefault(b, i)
    ids = []
    for i, b in enumerate(d_bytes):
        first, second = (added, normal) if i in d_added else (normal, added)  # same kind of token first
        ids.append(SUPPRESSED if b is None else first.get(b, second.get(b, SUPPRESSED)))
    d2t = torch.tensor(ids, dtype=torch.int64)
    return VocabMap(
        target_fingerprint=tokenizer_fingerprint(target_tok),
        target_vocab_size=max(target_vocab_size or 0, len(t_bytes)),
        draft_fingerprint=tokenizer_fingerprint(draft_tok),
        draft_to_target=d2t,
        draft_name=draft_name or _tokenizer_name(draft_tok),
        target_name=target_name or _tokenizer_name(target_tok),
        info={"draft_scheme": tokenizer_scheme(draft_tok), "target_scheme": tokenizer_scheme(target_tok)},
    )
