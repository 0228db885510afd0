"""``specctl recommend``: which draft method fits a target, by the seed's layered flowchart, with evidence.

The four layers, by what it costs to adopt them: 1 zero-model (ngram, suffix), 2 light add-on
(Medusa heads, EAGLE draft), 3 independent model (draft_model), 4 trained-in (MTP). The walk:

    own training? ─yes─► MTP (train it in)          built-in MTP layers? ─yes─► mtp
        │no                                              │no
    Medusa/EAGLE draft made for this target? ─yes─► medusa / eagle / eagle3
        │no
    smaller model, same tokenizer, ρ in the sweet spot? ─yes─► draft_model
        │no
    requests repeat (agentic, fixed templates)? ─yes─► suffix, else ngram (the always-available baseline)

What it reads, without loading weights: config.json fields and safetensors headers (tensor names and
shapes; parameter counts come from the shapes), GGUF metadata for MTP (``*.nextn_predict_layers``),
tokenizers (vocabulary overlap, through ``specctl.runtime.vocab_map`` as build-vocab-map computes it).
Catalogue models that are not pulled are judged from the catalogue's metadata alone, and nothing is
downloaded unless ``--probe`` needs the target.

Cost model (the seed's): a draft of k tokens with acceptance α and cost ratio ρ (one draft step /
one target step) gives  S(α, ρ, k) = (1 − α^(k+1)) / ((1 − α)(1 + kρ))  tokens per target-step time.
Without probing, ρ is estimated from parameter counts plus a fixed per-layer overhead (small models
are overhead-bound; see ``LAYER_OVERHEAD_PARAMS``), and α is a workload prior (labelled as such).
``probe`` measures both: α by maximum likelihood over every verification step, ρ as the draft's
time (``propose()`` and the hooks a stateful draft computes in) per drafted token over one target
decode step, and the real speedup; plus the verify cost (one verify forward / one decode step),
which the formula takes as 1 and which explains most gaps between predicted and measured.

What it does not know: how methods work (the runtime does); it only *uses* a method in a probe if
``specctl.config.implemented_methods()`` lists it, and says so when a recommended one is not runnable.
"""

from __future__ import annotations

import json
import re
import shlex
import struct
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from specctl.errors import ModelError, UsageError

# ----------------------------------------------------------------------------- constants

# sparse_attn: the target drafts for itself over part of its KV cache: no weights, no training (layer 1's cost)
LAYERS = {"ngram": 1, "suffix": 1, "sparse_attn": 1, "medusa": 2, "eagle": 2, "eagle3": 2, "draft_model": 3, "mtp": 4}
DRAFT_PREFERENCE = ("eagle3", "eagle", "medusa")  # EAGLE usually accepts more than Medusa (seed §3.2)
LAYER_OVERHEAD_PARAMS = 5e6
"""A decode step costs ~ (parameters read + this many per layer): fitted on this CPU from MODELS.md
(bf16 tok/s of SmolLM2-135M, 30 layers, and Qwen2.5-Coder-1.5B, 28 layers). It keeps a thin, deep
model from being judged by its parameters alone."""
MIN_GAIN = 1.1  # a model draft must be predicted to beat this, else the walk falls through to layer 1
K_MAX = 16  # largest k the speedup formula is maximised over
CROSS_TOKENIZER_PENALTY = 0.1  # prior α of a draft with another tokenizer, below a same-tokenizer one
MAX_PROBED_DRAFTS = 2
_EMBED_SUFFIXES = ("embed_tokens.weight", "wte.weight", "tok_embeddings.weight", "word_embeddings.weight")


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    copies_prompt: bool  # the output repeats spans of the prompt: ngram's case
    repeats: bool  # requests repeat across calls: suffix's case (its cache of earlier responses)
    alpha_prior: float  # assumed acceptance of a same-tokenizer draft model (a prior, not a measurement)
    prompts: str | None  # built-in bench workload --probe uses (None: chat, with a note)
    context: int = 1024  # typical tokens in the KV cache while decoding (prompt + output)


WORKLOADS: dict[str, Workload] = {w.name: w for w in (
    Workload("chat", "open-ended conversation", False, False, 0.6, "chat"),
    Workload("code", "code generation and editing", True, False, 0.8, "code-edit"),
    Workload("code-edit", "edits that mostly copy the given code", True, False, 0.8, "code-edit"),
    Workload("agentic", "agent loops and tool calls over a fixed template", True, True, 0.75, "agentic@2"),
    Workload("batch", "fixed-template batch jobs", False, True, 0.7, "agentic@2"),
    Workload("rag", "answers grounded in retrieved passages", True, False, 0.7, None),
    Workload("summarization", "summaries of a given text", True, False, 0.7, None),
    Workload("translation", "translation", False, False, 0.75, None),
    Workload("math", "reasoning and math", False, False, 0.65, None, 2048),
    Workload("long-context", "questions over long documents (4k-32k tokens)", True, False, 0.7, "long-4k", 16384),
)}

# sparse_attn's prior acceptance per draft token on long contexts (Qwen2.5-Coder-0.5B, long-4k, Vegas
# at k = 4: 0.7-1.0 per position, measured here; a prior, --probe measures it) and elsewhere
SPARSE_ALPHA = {True: 0.8, False: 0.6}


def get_workload(name: str) -> Workload:
    w = WORKLOADS.get(name.strip().lower())
    if w is None:
        raise UsageError(f"unknown workload '{name}'", f"use one of: {', '.join(WORKLOADS)}")
    return w


# ----------------------------------------------------------------------------- cost model

def predicted_speedup(alpha: float, rho: float, k: int) -> float:
    """S = (1 − α^(k+1)) / ((1 − α)(1 + kρ)); at α = 1 the limit (k + 1) / (1 + kρ)."""
    tokens = k + 1.0 if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)
    return tokens / (1.0 + k * rho)


def best_k(alpha: float, rho: float, k_max: int = K_MAX) -> tuple[int, float]:
    """(k, S) maximising the predicted speedup over k = 1..k_max."""
    return max(((k, predicted_speedup(alpha, rho, k)) for k in range(1, k_max + 1)), key=lambda t: t[1])


def estimate_rho(draft_cost: float, draft_layers: int | None, target_cost: float, target_layers: int | None) -> float:
    """ρ from parameter counts (+ a per-layer overhead when both layer counts are known)."""
    if draft_layers and target_layers:
        return (draft_cost + LAYER_OVERHEAD_PARAMS * draft_layers) / (target_cost + LAYER_OVERHEAD_PARAMS * target_layers)
    return draft_cost / target_cost


def estimate_alpha(steps: list[tuple[int, int]]) -> float | None:
    """α by maximum likelihood from (drafted, accepted) per step: each draft token is accepted with
    probability α until the first rejection, so α̂ = accepted / (accepted + steps that saw a rejection).
    E.g. [(4, 4), (4, 1)]: 5 accepted, 1 rejection -> 5/6."""
    acc = sum(a for n, a in steps if n > 0)
    rej = sum(1 for n, a in steps if n > 0 and a < n)
    return acc / (acc + rej) if acc + rej else None


# ----------------------------------------------------------------------------- reading folders

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
    out: dict[str, tuple[str, list[int]]] = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        try:
            with open(f, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                if n > 256 << 20:
                    raise ValueError("header too large")
                header = json.loads(fh.read(n))
        except (OSError, ValueError, struct.error, UnicodeDecodeError) as e:
            raise ModelError(f"cannot read the safetensors header of {f} ({e})", "the file is damaged: replace it") from None
        header.pop("__metadata__", None)
        out.update({k: (v.get("dtype", "?"), list(v.get("shape", []))) for k, v in header.items()})
    return out


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _text_config(cfg: dict) -> dict:
    return cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg


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


def _parse_count(s: str) -> int | None:
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMB]?)\s*", s or "", re.I)
    if not m:
        return None
    return int(float(m.group(1)) * {"": 1, "K": 1e3, "M": 1e6, "B": 1e9}[m.group(2).upper()])


