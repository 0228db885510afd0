"""``--probe``: run every applicable, implemented method briefly, and rank them by measured speedup.

``probe_plan`` lists what to run (ngram, suffix, the target's MTP layers, the accepted drafts, the
most promising draft models, sparse_attn and hybrids where recommended) and what is skipped, and why.
``probe`` runs them through ``specctl bench``'s own measuring loop (``bench.suite.run_bench``: the
same prompts, decode tokens/s, per-prompt interleaving, a warm-up; ``time_drafts`` for the draft's
own time and its (drafted, accepted) steps) and derives, per method: α (MLE over every verification
step), ρ (draft time per drafted token / one target decode step), the predicted speedup at the best
k, and the verify cost (one verify forward / one decode step), which the formula takes as 1 and
which explains most gaps between predicted and measured. ``apply_probe`` records the ranking in
the tree; the measured best becomes the pick.

What it does not know: how the methods work or are timed (the runtime and bench do); it only uses
a method ``specctl.config.implemented_methods()`` lists.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from specctl.recommend.candidates import vllm_refusal
from specctl.recommend.choices import Node, implemented, make_choice
from specctl.recommend.cost import best_k, estimate_alpha, sparse_roofline
from specctl.recommend.flowchart import Recommendation
from specctl.recommend.inspection import pulled_path

MAX_PROBED_DRAFTS = 2


def probe_plan(rec: Recommendation, k: int | None = None) -> tuple[list[tuple[str, dict]], list[dict]]:
    """[(label, speculative config)] to run, and [{method, label, reason}] skipped."""
    impl = set(implemented())
    run: list[tuple[str, dict]] = []
    skipped: list[dict] = []

    def add(label: str, method: str, cfg: dict, why_not: str | None = None) -> None:
        if why_not is None and method not in impl:
            why_not = f"'{method}' is not implemented in this installation"
        if why_not:
            skipped.append({"method": method, "label": label, "reason": why_not})
        else:
            run.append((label, dict(cfg, num_speculative_tokens=k) if k else cfg))

    for m in ("ngram", "suffix"):
        add(m, m, make_choice(m, rec.target, m, "").config)
    if rec.mtp.present:
        add("mtp", "mtp", {"method": "mtp", "num_speculative_tokens": rec.mtp.layers})
    for d in rec.drafts:
        if d.accepted:
            add(f"{d.kind}:{Path(d.path).name}", d.kind, {"method": d.kind, "model": d.path, "num_speculative_tokens": d.k or 3})
    models = sorted((c for c in rec.candidates if c.verdict in ("draft", "alternative")),
                    key=lambda c: (c.verdict != "draft", -(c.predicted_speedup or 0)))
    for i, c in enumerate(models):
        why = (f"not pulled: `specctl models pull {c.spec}`" if not c.path else
               f"the own runtime cannot run {c.arch}" if not c.runnable else
               f"only the {MAX_PROBED_DRAFTS} most promising draft models are probed" if i >= MAX_PROBED_DRAFTS else None)
        add(f"draft_model:{c.name}", "draft_model",
            {"method": "draft_model", "model": c.path or c.spec, "num_speculative_tokens": c.best_k or 3}, why)
    for a in [a for a in [rec.choice, *rec.alternatives] if a.method == "sparse_attn"]:
        add("sparse_attn", "sparse_attn", dict(a.config))
    for h in [a for a in [rec.choice, *rec.alternatives] if a.method == "hybrid"]:
        parts = [dict(p, model=local) if (local := _local_model(p)) else p for p in h.config["proposers"]]
        add("hybrid:" + "+".join(p["method"] for p in parts), "hybrid", dict(h.config, proposers=parts),
            None if all(_local_model(p) is not None or "model" not in p for p in parts) else "its draft model is not pulled")
    return run, skipped


def _local_model(part: dict) -> str | None:
    """A sub-config's draft as a local path (a catalogue name that is pulled), else None."""
    m = part.get("model")
    if m is None:
        return None
    return m if Path(m).exists() else (str(p) if (p := pulled_path(m)) else None)


class _Progress:
    """bench's progress (advance, description, total) told as the probe's lines: 'warm-up', then
    'prompt i/n · label' as each generation starts. bench runs every prompt by the baseline and then
    by each method in turn, so a generation's index says which prompt and which row it is. ``rows``
    is asked when bench tells the total, once the proposers are built (a draft may fail to load)."""

    def __init__(self, say: Callable[[str], None], rows: Callable[[], list[str]]):
        self.say, self.rows_now, self.rows, self.done, self.turns = say, rows, [], 0, 0

    def __call__(self, advance: int, description: str, total: int | None = None) -> None:
        if total is not None:
            self.rows = self.rows_now()
            self.turns = total // len(self.rows)
            self.say("warm-up")
        elif advance:
            self.done += advance
        elif self.turns:
            prompt, row = divmod(self.done, len(self.rows))
            self.say(f"prompt {prompt + 1}/{self.turns} · {self.rows[row]}")


