"""Registry: method name -> Proposer class (imported lazily, one file per method)."""

from __future__ import annotations

import importlib

from specctl.config import SpecConfig
from specctl.runtime.proposers.base import DraftOutput, Proposer

_REGISTRY = {
    "ngram": ("specctl.runtime.proposers.ngram", "NgramProposer"),
}


def build_proposer(config: SpecConfig, max_model_len: int, **kwargs) -> Proposer:
    """Instantiate the proposer for a validated SpecConfig."""
    module, cls = _REGISTRY[config.method]
    return getattr(importlib.import_module(module), cls)(config, max_model_len=max_model_len, **kwargs)


__all__ = ["DraftOutput", "Proposer", "build_proposer"]
