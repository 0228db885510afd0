"""Medusa heads (Cai et al., arXiv 2401.10774): the module, its losses and metrics, and the trainer.

Index convention (the proposer's and vLLM's): for a sequence x[0:T] the target's final-normed hidden
state h_t at position t is what its LM head reads to predict x[t+1]. Medusa head k (0-based) reads
the same h_t and predicts x[t+k+2]: with the decode loop's ``hidden`` (the row that produced the
last emitted token ``last`` = x[t+1]), head 0 drafts the token after ``last``, head 1 the one after
that, and so on. Worked: T = 6, K = 2 heads, response = x[3:6]. Row t = 1 trains head 0 on x[3] and
head 1 on x[4]; row t = 3 trains head 0 on x[5] and head 1 on nothing (x[6] does not exist); row
t = 0 trains head 1 on x[3] only (x[2] is prompt).

Head k: a residual block x + SiLU(W x) (``num_layers`` of them; W zero-initialised, so a fresh head
is the identity) followed by an LM head initialised from the target's. Medusa-1 keeps the target
frozen: the loss is sum_k 0.8^k CE_k. Medusa-2 (``joint``) trains the target too, through LoRA
(peft): loss = CE_base + 0.2 * sum_k 0.8^k CE_k. With ``soft_labels`` CE_k is taken against the
target's own distribution at position t+k+1 (p over x[t+k+2]) instead of the token in the data.

Metrics (teacher-forced, greedy): head k at row t is right when its top-1 equals the target's argmax
at t+k+1; chain acceptance length = 1 + E[number of leading heads that are right], exactly what
greedy chain drafting with k = K accepts when the data is the target's own greedy output.

Training runs the same code in one process or under ``accelerate launch`` (Accelerator: device,
DDP, bf16 autocast); each process trains on its shard of the sequences, all take the same steps.
What it does not know: the CLI, the network and its file layouts (``specctl.drafts.medusa``), the data formats
(``specctl.training.data``), verification.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from specctl.drafts.medusa import MedusaHeads

HEAD_DECAY = 0.8  # weight of head k's loss: HEAD_DECAY ** k
JOINT_HEADS_WEIGHT = 0.2  # Medusa-2: loss = CE_base + 0.2 * heads' loss
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# --------------------------------------------------------------------------- losses and metrics

def head_weights(num_heads: int, decay: float = HEAD_DECAY) -> list[float]:
    return [decay ** k for k in range(num_heads)]


def head_ce_sums(logits: torch.Tensor, targets: torch.Tensor, teacher: torch.Tensor | None = None) -> torch.Tensor:
    """Per-head summed cross-entropy over valid rows.

    logits [N, K, V'] (head rows); targets [N, K] LM-head rows, -1 = not trained; teacher [N, K, V']
    probabilities (soft labels) or None (the targets are the labels). Returns [K] sums (fp32).
    """
    valid = targets >= 0  # [N, K]
    logp = torch.log_softmax(logits.float(), -1)  # [N, K, V']
    if teacher is None:
        ce = -logp.gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)  # [N, K]
    else:
        ce = -(teacher * logp).sum(-1)  # [N, K]
    return torch.where(valid, ce, torch.zeros_like(ce)).sum(0)


def chain_acceptance(right: torch.Tensor) -> torch.Tensor:
    """right [N, K] bool: head k right at row n -> [N] accepted drafts of a greedy chain (leading run)."""
    return torch.cumprod(right.int(), -1).sum(-1)


# --------------------------------------------------------------------------- config

@dataclass
class MedusaTrainConfig:
    """Every setting of a train-medusa run; saved as training_config.json beside every checkpoint.
    CLI flags map one to one onto fields (``specctl train-medusa --help``)."""

    model: str
    """Target model: an HF folder, a .gguf file or a catalogue name."""
    output: str
    """Run folder: the exported heads (vLLM layout) at its root, checkpoints/ and data/ inside."""
    data: list[str] = field(default_factory=list)
    """Training data files (.jsonl/.json: prompt+response, messages, ShareGPT conversations, text; .txt; folders)."""
    self_distill: list[str] = field(default_factory=list)
    """Prompt sources the target answers itself (a .jsonl/.txt prompt file, or a workload name: code-edit, chat)."""
    hold_out: int = 8
    """For workload names in self_distill: the first N prompts (seed 0, what `specctl bench -n N` runs) are never trained on."""
    distill_max_prompts: int | None = None
    """Answer at most the first N prompts of each self_distill source (after the hold-out)."""
    distill_max_new_tokens: int = 256
    """Tokens the target writes per self-distilled response."""
    distill_temperature: float = 0.0
    """0 = greedy self-distillation; > 0 samples (seeded)."""
    distill_samples: int = 1
    """Sampled answers per prompt, decoded together as one batch (needs distill_temperature > 0)."""
    num_heads: int = 3
    """K, the number of heads (draft tokens per step)."""
    num_layers: int = 1
    """Residual blocks per head (vLLM num_hidden_layers)."""
    fc_bias: bool = False
    """Bias in the residual blocks (vLLM medusa_fc_bias)."""
    shared_lm_head: bool = False
    """All heads read through one frozen copy of the target's LM head (vLLM original_lm_head)."""
    truncated_vocab_size: int | None = None
    """Heads score only the N most frequent response tokens (vLLM truncated_vocab_size + token_map)."""
    soft_labels: bool = False
    """Train against the target's distribution at each position instead of the data's tokens."""
    joint: bool = False
    """Medusa-2: train the target too, through LoRA (loss = CE_base + 0.2 x heads' loss)."""
    lora_rank: int = 8
    lora_alpha: int = 16
    base_lr: float | None = None
    """Joint: learning rate of the LoRA weights (default lr / 4)."""
    epochs: float = 2.0
    """Passes over the training data (ignored when steps is set)."""
    steps: int | None = None
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup: float = 0.05
    """Fraction of the steps with a linear warm-up; then cosine decay to 10% of lr."""
    max_grad_norm: float = 1.0
    batch_size: int = 8
    """Sequences per step and process (frozen base: as many positions as that many sequences hold on average)."""
    seq_len: int = 1024
    """Longest training sequence in tokens (longer ones are cut)."""
    seed: int = 0
    eval_split: float = 0.05
    """Fraction of the sequences held out for evaluation."""
    eval_every: int = 0
    """Evaluate every N steps (0: at each checkpoint and at the end)."""
    save_every: int = 0
    """Checkpoint every N steps (0: only at the end)."""
    keep_checkpoints: int = 2
    dtype: str = "bfloat16"
    """Target dtype for self-distillation and hidden states; bf16 also turns on bf16 autocast for the heads."""
    export_dtype: str | None = None
    """Dtype of the exported heads (default: dtype)."""
    resume: bool = False
    """Continue from the latest checkpoint in output/checkpoints."""

    # settings that must not change between a checkpoint and --resume
    RESUME_KEYS = ("data", "self_distill", "hold_out", "distill_max_prompts", "distill_samples", "num_heads", "num_layers", "fc_bias", "shared_lm_head",
                   "truncated_vocab_size", "soft_labels", "joint", "lora_rank", "seq_len", "seed", "eval_split",
                   "batch_size")

    def validated(self) -> "MedusaTrainConfig":
        from specctl.errors import UsageError

        def need(ok: bool, problem: str, fix: str):
            if not ok:
                raise UsageError(problem, fix)

        need(bool(self.data or self.self_distill), "no training data", "pass --data FILE and/or --self-distill PROMPTS")
        for name, lo in (("num_heads", 1), ("num_layers", 1), ("batch_size", 1), ("seq_len", 8), ("lora_rank", 1),
                         ("distill_max_new_tokens", 1), ("keep_checkpoints", 0), ("hold_out", 0),
                         ("save_every", 0), ("eval_every", 0)):
            v = getattr(self, name)
            need(isinstance(v, int) and v >= lo, f"--{name.replace('_', '-')} must be an integer >= {lo}, got {v}",
                 f"pass --{name.replace('_', '-')} {max(lo, 1)} or more")
        need(self.distill_max_prompts is None or self.distill_max_prompts >= 1,
             f"--distill-max-prompts must be >= 1, got {self.distill_max_prompts}", "pass e.g. --distill-max-prompts 32")
        need(self.steps is None or self.steps >= 1, f"--steps must be >= 1, got {self.steps}", "pass e.g. --steps 500")
        need(self.epochs > 0, f"--epochs must be > 0, got {self.epochs}", "pass e.g. --epochs 2")
        need(self.lr > 0, f"--lr must be > 0, got {self.lr}", "pass e.g. --lr 1e-3")
        need(0 <= self.eval_split < 1, f"--eval-split must be in [0, 1), got {self.eval_split}", "pass e.g. --eval-split 0.05")
        need(0 <= self.warmup < 1, f"--warmup must be in [0, 1), got {self.warmup}", "pass e.g. --warmup 0.05")
        need(self.distill_temperature >= 0, "--distill-temperature must be >= 0", "use 0 for greedy")
        need(isinstance(self.distill_samples, int) and self.distill_samples >= 1, "--distill-samples must be >= 1",
             "pass e.g. --distill-samples 4")
        need(self.distill_samples == 1 or self.distill_temperature > 0, "several answers per prompt need sampling",
             "set --distill-temperature > 0 (e.g. 0.7) with --distill-samples")
        need(self.truncated_vocab_size is None or self.truncated_vocab_size >= 2,
             f"--truncated-vocab-size must be >= 2, got {self.truncated_vocab_size}", "pass e.g. --truncated-vocab-size 8192")
        need(not (self.joint and self.shared_lm_head), "--joint and --shared-lm-head do not go together",
             "the shared LM head is the target's own, which --joint changes; drop one of them")
        from specctl.runtime.runner import parse_dtype

        parse_dtype(self.dtype)
        if self.export_dtype:
            parse_dtype(self.export_dtype)
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def lr_lambda(total: int, warmup: float) -> Callable[[int], float]:
    """Linear warm-up over warmup*total steps, then cosine from 1 down to 0.1."""
    w = max(1, int(round(warmup * total)))

    def f(step: int) -> float:
        if step < w:
            return (step + 1) / w
        t = min(1.0, (step - w) / max(1, total - w))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))

    return f


