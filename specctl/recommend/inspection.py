"""What a model says about itself, read without loading its weights.

Owns the readers recommend works from: ``config.json`` (``read_config``), the tensor names, dtypes
and shapes in the safetensors headers (``tensor_index``, through ``safetensors.safe_open``), a GGUF's
header (``read_gguf``: architecture, sizes, vocabulary, tensor shapes and the MTP fields, through
``gguf.GGUFReader``; a ``.gguf`` is never converted here), and ``inspect_model``, which puts them
together into a ``ModelInfo`` for a local HF folder, a ``.gguf`` file or a catalogue name (one that is
not pulled is described from the catalogue's metadata alone; with ``quantization="gguf"`` from its
kept GGUF unless its dense folder is here). Parameter counts come from the shapes (from the config's
sizes where there are no safetensors).

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
    try:
        return read_gguf(path)["mtp"]
    except ModelError:  # an unreadable GGUF is reported where it is read as the target, not here
        return {}


def _gguf_field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    try:
        return f.contents()
    except Exception:  # noqa: BLE001 - a field of an unexpected type is as good as absent here
        return default


def _hub_repo(url) -> str | None:
    """'https://huggingface.co/org/name' (or 'org/name') -> 'org/name'; else None."""
    if not isinstance(url, str) or not url.strip():
        return None
    m = re.fullmatch(r"\s*(?:https?://(?:www\.)?huggingface\.co/)?([\w.-]+/[\w.-]+?)/?\s*", url)
    return m.group(1) if m and ("huggingface.co" in url or "://" not in url) else None


def read_gguf(path: Path) -> dict:
    """A GGUF's header, without loading a tensor: ``config`` (HF-style sizes: model_type, hidden_size,
    num_hidden_layers, vocab_size, heads, intermediate_size, ...), ``params`` and ``cost_params`` (from
    the tensor shapes; an untied input embedding is a lookup), ``cost_bytes`` (the bytes of those as the file
    stores them: what a decode step reads where the model runs as this GGUF), ``names`` (general.name, basename, the
    source repo), ``hub_id`` (the Hugging Face repo it was converted from, when the file says so:
    ``general.source.huggingface.repository`` / ``general.source.url``) and ``mtp`` (``gguf_mtp``'s fields).
    An unreadable file: one ModelError naming it."""
    from gguf import GGUFReader

    path = Path(path)
    try:
        r = GGUFReader(str(path))
        arch = _gguf_field(r, "general.architecture")
        tensors = {t.name: t for t in r.tensors}
    except Exception as e:  # noqa: BLE001 - any failure to read the header is a model problem
        first = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
        raise ModelError(f"cannot read the GGUF header of {path} ({type(e).__name__}: {first})",
                         "give a complete .gguf file (llama.cpp's format), or an HF folder") from None
    if not isinstance(arch, str):
        raise ModelError(f"{path} has no general.architecture in its GGUF header",
                         "give a complete .gguf file (llama.cpp's format), or an HF folder")

    def num(key: str, default=None):
        v = _gguf_field(r, f"{arch}.{key}", default)
        return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else default

    embd = tensors.get("token_embd.weight")
    toks = r.fields.get("tokenizer.ggml.tokens")
    vocab = num("vocab_size") or (int(embd.shape[-1]) if embd is not None else None) or (
        len(toks.data) if toks is not None else None)
    hidden, heads = num("embedding_length"), num("attention.head_count")
    cfg = {"model_type": arch, "hidden_size": hidden, "num_hidden_layers": num("block_count"),
           "vocab_size": vocab, "num_attention_heads": heads, "num_key_value_heads": num("attention.head_count_kv", heads),
           "intermediate_size": num("feed_forward_length"), "max_position_embeddings": num("context_length"),
           "tie_word_embeddings": "output.weight" not in tensors}
    if num("attention.key_length"):
        cfg["head_dim"] = num("attention.key_length")
    cfg = {k: v for k, v in cfg.items() if v is not None}
    params = sum(int(t.n_elements) for t in r.tensors) or None
    untied = embd is not None and "output.weight" in tensors
    cost = params - int(embd.n_elements) if params and untied else params
    cost_bytes = sum(int(t.n_bytes) for t in r.tensors) - (int(embd.n_bytes) if untied else 0)
    hub = _hub_repo(_gguf_field(r, "general.source.huggingface.repository")) or _hub_repo(
        _gguf_field(r, "general.source.url"))
    names = [v for k in ("general.name", "general.basename") if isinstance(v := _gguf_field(r, k), str) and v.strip()]
    mtp = {name: int(v) for name in r.fields if name.endswith(".nextn_predict_layers")
           and isinstance(v := _gguf_field(r, name), (int, float))}
    mtp["nextn_tensors"] = sum(".nextn." in n for n in tensors)
    return {"config": cfg, "params": params, "cost_params": cost, "cost_bytes": cost_bytes or None,
            "names": names + ([hub] if hub else []),
            "hub_id": hub, "mtp": mtp}


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
    gguf_file: str | None = None  # the .gguf it was read from, or that runs with quantization="gguf"
    quantization: str | None = None  # "gguf": the target runs as its GGUF's blocks (the commands say so)
    hub_id: str | None = None  # the Hugging Face repo of its weights and tokenizer, where known (vLLM's --tokenizer)
    config: dict = field(default_factory=dict, repr=False)
    tensors: dict = field(default_factory=dict, repr=False)
    gguf: dict = field(default_factory=dict, repr=False)  # MTP fields read from a GGUF
    cost_bytes: int | None = None  # bytes read per decode step where it runs as its GGUF (quantization="gguf")

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


def _from_gguf(spec: str, name: str, source: str, file: Path, extra_names: list[str]) -> ModelInfo:
    """A ModelInfo read from a GGUF's header alone (no dense folder: ``path`` None)."""
    g = read_gguf(file)
    c = g["config"]
    names = [spec, file.name, file.stem, *extra_names, *g["names"]]
    return ModelInfo(spec, name, source, None, c.get("model_type"), [], g["params"], g["cost_params"],
                     c.get("num_hidden_layers"), c.get("hidden_size"), c.get("vocab_size"),
                     names=list(dict.fromkeys(names)), config=c, gguf=g["mtp"], gguf_file=str(file),
                     hub_id=g["hub_id"], cost_bytes=g["cost_bytes"])


def inspect_model(spec: str, *, pull: bool = False, dtype: str = "bfloat16", quantization: str | None = None) -> ModelInfo:
    """Read a model (HF folder, .gguf file, catalogue name) without loading its weights.

    A ``.gguf`` file is read from its header (never converted). A catalogue model that is not pulled is
    described from the catalogue unless ``pull``. ``quantization="gguf"`` (the target runs as its GGUF):
    a catalogue model is read from its dense folder when that is here, else from its kept GGUF (pulled,
    GGUF only, when ``pull``); the dense weights are never pulled for it.
    """
    from specctl.models import CATALOGUE, normalize_quantization, resolve_model

    quantization = normalize_quantization(quantization)
    spec = str(spec).strip()
    p = Path(spec).expanduser()
    entry = catalogue_entry(spec) if not p.exists() else None
    gguf_file: Path | None = None
    if p.is_file() and p.suffix.lower() == ".gguf":
        info = _from_gguf(spec, p.name, "gguf", p.resolve(), [])
        info.quantization = quantization
        return info
    if entry is not None:
        source = "catalogue"
        if quantization == "gguf":
            gguf_file = resolve_model(spec, quantization="gguf", pull=pull) if pull else _kept_gguf(spec)
            folder = pulled_path(spec)
            if folder is None and gguf_file is not None:
                info = _from_gguf(spec, entry.name, source, Path(gguf_file), [entry.name, entry.upstream])
                info.quantization, info.hub_id = quantization, entry.hub_id or info.hub_id
                return info
        else:
            folder = resolve_model(spec, dtype=dtype) if pull else pulled_path(spec)
        if folder is None:
            params = parse_count(entry.params)
            return ModelInfo(spec, entry.name, source, None, entry.arch, [], params, params, None, None, entry.vocab,
                             names=[entry.name, entry.upstream], quantization=quantization, hub_id=entry.hub_id or None)
    else:
        if quantization == "gguf":  # an HF folder has no GGUF to run: resolve_model's one-line usage error
            resolve_model(spec, quantization="gguf", pull=False)
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
    # a dense folder here, run as the kept GGUF beside it: the bytes a step reads are the GGUF's
    cost_bytes = read_gguf(Path(gguf_file))["cost_bytes"] if quantization == "gguf" and gguf_file else None
    return ModelInfo(spec, entry.name if entry else folder.name, source, str(folder), tc.get("model_type"),
                     list(cfg.get("architectures") or []), params, cost, tc.get("num_hidden_layers"),
                     tc.get("hidden_size"), tc.get("vocab_size"), names=list(dict.fromkeys(names)), config=cfg,
                     tensors=tensors, gguf_file=str(gguf_file) if gguf_file else None, quantization=quantization,
                     hub_id=(entry.hub_id or None) if entry else None, cost_bytes=cost_bytes)


def _kept_gguf(spec: str) -> Path | None:
    """A catalogue model's kept GGUF when it is in the cache, else None (nothing is pulled)."""
    from specctl.models import resolve_model

    try:
        return resolve_model(spec, quantization="gguf", pull=False)
    except ModelError:
        return None