_NOISE = {"instruct", "chat", "it", "hf", "gguf", "awq", "gptq", "bf16", "bfloat16", "fp16", "float16", "fp32",
          "float32", "int4", "int8", "q4", "q8", "model", "the"}


def name_key(name: str) -> str:
    """A model name reduced for comparison: 'Qwen/Qwen2.5-Coder-1.5B-Instruct' -> 'qwen25coder15b'."""
    last = re.split(r"[/\\]", str(name).strip().rstrip("/\\"))[-1].lower()
    return "".join(w for w in re.split(r"[^a-z0-9]+", last) if w and w not in _NOISE)


# ----------------------------------------------------------------------------- the target (and candidates)

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


def _catalogue_entry(spec: str):
    from specctl.models import CATALOGUE

    return CATALOGUE.get(str(spec).strip().lower())


def _pulled_path(spec: str) -> Path | None:
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
    from specctl.models import resolve_model

    spec = str(spec).strip()
    p = Path(spec).expanduser()
    entry = _catalogue_entry(spec) if not p.exists() else None
    gguf_meta: dict = {}
    if p.is_file() and p.suffix.lower() == ".gguf":
        source = "gguf"
        gguf_meta = _gguf_mtp(p)
        folder = resolve_model(spec, dtype=dtype)
    elif entry is not None:
        source = "catalogue"
        folder = resolve_model(spec, dtype=dtype) if pull else _pulled_path(spec)
        if folder is None:
            params = _parse_count(entry.params)
            return ModelInfo(spec, entry.name, source, None, entry.arch, [], params, params, None, None, entry.vocab,
                             names=[entry.name, entry.upstream])
    else:
        source = "folder"
        folder = resolve_model(spec, dtype=dtype, pull=False)  # ModelError: no such model / no config / no weights
    folder = Path(folder)
    cfg = read_config(folder)
    tensors = tensor_index(folder)
    tc = _text_config(cfg)
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
    from specctl.models import CATALOGUE

    for e in CATALOGUE.values():  # a catalogue folder in the cache goes by the catalogue's names too
        if folder.name.startswith(e.name + "-"):
            names += [e.name, e.upstream]
    return ModelInfo(spec, entry.name if entry else folder.name, source, str(folder), tc.get("model_type"),
                     list(cfg.get("architectures") or []), params, cost, tc.get("num_hidden_layers"),
                     tc.get("hidden_size"), tc.get("vocab_size"), names=list(dict.fromkeys(names)), config=cfg,
                     tensors=tensors, gguf=gguf_meta)


def _gguf_mtp(path: Path) -> dict:
    """MTP fields of a GGUF: ``<arch>.nextn_predict_layers`` and ``*nextn*`` tensors (llama.cpp's layout)."""
    try:
        from gguf import GGUFReader

        r = GGUFReader(str(path))
        out = {}
        for name, f in r.fields.items():
            if name.endswith(".nextn_predict_layers"):
                out[name] = int(f.parts[f.data[0]][0])
        out["nextn_tensors"] = sum(".nextn." in t.name for t in r.tensors)
        return out
    except Exception:  # noqa: BLE001 - an unreadable GGUF is reported by resolve_model, not here
        return {}


# ----------------------------------------------------------------------------- MTP layers

_MTP_TENSOR = re.compile(r"(^|\.)mtp[._]|mtp_layers|(^|\.)(eh_proj|enorm|hnorm|shared_head)\.")


@dataclass
class MTPInfo:
    present: bool
    layers: int = 0
    evidence: list[str] = field(default_factory=list)
    refused: str | None = None  # why declared MTP layers cannot be used


def mtp_modules(cfg: dict, tensors: dict, gguf: dict | None = None) -> MTPInfo:
    """MTP modules from config keys (``num_nextn_predict_layers``, ``mtp_num_hidden_layers``, ...) and tensors:
    DeepSeek-V3's ``model.layers.{N+i}.{eh_proj,enorm,hnorm,shared_head}``, Qwen3-Next's ``mtp.layers.{i}.*``."""
    gguf = gguf or {}
    evidence: list[str] = []
    declared = 0
    for c in (cfg, _text_config(cfg)):
        for k, v in c.items():
            if ("nextn" in k or "mtp" in k) and isinstance(v, int) and not isinstance(v, bool) and v > 0:
                declared = max(declared, v)
                evidence.append(f"config.json {k} = {v}")
    for k, v in gguf.items():
        if k.endswith("nextn_predict_layers") and v > 0:
            declared = max(declared, v)
            evidence.append(f"GGUF {k} = {v}")
    names = [n for n in tensors if _MTP_TENSOR.search(n)]
    deepseek = {m.group(1) for n in names if (m := re.search(r"layers\.(\d+)\.eh_proj\.", n))}
    qwen = {m.group(1) for n in names if (m := re.search(r"mtp(?:\.layers|_layers)?\.(\d+)\.", n))}
    found = len(deepseek) or len(qwen) or (1 if names else 0) or (declared if gguf.get("nextn_tensors") else 0)
    if names:
        evidence.append(f"{len(names)} MTP tensors (e.g. {names[0]})")
    elif gguf.get("nextn_tensors"):
        evidence.append(f"{gguf['nextn_tensors']} nextn tensors in the GGUF")
    evidence = list(dict.fromkeys(evidence))
    if declared and not found:
        return MTPInfo(False, declared, evidence, f"the config declares {declared} MTP layer(s) but the checkpoint "
                       "holds no MTP tensors (dropped when it was converted or quantized): use a checkpoint that keeps them")
    if declared and deepseek and len(deepseek) != declared:
        return MTPInfo(False, declared, evidence, f"num_nextn_predict_layers is {declared} but {len(deepseek)} MTP "
                       "module(s) are in the weights: fix config.json")
    return MTPInfo(bool(found), declared or found, evidence)


def detect_mtp(t: ModelInfo) -> MTPInfo:
    """Built-in MTP layers of the target (config keys, tensors, GGUF metadata)."""
    return mtp_modules(t.config, t.tensors, t.gguf)


# ----------------------------------------------------------------------------- Medusa / EAGLE drafts

@dataclass
class DraftInfo:
    path: str
    kind: str  # method: medusa, eagle, eagle3
    accepted: bool = False
    reasons: list[str] = field(default_factory=list)  # why refused (or notes when accepted)
    details: dict = field(default_factory=dict)

    @property
    def k(self) -> int:
        if self.kind in ("medusa", "mtp"):
            return int(self.details.get("num_heads") or self.details.get("layers") or 0)
        return 3


def classify_draft(folder: Path, cfg: dict | None = None, tensors: dict | None = None) -> str | None:
    """'medusa', 'eagle3', 'eagle', 'mtp' or None (a plain model or something else) from config + tensor names.

    An MTP draft (``specctl train-mtp``'s draft folder) holds MTP modules and no main model
    (no ``model.embed_tokens``, no ``model.layers.0``)."""
    cfg = read_config(folder) if cfg is None else cfg
    tensors = tensor_index(folder) if tensors is None else tensors
    if (any(_MTP_TENSOR.search(k) for k in tensors) and "model.embed_tokens.weight" not in tensors
            and not any(k.startswith("model.layers.0.") for k in tensors)):
        return "mtp"
    archs = " ".join(cfg.get("architectures") or []).lower()
    mt = str(cfg.get("model_type", "")).lower()
    if mt == "medusa" or "medusa" in archs or "medusa_num_heads" in cfg or any(k.startswith("medusa_head") for k in tensors):
        return "medusa"
    if ("eagle3" in archs or "eagle3" in mt or "draft_vocab_size" in cfg or any(k.startswith("midlayer.") for k in tensors)):
        return "eagle3"
    if "eagle" in archs or mt == "eagle" or ("fc.weight" in tensors and any(k.startswith("layers.0.") for k in tensors)):
        return "eagle"
    return None


