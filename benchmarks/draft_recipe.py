"""A trained draft for a catalogue target, from nothing: data, training (with its state cache), export, bench.

    python benchmarks/draft_recipe.py --model qwen2.5-coder-0.5b --method eagle3 --out runs/q05-eagle3 --quick
    python benchmarks/draft_recipe.py --model qwen2.5-coder-0.5b --method medusa --out runs/q05-medusa
    python benchmarks/draft_recipe.py --model qwen2.5-coder-0.5b --method medusa --out runs/q05-medusa \
        --states-from runs/q05-eagle3     # the EAGLE-3 run's data and target states: training alone

Stages, each resumable after an interruption (SIGKILL included) without redoing finished work:

1. data   ShareGPT first turns (``--self-distill sharegpt``'s prompts) answered again by the target through
          the batched engine, greedy and sampled (the draft learns the target's distribution, not
          ShareGPT's answers): OUT/data/sharegpt-greedy.jsonl and OUT/data/sharegpt-t<T>.jsonl, appended
          a batch at a time (``specctl.training.data.self_distill``'s cache). Then, for EAGLE-3, more
          ShareGPT conversations (other ones) with their own answers, OUT/data/sharegpt-read.jsonl: the
          target only reads them (a forward, no generation) and its distribution at each position is
          the label (EAGLE-3's loss is against the target's distribution), so they add data at the cost
          of the state cache alone.
2. train  ``specctl train-eagle`` / ``train-medusa`` / ``train-mtp`` on those files into OUT/train
          (EAGLE-3's target states cached once in OUT/states; checkpoints every few steps, ``--resume``);
          its summary in OUT/train.json, the export beside it.
   held-out: the target's greedy answers to exactly the prompts bench runs (OUT/data/heldout.jsonl), which
          EAGLE-3's training evaluates on (``--eval-data``), never trains on.
   replay  greedy decoding of the held-out answers replayed through the proposer on the target's states, for
          each bench configuration (OUT/replay.json): what bench measures at a fixed draft length, in seconds.
3. bench  ``specctl bench`` on held-out prompts (MT-Bench first turns, HumanEval; never training data:
          the trainers refuse evaluation prompts), a chain of k and, for EAGLE-3, a tree of at most 16
          nodes: one request at a time (OUT/bench.json), then 8 together (OUT/bench-c8.json).

The last line printed is JSON: the export's folder, the training time, the replayed mean acceptance lengths
(``training_estimate``, ``training_estimate_tree``), bench's, the speedups at concurrency 1 and 8.
A stage whose result file exists is skipped; delete the file to redo it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass
class Plan:
    """What a recipe run does: its data, training and bench sizes."""

    greedy_prompts: int  # ShareGPT prompts answered greedily
    sampled_prompts: int  # ... and answered once more, sampled at `temperature`
    read_conversations: int  # EAGLE-3: other ShareGPT conversations the target reads with their own answers
    temperature: float
    max_new_tokens: int  # per answer
    steps: int  # optimizer steps
    batch_size: int
    seq_len: int
    lr: float
    bench_prompts: int  # per held-out workload
    bench_tokens: int
    k: int = 3  # the chain bench measures (and Medusa's heads, MTP's depth)
    more_answers: int = 0  # more prompts answered greedily, from the back of ShareGPT's list (added to a finished run)

    @property
    def answer_tokens(self) -> int:
        """At most this many answer tokens (answers stop early at an end of turn)."""
        return (self.greedy_prompts + self.sampled_prompts + self.more_answers) * self.max_new_tokens


# The budget each plan states up front: ``budget`` (on 2 cores for the 0.5B: the quick plan ~50 minutes, the full ~3 hours).
QUICK = Plan(greedy_prompts=160, sampled_prompts=64, read_conversations=300, temperature=0.8, max_new_tokens=256, steps=120, batch_size=4,
             seq_len=768, lr=1e-3, bench_prompts=4, bench_tokens=96)
FULL = Plan(greedy_prompts=320, sampled_prompts=96, read_conversations=700, temperature=0.8, max_new_tokens=320,
            steps=800, batch_size=4, seq_len=768, lr=1e-3, bench_prompts=8, bench_tokens=128)
# What each stage costs a 0.5B target (Qwen2.5-Coder-0.5B) on a 2-core CPU, measured by the recipe's runs: answer
# tokens/s of the batched engine, tokens/s the target reads for the state cache (bf16), seconds an EAGLE-3 step of 4
# sequences of 768 tokens takes (Medusa's and MTP's steps are cheaper: an upper bound), the bench; answers stop at
# ~2/3 of max_new_tokens on average. "native": bf16 multiplies natively (AMD EPYC Zen 4, AVX512-BF16); "avx2": no
# bf16 instructions (AMD EPYC Zen 3), where the draft trains in fp32 (torch's bf16 matmul is ~5.7x slower there).
ANSWER_FILL = 0.67
RATES_BY_CPU = {"native": {"generate_tok_s": 70.0, "read_tok_s": 210.0, "step_s": 5.0, "bench_s": 300.0},
                "avx2": {"generate_tok_s": 42.0, "read_tok_s": 65.0, "step_s": 12.0, "bench_s": 500.0}}

RATES_SEEN_ON = {"native": "a 2-core AMD EPYC Zen 4 with native bf16", "avx2": "a 2-core AMD EPYC Zen 3 without bf16 instructions"}


def cpu_rates() -> tuple[str, dict[str, float]]:
    """This CPU's kind ("native" where bf16 multiplies natively: AVX512-BF16, which AMX CPUs have too, the rule
    train-eagle's autocast default follows; else "avx2") and its rates."""
    from specctl.kernels import cpu

    kind = "native" if cpu.has("avx512_bf16") else "avx2"
    return kind, RATES_BY_CPU[kind]


