"""What a model says about itself, read without loading its weights.

Owns the readers recommend works from: ``config.json`` (``read_config``), the tensor names, dtypes
and shapes in the safetensors headers (``tensor_index``, through ``safetensors.safe_open``), the MTP
fields of a GGUF (``gguf_mtp``, through ``gguf.GGUFReader``), and ``inspect_model``, which puts them
together into a ``ModelInfo`` for a local HF folder, a ``.gguf`` file or a catalogue name (one that is
not pulled is described from the catalogue's metadata alone). Parameter counts come from the shapes
(from the config's sizes where there are no safetensors).

What it does not know: draft formats (``detect``), the cost model, the flowchart; it never loads a
tensor's data, and it downloads nothing unless asked to ``pull``.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specctl.drafts.formats import text_config
from specctl.errors import ModelError

_EMBED_SUFFIXES = ("embed_tokens.weight", "wte.weight", "tok_embeddings.weight", "word_embeddings.weight")


def read_config(folder: Path) -> dict:
    path = Path(folder) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelError(f"cannot read {path} ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})",
                         "fix or replace the model folder's config.json") from None
    if not isinstance(cfg, dict):
        raise ModelError(f"{path} is not a JSON object", "fix or replace the model folder's config.json")
    return cfg


def tensor_index(folder: Path) -> dict[str, tuple[str, list[int]]]:
    """name -> (dtype, shape) of every tensor in the folder's *.safetensors files, from the headers only."""
    from specctl.models import open_safetensors

    out: dict[str, tuple[str, list[int]]] = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        with open_safetensors(f, framework="numpy") as fh:  # a damaged file: one ModelError naming it
            for k in fh.keys():
                s = fh.get_slice(k)
                out[k] = (s.get_dtype(), list(s.get_shape()))
    return out


def gguf_mtp(path: Path) -> dict:
    """MTP fields of a GGUF: ``<arch>.nextn_predict_layers`` and ``*nextn*`` tensors (llama.cpp's layout)."""
    from gguf import GGUFReader

    try:
        r = GGUFReader(str(path))
        out = {name: int(f.parts[f.data[0]][0]) for name, f in r.fields.items()
               if name.endswith(".nextn_predict_layers")}
        out["nextn_tensors"] = sum(".nextn." in t.name for t in r.tensors)
        return out
    except Exception:  # noqa: BLE001 - an unreadable GGUF is reported by resolve_model, not here
        return {}


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _params_from_config(c: dict) -> int | None:
    """Parameter count of a llama-like config (when the weights are not safetensors)."""
    try:
        h, v, n, inter = c["hidden_size"], c["vocab_size"], c["num_hidden_layers"], c["intermediate_size"]
    except KeyError:
        return None
    heads = c.get("num_attention_heads") or 1
    hd = c.get("head_dim") or h // heads
    kv = (c.get("num_key_value_heads") or heads) * hd
    per_layer = h * heads * hd * 2 + 2 * h * kv + 3 * h * inter
    return v * h * (1 if c.get("tie_word_embeddings") else 2) + n * per_layer


def parse_count(s: str) -> int | None:
    """'134.5M' -> 134500000 (the catalogue's parameter counts)."""
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMB]?)\s*", s or "", re.IGNORECASE)
    if not m:
        return None
    return int(float(m.group(1)) * {"": 1, "K": 1e3, "M": 1e6, "B": 1e9}[m.group(2).upper()])


def fmt_count(n: int | None) -> str:
    """630200000 -> '630.2M' (and '?' when unknown)."""
    if not n:
        return "?"
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}K"


@dataclass
class ModelInfo:
    """What a model folder (or a catalogue entry that is not pulled) says about itself."""

    spec: str
    name: str
    source: str  # "folder", "gguf", "catalogue"
    path: str | None  # the dense HF folder, when there is one here
    arch: str | None
    architectures: list[str]
    params: int | None
    cost_params: int | None  # parameters read per decode step (an untied input embedding is a lookup)
    num_layers: int | None
    hidden_size: int | None
    vocab_size: int | None
    names: list[str] = field(default_factory=list)  # every name it goes by (for recorded-base checks)
    config: dict = field(default_factory=dict, repr=False)
    tensors: dict = field(default_factory=dict, repr=False)
    gguf: dict = field(default_factory=dict, repr=False)  # MTP fields read from a GGUF

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k not in ("config", "tensors", "gguf")}


def catalogue_entry(spec: str):
    from specctl.models import CATALOGUE

    return CATALOGUE.get(str(spec).strip().lower())


def pulled_path(spec: str) -> Path | None:
    """The local folder of a catalogue model when it is pulled (in either dtype), else None."""
    from specctl.models import resolve_model

    for dtype in ("bfloat16", "float32"):
        try:
            return resolve_model(spec, dtype=dtype, pull=False)
        except ModelError:
            pass
    return None


def inspect_model(spec: str, *, pull: bool = False, dtype: str = "bfloat16") -> ModelInfo:
    """Read a model (HF folder, .gguf via resolve_model, catalogue name) without loading its weights.

    A catalogue model that is not pulled is described from the catalogue unless ``pull``.
    """
    from specctl.models import CATALOGUE, resolve_model

    spec = str(spec).strip()
    p = Path(spec).expanduser()
    entry = catalogue_entry(spec) if not p.exists() else None
    gguf_meta: dict = {}
    if p.is_file() and p.suffix.lower() == ".gguf":
        source = "gguf"
        gguf_meta = gguf_mtp(p)
        folder = resolve_model(spec, dtype=dtype)
    elif entry is not None:
        source = "catalogue"
        folder = resolve_model(spec, dtype=dtype) if pull else pulled_path(spec)
        if folder is None:
            params = parse_count(entry.params)
            return ModelInfo(spec, entry.name, source, None, entry.arch, [], params, params, None, None, entry.vocab,
                             names=[entry.name, entry.upstream])
    else:
        source = "folder"
        folder = resolve_model(spec, dtype=dtype, pull=False)  # ModelError: no such model / no config / no weights
    folder = Path(folder)
    cfg = read_config(folder)
    tensors = tensor_index(folder)
    tc = text_config(cfg)
    if tensors:
        params = sum(_numel(s) for _, s in tensors.values())
        has_head = any(k.endswith("lm_head.weight") for k in tensors)
        embed = sum(_numel(s) for k, (_, s) in tensors.items() if k.endswith(_EMBED_SUFFIXES))
        cost = params - (embed if has_head else 0)
    else:
        params = _params_from_config(tc)
        cost = None if params is None else params - (0 if tc.get("tie_word_embeddings") else
                                                      tc.get("vocab_size", 0) * tc.get("hidden_size", 0))
    names = [spec, folder.name] + [cfg[k] for k in ("_name_or_path", "_model_name_or_path") if isinstance(cfg.get(k), str)]
    if entry is not None:
        names += [entry.name, entry.upstream]
    for e in CATALOGUE.values():  # a catalogue folder in the cache goes by the catalogue's names too
        if folder.name.startswith(e.name + "-"):
            names += [e.name, e.upstream]
    return ModelInfo(spec, entry.name if entry else folder.name, source, str(folder), tc.get("model_type"),
                     list(cfg.get("architectures") or []), params, cost, tc.get("num_hidden_layers"),
                     tc.get("hidden_size"), tc.get("vocab_size"), names=list(dict.fromkeys(names)), config=cfg,
                     tensors=tensors, gguf=gguf_meta)
