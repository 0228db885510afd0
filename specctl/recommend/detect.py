"""Draft formats on disk: which one a folder holds, and whether it fits a target.

One detector and one check per format, each a pure function of a folder's ``config.json`` (a dict)
and its tensor index (name -> (dtype, shape), as ``inspection.tensor_index`` reads it):

    format        detect             check                 what it looks for
    mtp           is_mtp_draft       check_mtp             MTP modules and no main model (train-mtp's folder)
    medusa        is_medusa          check_medusa          ``medusa`` model_type/keys, ``lm_heads.{h}``
    eagle3        is_eagle3          check_eagle3          ``draft_vocab_size``, ``midlayer.*``, ``d2t``, aux layers
    eagle         is_eagle           check_eagle           ``fc.weight`` + ``layers.0.*`` (EAGLE-1)
    draft_model   is_model           check_draft_model     a plain causal LM; its tokenizer against the target's

``mtp_modules`` finds the MTP layers built into a target (config keys, tensors, GGUF fields).
``check_draft`` runs a format's check plus what every adapter is checked for (hidden size,
vocabulary, the base model it records it was trained for) against ``TargetFacts``.

What it does not know: how folders are found or read, the target beyond ``TargetFacts``, the cost
model and the flowchart; it keeps no state (``specctl.drafts`` is where each format's detect/check
is headed, beside its reader).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cache

Tensors = dict  # name -> (dtype, shape): a folder's safetensors headers

MTP_TENSOR = re.compile(r"(^|\.)mtp[._]|mtp_layers|(^|\.)(eh_proj|enorm|hnorm|shared_head)\.")


def text_config(cfg: dict) -> dict:
    """The language model's part of a config (a multimodal config nests it under ``text_config``)."""
    return cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg


_NOISE = {"instruct", "chat", "it", "hf", "gguf", "awq", "gptq", "bf16", "bfloat16", "fp16", "float16", "fp32",
          "float32", "int4", "int8", "q4", "q8", "model", "the"}


def name_key(name: str) -> str:
    """A model name reduced for comparison: 'Qwen/Qwen2.5-Coder-1.5B-Instruct' -> 'qwen25coder15b'."""
    last = re.split(r"[/\\]", str(name).strip().rstrip("/\\"))[-1].lower()
    return "".join(w for w in re.split(r"[^a-z0-9]+", last) if w and w not in _NOISE)


@dataclass(frozen=True)
class TargetFacts:
    """What a draft is checked against: the target's sizes (None: not known, e.g. not pulled) and names."""

    name: str
    hidden_size: int | None
    vocab_size: int | None
    num_layers: int | None
    names: tuple[str, ...] = ()  # every name it goes by (a recorded base model must be one of them)


# ----------------------------------------------------------------------------- MTP layers in a target

@dataclass
class MTPInfo:
    present: bool
    layers: int = 0
    evidence: list[str] = field(default_factory=list)
    refused: str | None = None  # why declared MTP layers cannot be used


def mtp_modules(cfg: dict, tensors: Tensors, gguf: dict | None = None) -> MTPInfo:
    """MTP modules from config keys (``num_nextn_predict_layers``, ``mtp_num_hidden_layers``, ...) and tensors:
    DeepSeek-V3's ``model.layers.{N+i}.{eh_proj,enorm,hnorm,shared_head}``, Qwen3-Next's ``mtp.layers.{i}.*``."""
    gguf = gguf or {}
    evidence: list[str] = []
    declared = 0
    for c in (cfg, text_config(cfg)):
        for k, v in c.items():
            if ("nextn" in k or "mtp" in k) and isinstance(v, int) and not isinstance(v, bool) and v > 0:
                declared = max(declared, v)
                evidence.append(f"config.json {k} = {v}")
    for k, v in gguf.items():
        if k.endswith("nextn_predict_layers") and v > 0:
            declared = max(declared, v)
            evidence.append(f"GGUF {k} = {v}")
    names = [n for n in tensors if MTP_TENSOR.search(n)]
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


# ----------------------------------------------------------------------------- detection, one per format

def is_mtp_draft(cfg: dict, tensors: Tensors) -> bool:
    """MTP modules and no main model (no ``model.embed_tokens``, no ``model.layers.0``): train-mtp's folder."""
    return (any(MTP_TENSOR.search(k) for k in tensors) and "model.embed_tokens.weight" not in tensors
            and not any(k.startswith("model.layers.0.") for k in tensors))


def is_medusa(cfg: dict, tensors: Tensors) -> bool:
    archs = " ".join(cfg.get("architectures") or []).lower()
    return (str(cfg.get("model_type", "")).lower() == "medusa" or "medusa" in archs or "medusa_num_heads" in cfg
            or any(k.startswith("medusa_head") for k in tensors))