def _recorded_base(cfg: dict) -> str | None:
    for k in ("base_model_name_or_path", "base_model", "verifier_name_or_path", "target_model", "target_model_name_or_path"):
        if isinstance(cfg.get(k), str) and cfg[k].strip():
            return cfg[k]
    own = cfg.get("specctl")  # what specctl's trainers record
    if isinstance(own, dict) and isinstance(own.get("base_model"), str) and own["base_model"].strip():
        return own["base_model"]
    sc = cfg.get("speculators_config")
    if isinstance(sc, dict) and isinstance(sc.get("verifier"), dict):
        v = sc["verifier"].get("name_or_path")
        return v if isinstance(v, str) and v else None
    return None


def check_draft(folder: Path, kind: str, target: ModelInfo) -> DraftInfo:
    """Check a Medusa/EAGLE draft against the target: hidden size, vocabulary, recorded base model."""
    cfg, tensors = read_config(folder), tensor_index(folder)
    d = DraftInfo(str(folder), kind)
    bad = d.reasons
    H, V, L = target.hidden_size, target.vocab_size, target.num_layers
    if H is None or V is None:
        bad.append("cannot check it against the target: the target is not pulled "
                   f"(run `specctl models pull {target.name}`)")
    if kind == "mtp":
        m = mtp_modules(cfg, tensors)
        hidden, vocab = _text_config(cfg).get("hidden_size"), _text_config(cfg).get("vocab_size")
        n_main = _text_config(cfg).get("num_hidden_layers")
        d.details = {"layers": m.layers, "hidden_size": hidden, "vocab_size": vocab, "num_hidden_layers": n_main,
                     "evidence": m.evidence}
        if m.refused:
            bad.append(m.refused)
        if any(re.match(r"model\.layers\.\d+\.eh_proj", k) for k in tensors) and L is not None and n_main != L:
            bad.append(f"its modules follow a {n_main}-layer model, the target has {L} layers")
    elif kind == "medusa":
        heads = cfg.get("num_heads", cfg.get("medusa_num_heads"))
        d.details = {"num_heads": heads, "num_layers": cfg.get("num_hidden_layers", cfg.get("medusa_num_layers")),
                     "hidden_size": cfg.get("hidden_size"), "vocab_size": cfg.get("vocab_size")}
        lm = sorted(k for k in tensors if re.match(r"lm_heads\.\d+\.weight$", k))
        if not heads:
            bad.append("config.json has no num_heads")
        elif lm and len(lm) != heads:
            bad.append(f"config says {heads} heads but the weights hold {len(lm)} lm_heads")
        if any(k.startswith("medusa_head") for k in tensors):
            d.reasons.append("note: original Medusa layout (medusa_head.*): vLLM loads blocks.*/lm_heads.*; convert it")
        hs = [tensors[k][1][0] for k in lm if tensors[k][1]]
        vocab = cfg.get("vocab_size") or (hs[0] if hs else None)
        hidden = cfg.get("hidden_size") or next((s[1][-1] for k, s in tensors.items() if k.startswith("blocks.")), None)
    else:
        hidden = cfg.get("target_hidden_size") or cfg.get("hidden_size") if kind == "eagle3" else cfg.get("hidden_size")
        vocab = cfg.get("vocab_size")
        aux = cfg.get("eagle_aux_hidden_state_layer_ids") or (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        d.details = {"hidden_size": cfg.get("hidden_size"), "target_hidden_size": cfg.get("target_hidden_size"),
                     "vocab_size": vocab, "draft_vocab_size": cfg.get("draft_vocab_size"), "aux_layers": aux}
        if kind == "eagle3":
            dv = cfg.get("draft_vocab_size")
            if "d2t" in tensors and dv and tensors["d2t"][1] and tensors["d2t"][1][0] != dv:
                bad.append(f"d2t has {tensors['d2t'][1][0]} entries but draft_vocab_size is {dv}")
            if aux and L is not None and max(aux) >= L:
                bad.append(f"it reads target layers {aux} but the target has {L} layers")
            fc = tensors.get("fc.weight")
            if fc and H and len(fc[1]) == 2 and fc[1][1] % H:
                bad.append(f"fc.weight takes {fc[1][1]} inputs, not a multiple of the target's hidden size {H}")
        elif "fc.weight" in tensors and H and tensors["fc.weight"][1][-1] != 2 * H:
            bad.append(f"fc.weight takes {tensors['fc.weight'][1][-1]} inputs, EAGLE-1 needs 2 x {H}")
    if H is not None and hidden is not None and hidden != H:
        bad.append(f"hidden size {hidden} != the target's {H}")
    if V is not None and vocab is not None and vocab != V:
        bad.append(f"vocabulary {vocab} != the target's {V}")
    base = _recorded_base(cfg)
    if base is not None:
        d.details["recorded_base"] = base
        if name_key(base) not in {name_key(n) for n in target.names}:
            bad.append(f"trained for {base}, not for this target ({target.name})")
    d.accepted = not [r for r in bad if not r.startswith("note:")]
    return d


def find_drafts(target: ModelInfo, dirs: list[str]) -> tuple[list[DraftInfo], list[str], list[str]]:
    """Drafts from ``dirs`` (each a draft folder or a folder of them) and beside the target folder.

    Returns (drafts, plain models found in ``dirs`` (candidates), notes on folders that are neither).
    """
    drafts: list[DraftInfo] = []
    plain: list[str] = []
    notes: list[str] = []
    seen: set[str] = set()

    def visit(folder: Path, given: bool) -> None:
        key = str(folder.resolve())
        if key in seen or (target.path and key == str(Path(target.path).resolve())):
            return
        seen.add(key)
        cfg, tensors = read_config(folder), tensor_index(folder)
        kind = classify_draft(folder, cfg, tensors)
        if kind is not None:
            drafts.append(check_draft(folder, kind, target))
        elif given and cfg.get("model_type") and any(re.search(r"layers\.\d+\.", k) for k in tensors):
            plain.append(str(folder))
        elif given:
            notes.append(f"{folder}: not a Medusa/EAGLE draft nor a model (model_type {cfg.get('model_type')!r})")

    for d in dirs:
        p = Path(d).expanduser()
        if not p.is_dir():
            raise ModelError(f"--drafts {d}: no such folder", "give a draft folder (config.json + *.safetensors) or a folder of them")
        if (p / "config.json").is_file():
            visit(p, True)
        else:
            subs = [s for s in sorted(p.iterdir()) if (s / "config.json").is_file()]
            if not subs:
                raise ModelError(f"--drafts {d}: no config.json in it or in its subfolders", "give a draft folder")
            for s in subs:
                visit(s, True)
    if target.path:  # beside the model: its parent's subfolders, and its own
        tp = Path(target.path)
        for base in (tp.parent, tp):
            try:
                subs = sorted(s for s in base.iterdir() if s.is_dir() and (s / "config.json").is_file())[:200]
            except OSError:
                continue
            for s in subs:
                try:
                    cfg = read_config(s)
                    if classify_draft(s, cfg, tensor_index(s)) is not None:
                        visit(s, False)
                except ModelError:
                    continue
    return drafts, plain, notes


# ----------------------------------------------------------------------------- candidate draft models

@dataclass
class Candidate:
    spec: str  # how specctl names it (catalogue name or path)
    name: str
    path: str | None
    arch: str | None
    params: int | None
    rho_estimate: float | None = None
    tokenizer: str = "unknown"  # same, different, unknown
    overlap: dict | None = None  # draft_coverage, target_coverage, mode (draft_model's same/tli/text)
    alpha_prior: float | None = None
    best_k: int | None = None
    predicted_speedup: float | None = None
    verdict: str = "refused"  # draft (same tokenizer), alternative (another tokenizer), refused
    reason: str = ""
    runnable: bool = True  # the own runtime can run its architecture

    def to_dict(self) -> dict:
        return asdict(self)


_TOKENIZERS: dict[str, Any] = {}


def _tokenizer(path: str):
    if path not in _TOKENIZERS:
        from transformers import AutoTokenizer

        try:
            _TOKENIZERS[path] = AutoTokenizer.from_pretrained(path)
        except Exception:  # noqa: BLE001 - a folder without a usable tokenizer: overlap unknown
            _TOKENIZERS[path] = None
    return _TOKENIZERS[path]


def tokenizer_overlap(draft_path: str, target_path: str) -> dict | None:
    """{"same": bool, "draft_coverage", "target_coverage", "mode"} or None when a tokenizer is missing.

    Uses ``specctl.runtime.vocab_map`` (fingerprints; the byte-level token intersection) when it is
    installed, else the overlap of the decoded vocabulary strings.
    """
    dt, tt = _tokenizer(draft_path), _tokenizer(target_path)
    if dt is None or tt is None:
        return None
    try:
        from specctl.runtime import vocab_map as vm
    except ImportError:
        vm = None
    if vm is not None and hasattr(vm, "build_vocab_map"):
        if vm.tokenizer_fingerprint(dt) == vm.tokenizer_fingerprint(tt):
            return {"same": True, "draft_coverage": 1.0, "target_coverage": 1.0, "mode": "same"}
        m = vm.build_vocab_map(dt, tt)
        dc, tc = m.draft_coverage, m.target_coverage
    else:
        if dt.get_vocab() == tt.get_vocab():
            return {"same": True, "draft_coverage": 1.0, "target_coverage": 1.0, "mode": "same"}
        ds = {dt.convert_tokens_to_string([t]) for t in dt.get_vocab()}
        ts = {tt.convert_tokens_to_string([t]) for t in tt.get_vocab()}
        dc, tc = len(ds & ts) / max(len(ds), 1), len(ds & ts) / max(len(ts), 1)
    try:
        from specctl.runtime.proposers.draft_model import MIN_TLI_COVERAGE
    except ImportError:
        MIN_TLI_COVERAGE = 0.5
    return {"same": False, "draft_coverage": dc, "target_coverage": tc, "mode": "tli" if dc >= MIN_TLI_COVERAGE else "text"}


def _runtime_archs() -> tuple[str, ...]:
    try:
        from specctl.runtime.model import SUPPORTED_ARCHS

        return tuple(SUPPORTED_ARCHS)
    except ImportError:
        return ()


def judge_candidate(c: ModelInfo, target: ModelInfo, workload: Workload) -> Candidate:
    """Same tokenizer and ρ in the sweet spot -> draft; another tokenizer -> alternative; else refused."""
    cand = Candidate(c.spec, c.name, c.path, c.arch, c.params, runnable=c.arch in _runtime_archs())
    if not c.cost_params or not target.cost_params:
        cand.reason = "size unknown"
        return cand
    rho = estimate_rho(c.cost_params, c.num_layers, target.cost_params, target.num_layers)
    cand.rho_estimate = rho
    if rho >= 1.0 or (c.params and target.params and c.params >= target.params):
        cand.reason = f"not smaller than the target ({_fmt_count(c.params)} vs {_fmt_count(target.params)} parameters)"
        return cand
    ov = tokenizer_overlap(c.path, target.path) if c.path and target.path else None
    cand.overlap = ov
    if ov is not None:
        cand.tokenizer = "same" if ov["same"] else "different"
        tok_text = "same tokenizer" if ov["same"] else (
            f"another tokenizer ({ov['draft_coverage']:.0%} of its vocabulary maps onto the target's; drafts by {ov['mode']})")
    elif c.vocab_size is not None and target.vocab_size is not None and c.vocab_size != target.vocab_size:
        cand.tokenizer = "different"
        tok_text = f"another vocabulary ({c.vocab_size} vs {target.vocab_size}); overlap unknown"
    else:
        tok_text = "tokenizer not verified"
        if c.arch == target.arch and c.vocab_size == target.vocab_size:
            cand.tokenizer = "same"
            tok_text = "same family and vocabulary size (tokenizer not verified)"
    missing = [m.spec for m in (c, target) if not m.path]
    if missing:
        tok_text += f"; pull {' and '.join(missing)} to check (`specctl models pull NAME`)"
    family = "" if c.arch == target.arch else f"; another architecture ({c.arch})"
    alpha = workload.alpha_prior - (0 if cand.tokenizer == "same" else CROSS_TOKENIZER_PENALTY)
    cand.alpha_prior = alpha
    cand.best_k, cand.predicted_speedup = best_k(alpha, rho)
    gain = (f"ρ≈{rho:.2f} (from parameter counts), prior α={alpha:.2f} ({workload.name}) -> "
            f"x{cand.predicted_speedup:.2f} at k={cand.best_k}")
    if cand.predicted_speedup < MIN_GAIN:
        cand.reason = f"{tok_text}{family}; ρ too close to 1: {gain}"
        return cand
    if cand.tokenizer == "same":
        cand.verdict, cand.reason = "draft", f"{tok_text}{family}; {gain}"
    elif ov is not None:
        cand.verdict, cand.reason = "alternative", f"{tok_text}{family}; {gain}"
    else:
        cand.reason = f"{tok_text}{family}"
    if not cand.runnable:
        cand.reason += f"; the own runtime cannot run {c.arch} yet (vLLM can)"
    return cand


def gather_candidates(target: ModelInfo, specs: list[str] | None, extra_paths: list[str]) -> list[ModelInfo]:
    """``specs`` (--candidates), else every catalogue model; plus plain models found in --drafts."""
    from specctl.models import CATALOGUE

    out: list[ModelInfo] = []
    seen = {name_key(n) for n in target.names} | ({str(Path(target.path).resolve())} if target.path else set())
    for spec in list(specs if specs is not None else CATALOGUE) + extra_paths:
        info = inspect_model(spec)
        keys = {str(Path(info.path).resolve())} if info.path else {name_key(info.name)}
        if keys & seen:
            continue
        seen |= keys
        out.append(info)
    return out


# ----------------------------------------------------------------------------- choices and the tree

@dataclass
class Choice:
    method: str
    label: str
    reason: str
    config: dict  # vLLM's --speculative-config keys, as specctl takes them (catalogue names allowed)
    vllm_config: dict  # the same, with local paths for vLLM
    runnable: bool = True
    note: str = ""
    commands: dict = field(default_factory=dict)

    @property
    def layer(self) -> int:
        if self.method == "hybrid":  # as costly as its costliest part
            return max(LAYERS[p["method"]] for p in self.config["proposers"])
        return LAYERS[self.method]

    def to_dict(self) -> dict:
        return {"method": self.method, "layer": self.layer, **{k: v for k, v in asdict(self).items() if k != "method"}}


@dataclass
class Node:
    """One step of the walk: a question with its answer and reason, evidence, or a chosen method."""

    kind: str  # question, evidence, choice, note
    text: str
    answer: str | None = None
    reason: str = ""
    ok: bool | None = None  # evidence: accepted / refused
    children: list["Node"] = field(default_factory=list)

    def add(self, node: "Node") -> "Node":
        self.children.append(node)
        return node

    def to_dict(self) -> dict:
        d = {"kind": self.kind, "text": self.text}
        if self.answer is not None:
            d["answer"] = self.answer
        if self.reason:
            d["reason"] = self.reason
        if self.ok is not None:
            d["ok"] = self.ok
        if self.children:
            d["children"] = [c.to_dict() for c in self.children]
        return d


def _implemented() -> tuple[str, ...]:
    from specctl.config import implemented_methods

    return implemented_methods()


def make_choice(method: str, target: ModelInfo, label: str, reason: str, *, draft: str | None = None,
                draft_path: str | None = None, k: int | None = None, extra: dict | None = None) -> Choice:
    """A ready choice: its config (``extra``: more of the method's keys), vLLM's, and the commands."""
    from specctl.config import DEFAULT_NUM_SPECULATIVE_TOKENS

    k = k or DEFAULT_NUM_SPECULATIVE_TOKENS.get(method, 3)
    cfg: dict[str, Any] = {"method": method}
    if draft is not None:
        cfg["model"] = draft
    cfg["num_speculative_tokens"] = int(k)
    if method == "ngram":
        cfg.update(prompt_lookup_min=2, prompt_lookup_max=5)
    cfg.update(extra or {})
    vcfg = dict(cfg, model=draft_path or draft) if draft is not None else dict(cfg)
    runnable = method in _implemented()
    note = "" if runnable else (f"recommended, but '{method}' is not runnable in this installation yet "
                                f"(no specctl/runtime/proposers/{'eagle' if method == 'eagle3' else method}.py): "
                                "the vLLM config works in vLLM today")
    if method == "mtp":
        note = (note + "; " if note else "") + "older vLLM versions call this method 'deepseek_mtp'"
    model = shlex.quote(target.spec)
    js = shlex.quote(json.dumps(cfg))
    flags = (f"--method {method} -k {k}" if method in ("ngram", "suffix") else f"--speculative-config {js}")
    commands = {"specctl_flags": flags, "specctl_serve": f"specctl serve --model {model} {flags}",
                "specctl_bench": f"specctl bench --model {model} {flags}",
                "vllm": f"vllm serve {shlex.quote(target.path or target.spec)} --speculative-config {shlex.quote(json.dumps(vcfg))}"}
    return Choice(method, label, reason, cfg, vcfg, runnable, note, commands)


PATTERN_ALPHA_WHEN_MATCHED = 0.7
"""Prior acceptance of an n-gram/suffix draft on the steps where it finds a match, on a workload
whose output copies the prompt or repeats earlier responses (measured on code editing here: 0.8 to
0.85 for ngram on Qwen2.5-Coder; a prior, --probe measures it)."""


def hybrid_choice(target: ModelInfo, pattern: Choice, model: Choice, w: Workload, model_gain: float | None) -> Choice:
    """A hybrid of a zero-cost pattern proposer (first) and a model draft (where it has nothing),
    with the predicted gain of each part: the pattern part's from its prior where it matches (ρ = 0),
    the model part's from the cost model."""
    k = int(pattern.config.get("num_speculative_tokens") or 8)
    pattern_gain = best_k(PATTERN_ALPHA_WHEN_MATCHED, 0.0, k)[1]
    cfg = {"method": "hybrid", "policy": "first", "hybrid_min_match": 2,
           "proposers": [dict(pattern.config), dict(model.config)]}
    why = ("the output copies the prompt" if w.copies_prompt else "requests repeat earlier responses")
    reason = (f"{pattern.method} first where it matches ({why}): predicted x{pattern_gain:.2f} on those steps "
              f"(α≈{PATTERN_ALPHA_WHEN_MATCHED} when matched, no draft cost); {model.label} on new text"
              + (f": predicted x{model_gain:.2f}" if model_gain else "") + "; --probe measures both parts")
    model_q = shlex.quote(target.spec)
    flags = f"--speculative-config {shlex.quote(json.dumps(cfg))}"
    commands = {"specctl_flags": flags, "specctl_serve": f"specctl serve --model {model_q} {flags}",
                "specctl_bench": f"specctl bench --model {model_q} {flags}",
                "vllm": model.commands.get("vllm", "")}  # vLLM: the model part alone
    note = ("specctl's own method: vLLM runs one proposer at a time (its config below is the model part's)"
            + ("; " + model.note if model.note else ""))
    return Choice("hybrid", f"hybrid: {pattern.method} first, then {model.label}", reason, cfg, model.vllm_config,
                  pattern.runnable and model.runnable and "hybrid" in _implemented(), note, commands)


def _fmt_count(n: int | None) -> str:
    if not n:
        return "?"
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}K"