def probe(rec: Recommendation, *, prompts: str | None = None, num_prompts: int = 2, max_new_tokens: int = 32,
          k: int | None = None, adaptive: bool = True, dtype: str = "bfloat16", device: str = "cpu", seed: int = 0,
          progress: Callable[[str], None] | None = None, quantization: str | None = None) -> dict:
    """Run each applicable, implemented method briefly against the plain baseline; rank by measured speedup.

    Through ``specctl bench``'s loop (same prompts, decode tokens/s, per-prompt interleaving, a
    warm-up), plus per method: α (MLE over steps), ρ (draft time per drafted token / one target
    decode step), the predicted speedup at the best k, and the verify cost (one verify forward / one
    decode step). ``quantization="gguf"``: the target runs as its GGUF's blocks (``resolve_model``); the
    result says what ran as bench's header does (``quantization``, ``kernels``: its CPU kernel path).
    """
    from specctl.bench.draft_timer import DraftTiming
    from specctl.bench.labels import config_labels
    from specctl.bench.suite import BASELINE, run_bench
    from specctl.config import SpecConfig
    from specctl.models import resolve_model
    from specctl.runtime.decoder import SamplingParams
    from specctl.runtime.loading import load_model

    say = progress or (lambda _m: None)
    source = prompts or rec.workload.prompts or "chat"
    note = None
    if prompts is None and rec.workload.prompts is None:
        note = f"no built-in prompts for workload {rec.workload.name}: probed on chat (pass --prompts FILE)"
    plan, skipped = probe_plan(rec, k)
    configs = [SpecConfig.from_dict(cfg) for _, cfg in plan]
    labels = dict(zip(config_labels(configs), (label for label, _ in plan)))  # bench's row label -> the probe's
    path = resolve_model(rec.target.spec, dtype=dtype, quantization=quantization)
    say(f"loading {path} ({dtype}, {device})")
    loaded = load_model(path, dtype=dtype, device=device)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, stop_token_ids=loaded.stop_token_ids)
    unbuilt: set[str] = set()

    def not_built(label: str, c: SpecConfig, e: Exception) -> None:  # a draft that does not load: reported, not fatal
        unbuilt.add(label)
        skipped.append({"method": c.method, "label": labels[label], "reason": f"{type(e).__name__}: {str(e)[:160]}"})

    def built() -> list[tuple[str, SpecConfig]]:
        return [(b, c) for b, c in zip(labels, configs) if b not in unbuilt]

    report = run_bench(loaded, configs, [source], num_prompts, params, seed=seed, adaptive=adaptive,
                       progress=_Progress(say, lambda: [BASELINE] + [labels[b] for b, _ in built()]),
                       time_drafts=True, on_build_error=not_built)
    runs: dict[str, list] = {}
    for r in report.runs:  # a multi-round workload (agentic@2) has a row per round: summed here
        runs.setdefault(r.method, []).append(r)

    def total(label: str, attr: str):
        return sum(getattr(r, attr) for r in runs[label])

    base_tokens, base_s = total(BASELINE, "decode_tokens"), total(BASELINE, "decode_s")
    base_tps = base_tokens / base_s if base_s > 0 else 0.0
    step_s = base_s / base_tokens if base_tokens else 0.0  # one target decode step
    requests = total(BASELINE, "num_requests")
    rows = []
    for b, c in built():
        tokens, decode_s, steps = total(b, "decode_tokens"), total(b, "decode_s"), total(b, "steps")
        t = DraftTiming()
        for r in runs[b]:
            t = t.merge(r.draft)
        tps = tokens / decode_s if decode_s > 0 else 0.0
        alpha = estimate_alpha(t.steps)
        rho = (t.draft_s / t.k_asked) / step_s if t.k_asked and step_s else None
        pk, ps = best_k(alpha, rho) if alpha is not None and rho is not None else (None, None)
        acc = sum(a for _, a in t.steps)
        drafted = sum(n for n, _ in t.steps)
        verify = ((decode_s - t.draft_s) / steps) / step_s if steps and step_s else None
        rows.append({
            "label": labels[b], "method": c.method, "config": c.to_dict(), "k": c.num_speculative_tokens,
            "alpha": alpha, "rho": rho, "predicted_k": pk, "predicted_speedup": ps,
            "measured_speedup": tps / base_tps if base_tps else None, "tokens_per_s": tps,
            "acceptance_rate": acc / drafted if drafted else 0.0,
            "mean_acceptance_length": 1 + acc / len(t.steps) if t.steps else 1.0,
            "draft_rate": len(t.steps) / steps if steps else 0.0,
            "verify_cost": verify, "identical_to_baseline": total(b, "identical"), "requests": requests,
        })
        if c.method == "sparse_attn":
            rows[-1]["roofline"] = sparse_roofline(rec.context, rec.batch, loaded, c, rows[-1]["mean_acceptance_length"])
    rows.sort(key=lambda r: -(r["measured_speedup"] or 0))
    for i, r in enumerate(rows, 1):
        r["rank"] = i
    out = {"prompts": source, "num_prompts": requests, "max_new_tokens": max_new_tokens, "dtype": dtype,
           "device": report.header["device"], "draft_length": "adaptive (up to k)" if adaptive else "fixed k",
           "threads": report.header["threads"], "quantization": report.header.get("quantization") or "none",
           "kernels": report.header.get("cpu_kernels"), "model_path": str(path), "baseline_tokens_per_s": base_tps, "target_step_s": step_s,
           "methods": rows, "skipped": skipped}
    if note:
        out["note"] = note
    return out


