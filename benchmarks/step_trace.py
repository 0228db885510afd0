"""Where a request's time goes, step by step: drafting, a draft model's prompt reading and catching up,
verification, and the rejected work, for plain decoding and each configuration, on one workload.

    python benchmarks/step_trace.py --model qwen2.5-coder-1.5b -w doc-qa -n 2 --max-new-tokens 128 \\
        --speculative-config '{"method": "draft_model", "model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 4}' \\
        --speculative-config '{"method": "hybrid", "proposers": [{"method": "ngram", "num_speculative_tokens": 8}, {"method": "draft_model", "model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 4}]}'

Each request runs through ``SpecDecoder`` as bench runs it (adaptive draft length on), plain first. The
proposer's own calls are timed from outside (``propose``, ``on_prefill``), and a draft model's runners
count the tokens each forward reads, so the trace splits a draft model's work into prompt reading
(in the prefill), catching up (context tokens read while drafting) and drafting proper. Prints one
table per configuration and, with --json, every step. The CPU is named in the header.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict



def cpu_name() -> str:
    from specctl.kernels import cpu

    return cpu.name()


class Timed:
    """Seconds and calls of a wrapped callable (an instance attribute replaced in place)."""

    def __init__(self, obj, name: str, book: dict):
        self.fn, self.book, self.name = getattr(obj, name), book, name
        setattr(obj, name, self)

    def __call__(self, *a, **k):
        t = time.perf_counter()
        try:
            return self.fn(*a, **k)
        finally:
            self.book[self.name] += time.perf_counter() - t


def draft_runners(proposer):
    """The draft models' TargetRunner classes' forward, counted: tokens read per phase."""
    from specctl.runtime.proposers.draft_model import DraftModelProposer

    subs = getattr(proposer, "subs", [proposer])
    return [p for p in subs if isinstance(p, DraftModelProposer)]


def run(loaded, cfg, requests, max_new_tokens: int, max_len: int):
    from specctl.runtime import runner as R
    from specctl.runtime.decoder import SamplingParams, SpecDecoder
    from specctl.runtime.proposers import build_proposer
    from specctl.workloads import render_prompt

    proposer = build_proposer(cfg, max_len, target=loaded) if cfg is not None else None
    k = int(cfg.num_speculative_tokens or 0) if cfg is not None else 0
    dec = SpecDecoder(R.TargetRunner(loaded.model, max_len), proposer, k, adaptive=cfg is not None)
    book: dict = defaultdict(float)
    if proposer is not None:
        Timed(proposer, "propose", book)
        Timed(proposer, "on_prefill", book)
        Timed(proposer, "on_verified", book)
    drafts = draft_runners(proposer) if proposer is not None else []
    phase = {"now": "prompt"}
    reads: dict = defaultdict(int)  # draft-model tokens read, by phase
    orig_fb = R.forward_batch

    def counting_forward_batch(runners, tokens, *a, **kw):
        for r, t in zip(runners, tokens):
            if getattr(r, "_is_draft", False):
                reads[phase["now"]] += int(t.shape[-1])
        return orig_fb(runners, tokens, *a, **kw)

    for d in drafts:
        orig_slot = d._slot

        def slot(i, _orig=orig_slot):
            s = _orig(i)
            s.runner._is_draft = True
            if not getattr(s.runner, "_counted", False):
                fwd = s.runner.forward

                def counted(tok, *a, _fwd=fwd, **kw):
                    reads[phase["now"]] += int(tok.shape[-1])
                    return _fwd(tok, *a, **kw)

                s.runner.forward, s.runner._counted = counted, True
            return s

        d._slot = slot
    R.forward_batch = counting_forward_batch  # draft_model imports it at each call
    steps, totals = [], defaultdict(float)
    try:
        for req in requests:
            ids = render_prompt(loaded.tokenizer, req)
            params = SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=loaded.stop_token_ids)
            phase["now"] = "prompt"
            t = time.perf_counter()
            st = dec.start(ids, params)
            totals["prefill_s"] += time.perf_counter() - t
            phase["now"] = "decode"
            t_dec = time.perf_counter()
            while st.finish is None:
                before = dict(book)
                nd0, na0 = st.stats.num_draft_tokens, st.stats.num_accepted_tokens
                r0 = reads["decode"]
                t = time.perf_counter()
                dec.step(st)
                dt = time.perf_counter() - t
                nd, na = st.stats.num_draft_tokens - nd0, st.stats.num_accepted_tokens - na0
                prop = book["propose"] - before.get("propose", 0.0)
                steps.append({"request": req.id, "seconds": dt, "draft_s": prop, "verify_s": dt - prop,
                              "drafted": nd, "accepted": na, "draft_tokens_read": reads["decode"] - r0})
            totals["decode_s"] += time.perf_counter() - t_dec
            totals["tokens"] += len(st.out) - 1
            dec.finish(st)
    finally:
        R.forward_batch = orig_fb
    draft_s = sum(s["draft_s"] for s in steps)
    verify_s = sum(s["verify_s"] for s in steps)
    plain_like = [s for s in steps if s["drafted"] == 0]
    drafting = [s for s in steps if s["drafted"] > 0]
    # rejected work: the verify rows of rejected drafts, at the drafting steps' average time per row
    v_per_step = (sum(s["verify_s"] for s in drafting) / len(drafting)) if drafting else 0.0
    summary = {
        "tokens": int(totals["tokens"]), "decode_s": totals["decode_s"], "prefill_s": totals["prefill_s"],
        "tok_s": totals["tokens"] / max(totals["decode_s"], 1e-9), "steps": len(steps),
        "drafting_steps": len(drafting), "plain_steps": len(plain_like),
        "draft_s": draft_s, "verify_s": verify_s, "prompt_read_s": book["on_prefill"],
        "drafted": sum(s["drafted"] for s in steps), "accepted": sum(s["accepted"] for s in steps),
        "draft_tokens_read_prompt": reads["prompt"], "draft_tokens_read_decode": reads["decode"],
        "verify_s_per_drafting_step": v_per_step,
        "verify_s_per_plain_step": (sum(s["verify_s"] for s in plain_like) / len(plain_like)) if plain_like else None,
    }
    return summary, steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("-w", "--workload", default="doc-qa")
    ap.add_argument("-n", "--num-prompts", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--speculative-config", action="append", default=[])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--json", action="store_true", help="every step as JSON lines after the tables")
    args = ap.parse_args()
    from specctl.config import SpecConfig
    from specctl.models import resolve_model
    from specctl.runtime.loading import load_model
    from specctl.workloads import load_workload, render_prompt

    loaded = load_model(resolve_model(args.model, dtype=args.dtype), dtype=args.dtype)
    reqs = load_workload(args.workload, args.num_prompts, 0)
    longest = max(len(render_prompt(loaded.tokenizer, r)) for r in reqs)
    max_len = longest + args.max_new_tokens + 64
    print(f"# {args.model} {args.dtype}, workload {args.workload} x{len(reqs)} (longest prompt {longest} tokens), "
          f"{args.max_new_tokens} new tokens, CPU: {cpu_name()}")
    configs = [("plain", None)] + [(c, SpecConfig.from_dict(json.loads(c))) for c in args.speculative_config]
    results = []
    for label, cfg in configs:
        summary, steps = run(loaded, cfg, reqs, args.max_new_tokens, max_len)
        results.append((label, summary, steps))
    base = results[0][1]["tok_s"]
    for label, s, _ in results:
        name = label if label == "plain" else json.loads(label)["method"]
        print(f"\n## {name}: {s['tok_s']:.2f} tok/s ({s['tok_s'] / base:.2f}x plain), {s['steps']} steps "
              f"({s['drafting_steps']} drafting), prefill {s['prefill_s']:.2f} s (of which draft prompt reading "
              f"{s['prompt_read_s']:.2f} s, {s['draft_tokens_read_prompt']} draft tokens)")
        if label == "plain":
            continue
        print(f"   decode {s['decode_s']:.2f} s = drafting {s['draft_s']:.2f} s + verification {s['verify_s']:.2f} s; "
              f"draft tokens read while decoding {s['draft_tokens_read_decode']} (drafts fed + catching up)")
        print(f"   drafted {s['drafted']}, accepted {s['accepted']} ({s['accepted'] / max(s['drafted'], 1):.0%}); "
              f"verify step {s['verify_s_per_drafting_step'] * 1e3:.0f} ms drafting, "
              f"{(s['verify_s_per_plain_step'] or 0) * 1e3:.0f} ms plain")
    if args.json:
        for label, s, steps in results:
            print(json.dumps({"config": label, "summary": s, "steps": steps}))


if __name__ == "__main__":
    main()
