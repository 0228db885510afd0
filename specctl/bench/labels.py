"""Names of what a bench run compares: one readable, unique label per configuration, short names for
drafts, and which rows are peer engines (``vllm:ngram``).

What it does not know: running anything; torch.
"""

from __future__ import annotations

import json
from pathlib import Path

from specctl.config import SpecConfig

PEER_ENGINES = ("hf", "vllm", "llama.cpp")


def peer_engine(method: str) -> str | None:
    """'vllm:ngram' -> 'vllm'; a specctl method ('ngram', 'draft_model:x', 'baseline') -> None."""
    eng = method.split(":", 1)[0]
    return eng if ":" in method and eng in PEER_ENGINES else None


MODEL_METHODS = ("draft_model", "medusa", "eagle", "eagle3", "mtp")  # methods whose 'model' names a draft
_SHORT_KEYS = {"num_speculative_tokens": "k"}
_VALUE_ONLY_KEYS = ("sparse_attn_algorithm",)  # labelled by the value alone: sparse_attn:vegas


def draft_name(spec: str) -> str:
    """A short readable name for a draft given as a catalogue name, an HF folder or a .gguf file.

    'smollm2-135m' -> 'smollm2-135m'; '/x/y/my-draft/' -> 'my-draft'; '/x/d.gguf' -> 'd'. As
    ``specctl.models.resolve_model`` does, an existing path wins over a catalogue name.
    """
    from specctl.models import CATALOGUE

    s = str(spec).strip()
    p = Path(s).expanduser()
    if not p.exists() and s.lower() in CATALOGUE:
        return s.lower()
    return (p.stem if p.suffix.lower() == ".gguf" else p.name) or s


def config_labels(configs: list[SpecConfig]) -> list[str]:
    """One unique, readable label per configuration, in order.

    The method alone where it is unique. Configurations sharing a method are told apart by their
    draft for methods that draft with a model (``draft_model:smollm2-135m``), then by the keys that
    differ, each ``key=value`` (``ngram:k=4`` / ``ngram:k=8``; two keys: ``ngram:k=4,prompt_lookup_max=3``),
    else (the same configuration twice, nested settings such as a hybrid's parts, or more than
    ``MAX_LABEL_KEYS`` keys) by a ``#N`` suffix (``ngram``, ``ngram#2``).
    E.g. [draft_model 0.5b, draft_model 135m, ngram] ->
    ['draft_model:qwen2.5-coder-0.5b', 'draft_model:smollm2-135m', 'ngram'].
    """
    labels = [str(c.method) for c in configs]
    shared = {m for m in labels if labels.count(m) > 1}
    labels = [f"{c.method}:{draft_name(c.model)}" if lab in shared and c.method in MODEL_METHODS and c.model else lab
              for lab, c in zip(labels, configs)]
    groups: dict[str, list[int]] = {}
    for i, lab in enumerate(labels):
        groups.setdefault(lab, []).append(i)
    for lab, idx in groups.items():
        if len(idx) < 2:
            continue
        dicts = [configs[i].to_dict() for i in idx]
        keys = list(dict.fromkeys(k for d in dicts for k in d))
        values = {k: [json.dumps(d.get(k), sort_keys=True) for d in dicts] for k in keys}
        varying = [k for k in keys if len(set(values[k])) > 1]
        scalar = all(not isinstance(d.get(k), (dict, list)) for k in varying for d in dicts)
        told_apart = len({tuple(values[k][j] for k in varying) for j in range(len(idx))}) == len(idx)
        if varying and scalar and told_apart and len(varying) <= MAX_LABEL_KEYS:
            for i, d in zip(idx, dicts):
                labels[i] = f"{lab}:" + ",".join(_key_label(k, d.get(k)) for k in varying)
        else:
            for n, i in enumerate(idx[1:], 2):
                labels[i] = f"{lab}#{n}"
    # a '#N' label may still collide with a user's own; number on until unique
    seen: set[str] = set()
    for i, lab in enumerate(labels):
        n, out = 2, lab
        while out in seen:
            out, n = f"{lab}#{n}", n + 1
        labels[i] = out
        seen.add(out)
    return labels


MAX_LABEL_KEYS = 3  # more differing keys than this: numbered, not spelt out


def _key_label(key: str, value) -> str:
    """'num_speculative_tokens', 4 -> 'k=4'; 'sparse_attn_algorithm', 'vegas' -> 'vegas'."""
    return str(value) if key in _VALUE_ONLY_KEYS else f"{_SHORT_KEYS.get(key, key)}={value}"