def apply_probe(rec: Recommendation, result: dict) -> None:
    """Record the probe in the recommendation: a tree node with the ranking; the measured best becomes the pick."""
    rec.probe = result
    rows = result["methods"]
    node = rec.tree.add(Node("question", "Measured (--probe): which method is fastest here?",
                             rows[0]["label"] if rows else "none",
                             f"{result['num_prompts']} prompt(s) of {result['prompts']}, {result['max_new_tokens']} new tokens, "
                             f"baseline {result['baseline_tokens_per_s']:.2f} tok/s"))
    for r in rows:
        node.add(Node("evidence", f"{r['rank']}. {r['label']}: x{r['measured_speedup']:.2f} measured",
                      reason=f"α={_f(r['alpha'])}, ρ={_f(r['rho'], 3)}, predicted x{_f(r['predicted_speedup'])} "
                             f"at k={r['predicted_k']}; drafted at {r['draft_rate']:.0%} of steps; a verify forward "
                             f"cost {_f(r['verify_cost'])} decode steps (the formula assumes 1)",
                      ok=(r["measured_speedup"] or 0) > 1.0))
        if "roofline" in r:
            rf = r["roofline"]
            node.add(Node("evidence", f"{r['label']} at {rf['context']} tokens of context, batch {rf['batch']}: "
                                      f"predicted x{rf['predicted_speedup']:.2f} on this machine",
                          reason=f"roofline with this machine's measured bandwidth "
                                 f"({rf['machine']['bandwidth'] / 1e9:.1f} GB/s) and attention compute, and the "
                                 f"acceptance length measured here ({r['mean_acceptance_length']:.2f}); the KV read is "
                                 f"{100 * rf['kv_share']:.0f}% of the weights'",
                          ok=rf["predicted_speedup"] > 1.0))
    for s in result["skipped"]:
        node.add(Node("evidence", f"{s['label']}: not probed", reason=s["reason"], ok=False))
    if rows and (rows[0]["measured_speedup"] or 0) > 1.0:
        best = rows[0]
        if best["config"]["method"] != rec.choice.method or best["config"].get("model") not in (
                None, rec.choice.config.get("model"), (rec.choice.vllm_config or {}).get("model")):
            flow = rec.choice
            cfg = best["config"]
            draft = cfg.get("model")
            cand = next((c for c in rec.candidates if draft is not None and draft in (c.path, c.spec)), None)
            new = make_choice(cfg["method"], rec.target, f"{best['label']} (measured best)",
                              f"measured x{best['measured_speedup']:.2f} here; the flowchart's pick was {flow.method}",
                              draft=draft, draft_path=draft, k=best["k"],
                              vllm_unsupported=vllm_refusal(cand, rec.target) if cand is not None else "")
            rec.alternatives = [flow] + [a for a in rec.alternatives if a.config != new.config]
            rec.choice = new
        node.add(Node("choice", rec.choice.label, reason=f"measured x{best['measured_speedup']:.2f}"))
    else:
        node.add(Node("note", "no method beat plain decoding on these prompts: the flowchart's pick stands",
                      reason="try more prompts or tokens (--num-prompts, --max-new-tokens), or the real workload (--prompts)"))


def _f(x: float | None, digits: int = 2) -> str:
    return "?" if x is None else f"{x:.{digits}f}"