@dataclass
class Recommendation:
    target: ModelInfo
    workload: Workload
    own_training: bool
    mtp: MTPInfo
    drafts: list[DraftInfo]
    candidates: list[Candidate]
    tree: Node
    choice: Choice
    alternatives: list[Choice]
    notes: list[str] = field(default_factory=list)
    probe: dict | None = None
    context: int = 1024  # tokens in the KV cache while decoding, and requests decoding together,
    batch: int = 1  # as recommend judged sparse_attn (and --probe predicts it on this machine)

    def to_dict(self) -> dict:
        return {
            "target": self.target.to_dict(), "workload": asdict(self.workload), "own_training": self.own_training,
            "mtp": asdict(self.mtp), "drafts": [asdict(d) for d in self.drafts],
            "candidates": [c.to_dict() for c in self.candidates], "tree": self.tree.to_dict(),
            "recommendation": self.choice.to_dict(), "alternatives": [a.to_dict() for a in self.alternatives],
            "implemented_methods": list(_implemented()), "notes": self.notes, "probe": self.probe,
            "context": self.context, "batch": self.batch,
        }


def _layer1(target: ModelInfo, w: Workload, parent: Node) -> tuple[Choice, Choice]:
    """The zero-model layer: suffix where requests repeat, else ngram. Returns (pick, the other)."""
    q = parent.add(Node("question", "Do requests repeat (agent loops, fixed-template batch jobs)?",
                        "yes" if w.repeats else "no", f"workload {w.name}: {w.description}"))
    copy = ("the output copies the prompt, where prompt lookup does well" if w.copies_prompt
            else "little of the output copies the prompt: a low ceiling, but ngram costs nothing")
    ng = make_choice("ngram", target, "ngram (prompt lookup)", f"always available, zero cost; {copy}")
    sf = make_choice("suffix", target, "suffix (suffix trees over this and earlier responses)",
                     "reuses earlier responses when requests repeat; zero model cost")
    pick, other = (sf, ng) if w.repeats else (ng, sf)
    q.add(Node("choice", pick.label, reason=pick.reason))
    return pick, other


