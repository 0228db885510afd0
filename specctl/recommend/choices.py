"""What recommend hands back: a ``Choice`` (a method with its ready configs and commands) and the
``Node``s of the tree that explains it.

``make_choice`` turns a method (+ its draft and k) into specctl's config (vLLM's
``--speculative-config`` keys; catalogue names allowed), vLLM's (local paths), the
``specctl serve``/``bench`` and ``vllm serve`` command lines, and says when the method is not
runnable in this installation (``specctl.config.implemented_methods``).

What it does not know: why a method is chosen (the flowchart and the cost model decide), how a
method works.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict, dataclass, field
from typing import Any

# The layers, by what it costs to adopt them: 1 zero-model, 2 light add-on, 3 independent model,
# 4 trained-in. sparse_attn: the target drafts for itself over part of its KV cache: no weights,
# no training (layer 1's cost)
LAYERS = {"ngram": 1, "suffix": 1, "sparse_attn": 1, "medusa": 2, "eagle": 2, "eagle3": 2, "draft_model": 3, "mtp": 4}


@dataclass
class Choice:
    method: str
    label: str
    reason: str
    config: dict  # vLLM's --speculative-config keys, as specctl takes them (catalogue names allowed)
    vllm_config: dict | None  # the same, with local paths for vLLM (None: vLLM cannot run it)
    runnable: bool = True
    note: str = ""
    commands: dict = field(default_factory=dict)
    vllm_unsupported: str = ""  # why vLLM cannot run it (then no vLLM config nor command)

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
    children: list[Node] = field(default_factory=list)

    def add(self, node: Node) -> Node:
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


def implemented() -> tuple[str, ...]:
    from specctl.config import implemented_methods

    return implemented_methods()


def vllm_model(spec: str, path: str | None) -> str:
    """What ``vllm serve`` loads for a model specctl names ``spec``: its folder here, or, for a catalogue model
    not pulled yet, the upstream Hugging Face id (vLLM knows no catalogue names)."""
    if path:
        return path
    from specctl.models import CATALOGUE

    entry = CATALOGUE.get(spec)
    return entry.hub_id if entry is not None and entry.hub_id else spec


def commands(target_spec: str, flags: str, vllm: str) -> dict:
    """The ready command lines: specctl's flags, ``specctl serve``/``bench`` with them, and ``vllm serve``
    (None where vLLM cannot run the choice)."""
    model = shlex.quote(target_spec)
    return {"specctl_flags": flags, "specctl_serve": f"specctl serve --model {model} {flags}",
            "specctl_bench": f"specctl bench --model {model} {flags}", "vllm": vllm or None}


def make_choice(method: str, target, label: str, reason: str, *, draft: str | None = None,
                draft_path: str | None = None, k: int | None = None, extra: dict | None = None,
                vllm_unsupported: str = "") -> Choice:
    """A ready choice for ``target`` (its ``spec`` and local ``path``): its config (``extra``: more of
    the method's keys), vLLM's, and the commands. ``vllm_unsupported``: why vLLM cannot run it (a draft
    with another vocabulary): then no vLLM config nor command, only specctl's."""
    from specctl.config import DEFAULT_NUM_SPECULATIVE_TOKENS

    k = k or DEFAULT_NUM_SPECULATIVE_TOKENS.get(method, 3)
    cfg: dict[str, Any] = {"method": method}
    if draft is not None:
        cfg["model"] = draft
    cfg["num_speculative_tokens"] = int(k)
    if method == "ngram":
        cfg.update(prompt_lookup_min=2, prompt_lookup_max=5)
    cfg.update(extra or {})
    vcfg = dict(cfg, model=vllm_model(draft, draft_path)) if draft is not None else dict(cfg)
    runnable = method in implemented()
    note = "" if runnable else (f"recommended, but '{method}' is not runnable in this installation yet "
                                f"(no specctl/runtime/proposers/{'eagle' if method == 'eagle3' else method}.py): "
                                "the vLLM config works in vLLM today")
    if method == "mtp":
        note = (note + "; " if note else "") + "older vLLM versions call this method 'deepseek_mtp'"
    js = shlex.quote(json.dumps(cfg))
    flags = (f"--method {method} -k {k}" if method in ("ngram", "suffix") else f"--speculative-config {js}")
    vllm = ("" if vllm_unsupported else
            f"vllm serve {shlex.quote(vllm_model(target.spec, target.path))} --speculative-config {shlex.quote(json.dumps(vcfg))}")
    return Choice(method, label, reason, cfg, None if vllm_unsupported else vcfg, runnable, note,
                  commands(target.spec, flags, vllm), vllm_unsupported)
