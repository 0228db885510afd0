"""What every draft format's detector and check share: a folder's tensor index, the target's facts a
draft is checked against, and a check's findings. Each format's ``is_<kind>`` / ``check_<kind>`` lives
beside its reader and writer (``specctl.drafts.medusa``, ``.eagle``, ``.mtp``); ``specctl.recommend``
runs them over the folders it finds.

What it does not know: reading files (callers pass ``config.json`` as a dict and the safetensors
headers as ``Tensors``), torch.
"""

from __future__ import annotations

from dataclasses import dataclass

Tensors = dict  # name -> (dtype, shape): a folder's safetensors headers


def text_config(cfg: dict) -> dict:
    """The language model's part of a config (a multimodal config nests it under ``text_config``)."""
    return cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg


def truncated_vocab(cfg: dict) -> bool:
    """A Medusa config whose heads score a truncated vocabulary (``truncated_vocab_size`` below
    ``vocab_size``): the only case where vLLM applies its ``token_map``."""
    tv, v = cfg.get("truncated_vocab_size"), cfg.get("vocab_size")
    return tv is not None and v is not None and int(tv) < int(v)


@dataclass(frozen=True)
class TargetFacts:
    """What a draft is checked against: the target's sizes (None: not known, e.g. not pulled) and names."""

    name: str
    hidden_size: int | None
    vocab_size: int | None
    num_layers: int | None
    names: tuple[str, ...] = ()  # every name it goes by (a recorded base model must be one of them)


@dataclass
class FormatCheck:
    """A format's own findings: its details, its reasons, and the hidden size and vocabulary it declares."""

    details: dict
    reasons: list[str]
    hidden: int | None
    vocab: int | None