def is_eagle3(cfg: dict, tensors: Tensors) -> bool:
    archs = " ".join(cfg.get("architectures") or []).lower()
    return ("eagle3" in archs or "eagle3" in str(cfg.get("model_type", "")).lower() or "draft_vocab_size" in cfg
            or any(k.startswith("midlayer.") for k in tensors))


def is_eagle(cfg: dict, tensors: Tensors) -> bool:
    """EAGLE-1 (test after ``is_eagle3``, whose folders match this too)."""
    archs = " ".join(cfg.get("architectures") or []).lower()
    return ("eagle" in archs or str(cfg.get("model_type", "")).lower() == "eagle"
            or ("fc.weight" in tensors and any(k.startswith("layers.0.") for k in tensors)))


def is_model(cfg: dict, tensors: Tensors) -> bool:
    """A plain causal LM (a draft_model candidate): a model_type and numbered decoder layers."""
    return bool(cfg.get("model_type")) and any(re.search(r"layers\.\d+\.", k) for k in tensors)


_DETECT_ORDER = (("mtp", is_mtp_draft), ("medusa", is_medusa), ("eagle3", is_eagle3), ("eagle", is_eagle))


def classify_draft(cfg: dict, tensors: Tensors) -> str | None:
    """'mtp', 'medusa', 'eagle3', 'eagle' or None (a plain model or something else), first match in that order."""
    return next((kind for kind, detect in _DETECT_ORDER if detect(cfg, tensors)), None)


# ----------------------------------------------------------------------------- checks, one per format

@dataclass
class DraftInfo:
    path: str
    kind: str  # method: medusa, eagle, eagle3, mtp
    accepted: bool = False
    reasons: list[str] = field(default_factory=list)  # why refused (or notes when accepted)
    details: dict = field(default_factory=dict)

    @property
    def k(self) -> int:
        if self.kind in ("medusa", "mtp"):
            return int(self.details.get("num_heads") or self.details.get("layers") or 0)
        return 3


@dataclass
class FormatCheck:
    """A format's own findings: its details, its reasons, and the hidden size and vocabulary it declares."""

    details: dict
    reasons: list[str]
    hidden: int | None
    vocab: int | None


def check_mtp(cfg: dict, tensors: Tensors, target: TargetFacts) -> FormatCheck:
    m = mtp_modules(cfg, tensors)
    tc = text_config(cfg)
    hidden, vocab, n_main = tc.get("hidden_size"), tc.get("vocab_size"), tc.get("num_hidden_layers")
    details = {"layers": m.layers, "hidden_size": hidden, "vocab_size": vocab, "num_hidden_layers": n_main,
               "evidence": m.evidence}
    bad = [m.refused] if m.refused else []
    L = target.num_layers
    if any(re.match(r"model\.layers\.\d+\.eh_proj", k) for k in tensors) and L is not None and n_main != L:
        bad.append(f"its modules follow a {n_main}-layer model, the target has {L} layers")
    return FormatCheck(details, bad, hidden, vocab)


def check_medusa(cfg: dict, tensors: Tensors, target: TargetFacts) -> FormatCheck:
    heads = cfg.get("num_heads", cfg.get("medusa_num_heads"))
    details = {"num_heads": heads, "num_layers": cfg.get("num_hidden_layers", cfg.get("medusa_num_layers")),
               "hidden_size": cfg.get("hidden_size"), "vocab_size": cfg.get("vocab_size")}
    bad = []
    lm = sorted(k for k in tensors if re.match(r"lm_heads\.\d+\.weight$", k))
    if not heads:
        bad.append("config.json has no num_heads")
    elif lm and len(lm) != heads:
        bad.append(f"config says {heads} heads but the weights hold {len(lm)} lm_heads")
    if any(k.startswith("medusa_head") for k in tensors):
        bad.append("note: original Medusa layout (medusa_head.*): vLLM loads blocks.*/lm_heads.*; convert it")
    hs = [tensors[k][1][0] for k in lm if tensors[k][1]]
    vocab = cfg.get("vocab_size") or (hs[0] if hs else None)
    hidden = cfg.get("hidden_size") or next((s[1][-1] for k, s in tensors.items() if k.startswith("blocks.")), None)
    return FormatCheck(details, bad, hidden, vocab)