def walk(target: ModelInfo, mtp: MTPInfo, drafts: list[DraftInfo], cands: list[Candidate], w: Workload,
         own_training: bool, drafts_searched: str) -> tuple[Node, Choice, list[Choice]]:
    """The flowchart: (tree, chosen method, alternatives)."""
    root = Node("note", f"{target.name}: {target.arch or '?'}, {_fmt_count(target.params)} parameters, "
                        f"{target.num_layers or '?'} layers, hidden {target.hidden_size or '?'}, vocab {target.vocab_size or '?'}",
                reason=f"workload {w.name}")
    q1 = root.add(Node("question", "Do you train this model yourself?", "yes" if own_training else "no",
                       "--own-training: MTP is a (pre)training decision, the most thorough layer" if own_training
                       else "a released model (no --own-training): MTP cannot be added after training"))
    mtp_ev = "; ".join(mtp.evidence) or "no nextn/mtp key in config.json and no MTP tensors"
    if own_training and not mtp.present and not any(d.kind == "mtp" and d.accepted for d in drafts):
        train = "`specctl train-mtp`" if _command_exists("train_mtp") else "your trainer (specctl train-mtp is not in this installation yet)"
        c = make_choice("mtp", target, "mtp (train MTP layers in)",
                        f"add MTP layers when you train, with {train}; every deployment then drafts for free", k=1)
        c.runnable, c.note = False, "a plan: usable once the model is trained with MTP layers. " + c.note
        q1.add(Node("choice", c.label, reason=c.reason))
        meanwhile = q1.add(Node("note", "Until then:"))
        now, more = _after_q1(target, mtp, mtp_ev, drafts, cands, w, meanwhile, drafts_searched)
        return root, c, [now] + more
    c, alts = _after_q1(target, mtp, mtp_ev, drafts, cands, w, q1, drafts_searched)
    return root, c, alts