ProgressFn = Callable[[str, int, int], None]  # (phase, done, total)


def _noop(*_a, **_k) -> None:
    return None


# --------------------------------------------------------------------------- features (frozen base)

@dataclass
class Features:
    """Everything Medusa-1 needs from the frozen target, computed once per sequence."""

    hidden: torch.Tensor  # [P, H] final-normed hidden states of every position of every sequence
    rows: torch.Tensor  # [M] long: rows of `hidden` (positions t) that train at least one head
    targets: torch.Tensor  # [M, K] long: vocab id of x[t+k+2], -1 where head k has nothing to learn at t

    @property
    def num_positions(self) -> int:
        return int(self.rows.numel())


def head_targets(ids: torch.Tensor, mask: torch.Tensor, K: int) -> torch.Tensor:
    """ids [T], mask [T] bool (response tokens) -> [T, K]: x[t+k+2] where it exists and is in the response, else -1."""
    T = ids.numel()
    out = torch.full((T, K), -1, dtype=torch.long)
    for k in range(K):
        j = torch.arange(T) + k + 2
        ok = j < T
        jj = j[ok]
        out[ok, k] = torch.where(mask[jj], ids[jj], torch.full_like(ids[jj], -1))
    return out


@torch.inference_mode()
def extract_features(model, examples: list, K: int, seq_len: int, progress: ProgressFn = _noop) -> Features:
    """Run the frozen target (the own runtime's Transformer) over each example once."""
    from specctl.runtime.runner import TargetRunner

    runner = TargetRunner(model, max_len=seq_len)
    hidden, rows, targets, base = [], [], [], 0
    for i, ex in enumerate(examples):
        ids = torch.tensor(ex.input_ids[:seq_len], dtype=torch.long)
        mask = torch.tensor(ex.loss_mask[:seq_len], dtype=torch.bool)
        runner.reset()
        runner.forward(ids[None].to(runner.device), logits="none")
        hidden.append(runner.last_hidden[0].to("cpu"))
        tg = head_targets(ids, mask, K)
        keep = (tg >= 0).any(-1).nonzero().flatten()
        rows.append(keep + base)
        targets.append(tg[keep])
        base += ids.numel()
        progress("features", i + 1, len(examples))
    H = model.args.hidden_size
    return Features(torch.cat(hidden) if hidden else torch.zeros(0, H), torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long),
                    torch.cat(targets) if targets else torch.zeros(0, K, dtype=torch.long))