def _eagle_details(cfg: dict) -> dict:
    aux = cfg.get("eagle_aux_hidden_state_layer_ids") or (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return {"hidden_size": cfg.get("hidden_size"), "target_hidden_size": cfg.get("target_hidden_size"),
            "vocab_size": cfg.get("vocab_size"), "draft_vocab_size": cfg.get("draft_vocab_size"), "aux_layers": aux}


def check_eagle3(cfg: dict, tensors: Tensors, target: TargetFacts) -> FormatCheck:
    details = _eagle_details(cfg)
    H, L, aux, bad = target.hidden_size, target.num_layers, details["aux_layers"], []
    dv = cfg.get("draft_vocab_size")
    if "d2t" in tensors and dv and tensors["d2t"][1] and tensors["d2t"][1][0] != dv:
        bad.append(f"d2t has {tensors['d2t'][1][0]} entries but draft_vocab_size is {dv}")
    if aux and L is not None and max(aux) >= L:
        bad.append(f"it reads target layers {aux} but the target has {L} layers")
    fc = tensors.get("fc.weight")
    if fc and H and len(fc[1]) == 2 and fc[1][1] % H:
        bad.append(f"fc.weight takes {fc[1][1]} inputs, not a multiple of the target's hidden size {H}")
    return FormatCheck(details, bad, cfg.get("target_hidden_size") or cfg.get("hidden_size"), cfg.get("vocab_size"))


def check_eagle(cfg: dict, tensors: Tensors, target: TargetFacts) -> FormatCheck:
    H, bad = target.hidden_size, []
    if "fc.weight" in tensors and H and tensors["fc.weight"][1][-1] != 2 * H:
        bad.append(f"fc.weight takes {tensors['fc.weight'][1][-1]} inputs, EAGLE-1 needs 2 x {H}")
    return FormatCheck(_eagle_details(cfg), bad, cfg.get("hidden_size"), cfg.get("vocab_size"))


_CHECKS = {"mtp": check_mtp, "medusa": check_medusa, "eagle3": check_eagle3, "eagle": check_eagle}


def recorded_base(cfg: dict) -> str | None:
    """The base model a draft records it was trained for (the Hub's keys, specctl's, speculators')."""
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


def check_draft(path: str, kind: str, cfg: dict, tensors: Tensors, target: TargetFacts) -> DraftInfo:
    """A Medusa/EAGLE/MTP draft against the target: its format's check, then hidden size, vocabulary and
    recorded base model. Accepted when no reason but notes ("note: ...") is left."""
    H, V = target.hidden_size, target.vocab_size
    bad = []
    if H is None or V is None:
        bad.append("cannot check it against the target: the target is not pulled "
                   f"(run `specctl models pull {target.name}`)")
    own = _CHECKS[kind](cfg, tensors, target)
    bad += own.reasons
    if H is not None and own.hidden is not None and own.hidden != H:
        bad.append(f"hidden size {own.hidden} != the target's {H}")
    if V is not None and own.vocab is not None and own.vocab != V:
        bad.append(f"vocabulary {own.vocab} != the target's {V}")
    details = own.details
    base = recorded_base(cfg)
    if base is not None:
        details["recorded_base"] = base
        if name_key(base) not in {name_key(n) for n in target.names}:
            bad.append(f"trained for {base}, not for this target ({target.name})")
    return DraftInfo(path, kind, not [r for r in bad if not r.startswith("note:")], bad, details)


# ----------------------------------------------------------------------------- draft_model: the tokenizers

@cache
def _tokenizer(path: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception:  # noqa: BLE001 - a folder without a usable tokenizer: overlap unknown
        return None


def check_draft_model(draft_path: str, target_path: str) -> dict | None:
    """How a draft model's tokenizer relates to the target's, as the draft_model method will draft:
    {"same": bool, "draft_coverage", "target_coverage", "mode"}, or None when a tokenizer is missing.

    ``mode`` is the draft_model method's own default for the pair: "same" (identical fingerprints),
    "auto" (different tokenizers sharing at least MIN_TLI_COVERAGE of the draft's vocabulary: the
    token-level intersection or text, chosen per step) or "text" (re-tokenized text). The coverage is
    ``specctl.runtime.vocab_map``'s byte-level token intersection, as build-vocab-map computes it.
    """
    from specctl.runtime import vocab_map as vm
    from specctl.runtime.proposers.draft_model import MIN_TLI_COVERAGE

    dt, tt = _tokenizer(draft_path), _tokenizer(target_path)
    if dt is None or tt is None:
        return None
    if vm.tokenizer_fingerprint(dt) == vm.tokenizer_fingerprint(tt):
        return {"same": True, "draft_coverage": 1.0, "target_coverage": 1.0, "mode": "same"}
    m = vm.build_vocab_map(dt, tt)
    return {"same": False, "draft_coverage": m.draft_coverage, "target_coverage": m.target_coverage,
            "mode": "auto" if m.draft_coverage >= MIN_TLI_COVERAGE else "text"}
