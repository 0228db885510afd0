"""The flowchart: which draft method fits a target, walked with evidence at every step.

The four layers, by what it costs to adopt them: 1 zero-model (ngram, suffix), 2 light add-on
(Medusa heads, EAGLE draft), 3 independent model (draft_model), 4 trained-in (MTP). The walk:

    own training? ─yes─► MTP (train it in)          built-in MTP layers? ─yes─► mtp
        │no                                              │no
    Medusa/EAGLE draft made for this target? ─yes─► medusa / eagle / eagle3
        │no
    smaller model, same tokenizer, ρ in the sweet spot? ─yes─► draft_model
        │no
    requests repeat (agentic, fixed templates)? ─yes─► suffix, else ngram (the always-available baseline)

Beside the walk, sparse_attn is judged by the roofline (``cost.sparse_attn_choice``) and replaces
ngram/suffix where it pays. ``recommend`` runs it all: inspect the target, find its drafts and judge
the candidates, walk, and return a ``Recommendation`` (the tree, the choice, the alternatives).

What it does not know: how folders are read, drafts checked or candidates judged (``inspection``,
``detect``, ``candidates``), the formula (``cost``); it runs nothing (the probe does).
"""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict, dataclass, field

from specctl.drafts.mtp_files import MTPInfo, mtp_modules
from specctl.recommend.candidates import Candidate, find_drafts, gather_candidates, judge_candidate, vllm_refusal
from specctl.recommend.choices import Choice, Node, commands, implemented, make_choice
from specctl.recommend.cost import (CROSS_TOKENIZER_PENALTY, MIN_GAIN, PATTERN_ALPHA_WHEN_MATCHED, Workload, best_k,
                                    get_workload, ngram_prediction, sparse_attn_choice)
from specctl.recommend.detect import DraftInfo
from specctl.recommend.inspection import ModelInfo, fmt_count, inspect_model

DRAFT_PREFERENCE = ("eagle3", "eagle", "medusa")  # EAGLE usually accepts more than Medusa (seed §3.2)


def hybrid_choice(target: ModelInfo, pattern: Choice, model: Choice, w: Workload, model_gain: float | None) -> Choice:
    """A hybrid of a zero-cost pattern proposer (first) and a model draft (where it has nothing),
    with the predicted gain of each part: the pattern part's from its prior where it matches (ρ = 0),
    the model part's from the cost model. Its policy is the default, ``score``: each step the part
    with the most expected tokens per second as measured, the model part reading prompts only while
    it pays (measured never below its best part on bench's workloads)."""
    k = int(pattern.config.get("num_speculative_tokens") or 8)
    pattern_gain = best_k(PATTERN_ALPHA_WHEN_MATCHED, 0.0, k)[1]
    cfg = {"method": "hybrid", "proposers": [dict(pattern.config), dict(model.config)]}
    why = ("the output copies the prompt" if w.copies_prompt else "requests repeat earlier responses")
    reason = (f"{pattern.method} where it matches ({why}): predicted x{pattern_gain:.2f} on those steps "
              f"(α≈{PATTERN_ALPHA_WHEN_MATCHED} when matched, no draft cost); {model.label} on new text"
              + (f": predicted x{model_gain:.2f}" if model_gain else "")
              + "; each step the part that measures more tokens per second, the model only while it pays"
              + "; --probe measures both parts")
    flags = f"--speculative-config {shlex.quote(json.dumps(cfg))}"
    cmds = commands(target.spec, flags, model.commands.get("vllm", ""), target.quantization)  # vLLM: the model part alone
    note = ("specctl's own method: vLLM runs one proposer at a time (its config below is the model part's)"
            + ("; " + model.note if model.note else ""))
    return Choice("hybrid", f"hybrid: {pattern.method} first, then {model.label}", reason, cfg, model.vllm_config,
                  pattern.runnable and model.runnable and "hybrid" in implemented(), note, cmds,
                  model.vllm_unsupported)


@dataclass
class Recommendation:
    target: ModelInfo
    workload: Workload
    own_training: bool
    mtp: MTPInfo
    drafts: list[DraftInfo]
    candidates: list[Candidate]
    tree: Node
    choice: Choice
    alternatives: list[Choice]
    notes: list[str] = field(default_factory=list)
    probe: dict | None = None
    context: int = 1024  # tokens in the KV cache while decoding, and requests decoding together,
    batch: int = 1  # as recommend judged sparse_attn (and --probe predicts it on this machine)

    def to_dict(self) -> dict:
        return {
            "target": self.target.to_dict(), "workload": asdict(self.workload), "own_training": self.own_training,
            "mtp": asdict(self.mtp), "drafts": [asdict(d) for d in self.drafts],
            "candidates": [c.to_dict() for c in self.candidates], "tree": self.tree.to_dict(),
            "recommendation": self.choice.to_dict(), "alternatives": [a.to_dict() for a in self.alternatives],
            "implemented_methods": list(implemented()), "notes": self.notes, "probe": self.probe,
            "context": self.context, "batch": self.batch,
        }


