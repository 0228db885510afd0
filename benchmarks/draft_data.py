"""The training data of the drafts in README: the target's own answers, generated in batches.

    python benchmarks/draft_data.py --model smollm2-135m --output data/ [--hold-out 8]

Writes one record file per source into OUTPUT (each is also a resumable self-distillation cache):
chat.jsonl (MT-Bench first turns, greedy), code-edit.jsonl (standard-library functions to rework,
greedy), chat-t0.8x4.jsonl (four sampled answers per chat prompt), humaneval.jsonl (greedy). The
first ``--hold-out`` prompts of each workload (and, for code-edit, every prompt on the same
functions) are never answered: `specctl bench -n 8` measures on exactly those. Feed the files to
`specctl train-eagle` / `train-medusa` / `train-mtp` with repeated ``--data``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from specctl.runtime.loading import load_model
from specctl.training.data import load_prompts, self_distill

SOURCES = (("chat", 0.0, 1), ("code-edit", 0.0, 1), ("chat", 0.8, 4), ("humaneval", 0.0, 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--output", required=True)
    ap.add_argument("--hold-out", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--seq-len", type=int, default=2048)
    args = ap.parse_args()
    from specctl.models import resolve_model

    lm = load_model(resolve_model(args.model, dtype="bfloat16"), dtype="bfloat16")
    out = Path(args.output)
    for workload, temperature, samples in SOURCES:
        name = f"{workload}.jsonl" if temperature == 0 else f"{workload}-t{temperature}x{samples}.jsonl"
        t = time.time()
        recs = self_distill(lm, load_prompts(workload, args.hold_out), max_new_tokens=args.max_new_tokens,
                            seq_len=args.seq_len, temperature=temperature, samples=samples, seed=1, cache=out / name,
                            progress=lambda s, i, n: print(f"{name}: {i}/{n} prompts ({time.time() - t:.0f}s)", flush=True),
                            log=print)
        tokens = sum(len(r.response_ids) for r in recs)
        print(f"{name}: {len(recs)} answers, {tokens} answer tokens, {time.time() - t:.0f}s "
              f"({tokens / max(time.time() - t, 1e-9):.0f} tok/s)", flush=True)


if __name__ == "__main__":
    main()
