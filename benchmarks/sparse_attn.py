"""sparse_attn on long contexts: acceptance per position, measured speedup over plain decoding, and the
roofline model's prediction (specctl/roofline.py) beside it, at batch 1 and at a concurrency N.

    python benchmarks/sparse_attn.py --model qwen2.5-coder-0.5b -w long-4k -w long-16k -n 2 -k 4 -k 6
    python benchmarks/sparse_attn.py --model qwen2.5-coder-0.5b -w long-4k -n 8 -k 4 --concurrency 8

Each prompt is prefilled once (plain decoding's); every method takes its keys/values over
(``reuse_prefill``), so the figures are decode figures. Plain runs before and after the methods of a
prompt and its mean is the reference (the machine drifts). Methods run with a fixed k (what the
prediction models) and, with --adaptive, with the controller choosing k (what a user gets).
The machine's bandwidth and compute come from forwards of the model itself, in the same run.
All ratios are from one run on one machine; the CPU is printed first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace

import torch

import specctl
from specctl.bench.suite import machine_header
from specctl.workloads import load_workload, render_prompt
from specctl.config import SpecConfig
from specctl.models import resolve_model
from specctl.roofline import Shapes, sparse_attn_estimate
from specctl.runtime.machine import measure_machine
from specctl.runtime.decoder import SamplingParams, SpecDecoder
from specctl.runtime.proposers import build_proposer
from specctl.runtime.loading import load_model
from specctl.runtime.runner import TargetRunner


def tau(stats) -> float:
    return 1 + stats.num_accepted_tokens / stats.num_drafts if stats.num_drafts else 1.0


def per_pos(stats, k: int) -> list[float]:
    return [round(a / stats.num_drafts, 3) if stats.num_drafts else 0.0 for a in stats.num_accepted_tokens_per_pos[:k]]


def layer_share(proposer, shapes) -> float:
    """The share of the target's layers the draft ran: all but the skipped ones (for "auto", the
    candidate it settled on)."""
    if proposer.chooser is not None:
        return 1 - len(proposer.chooser.candidates[proposer.chooser.best()]) / shapes.layers
    return len(proposer.layers) / shapes.layers


def configs(args) -> list[tuple[str, SpecConfig, bool]]:
    out = []
    skips = [None] + ([args.skip_layers] if args.skip_layers else [])
    for algo in args.algorithm:
        for k in args.k:
            for skip in skips:
                c = SpecConfig(method="sparse_attn", num_speculative_tokens=k, sparse_attn_algorithm=algo,
                               sparse_attn_ratio=args.ratio, sparse_attn_min_tokens=args.min_tokens,
                               sparse_attn_skip_layers=skip).validated()
                label = f"{algo} k={k}" + ("" if not skip else " skip=auto" if skip == "auto" else f" skip={len(skip)}")
                out.append((label, c, False))
                if args.adaptive:
                    out.append((label + " adaptive", c, True))
    return out


def batch1(loaded, shapes, machines, args, params) -> list[dict]:
    rows = []
    for w in args.workload:
        reqs = load_workload(w, args.num_prompts, args.seed)
        for req in reqs:
            ids = render_prompt(loaded.tokenizer, req)
            machine = machines(len(ids))
            runner = TargetRunner(loaded.model, len(ids) + params.max_new_tokens + 2 * max(args.k) + 8)
            plain = SpecDecoder(runner, reuse_prefill=True)
            t = time.perf_counter()
            base = plain.generate(ids, params)
            print(f"# {w} {req.id}: {len(ids)} prompt tokens, prefill {time.perf_counter() - t:.1f} s", file=sys.stderr)
            results = []
            for label, c, adaptive in configs(args):
                dec = SpecDecoder(runner, build_proposer(c, runner.max_len, target=loaded), c.num_speculative_tokens,
                                  adaptive=adaptive, reuse_prefill=True)
                results.append((label, c, adaptive, dec.generate(ids, params), layer_share(dec.proposer, shapes)))
            again = plain.generate(ids, params)
            plain_tps = statistics.mean([base.decode_tokens_per_s, again.decode_tokens_per_s])
            ctx = len(ids) + params.max_new_tokens // 2
            for label, c, adaptive, r, share in results:
                est = sparse_attn_estimate(shapes, machine, context=ctx, batch=1, k=c.num_speculative_tokens, tau=tau(r.stats),
                                           ratio=c.sparse_attn_ratio, min_tokens=c.sparse_attn_min_tokens,
                                           layer_share=share, algorithm=c.sparse_attn_algorithm)
                speedup = r.decode_tokens_per_s / plain_tps
                row = {"workload": w, "prompt": req.id, "prompt_tokens": len(ids), "method": label, "batch": 1,
                       "equal": r.token_ids == base.token_ids, "tau": round(tau(r.stats), 3),
                       "per_position": per_pos(r.stats, c.num_speculative_tokens), "plain_tok_s": round(plain_tps, 2),
                       "tok_s": round(r.decode_tokens_per_s, 2), "speedup": round(speedup, 3),
                       "predicted": None if adaptive else round(est.speedup, 3),
                       "error": None if adaptive else round(est.speedup / speedup - 1, 3),
                       "draft_positions": est.draft_positions, "kv_share": round(est.kv_share, 3)}
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    return rows


def concurrent(loaded, shapes, machines, args, params, n: int) -> list[dict]:
    """n requests decoding together (one target forward per step; sparse_attn drafts all in one ragged
    forward per drafting step); decode throughput after every prompt is prefilled."""
    w = args.workload[0]
    reqs = load_workload(w, n, args.seed)
    prompts = [render_prompt(loaded.tokenizer, r) for r in reqs]
    longest = max(len(p) for p in prompts)
    runners = [TargetRunner(loaded.model, longest + params.max_new_tokens + 2 * max(args.k) + 8) for _ in prompts]

    def run(dec) -> tuple[float, list, list]:
        states = [dec.start(p, params, runner=r, slot=i) for i, (p, r) in enumerate(zip(prompts, runners))]
        t0 = time.perf_counter()
        n0 = sum(len(s.out) for s in states)
        live = list(states)
        while live:
            dec.step_batch(live)
            live = [s for s in live if s.finish is None]
        dt = time.perf_counter() - t0
        res = [dec.finish(s) for s in states]
        return (sum(len(r.token_ids) for r in res) - n0) / dt, res, states

    plain = SpecDecoder(runners[0], reuse_prefill=True)
    t = time.perf_counter()
    base_tps, base, _ = run(plain)
    print(f"# concurrency {n}: {w}, {len(prompts)} prompts of {min(map(len, prompts))}-{longest} tokens, "
          f"prefill {time.perf_counter() - t:.0f} s (with decoding)", file=sys.stderr)
    rows, measured = [], []
    for label, c, adaptive in configs(args):
        dec = SpecDecoder(runners[0], build_proposer(c, runners[0].max_len, target=loaded), c.num_speculative_tokens,
                          adaptive=adaptive, reuse_prefill=True)
        measured.append((label, c, adaptive, *run(dec)[:2], layer_share(dec.proposer, shapes)))
    again, _, _ = run(plain)
    plain_tps = statistics.mean([base_tps, again])
    ctx = int(statistics.mean(map(len, prompts))) + params.max_new_tokens // 2
    machine = machines(ctx)
    for label, c, adaptive, tps, res, share in measured:
        st = res[0].stats
        for r in res[1:]:
            st = st.merge(r.stats)
        est = sparse_attn_estimate(shapes, machine, context=ctx, batch=n, k=c.num_speculative_tokens, tau=tau(st),
                                   ratio=c.sparse_attn_ratio, min_tokens=c.sparse_attn_min_tokens, layer_share=share,
                                   algorithm=c.sparse_attn_algorithm)
        row = {"workload": w, "method": label, "batch": n, "equal": all(a.token_ids == b.token_ids for a, b in zip(res, base)),
               "tau": round(tau(st), 3), "per_position": per_pos(st, c.num_speculative_tokens),
               "plain_tok_s": round(plain_tps, 2), "tok_s": round(tps, 2), "speedup": round(tps / plain_tps, 3),
               "predicted": None if adaptive else round(est.speedup, 3),
               "error": None if adaptive else round(est.speedup / (tps / plain_tps) - 1, 3),
               "draft_positions": est.draft_positions, "kv_share": round(est.kv_share, 3)}
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("-w", "--workload", action="append", help="default: long-4k")
    ap.add_argument("-n", "--num-prompts", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("-k", type=int, action="append", help="draft lengths (default 4)")
    ap.add_argument("--algorithm", action="append", help="streamingllm and/or vegas (default both)")
    ap.add_argument("--ratio", type=float, default=0.05)
    ap.add_argument("--min-tokens", type=int, default=256)
    ap.add_argument("--skip-layers", type=lambda s: s if s == "auto" else [int(x) for x in s.split(",")], default=None,
                    help="also run with these layers skipped in the draft, e.g. 12,13,14,15, or auto")
    ap.add_argument("--adaptive", action="store_true", help="also run each with the draft-length controller")
    ap.add_argument("--concurrency", type=int, default=0, help="also measure N requests decoding together")
    ap.add_argument("--no-batch1", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    args.workload = args.workload or ["long-4k"]
    args.k = args.k or [4]
    args.algorithm = args.algorithm or ["streamingllm", "vegas"]
    specctl.process_defaults()
    torch.manual_seed(args.seed)
    loaded = load_model(resolve_model(args.model, dtype="bfloat16"), dtype="bfloat16")
    params = SamplingParams(max_new_tokens=args.max_new_tokens, stop_token_ids=loaded.stop_token_ids)
    header = machine_header(loaded, args.max_new_tokens, 0.0)
    shapes = Shapes.of(loaded.model)
    header["roofline_machine"] = {}
    measured: dict[int, object] = {}

    def machines(context: int):
        """The machine's rates measured at this context (to the nearest 1024 tokens), once."""
        c = max(1024, round(context / 1024) * 1024)
        if c not in measured:
            m = measured[c] = measure_machine(loaded.model, context=c)
            header["roofline_machine"][c] = {"bandwidth_GBps": round(m.bandwidth / 1e9, 1),
                                             "linear_GFLOPs": round(m.linear_flops / 1e9, 1),
                                             "attention_GFLOPs": round(m.attention_flops / 1e9, 2),
                                             "kv_GBps": round(m.kv_bw / 1e9, 1)}
            print(f"# {header['machine']}, {header['threads']} threads, kernels {header['cpu_kernels']}; measured at "
                  f"{c} tokens of context: {header['roofline_machine'][c]}", file=sys.stderr)
        return measured[c]

    rows = [] if args.no_batch1 else batch1(loaded, shapes, machines, args, params)
    if args.concurrency:
        rows += concurrent(loaded, shapes, machines, args, replace(params), args.concurrency)
    if args.json:
        print(json.dumps({"header": header, "rows": rows}, indent=1))
        return
    print(f"model {header['model']} ({header['dtype']}), {header['machine']}, {header['threads']} threads; "
          f"roofline machine by context {header['roofline_machine']}")
    print(f"{'workload':9} {'batch':>5} {'method':28} {'ctx':>6} {'equal':>5} {'tau':>5} {'per-position':32} "
          f"{'plain':>7} {'tok/s':>7} {'speedup':>7} {'pred':>6} {'err':>6}")
    for r in rows:
        pred = "" if r["predicted"] is None else f"{r['predicted']:.2f}"
        err = "" if r["error"] is None else f"{100 * r['error']:+.0f}%"
        print(f"{r['workload']:9} {r['batch']:>5} {r['method']:28} {r.get('prompt_tokens', ''):>6} {str(r['equal']):>5} "
              f"{r['tau']:>5.2f} {str(r['per_position']):32} {r['plain_tok_s']:>7.2f} {r['tok_s']:>7.2f} "
              f"{r['speedup']:>6.2f}x {pred:>6} {err:>6}")


if __name__ == "__main__":
    main()