def _layer1(target: ModelInfo, w: Workload, parent: Node) -> tuple[Choice, Choice]:
    """The zero-model layer: suffix where requests repeat, else ngram. Returns (pick, the other)."""
    q = parent.add(Node("question", "Do requests repeat (agent loops, fixed-template batch jobs)?",
                        "yes" if w.repeats else "no", f"workload {w.name}: {w.description}"))
    copy = ("the output copies the prompt, where prompt lookup does well" if w.copies_prompt
            else "little of the output copies the prompt: a low ceiling, but ngram costs nothing")
    ng = make_choice("ngram", target, "ngram (prompt lookup)", f"always available, zero cost; {copy}")
    ng_pred = ngram_prediction(w, int(ng.config["num_speculative_tokens"]))
    if ng_pred is not None:
        ng.reason += f" (predicted x{ng_pred:.2f}: {_ngram_prior(w, ng)})"
    sf = make_choice("suffix", target, "suffix (suffix trees over this and earlier responses)",
                     "reuses earlier responses when requests repeat; zero model cost")
    pick, other = (sf, ng) if w.repeats else (ng, sf)
    q.add(Node("choice", pick.label, reason=pick.reason))
    return pick, other


def _ngram_prior(w: Workload, ng: Choice) -> str:
    return (f"prior α={w.ngram_alpha} over every step on {w.name}, fitted to bench's ngram runs, "
            f"at k={ng.config['num_speculative_tokens']}, no draft cost")


def _other_tokenizer(target: ModelInfo, c: Candidate, pick: str, pick_speedup: float | None) -> Choice:
    """A draft_model with another tokenizer, as an alternative: no vLLM command (vLLM needs the target's
    vocabulary), and, where it is predicted above the pick, why it still ranks below it."""
    ch = make_choice("draft_model", target, f"draft_model with {c.name} (another tokenizer)", c.reason,
                     draft=c.spec, draft_path=c.path, k=c.best_k, vllm_unsupported=vllm_refusal(c, target))
    if pick_speedup is not None and c.predicted_speedup is not None and c.predicted_speedup > pick_speedup:
        ch.reason += (f"; predicted above the pick, {pick} (x{pick_speedup:.2f}), but ranked after it: the flowchart "
                      "takes a same-tokenizer draft or the zero-cost layer first, since this prior α is a guess (the "
                      f"same-tokenizer one minus {CROSS_TOKENIZER_PENALTY}), the formula leaves out the vocabulary "
                      "mapping's cost, and only specctl runs it; --probe measures both")
    return ch


def walk(target: ModelInfo, mtp: MTPInfo, drafts: list[DraftInfo], cands: list[Candidate], w: Workload,
         own_training: bool, drafts_searched: str) -> tuple[Node, Choice, list[Choice]]:
    """The flowchart: (tree, chosen method, alternatives)."""
    root = Node("note", f"{target.name}: {target.arch or '?'}, {fmt_count(target.params)} parameters, "
                        f"{target.num_layers or '?'} layers, hidden {target.hidden_size or '?'}, vocab {target.vocab_size or '?'}",
                reason=f"workload {w.name}")
    q1 = root.add(Node("question", "Do you train this model yourself?", "yes" if own_training else "no",
                       "--own-training: MTP is a (pre)training decision, the most thorough layer" if own_training
                       else "a released model (no --own-training): MTP cannot be added after training"))
    mtp_ev = "; ".join(mtp.evidence) or "no nextn/mtp key in config.json and no MTP tensors"
    if own_training and not mtp.present and not any(d.kind == "mtp" and d.accepted for d in drafts):
        c = make_choice("mtp", target, "mtp (train MTP layers in)",
                        "add MTP layers when you train, with `specctl train-mtp`; every deployment then drafts for free", k=1)
        c.runnable, c.note = False, "a plan: usable once the model is trained with MTP layers. " + c.note
        q1.add(Node("choice", c.label, reason=c.reason))
        meanwhile = q1.add(Node("note", "Until then:"))
        now, more = _after_q1(target, mtp, mtp_ev, drafts, cands, w, meanwhile, drafts_searched)
        return root, c, [now] + more
    c, alts = _after_q1(target, mtp, mtp_ev, drafts, cands, w, q1, drafts_searched)
    return root, c, alts


