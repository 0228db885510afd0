"""Registry: method name -> Proposer class, one file per method, imported lazily.

A proposer module defines ``PROPOSERS = {method: ProposerClass}``; ``specctl.config.PROPOSER_MODULES``
says which module serves which method. Every proposer is built as
``Cls(config, target=LoadedModel | None, max_model_len=int)``.
"""

from __future__ import annotations

import importlib

from specctl.config import PROPOSER_MODULES, SpecConfig
from specctl.runtime.proposers.base import Draft, DraftBatch, DraftRequest, Proposer


def build_proposer(config: SpecConfig, max_model_len: int, target=None) -> Proposer:
    """Instantiate the proposer for a validated SpecConfig (``target``: the LoadedModel it drafts for)."""
    module = importlib.import_module(f"specctl.runtime.proposers.{PROPOSER_MODULES[config.method]}")
    return module.PROPOSERS[config.method](config, target=target, max_model_len=max_model_len)


__all__ = ["Draft", "DraftBatch", "DraftRequest", "Proposer", "build_proposer"]
