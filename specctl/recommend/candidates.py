"""What could draft for a target: the draft folders found for it, and the smaller models judged for draft_model.

``find_drafts`` looks in ``--drafts`` (a draft folder or a folder of them) and beside the target's
folder, classifies each folder by ``detect`` and checks it against the target; a plain model given
in ``--drafts`` becomes a candidate. ``gather_candidates`` adds ``--candidates`` (default: the
offline catalogue), and ``judge_candidate`` gives each a verdict from its tokenizer (same, or
another one with its vocabulary overlap) and the cost model's predicted speedup:
    draft        same tokenizer, predicted gain above MIN_GAIN
    alternative  another tokenizer, predicted gain above MIN_GAIN (drafts through a vocabulary mapping)
    refused      not smaller, size unknown, ρ too close to 1, or the tokenizers cannot be compared

What it does not know: the draft formats themselves (``detect``), the flowchart's order of layers,
running anything (the probe).
"""

from __future__ import annotations

import shlex
from dataclasses import asdict, dataclass
from pathlib import Path

from specctl.drafts.formats import TargetFacts
from specctl.drafts.kinds import classify_draft
from specctl.errors import ModelError
from specctl.recommend.cost import CROSS_TOKENIZER_PENALTY, MIN_GAIN, Workload, best_k, estimate_rho
from specctl.recommend.detect import DraftInfo, check_draft, check_draft_model, is_model, name_key
from specctl.recommend.inspection import ModelInfo, fmt_count, inspect_model, read_config, tensor_index


def target_facts(t: ModelInfo) -> TargetFacts:
    return TargetFacts(t.name, t.hidden_size, t.vocab_size, t.num_layers, tuple(t.names))


def find_drafts(target: ModelInfo, dirs: list[str]) -> tuple[list[DraftInfo], list[str], list[str]]:
    """Drafts from ``dirs`` (each a draft folder or a folder of them) and beside the target folder.

    Returns (drafts, plain models found in ``dirs`` (candidates), notes on folders that are neither).
    """
    drafts: list[DraftInfo] = []
    plain: list[str] = []
    notes: list[str] = []
    seen: set[str] = set()
    facts = target_facts(target)

    def visit(folder: Path, given: bool) -> None:
        key = str(folder.resolve())
        if key in seen or (target.path and key == str(Path(target.path).resolve())):
            return
        seen.add(key)
        cfg, tensors = read_config(folder), tensor_index(folder)
        kind = classify_draft(cfg, tensors)
        if kind is not None:
            drafts.append(check_draft(str(folder), kind, cfg, tensors, facts))
        elif given and is_model(cfg, tensors):
            plain.append(str(folder))
        elif given:
            notes.append(f"{folder}: not a Medusa/EAGLE draft nor a model (model_type {cfg.get('model_type')!r})")

    for d in dirs:
        p = Path(d).expanduser()
        if not p.is_dir():
            raise ModelError(f"--drafts {d}: no such folder", "give a draft folder (config.json + *.safetensors) or a folder of them")
        if (p / "config.json").is_file():
            visit(p, True)
        else:
            subs = [s for s in sorted(p.iterdir()) if (s / "config.json").is_file()]
            if not subs:
                raise ModelError(f"--drafts {d}: no config.json in it or in its subfolders", "give a draft folder")
            for s in subs:
                visit(s, True)
    if target.path or target.gguf_file:  # beside the model (folder or .gguf): its parent's subfolders, and its own
        tp = Path(target.path or target.gguf_file)
        for base in (tp.parent, tp):
            try:
                subs = sorted(s for s in base.iterdir() if s.is_dir() and (s / "config.json").is_file())[:200]
            except OSError:
                continue
            for s in subs:
                try:
                    if classify_draft(read_config(s), tensor_index(s)) is not None:
                        visit(s, False)
                except ModelError:
                    continue
    return drafts, plain, notes


