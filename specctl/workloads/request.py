"""A benchmark prompt (``Request``) and how workloads interleave their sources; what every workload
module builds on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Request:
    """One benchmark prompt: chat ``messages`` (``role``/``content`` dicts) and where it came from."""

    id: str
    messages: list[dict]
    workload: str
    meta: dict[str, Any] = field(default_factory=dict)
    followups: list[str] = field(default_factory=list)  # later user turns, each asked after the model's answer

    @property
    def num_turns(self) -> int:
        return 1 + len(self.followups)


def _round_robin(groups: list[list]) -> list:
    out, i = [], 0
    while any(i < len(g) for g in groups):
        out.extend(g[i] for g in groups if i < len(g))
        i += 1
    return out