def _after_q1(target, mtp, mtp_ev, drafts, cands, w, parent, drafts_searched) -> tuple[Choice, list[Choice]]:
    alts: list[Choice] = []
    mtp_drafts = [d for d in drafts if d.kind == "mtp"]
    drafts = [d for d in drafts if d.kind != "mtp"]
    good_mtp = [d for d in mtp_drafts if d.accepted]
    qm = parent.add(Node("question", "Does the model carry MTP layers (built in, or trained for it)?",
                         "yes" if mtp.present or good_mtp else "no", mtp.refused or mtp_ev))
    for d in mtp_drafts:
        qm.add(Node("evidence", f"MTP draft {d.path}", reason="; ".join(d.reasons) or
                    f"{d.details.get('layers')} MTP module(s) matching the target", ok=d.accepted))
    if mtp.present:
        c = make_choice("mtp", target, f"mtp ({mtp.layers} built-in MTP layer(s))",
                        "trained in: no draft to pick, no second KV cache, no ρ to worry about", k=mtp.layers)
        qm.add(Node("choice", c.label, reason=c.reason))
        return c, alts
    if good_mtp:
        d = good_mtp[0]
        c = make_choice("mtp", target, f"mtp with {d.path}",
                        "MTP modules trained for this target: self-speculation, no second KV cache",
                        draft=d.path, draft_path=d.path, k=d.k or 1)
        qm.add(Node("choice", c.label, reason=c.reason))
        return c, alts
    good = [d for d in drafts if d.accepted]
    q2 = qm.add(Node("question", "Is there a Medusa head or EAGLE draft made for this model?",
                     "yes" if good else "no",
                     f"{len(good)} of {len(drafts)} draft(s) fit" if drafts else f"none found ({drafts_searched})"))
    for d in drafts:
        why = "; ".join(d.reasons) or "hidden size and vocabulary match the target"
        q2.add(Node("evidence", f"{d.kind} draft {d.path}", reason=why, ok=d.accepted))
    if good:
        good.sort(key=lambda d: DRAFT_PREFERENCE.index(d.kind))
        best = good[0]
        c = make_choice(best.kind, target, f"{best.kind} with {best.path}",
                        "a draft made for this target: the best match at almost no deployment cost",
                        draft=best.path, draft_path=best.path, k=best.k or None)
        q2.add(Node("choice", c.label, reason=c.reason))
        alts += [make_choice(d.kind, target, f"{d.kind} with {d.path}", "another fitting draft",
                             draft=d.path, draft_path=d.path, k=d.k or None) for d in good[1:]]
        l1 = _layer1(target, w, Node("note", ""))[0]
        alts.append(l1)
        if w.copies_prompt or w.repeats:
            alts.append(hybrid_choice(target, l1, c, w, None))
        return c, alts
    same = sorted((c for c in cands if c.verdict == "draft"), key=lambda c: -(c.predicted_speedup or 0))
    other = [c for c in cands if c.verdict == "alternative"]
    smaller_same = [c for c in cands if c.tokenizer == "same" and c.rho_estimate is not None and c.rho_estimate < 1]
    q3 = q2.add(Node("question", "Is there a smaller model of the same family, with the same tokenizer?",
                     "yes" if smaller_same else "no",
                     f"{len(cands)} candidate(s) checked" if cands else "no candidates (--candidates, or the catalogue)"))
    for c in cands:
        q3.add(Node("evidence", f"{c.name} ({c.arch or '?'}, {fmt_count(c.params)})", reason=c.reason,
                    ok={"draft": True, "alternative": None}.get(c.verdict, False)))
    if smaller_same:
        best = same[0] if same else min(smaller_same, key=lambda c: c.rho_estimate)
        q4 = q3.add(Node("question", f"Is ρ in the sweet spot for {best.name}?", "yes" if same else "no",
                         f"ρ≈{best.rho_estimate:.2f} (parameter counts + per-layer overhead), prior α={best.alpha_prior:.2f} "
                         f"-> predicted x{best.predicted_speedup:.2f} at k={best.best_k} (needs > x{MIN_GAIN}; "
                         "--probe measures α and ρ)"))
        if same:
            return _model_or_ngram(target, w, best, same, other, q4, alts)
        parent_l1 = q4
    else:
        parent_l1 = q3
    pick, other_l1 = _layer1(target, w, parent_l1)
    pick_speedup = ngram_prediction(w, int(pick.config["num_speculative_tokens"])) if pick.method == "ngram" else None
    draft_alts = [_other_tokenizer(target, c, pick.method, pick_speedup) for c in other]
    if draft_alts:
        parent_l1.add(Node("note", "a draft with another tokenizer may still pay off",
                           reason="; ".join(f"{c.name}: {c.reason}" for c in other)))
    return pick, draft_alts + [other_l1]


