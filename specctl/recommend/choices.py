"""What recommend hands back: a ``Choice`` (a method with its ready configs and commands) and the
``Node``s of the tree that explains it.

``make_choice`` turns a method (+ its draft and k) into specctl's config (vLLM's
``--speculative-config`` keys; catalogue names allowed), vLLM's (local paths), the
``specctl serve``/``bench`` and ``vllm serve`` command lines, and says when the method is not
runnable in this installation (``specctl.config.implemented_methods``). A target that runs as its GGUF
(``quantization="gguf"``) gets ``--quantization gguf`` in specctl's commands and is served by vLLM as that
file (``vllm_target``).

What it does not know: why a method is chosen (the flowchart and the cost model decide), how a
method works.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path
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
    vllm_unsupported: str = ""  # why there is no vLLM command (and, for a draft vLLM refuses, no vLLM config)

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


def vllm_target(target) -> tuple[str, str]:
    """(what follows ``vllm serve`` for the target, "" or why that is not a ready command).

    The weights that ran are the ones vLLM serves: a target that runs as its GGUF (``quantization="gguf"``),
    or a ``.gguf`` with no dense folder here, is served as that file, with the tokenizer of the Hugging Face
    repo it came from (vLLM's advice: converting a GGUF's own tokenizer is slow and unstable). Where that
    repo is not known (a GGUF that does not name it), the line holds HF_REPO and the reason says so."""
    gguf = getattr(target, "gguf_file", None)
    if gguf and (getattr(target, "quantization", None) == "gguf" or not target.path):
        hub = getattr(target, "hub_id", None)
        why = "" if hub else (f"{Path(gguf).name} does not name the Hugging Face repo it was made from, whose "
                              "tokenizer vLLM takes for a GGUF (--tokenizer); with HF_REPO filled in")
        return f"{shlex.quote(gguf)} --tokenizer {shlex.quote(hub or 'HF_REPO')}", why
    return shlex.quote(vllm_model(target.spec, target.path)), ""


def commands(target_spec: str, flags: str, vllm: str, quantization: str | None = None) -> dict:
    """The ready command lines: specctl's flags, ``specctl serve``/``bench`` with them (and ``--quantization
    gguf`` where the target runs as its GGUF), and ``vllm serve`` (None where vLLM cannot run the choice)."""
    model = shlex.quote(target_spec) + (f" --quantization {quantization}" if quantization else "")
    return {"specctl_flags": flags, "specctl_serve": f"specctl serve --model {model} {flags}",
            "specctl_bench": f"specctl bench --model {model} {flags}", "vllm": vllm or None}


def make_choice(method: str, target, label: str, reason: str, *, draft: str | None = None,
                draft_path: str | None = None, k: int | None = None, extra: dict | None = None,
                vllm_unsupported: str = "") -> Choice:
    """A ready choice for ``target`` (its ``spec`` and local ``path``): its config (``extra``: more of
    the method's keys), vLLM's, and the commands. ``vllm_unsupported``: why vLLM cannot run it (a draft
    with another vocabulary): then no vLLM config nor command, only specctl's. A GGUF target whose
    Hugging Face repo is unknown keeps its vLLM config; its command, to complete, is in the reason."""
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
    served, unknown = vllm_target(target)
    refused = bool(vllm_unsupported)
    vllm = "" if refused else f"vllm serve {served} --speculative-config {shlex.quote(json.dumps(vcfg))}"
    if vllm and unknown:  # not a command to paste as it is: said, with the line to complete
        vllm_unsupported, vllm = f"{unknown}: {vllm}", ""
    return Choice(method, label, reason, cfg, None if refused else vcfg, runnable, note,
                  commands(target.spec, flags, vllm, getattr(target, "quantization", None)), vllm_unsupported)
