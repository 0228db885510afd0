"""Which kind of draft a folder holds, from its ``config.json`` and its tensor names alone: what
``specctl recommend`` sorts folders by, what a method's loader checks first, so that a folder of
another kind (Medusa heads passed as an EAGLE-3 draft) is one line naming both kinds instead of a
failed load, and which method a speculative config that names a draft folder but no method runs.

What it does not know: reading the weights, the target.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from specctl.drafts.formats import Tensors
from specctl.errors import UsageError

# tensor names of MTP modules (train-mtp's folders, DeepSeek-V3's and MiMo's layouts)
MTP_TENSOR = re.compile(r"(^|\.)mtp[._]|mtp_layers|(^|\.)(eh_proj|enorm|hnorm|shared_head)\.")


def is_mtp_draft(cfg: dict, tensors: Tensors) -> bool:
    """MTP modules and no main model (no ``model.layers.0``): train-mtp's folder (MiMo's layout may carry
    the embedding and head the modules read)."""
    return any(MTP_TENSOR.search(k) for k in tensors) and not any(k.startswith("model.layers.0.") for k in tensors)


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


_DETECT_ORDER = (("mtp", is_mtp_draft), ("medusa", is_medusa), ("eagle3", is_eagle3), ("eagle", is_eagle))
NAMES = {"mtp": "MTP modules", "medusa": "Medusa heads", "eagle3": "an EAGLE-3 draft", "eagle": "an EAGLE-1 draft"}


def classify_draft(cfg: dict, tensors: Tensors) -> str | None:
    """'mtp', 'medusa', 'eagle3', 'eagle' or None (a plain model or something else), first match in that order."""
    return next((kind for kind, detect in _DETECT_ORDER if detect(cfg, tensors)), None)


def folder_kind(folder: str | Path) -> str | None:
    """The kind of draft in ``folder`` (None: no readable config.json, or not a draft of a known kind)."""
    from specctl.models import open_safetensors

    folder = Path(folder)
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(cfg, dict):
        return None
    names: Tensors = {}
    for f in sorted(folder.glob("*.safetensors")):
        with open_safetensors(f, framework="numpy") as fh:
            names.update((k, None) for k in fh.keys())  # noqa: SIM118 - a safetensors handle, not a dict
    return classify_draft(cfg, names)


def draft_method(model: str) -> str | None:
    """The speculative method a config's ``model`` is a draft for, when the config names no method: the
    kind of draft the local folder holds (a kind is the method that runs it: medusa, eagle3, eagle, mtp).
    vLLM works the method out the same way from the draft's config (``SpeculativeConfig.__post_init__``:
    model_type "medusa", an EAGLE/EAGLE-3 draft, an MTP model_type), and falls back to draft_model.

    None (draft_model) for a plain model, and for a name that is not a local folder (a Hub or catalogue
    name, a .gguf file): only a folder on this machine can be inspected before it is fetched."""
    folder = Path(model).expanduser()
    return folder_kind(folder) if folder.is_dir() else None


def check_kind(folder: str | Path, method: str, accept: tuple[str, ...]) -> None:
    """Refuse a folder that holds another kind of draft than ``accept`` (for ``method``), naming both."""
    kind = folder_kind(folder)
    if kind is not None and kind not in accept:
        raise UsageError(f'{folder} holds {NAMES[kind]}, not a draft for "method": "{method}"',
                         f'use "method": "{kind}" with it, or pass a draft made for {method}')