@torch.no_grad()
def target_argmax(hidden: torch.Tensor, head_weight: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """[P, H] hidden states -> [P] the target's greedy token at each (fp32 scores)."""
    w = head_weight.float()
    return torch.cat([(hidden[i:i + chunk].to(w.device).float() @ w.T).argmax(-1).cpu()
                      for i in range(0, hidden.shape[0], chunk)]) if hidden.shape[0] else torch.zeros(0, dtype=torch.long)


# --------------------------------------------------------------------------- the trainer

def train(cfg: MedusaTrainConfig, log: Callable[[str], None] = _noop, progress: ProgressFn = _noop) -> dict:
    """Run a whole train-medusa job (data, self-distillation, training, checkpoints, export)."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    from specctl.errors import UsageError
    from specctl.models import resolve_model
    from specctl.runtime.runner import load_model, parse_dtype
    from specctl.training import data as D
    from specctl.drafts import medusa as M
    from specctl.training import checkpoints as C

    cfg.validated()
    t0 = time.perf_counter()
    bf16 = parse_dtype(cfg.dtype) == torch.bfloat16
    acc = Accelerator(mixed_precision="bf16" if bf16 else "no", cpu=not torch.cuda.is_available())
    main, rank, world = acc.is_main_process, acc.process_index, acc.num_processes
    log = log if main else _noop
    progress = progress if main else _noop
    set_seed(cfg.seed)
    out = Path(cfg.output)
    ckpts = C.checkpoint_dirs(out)
    resume_from = ckpts[-1] if (cfg.resume and ckpts) else None
    if ckpts and not cfg.resume:
        raise UsageError(f"{out} already holds checkpoints (latest {ckpts[-1].name})",
                         "pass --resume to continue that run, or choose another --output")
    state = {}
    if resume_from is not None:
        state = json.loads((resume_from / "trainer_state.json").read_text())
        old = json.loads((resume_from / C.TRAINING_CONFIG).read_text())
        for key in cfg.RESUME_KEYS:
            if old.get(key) != getattr(cfg, key):
                raise UsageError(f"--resume: {key} was {old.get(key)!r} in {resume_from.name}, now {getattr(cfg, key)!r}",
                                 f"resume with the same --{key.replace('_', '-')}, or start a new --output")
        log(f"resuming from {resume_from} (step {state['step']})")
    elif cfg.resume:
        log(f"--resume: no checkpoint in {out / C.CHECKPOINTS}; starting a new run")

    records = [r for p in cfg.data for r in D.read_records(p)]  # bad data fails before the model loads
    path = resolve_model(cfg.model, dtype=cfg.dtype)
    log(f"loading target {path} ({cfg.dtype}, {acc.device})")
    loaded = load_model(path, dtype=cfg.dtype, device=str(acc.device))
    with acc.main_process_first():  # one process writes the self-distillation cache, the others read it
        examples = D.build_examples(cfg, loaded, out / "data", log=log, progress=progress, records=records)
    train_ex, eval_ex = D.split(examples, cfg.eval_split, cfg.seed)
    train_ex, eval_ex = train_ex[rank::world], eval_ex[rank::world]
    if not train_ex:
        raise UsageError("no training sequences left after the eval split", "pass more data or a smaller --eval-split")
    log(f"{len(train_ex)} training / {len(eval_ex)} eval sequences per process "
        f"({sum(sum(e.loss_mask) for e in train_ex)} response tokens)")

    head_w = loaded.model.head_weight
    if resume_from is not None:
        heads = M.load_medusa(resume_from, dtype=torch.float32)
        heads.requires_grad_(True)
        if heads.shared_lm_head:
            heads.lm_heads.requires_grad_(False)
    else:
        token_map = None
        if cfg.truncated_vocab_size and cfg.truncated_vocab_size < loaded.model.args.vocab_size:
            token_map = D.top_tokens(examples, cfg.truncated_vocab_size, loaded.model.args.vocab_size,
                                     always=list(loaded.stop_token_ids))
            log(f"truncated vocabulary: {token_map.numel()} tokens cover "
                f"{D.coverage(examples, token_map):.1%} of the response tokens")
        a = loaded.model.args
        heads = MedusaHeads(a.hidden_size, a.vocab_size, cfg.num_heads, cfg.num_layers, cfg.fc_bias,
                            cfg.shared_lm_head, token_map)
        heads.init_lm_heads(head_w.float())
    heads.train()
    runner = _JointRun if cfg.joint else _FrozenRun
    run = runner(cfg, acc, loaded, path, heads, train_ex, eval_ex, log, progress)
    summary = run.fit(state, resume_from)

    export_dtype = parse_dtype(cfg.export_dtype or cfg.dtype)
    if main:
        notes = {"base_model": str(path), "trained_with": "specctl train-medusa", "joint": cfg.joint}
        if summary["eval"].get("rank_accuracy"):  # held-out accuracy of each head's top-R tokens: "auto" trees
            notes["rank_accuracy"] = summary["eval"]["rank_accuracy"]
        if cfg.joint:
            notes["base_dir"] = "base"  # the fine-tuned target these heads belong to
            run.export_base(out / "base")
        M.save_medusa(run.heads, out, export_dtype, notes)
        C.write_training_config(out, cfg.to_dict())
        summary["wall_s"] = round(time.perf_counter() - t0, 1)
        (out / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        log(f"exported {cfg.num_heads} heads to {out}")
    acc.wait_for_everyone()
    summary.setdefault("wall_s", round(time.perf_counter() - t0, 1))
    return summary


class _Run:
    """Shared loop: optimizer, schedule, steps, eval and checkpoints. Subclasses feed batches."""

    def __init__(self, cfg, acc, loaded, path, heads, train_ex, eval_ex, log, progress):
        self.cfg, self.acc, self.loaded, self.path, self.log, self.progress = cfg, acc, loaded, path, log, progress
        self.heads, self.train_ex, self.eval_ex = heads, train_ex, eval_ex
        self.weights = head_weights(cfg.num_heads)

    # subclasses: setup() -> (module to optimize, param groups, steps per epoch); step(step) -> loss; evaluate() -> dict
    def fit(self, state: dict, resume_from: Path | None) -> dict:
        cfg, acc = self.cfg, self.acc
        module, groups, spe = self.setup()
        spe = int(acc.gather(torch.tensor([spe], device=acc.device)).min())  # every process takes the same steps
        total = cfg.steps or max(1, math.ceil(cfg.epochs * spe))
        self.steps_per_epoch = spe
        opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(total, cfg.warmup))
        step, history = 0, []
        if resume_from is not None:
            self.load_extra(resume_from)
            st = torch.load(resume_from / "optimizer.pt", map_location="cpu", weights_only=False)
            opt.load_state_dict(st["optimizer"])
            sched.load_state_dict(st["scheduler"])
            torch.set_rng_state(st["torch_rng"])
            step, history = state["step"], state["history"]
        self.module, self.opt = acc.prepare(module, opt)
        self.first_loss = state.get("first_loss")
        self.log(f"training {cfg.num_heads} Medusa heads ({'Medusa-2, LoRA' if cfg.joint else 'Medusa-1, frozen target'}): "
                 f"{total} steps, {spe} per epoch, lr {cfg.lr}")
        last, t_loop = {}, time.perf_counter()
        while step < total:
            loss = self.step(step)
            params = [p for g in groups for p in g["params"]]
            if cfg.max_grad_norm > 0:
                acc.clip_grad_norm_(params, cfg.max_grad_norm)
            self.opt.step()
            sched.step()
            self.opt.zero_grad(set_to_none=True)
            step += 1
            self.first_loss = loss if self.first_loss is None else self.first_loss
            last = {"step": step, "loss": round(loss, 5), "lr": sched.get_last_lr()[0]}
            self.progress("train", step, total)
            if step % max(1, total // 20) == 0 or step == total:
                self.log(f"step {step}/{total} loss {loss:.4f} ({time.perf_counter() - t_loop:.0f}s)")
            ckpt = cfg.save_every and (step % cfg.save_every == 0 or step == total)  # the end too: --resume can extend a run
            if (cfg.eval_every and step % cfg.eval_every == 0) or ckpt or step == total:
                ev = self.evaluate() if self.eval_ex else {}
                history.append({**last, **{f"eval_{k}": v for k, v in ev.items()}})
                if ev:
                    self.log(f"eval @ {step}: loss {ev['loss']:.4f}, top-1 per head {ev['top1_per_head']}, "
                             f"acceptance length {ev['acceptance_length']:.3f}")
            if ckpt:
                self._checkpoint(step, history, opt, sched)
        self.heads = acc.unwrap_model(self.module) if not self.cfg.joint else self.joint_heads()
        ev = history[-1] if history else {}
        return {"output": str(self.cfg.output), "steps": step, "epochs": round(step / spe, 3),
                "train_sequences": len(self.train_ex), "eval_sequences": len(self.eval_ex),
                "first_loss": self.first_loss, "final_loss": last.get("loss"),
                "eval": {k.removeprefix("eval_"): v for k, v in ev.items() if k.startswith("eval_")},
                "history": history, "mode": "medusa-2" if cfg.joint else "medusa-1"}

    def _checkpoint(self, step, history, opt, sched) -> None:
        from specctl.drafts import medusa as M
        from specctl.training import checkpoints as C

        acc = self.acc
        acc.wait_for_everyone()
        if acc.is_main_process:
            heads = acc.unwrap_model(self.module) if not self.cfg.joint else self.joint_heads()

            def write(d: Path):
                M.save_medusa(heads, d, torch.float32)  # fp32 master weights: resume is exact
                torch.save({"optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                            "torch_rng": torch.get_rng_state()}, d / "optimizer.pt")
                self.save_extra(d)
                C.write_training_config(d, self.cfg.to_dict())
                (d / "trainer_state.json").write_text(json.dumps({"step": step, "history": history,
                                                                  "first_loss": self.first_loss}, indent=2))

            path = C.save_checkpoint(self.cfg.output, step, write, self.cfg.keep_checkpoints)
            self.log(f"checkpoint {path}")
        acc.wait_for_everyone()

    def load_extra(self, folder: Path) -> None:
        pass

    def save_extra(self, folder: Path) -> None:
        pass

    def _perm(self, n: int, epoch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + epoch * 7919 + self.acc.process_index)
        return torch.randperm(n, generator=g)


class _FrozenRun(_Run):
    """Medusa-1: the target's hidden states are computed once; a step trains on random positions."""

    CHUNK_ELEMENTS = 1 << 25  # logits elements per micro-batch (memory bound; the step's loss is exact)

    def setup(self):
        cfg, K = self.cfg, self.cfg.num_heads
        self.log("computing the target's hidden states")
        model = self.loaded.model
        self.train_f = extract_features(model, self.train_ex, K, cfg.seq_len, self.progress)
        self.eval_f = extract_features(model, self.eval_ex, K, cfg.seq_len, self.progress) if self.eval_ex else None
        h = self.heads
        self.teacher_w = self.loaded.model.head_weight if h.token_map is None else \
            self.loaded.model.head_weight[h.token_map.to(self.loaded.model.head_weight.device)]  # [V', H]
        self.train_rows_t = h.rows_of(self.train_f.targets)  # [M, K] LM-head rows
        per_seq = max(1, round(self.train_f.num_positions / max(1, len(self.train_ex))))
        self.batch_positions = cfg.batch_size * per_seq
        self.chunk = max(16, self.CHUNK_ELEMENTS // (K * self.teacher_w.shape[0]))
        spe = max(1, math.ceil(self.train_f.num_positions / self.batch_positions))
        self.log(f"{self.train_f.num_positions} training positions, {self.batch_positions} per step")
        trainable = [p for p in h.parameters() if p.requires_grad]
        return h.to(self.acc.device), [{"params": trainable}], spe

    def _teacher(self, f: Features, rows: torch.Tensor) -> torch.Tensor:
        """[n] rows -> [n, K, V'] the target's distribution over x[t+k+2] (at position t+k+1)."""
        K, P = self.cfg.num_heads, f.hidden.shape[0]
        idx = (rows[:, None] + torch.arange(1, K + 1)[None]).clamp(max=P - 1)  # [n, K]
        w = self.teacher_w
        hid = f.hidden[idx].to(w.device, w.dtype)  # [n, K, H]
        return torch.softmax((hid @ w.T).float(), -1)

    def _loss(self, f: Features, sel: torch.Tensor, tgt_rows: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dev = self.acc.device
        x = f.hidden[f.rows[sel]].to(dev).float()  # [n, H]
        logits = self.module(x)  # [n, K, V']
        teacher = self._teacher(f, f.rows[sel]).to(dev) if self.cfg.soft_labels else None
        sums = head_ce_sums(logits, tgt_rows.to(dev), teacher)  # [K]
        w = torch.tensor(self.weights, device=dev)
        return (w * sums / counts.clamp(min=1)).sum(), logits

    def step(self, step: int) -> float:
        e, i = divmod(step, self.steps_per_epoch)
        perm = self._perm(self.train_f.num_positions, e)
        sel = perm[i * self.batch_positions:(i + 1) * self.batch_positions]
        tgt = self.train_rows_t[sel]
        counts = (tgt >= 0).sum(0).float().to(self.acc.device)  # [K] rows per head in the whole step
        chunks = sel.split(self.chunk)
        total = 0.0
        for j, c in enumerate(chunks):
            ctx = self.acc.no_sync(self.module) if j + 1 < len(chunks) else contextlib.nullcontext()
            with ctx:
                loss, _ = self._loss(self.train_f, c, self.train_rows_t[c], counts)
                self.acc.backward(loss)
            total += float(loss.detach())
        return total

    @torch.no_grad()
    def evaluate(self) -> dict:
        f, K, h = self.eval_f, self.cfg.num_heads, self.acc.unwrap_model(self.module)
        if f is None or f.num_positions == 0:
            return {}
        h.eval()
        greedy = target_argmax(f.hidden, self.loaded.model.head_weight)  # [P] the target's choice at each position
        tgt_rows = h.rows_of(f.targets)
        counts = (tgt_rows >= 0).sum(0).float().to(self.acc.device)
        loss, ranks, valid = 0.0, [], []
        for c in torch.arange(f.num_positions).split(self.chunk):
            l, logits = self._loss(f, c, tgt_rows[c], counts)
            loss += float(l)
            R = min(RANKS, logits.shape[-1])
            top = h.vocab_ids(logits.topk(R, -1).indices).cpu()  # [n, K, R] each head's R best tokens
            idx = (f.rows[c][:, None] + torch.arange(1, K + 1)[None]).clamp(max=f.hidden.shape[0] - 1)
            ranks.append(top == greedy[idx][..., None])  # [n, K, R]: rank r is the target's choice
            valid.append(f.targets[c] >= 0)
        h.train()
        return _metrics(loss, torch.cat(ranks), torch.cat(valid))


RANKS = 10  # rank accuracies kept per head (Medusa's tree construction reads them)


def _metrics(loss: float, ranks: torch.Tensor, valid: torch.Tensor) -> dict:
    """ranks [N, K, R] (head k's rank-r token is the target's choice), valid [N, K]: per-head top-1 and
    rank accuracies over valid rows; chain acceptance over rows where all K are valid."""
    right = ranks[..., 0]
    n = valid.sum(0).clamp(min=1).float()  # [K]
    rank_acc = ((ranks & valid[..., None]).sum(0).float() / n[:, None])  # [K, R]
    top1 = [round(float(x), 4) for x in rank_acc[:, 0]]
    full = valid.all(-1)
    acc_len = 1.0 + float(chain_acceptance(right[full]).float().mean()) if bool(full.any()) else 1.0
    return {"loss": round(loss, 5), "top1_per_head": top1, "acceptance_length": round(acc_len, 4),
            "rank_accuracy": [[round(float(x), 4) for x in row] for row in rank_acc],
            "positions": int(valid.any(-1).sum())}


class _Joint(nn.Module):
    """Medusa-2: the LoRA-wrapped target (transformers) and the heads, trained together."""

    def __init__(self, peft_model, heads: MedusaHeads):
        super().__init__()
        self.peft_model, self.heads = peft_model, heads

    def forward(self, ids: torch.Tensor, attn: torch.Tensor):  # ids, attn: [B, T]
        inner = self.peft_model.get_base_model()
        h = inner.model(input_ids=ids, attention_mask=attn).last_hidden_state  # [B, T, H] final-normed
        return inner.lm_head(h), self.heads(h)  # [B, T, V], [B, T, K, V']


class _JointRun(_Run):
    """Medusa-2: sequences in padded batches through the LoRA-wrapped target and the heads."""

    def setup(self):
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        cfg = self.cfg
        hf = AutoModelForCausalLM.from_pretrained(str(self.path), dtype=torch.float32)
        names = {n.rsplit(".", 1)[-1] for n, _ in hf.named_modules()}
        targets = [t for t in LORA_TARGETS if t in names]
        lcfg = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=0.0, target_modules=targets, bias="none")
        pm = get_peft_model(hf, lcfg)
        self.joint = _Joint(pm, self.heads)
        lora = [p for n, p in pm.named_parameters() if p.requires_grad]
        groups = [{"params": [p for p in self.heads.parameters() if p.requires_grad]},
                  {"params": lora, "lr": cfg.base_lr or cfg.lr / 4}]
        return self.joint, groups, max(1, math.ceil(len(self.train_ex) / cfg.batch_size))

    def load_extra(self, folder: Path) -> None:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        set_peft_model_state_dict(self.joint.peft_model, load_file(str(folder / "adapter.safetensors")))

    def save_extra(self, folder: Path) -> None:
        from peft import get_peft_model_state_dict
        from safetensors.torch import save_file

        pm = self.acc.unwrap_model(self.module).peft_model
        save_file({k: v.contiguous() for k, v in get_peft_model_state_dict(pm).items()}, str(folder / "adapter.safetensors"))

    def joint_heads(self) -> MedusaHeads:
        return self.acc.unwrap_model(self.module).heads

    def _batch(self, exs: list):
        T = min(self.cfg.seq_len, max(len(e.input_ids) for e in exs))
        ids = torch.zeros(len(exs), T, dtype=torch.long)
        attn = torch.zeros(len(exs), T, dtype=torch.long)
        mask = torch.zeros(len(exs), T, dtype=torch.bool)
        for b, e in enumerate(exs):
            n = min(T, len(e.input_ids))
            ids[b, :n] = torch.tensor(e.input_ids[:n])
            attn[b, :n] = 1
            mask[b, :n] = torch.tensor(e.loss_mask[:n], dtype=torch.bool)
        return ids, attn, mask

    def _loss(self, exs: list):
        dev, K = self.acc.device, self.cfg.num_heads
        ids, attn, mask = (t.to(dev) for t in self._batch(exs))
        base_logits, head_logits = self.module(ids, attn)  # [B, T, V], [B, T, K, V']
        B, T = ids.shape
        nxt = torch.where(mask[:, 1:], ids[:, 1:], torch.full_like(ids[:, 1:], -100))
        base_ce = F.cross_entropy(base_logits[:, :-1].float().reshape(-1, base_logits.shape[-1]), nxt.reshape(-1),
                                  ignore_index=-100)
        tg = torch.stack([head_targets(ids[b].cpu(), mask[b].cpu(), K) for b in range(B)]).to(dev)  # [B, T, K]
        rows = self.joint_heads_rows(tg)
        sums = head_ce_sums(head_logits.reshape(B * T, K, -1), rows.reshape(B * T, K))
        counts = (rows >= 0).reshape(-1, K).sum(0).clamp(min=1)
        heads_loss = (torch.tensor(self.weights, device=dev) * sums / counts).sum()
        return base_ce + JOINT_HEADS_WEIGHT * heads_loss, base_logits, head_logits, tg

    def joint_heads_rows(self, tg: torch.Tensor) -> torch.Tensor:
        return self.joint.heads.rows_of(tg)

    def step(self, step: int) -> float:
        e, i = divmod(step, self.steps_per_epoch)
        perm = self._perm(len(self.train_ex), e)
        exs = [self.train_ex[int(j)] for j in perm[i * self.cfg.batch_size:(i + 1) * self.cfg.batch_size]]
        loss = self._loss(exs)[0]
        self.acc.backward(loss)
        return float(loss.detach())

    @torch.no_grad()
    def evaluate(self) -> dict:
        K, bs = self.cfg.num_heads, self.cfg.batch_size
        self.module.eval()
        loss, right, valid, n = 0.0, [], [], 0
        for s in range(0, len(self.eval_ex), bs):
            exs = self.eval_ex[s:s + bs]
            l, base_logits, head_logits, tg = self._loss(exs)
            loss += float(l) * len(exs)
            n += len(exs)
            greedy = base_logits.argmax(-1)  # [B, T] the (fine-tuned) target's choice
            B, T = greedy.shape
            idx = (torch.arange(T, device=greedy.device)[:, None] + torch.arange(1, K + 1, device=greedy.device)).clamp(max=T - 1)
            want = greedy[:, idx]  # [B, T, K] argmax at t+k+1
            R = min(RANKS, head_logits.shape[-1])
            top = self.joint.heads.vocab_ids(head_logits.topk(R, -1).indices)  # [B, T, K, R]
            right.append((top == want[..., None]).reshape(-1, K, R).cpu())
            valid.append((tg >= 0).reshape(-1, K).cpu())
        self.module.train()
        return _metrics(loss / max(1, n), torch.cat(right), torch.cat(valid))

    def export_base(self, folder: Path) -> None:
        """The fine-tuned target (LoRA merged) as a plain HF folder, with the tokenizer."""
        import copy

        pm = self.acc.unwrap_model(self.module).peft_model
        merged = copy.deepcopy(pm).merge_and_unload()
        merged.save_pretrained(str(folder))
        self.loaded.tokenizer.save_pretrained(str(folder))
        gen = Path(self.path) / "generation_config.json"
        if gen.is_file():
            (folder / "generation_config.json").write_text(gen.read_text())
