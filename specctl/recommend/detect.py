"""Which draft format a folder holds, and whether it fits the target.

Each format's detector and check live beside its reader (``specctl.drafts``): pure functions of a
folder's ``config.json`` (a dict) and its tensor index (name -> (dtype, shape), as
``inspection.tensor_index`` reads it):

    format        detect             check                 what it looks for
    mtp           is_mtp_draft       check_mtp             MTP modules and no main model (train-mtp's folder)
    medusa        is_medusa          check_medusa          ``medusa`` model_type/keys, ``lm_heads.{h}``
    eagle3        is_eagle3          check_eagle3          ``draft_vocab_size``, ``midlayer.*``, ``d2t``, aux layers
    eagle         is_eagle           check_eagle           ``fc.weight`` + ``layers.0.*`` (EAGLE-1)
    draft_model   is_model           check_draft_model     a plain causal LM; its tokenizer against the target's

Here (the order they are tried in: ``specctl.drafts.kinds.classify_draft``): what every adapter is checked for beyond its
format (``check_draft``: hidden size, vocabulary, the base model it records it was trained for),
and the draft_model checks (plain models and their tokenizers).

What it does not know: how folders are found or read, the target beyond ``TargetFacts``, the cost
model and the flowchart; it keeps no state.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cache

from specctl.drafts.eagle_files import check_eagle, check_eagle3
from specctl.drafts.formats import TargetFacts, Tensors
from specctl.drafts.medusa import check_medusa
from specctl.drafts.mtp_files import check_mtp

_NOISE = {"instruct", "chat", "it", "hf", "gguf", "awq", "gptq", "bf16", "bfloat16", "fp16", "float16", "fp32",
          "float32", "int4", "int8", "q4", "q8", "model", "the"}


def name_key(name: str) -> str:
    """A model name reduced for comparison: 'Qwen/Qwen2.5-Coder-1.5B-Instruct' -> 'qwen25coder15b'."""
    last = re.split(r"[/\\]", str(name).strip().rstrip("/\\"))[-1].lower()
    return "".join(w for w in re.split(r"[^a-z0-9]+", last) if w and w not in _NOISE)


# ----------------------------------------------------------------------------- MTP layers in a target

# ----------------------------------------------------------------------------- detection, one per format

def is_model(cfg: dict, tensors: Tensors) -> bool:
    """A plain causal LM (a draft_model candidate): a model_type and numbered decoder layers."""
    return bool(cfg.get("model_type")) and any(re.search(r"layers\.\d+\.", k) for k in tensors)


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
    ``specctl.drafts.vocab_map``'s byte-level token intersection, as build-vocab-map computes it.
    """
    from specctl.drafts import vocab_map as vm
    from specctl.runtime.proposers.draft_model import MIN_TLI_COVERAGE

    dt, tt = _tokenizer(draft_path), _tokenizer(target_path)
    if dt is None or tt is None:
        return None
    if vm.tokenizer_fingerprint(dt) == vm.tokenizer_fingerprint(tt):
        return {"same": True, "draft_coverage": 1.0, "target_coverage": 1.0, "mode": "same"}
    m = vm.build_vocab_map(dt, tt)
    return {"same": False, "draft_coverage": m.draft_coverage, "target_coverage": m.target_coverage,
            "mode": "auto" if m.draft_coverage >= MIN_TLI_COVERAGE else "text"}