def _after_q1(target, mtp, mtp_ev, drafts, cands, w, parent, drafts_searched) -> tuple[Choice, list[Choice]]:
    alts: list[Choice] = []
    mtp_drafts = [d for d in drafts if d.kind == "mtp"]
    drafts = [d for d in drafts if d.kind != "mtp"]
    good_mtp = [d for d in mtp_drafts if d.accepted]
    qm = parent.add(Node("question", "Does the model carry MTP layers (built in, or trained for it)?",
                         "yes" if mtp.present or good_mtp else "no", mtp.refused or mtp_ev))
    for d in mtp_drafts:
        qm.add(Node("evidence", f"MTP draft {d.path}", reason="; ".join(d.reasons) or
                    f"{d.details.get('layers')} MTP module(s) matching the target", ok=d.accepted))
    if mtp.present:
        c = make_choice("mtp", target, f"mtp ({mtp.layers} built-in MTP layer(s))",
                        "trained in: no draft to pick, no second KV cache, no ρ to worry about", k=mtp.layers)
        qm.add(Node("choice", c.label, reason=c.reason))
        return c, alts
    if good_mtp:
        d = good_mtp[0]
        c = make_choice("mtp", target, f"mtp with {d.path}",
                        "MTP modules trained for this target: self-speculation, no second KV cache",
                        draft=d.path, draft_path=d.path, k=d.k or 1)
        qm.add(Node("choice", c.label, reason=c.reason))
        return c, alts
    good = [d for d in drafts if d.accepted]
    q2 = qm.add(Node("question", "Is there a Medusa head or EAGLE draft made for this model?",
                     "yes" if good else "no",
                     f"{len(good)} of {len(drafts)} draft(s) fit" if drafts else f"none found ({drafts_searched})"))
    for d in drafts:
        why = "; ".join(d.reasons) or "hidden size and vocabulary match the target"
        q2.add(Node("evidence", f"{d.kind} draft {d.path}", reason=why, ok=d.accepted))
    if good:
        good.sort(key=lambda d: DRAFT_PREFERENCE.index(d.kind))
        best = good[0]
        c = make_choice(best.kind, target, f"{best.kind} with {best.path}",
                        "a draft made for this target: the best match at almost no deployment cost",
                        draft=best.path, draft_path=best.path, k=best.k or None)
        q2.add(Node("choice", c.label, reason=c.reason))
        alts += [make_choice(d.kind, target, f"{d.kind} with {d.path}", "another fitting draft",
                             draft=d.path, draft_path=d.path, k=d.k or None) for d in good[1:]]
        l1 = _layer1(target, w, Node("note", ""))[0]
        alts.append(l1)
        if w.copies_prompt or w.repeats:
            alts.append(hybrid_choice(target, l1, c, w, None))
        return c, alts
    same = sorted((c for c in cands if c.verdict == "draft"), key=lambda c: -(c.predicted_speedup or 0))
    other = [c for c in cands if c.verdict == "alternative"]
    smaller_same = [c for c in cands if c.tokenizer == "same" and c.rho_estimate is not None and c.rho_estimate < 1]
    q3 = q2.add(Node("question", "Is there a smaller model of the same family, with the same tokenizer?",
                     "yes" if smaller_same else "no",
                     f"{len(cands)} candidate(s) checked" if cands else "no candidates (--candidates, or the catalogue)"))
    for c in cands:
        q3.add(Node("evidence", f"{c.name} ({c.arch or '?'}, {_fmt_count(c.params)})", reason=c.reason,
                    ok={"draft": True, "alternative": None}.get(c.verdict, False)))
    draft_alts = [make_choice("draft_model", target, f"draft_model with {c.name} (another tokenizer)",
                              c.reason, draft=c.spec, draft_path=c.path, k=c.best_k) for c in other]
    if smaller_same:
        best = same[0] if same else min(smaller_same, key=lambda c: c.rho_estimate)
        q4 = q3.add(Node("question", f"Is ρ in the sweet spot for {best.name}?", "yes" if same else "no",
                         f"ρ≈{best.rho_estimate:.2f} (parameter counts + per-layer overhead), prior α={best.alpha_prior:.2f} "
                         f"-> predicted x{best.predicted_speedup:.2f} at k={best.best_k} (needs > x{MIN_GAIN}; "
                         "--probe measures α and ρ)"))
        if same:
            c = make_choice("draft_model", target, f"draft_model with {best.name}",
                            "a smaller same-tokenizer model: the most flexible option; mind its second KV cache",
                            draft=best.spec, draft_path=best.path, k=best.best_k)
            if not best.runnable:
                c.runnable = False
                c.note = (c.note + "; " if c.note else "") + f"the own runtime cannot run {best.arch} yet (vLLM can)"
            q4.add(Node("choice", c.label, reason=c.reason))
            l1, _ = _layer1(target, w, Node("note", ""))
            note = ("the output copies the prompt: ngram is a strong zero-cost rival here, compare with --probe"
                    if w.copies_prompt else "zero-cost fallback")
            l1.reason = note if w.copies_prompt else l1.reason
            q4.add(Node("note", f"also try {l1.method}", reason=note))
            hyb = [hybrid_choice(target, l1, c, w, best.predicted_speedup)] if (w.copies_prompt or w.repeats) else []
            if hyb:
                q4.add(Node("note", f"or both: {hyb[0].label}", reason=hyb[0].reason))
            alts += [make_choice("draft_model", target, f"draft_model with {o.name}", o.reason, draft=o.spec,
                                 draft_path=o.path, k=o.best_k) for o in same[1:]] + [l1] + hyb + draft_alts
            return c, alts
        parent_l1 = q4
    else:
        parent_l1 = q3
    pick, other_l1 = _layer1(target, w, parent_l1)
    if draft_alts:
        parent_l1.add(Node("note", "a draft with another tokenizer may still pay off",
                           reason="; ".join(f"{c.name}: {c.reason}" for c in other)))
    return pick, draft_alts + [other_l1]