RATES = cpu_rates()[1]


def state_tokens(plan: Plan, method: str) -> float:
    """Tokens whose target states EAGLE-3 caches: the answered prompts with their answers (an answer ~0.6
    of its prompt's length again), and the read conversations (most fill the sequence); 0 for the others."""
    if method != "eagle3":
        return 0.0
    return plan.answer_tokens * ANSWER_FILL * 1.6 + plan.read_conversations * plan.seq_len * 0.8


def budget(plan: Plan, method: str, layers: int, hidden: int, rates: dict[str, float] | None = None) -> dict[str, float]:
    """Seconds each stage is expected to take on a 2-core CPU: ``rates`` (default this CPU kind's) scaled by the
    target's size against the 0.5B's (24 layers, hidden 896; the draft's step by hidden squared)."""
    r = rates or RATES
    size = layers * hidden ** 2 / (24 * 896 ** 2)
    answers = plan.answer_tokens * ANSWER_FILL
    return {"data": answers / r["generate_tok_s"] * size, "states": state_tokens(plan, method) / r["read_tok_s"] * size,
            "train": plan.steps * r["step_s"] * (hidden / 896) ** 2 * plan.seq_len / 768, "bench": r["bench_s"] * size}


METHOD_LR = {"eagle3": 1e-3, "medusa": 1e-3, "mtp": 1e-3}  # small batches on a CPU: SpecForge's 1e-4 is for 64+
HELD_OUT = ("chat", "humaneval")  # MT-Bench first turns, HumanEval: what bench measures on


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def eta_printer(name: str):
    """A (phase, done, total) callback printing progress with a rate-based ETA, at most every 20 s."""
    t0, last = time.time(), [0.0]

    def progress(_phase: str, done: int, total: int) -> None:
        now = time.time()
        if done < total and now - last[0] < 20:
            return
        last[0] = now
        rate = done / max(now - t0, 1e-9)
        eta = (total - done) / rate if rate > 0 else float("inf")
        say(f"  {name}: {done}/{total} ({now - t0:.0f} s, ETA {eta:.0f} s)")

    return progress


def write_json(path: Path, obj) -> None:
    from specctl.files import write_json_atomic

    write_json_atomic(path, obj)


# --------------------------------------------------------------------------- stages

def write_read(plan: Plan, prompts: list, path: Path) -> None:
    """The ShareGPT conversations whose prompts come after the answered ones (in the sharegpt workload's
    order), with their own answers, for the target to read: written once, atomically, into ``path``."""
    from specctl.files import write_text_atomic
    from specctl.training.data import check_not_evaluation, parse_record
    from specctl.workloads.data import sharegpt_dialogues

    by_id = {d["id"]: d for d in sharegpt_dialogues()}  # those that open with a question and hold an answer
    later = (r.id.split("/", 1)[1] for r in prompts[plan.greedy_prompts + plan.sampled_prompts:])
    rows = [by_id[i] for i in later if i in by_id][:plan.read_conversations]
    check_not_evaluation([parse_record(r, f"ShareGPT {r['id']}") for r in rows])
    write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in rows))
    say(f"data: {len(rows)} ShareGPT conversations with their own answers, for the target to read, in {path}")