def _model_or_ngram(target, w, best: Candidate, same: list[Candidate], other: list[Candidate], q4: Node,
                    alts: list[Choice]) -> tuple[Choice, list[Choice]]:
    """A same-tokenizer draft model pays: pick it, unless ngram is predicted faster on this workload."""
    c = make_choice("draft_model", target, f"draft_model with {best.name}",
                    "a smaller same-tokenizer model: the most flexible option; mind its second KV cache"
                    f" (predicted x{best.predicted_speedup:.2f} at k={best.best_k})",
                    draft=best.spec, draft_path=best.path, k=best.best_k)
    if not best.runnable:
        c.runnable = False
        c.note = (c.note + "; " if c.note else "") + f"the own runtime cannot run {best.arch} yet (vLLM can)"
    l1, _ = _layer1(target, w, Node("note", ""))
    ng_pred = ngram_prediction(w, int(l1.config["num_speculative_tokens"])) if l1.method == "ngram" else None
    at = q4
    if ng_pred is not None:
        at = q4.add(Node("question", f"Does {best.name} beat ngram on {w.name}?",
                         "yes" if best.predicted_speedup > ng_pred else "no",
                         f"draft_model predicted x{best.predicted_speedup:.2f} at k={best.best_k}; ngram x{ng_pred:.2f} "
                         f"({_ngram_prior(w, l1)}); --probe measures both"))
    hyb = [hybrid_choice(target, l1, c, w, best.predicted_speedup)] if (w.copies_prompt or w.repeats) else []
    more = [make_choice("draft_model", target, f"draft_model with {o.name}", o.reason, draft=o.spec,
                        draft_path=o.path, k=o.best_k) for o in same[1:]]
    if ng_pred is not None and ng_pred >= best.predicted_speedup:
        l1.reason = (f"predicted x{ng_pred:.2f} on {w.name}, above draft_model with {best.name} "
                     f"(x{best.predicted_speedup:.2f}), at zero cost: no draft model, no second KV cache")
        at.add(Node("choice", l1.label, reason=l1.reason))
        if hyb:
            at.add(Node("note", f"or both: {hyb[0].label}", reason=hyb[0].reason))
        draft_alts = [_other_tokenizer(target, o, l1.method, ng_pred) for o in other]
        return l1, alts + hyb + [c] + more + draft_alts
    at.add(Node("choice", c.label, reason=c.reason))
    note = ("the output copies the prompt: ngram is a strong zero-cost rival here, compare with --probe"
            if w.copies_prompt else "zero-cost fallback")
    if ng_pred is not None:
        note += f" (predicted x{ng_pred:.2f})"
    l1.reason = note if w.copies_prompt else l1.reason
    at.add(Node("note", f"also try {l1.method}", reason=note))
    if hyb:
        at.add(Node("note", f"or both: {hyb[0].label}", reason=hyb[0].reason))
    draft_alts = [_other_tokenizer(target, o, c.label, best.predicted_speedup) for o in other]
    return c, alts + more + [l1] + hyb + draft_alts


def recommend(model: str, *, drafts: list[str] | None = None, candidates: list[str] | None = None,
              own_training: bool = False, workload: str = "chat", pull: bool = False,
              dtype: str = "bfloat16", context: int | None = None, batch: int = 1,
              quantization: str | None = None) -> Recommendation:
    """Inspect the target, its drafts and candidate draft models, and walk the flowchart; ``context``
    (default: the workload's) and ``batch`` judge sparse_attn. ``quantization="gguf"``: the target runs
    as its GGUF (read from it; the commands carry ``--quantization gguf``)."""
    w = get_workload(workload)
    target = inspect_model(model, pull=pull, dtype=dtype, quantization=quantization)
    mtp = mtp_modules(target.config, target.tensors, target.gguf)  # built into the target
    found, plain, notes = find_drafts(target, list(drafts or []))
    infos = gather_candidates(target, candidates, plain)
    cands = [judge_candidate(c, target, w) for c in infos]
    searched = ("--drafts " + ", ".join(drafts)) if drafts else ""
    beside = target.path or target.gguf_file
    searched += (("; " if searched else "") + f"no Medusa/EAGLE folder beside {beside}") if beside else ""
    tree, choice, alts = walk(target, mtp, found, cands, w, own_training, searched or "no --drafts given")
    sparse, replaces = sparse_attn_choice(target, w, tree, choice, context, batch)
    if sparse is not None:
        if replaces:
            choice, alts = sparse, [choice] + alts
        else:
            alts.append(sparse)
    if not target.path and target.gguf_file:
        notes.append(f"{target.name} read from its GGUF header ({target.gguf_file}; no dense conversion): "
                     "draft models' tokenizers are compared by vocabulary size only")
    elif not target.path:
        notes.append(f"{target.name} is not pulled: described from the catalogue (`specctl models pull {target.name}` "
                     "to check drafts and tokenizers against it)")
    return Recommendation(target, w, own_training, mtp, found, cands, tree, choice, alts, notes,
                          context=context or w.context, batch=batch)