def _command_exists(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(f"specctl.commands.{name}") is not None


def sparse_attn_choice(target: ModelInfo, w: Workload, tree: Node, choice: Choice, context: int | None,
                       batch: int, machine=None) -> tuple[Choice | None, bool]:
    """sparse_attn, judged by the roofline model (specctl/roofline.py) from the target's shapes, the
    context and the batch: it pays when the KV cache read per step is a large share of the weights
    read. ``machine``: the measured one (--probe), else bytes alone (an upper bound: compute is free).
    Returns (the choice, or None where it does not pay; whether it replaces a layer-1 ``choice``)."""
    from specctl.roofline import Machine, Shapes, sparse_attn_estimate

    cfg = _text_config(target.config) if target.config else {}
    try:
        shapes = Shapes.from_config(cfg)
    except KeyError:
        tree.add(Node("note", "sparse_attn not judged", reason="the target's config.json is not at hand (pull it)"))
        return None, False
    context = context or w.context
    alpha, k = SPARSE_ALPHA[w.copies_prompt and context >= 4096], 4
    tau = (1 - alpha ** (k + 1)) / (1 - alpha)
    m = machine or Machine(1.0, float("inf"), float("inf"), "bytes only")
    est = sparse_attn_estimate(shapes, m, context=context, batch=batch, k=k, tau=tau, algorithm="vegas")
    bound = "" if machine is not None else " (bytes only: an upper bound; --probe measures this machine)"
    reason = (f"at {context} tokens of context and batch {batch}, the KV cache read per step is "
              f"{100 * est.kv_share:.0f}% of the weights read ({shapes.kv_heads} KV heads of {shapes.head_dim}, "
              f"{shapes.layers} layers); drafting over {est.draft_positions} positions with the target's own layers "
              f"at k={k}, prior α={alpha}: predicted x{est.speedup:.2f}{bound}")
    pays = est.speedup >= MIN_GAIN
    q = tree.add(Node("question", "Is the KV cache a large share of each step's reads (sparse-attention self-speculation)?",
                      "yes" if pays else "no", reason))
    if not pays:
        return None, False
    c = make_choice("sparse_attn", target, "sparse_attn (vegas: the target drafts over the positions it attended to most)",
                    reason, k=k, extra={"sparse_attn_algorithm": "vegas"})
    c.commands["specctl_bench"] += " -w long-4k --reuse-prefill"
    c.note = "vLLM RFC #47351's keys: mainline vLLM has no sparse_attn yet (the platformxlab/vegas fork does)"
    replace_choice = choice.layer == 1 and choice.method in ("ngram", "suffix")
    if replace_choice:
        q.add(Node("choice", c.label, reason="no trained draft here, and self-speculation over the long context pays"))
    return c, replace_choice


def recommend(model: str, *, drafts: list[str] | None = None, candidates: list[str] | None = None,
              own_training: bool = False, workload: str = "chat", pull: bool = False,
              dtype: str = "bfloat16", context: int | None = None, batch: int = 1) -> Recommendation:
    """Inspect the target, its drafts and candidate draft models, and walk the flowchart; ``context``
    (default: the workload's) and ``batch`` judge sparse_attn."""
    w = get_workload(workload)
    target = inspect_model(model, pull=pull, dtype=dtype)
    mtp = detect_mtp(target)
    found, plain, notes = find_drafts(target, list(drafts or []))
    infos = gather_candidates(target, candidates, plain)
    cands = [judge_candidate(c, target, w) for c in infos]
    searched = ("--drafts " + ", ".join(drafts)) if drafts else ""
    searched += (("; " if searched else "") + f"no Medusa/EAGLE folder beside {target.path}") if target.path else ""
    tree, choice, alts = walk(target, mtp, found, cands, w, own_training, searched or "no --drafts given")
    sparse, replaces = sparse_attn_choice(target, w, tree, choice, context, batch)
    if sparse is not None:
        if replaces:
            choice, alts = sparse, [choice] + alts
        else:
            alts.append(sparse)
    if not target.path:
        notes.append(f"{target.name} is not pulled: described from the catalogue (`specctl models pull {target.name}` "
                     "to check drafts and tokenizers against it)")
    return Recommendation(target, w, own_training, mtp, found, cands, tree, choice, alts, notes,
                          context=context or w.context, batch=batch)


# ----------------------------------------------------------------------------- probing

class _Timed:
    """Wraps a Proposer: times the draft's work during decoding and records (drafted, accepted) per step.

    Draft work is ``propose()`` plus the hooks a stateful draft computes in (``on_target_hidden``:
    EAGLE/MTP feed the target's states; ``on_verified``: rollback), counted from the request's first
    ``propose`` on, so that prefill-time work stays out, as it stays out of the decode time.
    """

    def __init__(self, inner):
        self.inner = inner
        self.reset()

    def reset(self) -> None:
        self.draft_s, self.k_asked, self.calls = 0.0, 0, 0
        self.steps: list[tuple[int, int]] = []  # [(drafted, accepted)] of steps that drafted
        self._pending = 0
        self._decoding = False

    @property
    def needs_hidden_states(self) -> bool:
        return getattr(self.inner, "needs_hidden_states", False)

    def _timed(self, fn, *args):
        if not self._decoding:
            return fn(*args)
        t = time.perf_counter()
        out = fn(*args)
        self.draft_s += time.perf_counter() - t
        return out

    def start_request(self, slot, prompt_ids):
        self._decoding = False
        self.inner.start_request(slot, prompt_ids)

    def set_sampling(self, slot, params, generator=None):
        if hasattr(self.inner, "set_sampling"):
            self.inner.set_sampling(slot, params, generator)

    def on_target_hidden(self, slot, hidden, aux):
        self._timed(self.inner.on_target_hidden, slot, hidden, aux)

    def propose(self, token_ids, num_tokens, k, hidden_states=None, slots=None):
        self._decoding = True
        d = self._timed(self.inner.propose, token_ids, num_tokens, k, hidden_states, slots)
        self.k_asked += k
        self.calls += 1
        self._pending = int(d.num_tokens[0])
        return d

    def on_verified(self, slot, num_accepted, emitted):
        if self._pending > 0:
            self.steps.append((self._pending, int(num_accepted)))
        self._pending = 0
        self._timed(self.inner.on_verified, slot, num_accepted, emitted)

    def end_request(self, slot):
        self._decoding = False
        self.inner.end_request(slot)

    def __getattr__(self, name):  # anything else goes to the wrapped proposer
        return getattr(self.inner, name)


def probe_plan(rec: Recommendation, k: int | None = None) -> tuple[list[tuple[str, dict]], list[dict]]:
    """[(label, speculative config)] to run, and [{method, label, reason}] skipped."""
    impl = set(_implemented())
    run: list[tuple[str, dict]] = []
    skipped: list[dict] = []

    def add(label: str, method: str, cfg: dict, why_not: str | None = None) -> None:
        if why_not is None and method not in impl:
            why_not = f"'{method}' is not implemented in this installation"
        if why_not:
            skipped.append({"method": method, "label": label, "reason": why_not})
        else:
            run.append((label, dict(cfg, num_speculative_tokens=k) if k else cfg))

    for m in ("ngram", "suffix"):
        add(m, m, make_choice(m, rec.target, m, "").config)
    if rec.mtp.present:
        add("mtp", "mtp", {"method": "mtp", "num_speculative_tokens": rec.mtp.layers})
    for d in rec.drafts:
        if d.accepted:
            add(f"{d.kind}:{Path(d.path).name}", d.kind, {"method": d.kind, "model": d.path, "num_speculative_tokens": d.k or 3})
    models = sorted((c for c in rec.candidates if c.verdict in ("draft", "alternative")),
                    key=lambda c: (c.verdict != "draft", -(c.predicted_speedup or 0)))
    for i, c in enumerate(models):
        why = ("not pulled: `specctl models pull %s`" % c.spec if not c.path else
               f"the own runtime cannot run {c.arch}" if not c.runnable else
               f"only the {MAX_PROBED_DRAFTS} most promising draft models are probed" if i >= MAX_PROBED_DRAFTS else None)
        add(f"draft_model:{c.name}", "draft_model",
            {"method": "draft_model", "model": c.path or c.spec, "num_speculative_tokens": c.best_k or 3}, why)
    for a in [a for a in [rec.choice, *rec.alternatives] if a.method == "sparse_attn"]:
        add("sparse_attn", "sparse_attn", dict(a.config))
    for h in [a for a in [rec.choice, *rec.alternatives] if a.method == "hybrid"]:
        parts = [dict(p, model=local) if (local := _local_model(p)) else p for p in h.config["proposers"]]
        add("hybrid:" + "+".join(p["method"] for p in parts), "hybrid", dict(h.config, proposers=parts),
            None if all(_local_model(p) is not None or "model" not in p for p in parts) else "its draft model is not pulled")
    return run, skipped


def _local_model(part: dict) -> str | None:
    """A sub-config's draft as a local path (a catalogue name that is pulled), else None."""
    m = part.get("model")
    if m is None:
        return None
    return m if Path(m).exists() else (str(p) if (p := _pulled_path(m)) else None)


def probe(rec: Recommendation, *, prompts: str | None = None, num_prompts: int = 2, max_new_tokens: int = 32,
          k: int | None = None, adaptive: bool = True, dtype: str = "bfloat16", device: str = "cpu", seed: int = 0,
          progress: Callable[[str], None] | None = None) -> dict:
    """Run each applicable, implemented method briefly against the plain baseline; rank by measured speedup.

    Like ``specctl bench`` (same prompts, decode tokens/s, per-prompt interleaving, a warm-up), plus
    per method: α (MLE over steps), ρ (draft time per drafted token / one target decode step),
    the predicted speedup at the best k, and the verify cost (one verify forward / one decode step).
    """
    import torch

    from specctl.bench.suite import first_divergence
    from specctl.bench.workloads import load_workload, render_prompt
    from specctl.config import SpecConfig
    from specctl.models import resolve_model
    from specctl.runtime.decoder import SamplingParams, SpecDecoder
    from specctl.runtime.proposers import build_proposer
    from specctl.runtime.runner import TargetRunner, load_model

    say = progress or (lambda _m: None)
    source = prompts or rec.workload.prompts or "chat"
    note = None
    if prompts is None and rec.workload.prompts is None:
        note = f"no built-in prompts for workload {rec.workload.name}: probed on chat (pass --prompts FILE)"
    reqs = load_workload(source, num_prompts, seed)
    plan, skipped = probe_plan(rec, k)
    path = resolve_model(rec.target.spec, dtype=dtype)
    say(f"loading {path} ({dtype}, {device})")
    loaded = load_model(path, dtype=dtype, device=device)
    ids = [render_prompt(loaded.tokenizer, r) for r in reqs]
    configs = []
    for label, cfg in plan:
        configs.append((label, SpecConfig.from_dict(cfg)))
    max_k = max([c.num_speculative_tokens for _, c in configs], default=0)
    runner = TargetRunner(loaded.model, max_len=max(len(i) for i in ids) + max_new_tokens + max_k + 8)
    decoders: list[tuple[str, SpecConfig | None, _Timed | None, Any]] = [("baseline", None, None, SpecDecoder(runner))]
    for label, c in configs:
        say(f"building {label}")
        try:
            t = _Timed(build_proposer(c, runner.max_len, target=loaded))
        except Exception as e:  # noqa: BLE001 - a draft that does not load is reported, not fatal
            skipped.append({"method": c.method, "label": label, "reason": f"{type(e).__name__}: {str(e)[:160]}"})
            continue
        decoders.append((label, c, t, SpecDecoder(runner, t, c.num_speculative_tokens, adaptive=adaptive)))
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, stop_token_ids=loaded.stop_token_ids)
    gen = lambda: torch.Generator().manual_seed(seed)  # noqa: E731
    for label, _, t, dec in decoders:  # warm-up (numba compilation, first allocations), outside the timings
        say(f"warm-up {label}")
        dec.generate(ids[0][:64], SamplingParams(max_new_tokens=8, temperature=0.0), gen())
        if t is not None:
            t.reset()
    tot = {label: {"decode_s": 0.0, "tokens": 0, "steps": 0, "identical": 0} for label, *_ in decoders}
    base_out: list[list[int]] = []
    for i, p in enumerate(ids):
        for label, _, _, dec in decoders:
            say(f"prompt {i + 1}/{len(ids)} · {label}")
            res = dec.generate(p, params, gen())
            s = tot[label]
            s["decode_s"] += res.decode_s
            s["tokens"] += max(len(res.token_ids) - 1, 0)
            s["steps"] += res.num_steps
            if label == "baseline":
                base_out.append(res.token_ids)
            else:
                s["identical"] += first_divergence(base_out[i], res.token_ids) is None
    b = tot["baseline"]
    base_tps = b["tokens"] / b["decode_s"] if b["decode_s"] > 0 else 0.0
    step_s = b["decode_s"] / b["tokens"] if b["tokens"] else 0.0  # one target decode step
    rows = []
    for label, c, t, _ in decoders[1:]:
        s = tot[label]
        tps = s["tokens"] / s["decode_s"] if s["decode_s"] > 0 else 0.0
        alpha = estimate_alpha(t.steps)
        rho = (t.draft_s / t.k_asked) / step_s if t.k_asked and step_s else None
        pk, ps = best_k(alpha, rho) if alpha is not None and rho is not None else (None, None)
        acc = sum(a for _, a in t.steps)
        drafted = sum(n for n, _ in t.steps)
        verify = ((s["decode_s"] - t.draft_s) / s["steps"]) / step_s if s["steps"] and step_s else None
        rows.append({
            "label": label, "method": c.method, "config": c.to_dict(), "k": c.num_speculative_tokens,
            "alpha": alpha, "rho": rho, "predicted_k": pk, "predicted_speedup": ps,
            "measured_speedup": tps / base_tps if base_tps else None, "tokens_per_s": tps,
            "acceptance_rate": acc / drafted if drafted else 0.0,
            "mean_acceptance_length": 1 + acc / len(t.steps) if t.steps else 1.0,
            "draft_rate": len(t.steps) / s["steps"] if s["steps"] else 0.0,
            "verify_cost": verify, "identical_to_baseline": s["identical"], "requests": len(ids),
        })
    for r in rows:
        if r["method"] == "sparse_attn":
            r["roofline"] = _sparse_roofline(rec, loaded, SpecConfig.from_dict(r["config"]), r["mean_acceptance_length"])
    rows.sort(key=lambda r: -(r["measured_speedup"] or 0))
    for i, r in enumerate(rows, 1):
        r["rank"] = i
    out = {"prompts": source, "num_prompts": len(ids), "max_new_tokens": max_new_tokens, "dtype": dtype,
           "device": str(loaded.device), "draft_length": "adaptive (up to k)" if adaptive else "fixed k",
           "threads": torch.get_num_threads(), "baseline_tokens_per_s": base_tps, "target_step_s": step_s,
           "methods": rows, "skipped": skipped}
    if note:
        out["note"] = note
    return out