@dataclass
class Candidate:
    spec: str  # how specctl names it (catalogue name or path)
    name: str
    path: str | None
    arch: str | None
    params: int | None
    rho_estimate: float | None = None
    tokenizer: str = "unknown"  # same, different, unknown
    overlap: dict | None = None  # draft_coverage, target_coverage, mode (draft_model's same/auto/text)
    alpha_prior: float | None = None
    best_k: int | None = None
    predicted_speedup: float | None = None
    verdict: str = "refused"  # draft (same tokenizer), alternative (another tokenizer), refused
    reason: str = ""
    runnable: bool = True  # the own runtime can run its architecture
    vocab_size: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def vllm_refusal(c: Candidate, target: ModelInfo) -> str:
    """Why vLLM cannot run ``c`` as the target's draft_model ("" when it can): vLLM drafts in the target's
    vocabulary, token id for token id, and refuses a draft whose vocabulary differs; specctl's draft_model
    maps one vocabulary onto the other (``specctl.drafts.vocab_map``)."""
    if c.tokenizer != "different":
        return ""
    sizes = (f" ({c.vocab_size} vs {target.vocab_size} tokens)" if c.vocab_size and target.vocab_size
             and c.vocab_size != target.vocab_size else " (another tokenizer)")
    return (f"vLLM's draft_model needs the target's vocabulary, and {c.name}'s is another{sizes}: vLLM refuses it. "
            f"specctl maps the vocabularies when the draft loads (or once, ahead: `specctl build-vocab-map --draft "
            f"{shlex.quote(c.spec)} --target {shlex.quote(target.spec)} --output map.safetensors`, then add \"vocab_map\": \"map.safetensors\" "
            "to the config)")


def judge_candidate(c: ModelInfo, target: ModelInfo, workload: Workload) -> Candidate:
    """Same tokenizer and ρ in the sweet spot -> draft; another tokenizer -> alternative; else refused."""
    from specctl.modeling import SUPPORTED_ARCHS

    cand = Candidate(c.spec, c.name, c.path, c.arch, c.params, runnable=c.arch in SUPPORTED_ARCHS,
                     vocab_size=c.vocab_size)
    if not c.cost_params or not target.cost_params:
        cand.reason = "size unknown"
        return cand
    rho = estimate_rho(c.cost_params, c.num_layers, target.cost_params, target.num_layers)
    cand.rho_estimate = rho
    if rho >= 1.0 or (c.params and target.params and c.params >= target.params):
        cand.reason = f"not smaller than the target ({fmt_count(c.params)} vs {fmt_count(target.params)} parameters)"
        return cand
    ov = check_draft_model(c.path, target.path) if c.path and target.path else None
    cand.overlap = ov
    if ov is not None:
        cand.tokenizer = "same" if ov["same"] else "different"
        tok_text = "same tokenizer" if ov["same"] else (
            f"another tokenizer ({ov['draft_coverage']:.0%} of its vocabulary maps onto the target's; drafts by {ov['mode']})")
    elif c.vocab_size is not None and target.vocab_size is not None and c.vocab_size != target.vocab_size:
        cand.tokenizer = "different"
        tok_text = f"another vocabulary ({c.vocab_size} vs {target.vocab_size}); overlap unknown"
    else:
        tok_text = "tokenizer not verified"
        if c.arch == target.arch and c.vocab_size == target.vocab_size:
            cand.tokenizer = "same"
            tok_text = "same family and vocabulary size (tokenizer not verified)"
    missing = [m.spec for m in (c, target) if not m.path and not m.gguf_file]
    if missing:
        tok_text += f"; pull {' and '.join(missing)} to check (`specctl models pull NAME`)"
    family = "" if c.arch == target.arch else f"; another architecture ({c.arch})"
    alpha = workload.alpha_prior - (0 if cand.tokenizer == "same" else CROSS_TOKENIZER_PENALTY)
    cand.alpha_prior = alpha
    cand.best_k, cand.predicted_speedup = best_k(alpha, rho)
    gain = (f"ρ≈{rho:.2f} (from parameter counts), prior α={alpha:.2f} ({workload.name}) -> "
            f"x{cand.predicted_speedup:.2f} at k={cand.best_k}")
    if cand.predicted_speedup < MIN_GAIN:
        cand.reason = f"{tok_text}{family}; ρ too close to 1: {gain}"
        return cand
    if cand.tokenizer == "same":
        cand.verdict, cand.reason = "draft", f"{tok_text}{family}; {gain}"
    elif ov is not None:
        cand.verdict, cand.reason = "alternative", f"{tok_text}{family}; {gain}"
    else:
        cand.reason = f"{tok_text}{family}"
    if not cand.runnable:
        cand.reason += f"; the own runtime cannot run {c.arch} yet (vLLM can)"
    return cand


def gather_candidates(target: ModelInfo, specs: list[str] | None, extra_paths: list[str]) -> list[ModelInfo]:
    """``specs`` (--candidates), else every catalogue model; plus plain models found in --drafts."""
    from specctl.models import CATALOGUE

    out: list[ModelInfo] = []
    seen = {name_key(n) for n in target.names} | ({str(Path(target.path).resolve())} if target.path else set())
    for spec in list(specs if specs is not None else CATALOGUE) + extra_paths:
        info = inspect_model(spec)
        keys = {str(Path(info.path).resolve())} if info.path else {name_key(info.name)}
        if keys & seen:
            continue
        seen |= keys
        out.append(info)
    return out