def _lines(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(1 for _ in f)


def stage_data(args, plan: Plan, out: Path) -> list[Path]:
    """The target's own answers to ShareGPT prompts (greedy, then sampled), cached a batch at a time;
    for EAGLE-3, other conversations it reads as they are."""
    from specctl.models import resolve_model
    from specctl.runtime.loading import load_model
    from specctl.training.data import check_not_evaluation, load_prompts, self_distill

    if getattr(args, "states_from", None):  # another run's data (and, in training, its states cache)
        made = args.states_from / "data" / "done.json"
        if not made.is_file():
            sys.exit(f"data: {args.states_from} has no finished data stage ({made}); run its recipe first, or drop --states-from")
        say(f"data: {args.states_from}'s")
        return [Path(f) for f in json.loads(made.read_text())["files"]]
    files = [out / "data" / "sharegpt-greedy.jsonl", out / "data" / f"sharegpt-t{plan.temperature}.jsonl"]
    done = out / "data" / "done.json"
    if args.method == "eagle3" and plan.read_conversations > 0:
        files.append(out / "data" / "sharegpt-read.jsonl")
        # written anew where the plan asks for another number: the same conversations first (one order), so a
        # run given more keeps its cached states and reads only the new ones
        if not files[-1].is_file() or _lines(files[-1]) != plan.read_conversations:
            write_read(plan, load_prompts("sharegpt"), files[-1])
    more = out / "data" / "sharegpt-greedy-more.jsonl"
    if plan.more_answers:
        files.append(more)
    earlier = json.loads(done.read_text()) if done.is_file() else None
    if earlier is not None and (not plan.more_answers or earlier.get("more_answers") == plan.more_answers):
        say(f"data: done earlier ({done})")
        return files
    prompts = load_prompts("sharegpt")
    greedy = prompts[:plan.greedy_prompts]
    sampled = prompts[plan.greedy_prompts:plan.greedy_prompts + plan.sampled_prompts]  # other prompts: more variety
    # more answers come from the list's back: the answered and read ranges grow from its front, so none collide
    extra = prompts[::-1][:plan.more_answers]
    check_not_evaluation([], greedy + sampled + extra)
    lm = load_model(resolve_model(args.model, dtype="bfloat16"), dtype="bfloat16")
    t = time.time() - (earlier["seconds"] if earlier else 0.0)  # a run given more answers adds their time
    jobs = [(files[0], greedy, 0.0), (files[1], sampled, plan.temperature)] + ([(more, extra, 0.0)] if extra else [])
    for path, reqs, temp in jobs:
        say(f"data: the target answers {len(reqs)} ShareGPT prompts (temperature {temp}, up to {plan.max_new_tokens} "
            f"tokens each) into {path}")
        recs = self_distill(lm, reqs, max_new_tokens=plan.max_new_tokens, temperature=temp, seed=1,
                            seq_len=plan.seq_len, cache=path, progress=eta_printer(path.name), log=say)
        say(f"  {path.name}: {len(recs)} answers, {sum(len(r.response_ids) for r in recs)} answer tokens")
    write_json(done, {"files": [str(f) for f in files], "seconds": round(time.time() - t, 1),
                      **({"more_answers": plan.more_answers} if plan.more_answers else {})})
    return files


def stage_heldout(args, plan: Plan, out: Path) -> Path:
    """The target's greedy answers to exactly the prompts bench runs (never trained on): the trainer
    evaluates on them (--eval-data), so the acceptance it prints is what bench then measures."""
    from specctl.models import resolve_model
    from specctl.runtime.loading import load_model
    from specctl.training.data import self_distill
    from specctl.workloads import load_workload

    path = out / "data" / "heldout.jsonl"
    done = out / "data" / "heldout.done"
    if done.is_file():
        return path
    reqs = [r for w in HELD_OUT for r in load_workload(w, plan.bench_prompts, 0)]
    lm = load_model(resolve_model(args.model, dtype="bfloat16"), dtype="bfloat16")
    say(f"held-out: the target answers bench's {len(reqs)} prompts into {path} (evaluation only)")
    self_distill(lm, reqs, max_new_tokens=plan.bench_tokens, seq_len=plan.seq_len, cache=path,
                 progress=eta_printer(path.name), log=say)
    done.write_text("done\n")
    return path


def train_command(args, plan: Plan, out: Path, files: list[Path]) -> list[str]:
    # EAGLE-3 as it paid on SmolLM2-135M (docs/results): the fc starts as the identity on the deepest aux
    # layer (the draft starts where the LM head reads), the answers' rows learnt and a tenth of the prompts',
    # an 8k draft vocabulary from the regenerated data's token frequencies (a quarter of the head's cost),
    # bf16 matmuls where the CPU multiplies bf16 natively (train-eagle's default: a step 8.9 -> 6.5 s on the 2-core
    # AMD EPYC Zen 4; on AVX2 alone, Zen 3, torch's bf16 matmul is ~5.7x slower than fp32, so there it stays fp32);
    # the target's states in bf16, the dtype it serves in (and read 1.6x faster than in fp32: 211 against 131 tokens/s on the Zen 4)
    cmd = {"eagle3": ["train-eagle", "--version", "3", "--cache-hidden-states", str(out / "states"), "--fc-init",
                      "last", "--prompt-rows", "0.1", "--draft-vocab-size", "8192", "--dtype", "bfloat16"],
           # the target's distribution (soft labels: read conversations teach it too) over an 8k vocabulary, as EAGLE-3's,
           # through one LM head shared by the heads: the only way vLLM loads a truncated vocabulary (token_map)
           "medusa": ["train-medusa", "--num-heads", str(plan.k), "--soft-labels", "--truncated-vocab-size", "8192",
                      "--shared-lm-head"],
           "mtp": ["train-mtp", "--depth", str(plan.k), "--layout", "mimo"]}[args.method]
    cmd = [sys.executable, "-m", "specctl.cli", *cmd, "--model", args.model, "--output", str(out / "train"),
           "--steps", str(plan.steps), "--batch-size", str(plan.batch_size), "--seq-len", str(plan.seq_len),
           "--lr", str(args.lr or METHOD_LR[args.method]), "--save-every", "20", "--json"]
    for f in files:
        cmd += ["--data", str(f)]
    # EAGLE-3 evaluates on the 16 held-out answers (seconds); Medusa and MTP on a 5 % split, a minute or more on
    # a CPU: five times a run, not at every checkpoint (their default), which took more time than the steps
    cmd += ["--eval-every", "40" if args.method == "eagle3" else str(max(20, plan.steps // 5))]
    if args.method in ("medusa", "mtp") and getattr(args, "states_from", None):
        cmd += ["--cache-hidden-states", str(args.states_from / "states")]
    if args.method == "mtp" and getattr(args, "states_from", None):
        # the EAGLE-3 run's sequences (its cache's key: bf16, its --seq-len), the answers' rows and a tenth of the
        # prompts' learnt, a loss over the 16k most frequent target choices (the full 152k head is ~90 % of a
        # step here: 4.5 against 50 s on the 2-core AMD EPYC), evaluated on the held-out answers as EAGLE-3 is
        cmd += ["--dtype", "bfloat16", "--prompt-rows", "0.1", "--loss-vocab-size", "16384",
                "--eval-data", str(args.states_from / "data" / "heldout.jsonl")]
    ckpts = sorted((out / "train" / "checkpoints").glob("step-*")) if (out / "train" / "checkpoints").is_dir() else []
    resuming = bool(ckpts)
    # the settings the run started with: its newest checkpoint's (the output's own copy is written at the end)
    saved = next((p for p in (*(c / "training_config.json" for c in ckpts[::-1]), out / "train" / "training_config.json")
                  if p.is_file()), None)
    earlier = json.loads(saved.read_text()).get("eval_data", []) if saved is not None else None
    heldout = out / "data" / "heldout.jsonl"
    if args.method == "eagle3" and heldout.is_file() and (not resuming or earlier):  # a resumed run keeps its setting
        cmd += ["--eval-data", str(heldout)]
    if resuming:
        cmd.append("--resume")
    return cmd


def stage_train(args, plan: Plan, out: Path, files: list[Path]) -> dict:
    result = out / "train.json"
    if result.is_file():
        say(f"train: done earlier ({result})")
        return json.loads(result.read_text())
    cmd = train_command(args, plan, out, files)
    say("train: " + " ".join(cmd[2:]))
    t = time.time()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        sys.exit(f"train: the trainer exited with {proc.returncode}; run the recipe again to resume")
    summary = json.loads(proc.stdout)
    summary["recipe_train_s"] = round(time.time() - t, 1)
    write_json(result, summary)
    return summary


def bench_configs(method: str, export: str, k: int) -> dict[str, dict]:
    chain = {"method": method, "model": export, "num_speculative_tokens": k}
    if method == "medusa":  # the tree of the heads' held-out rank accuracies (train-medusa records them)
        return {"chain": chain, "tree": dict(chain, speculative_token_tree="auto", speculative_num_draft_tokens=16)}
    if method != "eagle3":
        return {"chain": chain}
    from specctl.training.replay import TREE  # the tree train-eagle's replay runs too

    return {"chain": chain, "tree": {"method": method, "model": export, **TREE}}


def stage_replay(args, plan: Plan, out: Path, export: str, heldout: Path) -> dict:
    """What bench will measure at a fixed draft length, before it runs: greedy decoding of the held-out answers
    replayed through the proposer on the target's states (``specctl.training.replay``), for each bench
    configuration (OUT/replay.json). train-eagle does it at its end; here for every method, so the recipe's
    last line gives the same figures for Medusa and MTP."""
    result = out / "replay.json"
    if result.is_file():
        return json.loads(result.read_text())
    from specctl.config import SpecConfig
    from specctl.models import resolve_model
    from specctl.runtime.loading import load_model
    from specctl.runtime.proposers import build_proposer
    from specctl.training.data import read_records
    from specctl.training.replay import replay_records

    lm = load_model(resolve_model(args.model, dtype="bfloat16"), dtype="bfloat16")
    records = read_records(str(heldout))
    got = {}
    for name, conf in bench_configs(args.method, export, plan.k).items():
        prop = build_proposer(SpecConfig.from_dict(conf), 4096, target=lm)
        got[name] = dict(replay_records(prop, lm, records, int(conf["num_speculative_tokens"]), plan.bench_tokens),
                         config=conf)
        say(f"replay: {name} mean acceptance length {got[name]['mean_acceptance_length']:.3f} on {heldout.name} "
            "(greedy decoding replayed on the target's states: what bench --fixed-k measures)")
    write_json(result, got)
    return got


def stage_bench(args, plan: Plan, out: Path, export: str, concurrency: int = 1) -> dict:
    """``specctl bench`` on the held-out prompts, one request at a time (OUT/bench.json), or ``concurrency``
    requests decoding together, twice as many prompts as slots so that the batch stays full
    (OUT/bench-c<N>.json)."""
    result = out / ("bench.json" if concurrency == 1 else f"bench-c{concurrency}.json")
    if result.is_file():
        say(f"bench: done earlier ({result})")
        return json.loads(result.read_text())
    configs = bench_configs(args.method, export, plan.k)
    n = plan.bench_prompts if concurrency == 1 else 2 * concurrency
    cmd = [sys.executable, "-m", "specctl.cli", "bench", "--model", args.model, "-n", str(n),
           "--max-new-tokens", str(plan.bench_tokens), "--json"]
    if concurrency > 1:
        cmd += ["-c", str(concurrency)]
    for w in HELD_OUT:
        cmd += ["-w", w]
    for c in configs.values():
        cmd += ["--speculative-config", json.dumps(c)]
    say("bench: " + " ".join(cmd[2:]))
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        sys.exit(f"bench: exited with {proc.returncode}; run the recipe again to redo the bench")
    report = json.loads(proc.stdout)
    write_json(result, report)
    return report


def speedups(report: dict) -> dict:
    """{workload: {label: speedup over plain}} (plain's own row left out)."""
    out: dict = {}
    for r in report.get("results", []):
        if r.get("speedup") is not None and r.get("k") is not None:
            out.setdefault(r["workload"], {})[r["method"]] = round(r["speedup"], 3)
    return out


def acceptance(report: dict) -> dict:
    """{workload: {label: mean acceptance length}} and whether every output equalled plain's."""
    out: dict = {}
    for r in report.get("results", []):
        if r.get("mean_acceptance_length") is not None:
            out.setdefault(r["workload"], {})[r["method"]] = round(r["mean_acceptance_length"], 3)
    return out


def identical_to_plain(report: dict) -> bool:
    """Whether every compared output equalled plain decoding's (``identical_to_baseline`` counts the
    requests that did; None where outputs were not compared, as when sampling)."""
    return all(r.get("identical_to_baseline") is None or r["identical_to_baseline"] == r.get("requests")
               for r in report.get("results", []))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a catalogue target (qwen2.5-coder-0.5b, ...) or a folder")
    ap.add_argument("--method", required=True, choices=("eagle3", "medusa", "mtp"))
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--quick", action="store_true", help="the short recipe (about an hour for a 0.5B on 2 cores): fewer prompts and steps")
    ap.add_argument("--steps", type=int, help="override the plan's optimizer steps")
    ap.add_argument("--lr", type=float, help="override the method's learning rate")
    ap.add_argument("--read-conversations", type=int, help="EAGLE-3: override how many ShareGPT conversations the "
                    "target reads (more data for a run that has stopped improving: with --steps, the run resumes on them)")
    ap.add_argument("--more-answers", type=int, help="more ShareGPT prompts the target answers greedily (from the "
                    "back of the list, apart from every other range): its own answers, for a run that has stopped "
                    "improving on read data; with --steps, the run resumes on them")
    ap.add_argument("--until", choices=("data", "train", "bench"), default="bench", help="stop after this stage")
    ap.add_argument("--states-from", type=Path, help="Medusa, MTP: train on an EAGLE-3 recipe run's data, reading the "
                    "target's states from its cache (no data stage, no pass of the target)")
    args = ap.parse_args()
    plan = QUICK if args.quick else FULL
    if args.steps:
        plan.steps = args.steps
    if args.read_conversations is not None:
        plan.read_conversations = args.read_conversations
    if args.more_answers is not None:
        plan.more_answers = args.more_answers
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    from specctl.models import resolve_model

    import torch  # noqa: F401  (fails early when the environment lacks it)
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(resolve_model(args.model, dtype="bfloat16"))
    H, L = cfg.hidden_size, cfg.num_hidden_layers
    states = state_tokens(plan, args.method) * (3 * H + H) * 2  # bytes: bf16 aux + hidden
    free = shutil.disk_usage(out).free
    say(f"recipe {args.method} for {args.model} ({L} layers, hidden {H}) in {out}: "
        f"{'quick' if args.quick else 'full'} plan {json.dumps(asdict(plan))}")
    secs = budget(plan, args.method, L, H)
    if args.states_from:
        secs["data"] = 0.0  # another run's
    say(f"budget on a 2-core CPU: ~{sum(secs.values()) / 60:.0f} min ("
        + ", ".join(f"{k} {v / 60:.0f}" for k, v in secs.items() if v) + f" min, at the rates measured on {RATES_SEEN_ON[cpu_rates()[0]]}); "
        f"disk ~{(states + 2e8) / 2**30:.1f} GiB (states {states / 2**30:.1f} GiB), {free / 2**30:.0f} GiB free")
    write_json(out / "plan.json", {"model": args.model, "method": args.method, **asdict(plan)})
    t0 = time.time()
    files = stage_data(args, plan, out)
    heldout = (args.states_from / "data" / "heldout.jsonl") if getattr(args, "states_from", None) else stage_heldout(args, plan, out)
    if args.until == "data":
        return
    summary = stage_train(args, plan, out, files)
    if args.until == "train":
        return
    export = export_of(summary)
    replayed = stage_replay(args, plan, out, export, heldout)
    report = stage_bench(args, plan, out, export)
    batched = stage_bench(args, plan, out, export, concurrency=8)
    print(json.dumps(dict(result(args, summary, report, batched, replayed), recipe_s=round(time.time() - t0, 1))))


def export_of(summary: dict) -> str:
    """The trained draft's folder: train-eagle's export, train-medusa's and train-mtp's output."""
    return summary.get("export") or summary["output"]


def result(args, summary: dict, report: dict, batched: dict, replayed: dict | None = None) -> dict:
    """The recipe's last line: the export, the training time and estimate, what bench measured."""
    ev = summary.get("eval") or {}  # Medusa's and MTP's held-out split; EAGLE-3's last evaluation is "final"
    final = summary.get("final") or {}
    # greedy decoding of the held-out answers replayed through the proposer (bench --fixed-k's figures): the
    # recipe's own replay stage, else train-eagle's at its end
    replay = replayed or final.get("replay") or {}
    estimate = ((replay.get("chain") or {}).get("mean_acceptance_length") or final.get("decoding_acceptance_length")
                or ev.get("acceptance_length", ev.get("mean_acceptance_length")))
    tree = (replay.get("tree") or {}).get("mean_acceptance_length")
    return {"export": export_of(summary), "train_s": summary.get("wall_s") or summary.get("seconds") or summary.get("recipe_train_s"), "training_estimate": estimate,
            **({"training_estimate_tree": tree} if tree is not None else {}),
            "method": args.method, "model": args.model, "cpu": report.get("header", {}).get("machine"),
            "mean_acceptance_length": acceptance(report),
            "speedup": {"concurrency 1": speedups(report), "concurrency 8": speedups(batched)},
            "identical_to_plain": identical_to_plain(report) and identical_to_plain(batched)}


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