def _sparse_roofline(rec: Recommendation, loaded, c, tau: float) -> dict:
    """sparse_attn's predicted speedup at the recommendation's context and batch on this machine: the
    roofline model (specctl/roofline.py) with the bandwidth and compute measured on the loaded target
    at that context, and the acceptance length the probe measured."""
    from specctl.roofline import Shapes, measure_machine, sparse_attn_estimate

    a = loaded.model.args
    shapes = Shapes.of(loaded.model)
    m = measure_machine(loaded.model, context=rec.context, repeats=3)
    skip = c.sparse_attn_skip_layers if isinstance(c.sparse_attn_skip_layers, list) else []
    est = sparse_attn_estimate(shapes, m, context=rec.context, batch=rec.batch, k=c.num_speculative_tokens, tau=tau,
                               ratio=c.sparse_attn_ratio, min_tokens=c.sparse_attn_min_tokens,
                               layer_share=1 - len(skip) / a.num_layers, algorithm=c.sparse_attn_algorithm)
    return {"context": rec.context, "batch": rec.batch, "predicted_speedup": est.speedup, "kv_share": est.kv_share,
            "draft_positions": est.draft_positions, "machine": m.to_dict()}


def apply_probe(rec: Recommendation, result: dict) -> None:
    """Record the probe in the recommendation: a tree node with the ranking; the measured best becomes the pick."""
    rec.probe = result
    rows = result["methods"]
    node = rec.tree.add(Node("question", "Measured (--probe): which method is fastest here?",
                             rows[0]["label"] if rows else "none",
                             f"{result['num_prompts']} prompt(s) of {result['prompts']}, {result['max_new_tokens']} new tokens, "
                             f"baseline {result['baseline_tokens_per_s']:.2f} tok/s"))
    for r in rows:
        node.add(Node("evidence", f"{r['rank']}. {r['label']}: x{r['measured_speedup']:.2f} measured",
                      reason=f"α={_f(r['alpha'])}, ρ={_f(r['rho'], 3)}, predicted x{_f(r['predicted_speedup'])} "
                             f"at k={r['predicted_k']}; drafted at {r['draft_rate']:.0%} of steps; a verify forward "
                             f"cost {_f(r['verify_cost'])} decode steps (the formula assumes 1)",
                      ok=(r["measured_speedup"] or 0) > 1.0))
        if "roofline" in r:
            rf = r["roofline"]
            node.add(Node("evidence", f"{r['label']} at {rf['context']} tokens of context, batch {rf['batch']}: "
                                      f"predicted x{rf['predicted_speedup']:.2f} on this machine",
                          reason=f"roofline with this machine's measured bandwidth "
                                 f"({rf['machine']['bandwidth'] / 1e9:.1f} GB/s) and attention compute, and the "
                                 f"acceptance length measured here ({r['mean_acceptance_length']:.2f}); the KV read is "
                                 f"{100 * rf['kv_share']:.0f}% of the weights'",
                          ok=rf["predicted_speedup"] > 1.0))
    for s in result["skipped"]:
        node.add(Node("evidence", f"{s['label']}: not probed", reason=s["reason"], ok=False))
    if rows and (rows[0]["measured_speedup"] or 0) > 1.0:
        best = rows[0]
        if best["config"]["method"] != rec.choice.method or best["config"].get("model") not in (
                None, rec.choice.config.get("model"), rec.choice.vllm_config.get("model")):
            flow = rec.choice
            cfg = best["config"]
            draft = cfg.get("model")
            new = make_choice(cfg["method"], rec.target, f"{best['label']} (measured best)",
                              f"measured x{best['measured_speedup']:.2f} here; the flowchart's pick was {flow.method}",
                              draft=draft, draft_path=draft, k=best["k"])
            rec.alternatives = [flow] + [a for a in rec.alternatives if a.config != new.config]
            rec.choice = new
        node.add(Node("choice", rec.choice.label, reason=f"measured x{best['measured_speedup']:.2f}"))
    else:
        node.add(Node("note", "no method beat plain decoding on these prompts: the flowchart's pick stands",
                      reason="try more prompts or tokens (--num-prompts, --max-new-tokens), or the real workload (--prompts)"))


def _f(x: float | None, digits: int = 2) -> str:
    return "?" if x is None else f"{x:.{digits}f}"
