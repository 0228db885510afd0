"""EAGLE-3 / EAGLE-1 training: the config, the draft's initialisation, and the run.

A run: the training sequences (``load_examples``: --data records, then the target's answers to
--self-distill prompts), a fresh draft (``build_draft``: EAGLE-3's LM head rows from the target's,
d2t/t2d from token frequencies), then optimizer steps of training-time test (``eagle_ttt``) over
global batches (``loop``: one process or many under ``accelerate launch``, DDP, --grad-accum),
checkpoints through ``accelerator.save_state``, held-out evaluation, the export in the layout vLLM
loads, its model card, and --push-to-hub. The target's states come from ``eagle_states``.

What it does not know: the CLI, the network and its files (``specctl.drafts.eagle``, ``eagle_files``), verification.
"""

from __future__ import annotations

import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from specctl.drafts.eagle import EagleDraft, spec_from_target
from specctl.drafts.eagle_files import export_eagle
from specctl.errors import DataError
from specctl.training import checkpoints as C
from specctl.training import loop as L
from specctl.training.eagle_states import StateSource, batches
from specctl.training.eagle_ttt import TttLoss, evaluate, step_counts, to_device

LEGACY_CHECKPOINT = Path("checkpoint") / "state.pt"  # before checkpoints/: one torch.save'd dict


@dataclass
class EagleTrainConfig(L.TrainConfig):
    """Every setting of a train-eagle run (saved as training_config.json beside every checkpoint);
    the shared ones are ``TrainConfig``'s."""

    TRAINER = "train-eagle"  # a class attribute (no annotation): not a setting
    version: int = 3
    """3 = EAGLE-3, 1 = EAGLE-1."""
    draft_vocab_size: int | None = None
    """EAGLE-3 reduced draft vocabulary N (default min(32000, V))."""
    ttt_steps: int | None = None
    """Training-time-test steps (default 4 for EAGLE-3, 1 for EAGLE-1)."""
    aux_layers: tuple[int, ...] | None = None
    """EAGLE-3 target layers whose inputs feed fc (default (2, L//2, L-3))."""
    cache_hidden_states: str | None = None
    """Folder of safetensors shards with the target's states, computed once and reused."""
    prompt_rows: float = 0.1
    """Fraction of the non-answer rows (prompt tokens of chat records) unrolled and learnt each step;
    answer rows (and all of a plain text) always are. < 1 spends the compute on the answers."""
    fc_init: str | None = None
    """EAGLE-3 fc initialisation: last (the default: the identity on the deepest aux layer, zeros elsewhere, so
    the draft starts in the space the LM head reads), or random."""
    feature_loss: float = 0.0
    """EAGLE-3: weight of a smooth-L1 loss between the draft's final-normed state and the target's at the
    position it predicts from, beside the soft CE (0: none, SpecForge's loss)."""
    autocast: bool | None = None
    """Run the draft's matmuls in bfloat16 (autocast; weights and optimizer stay fp32). None: where the target
    runs in bf16 on a device that multiplies bf16 natively (CUDA; a CPU with AVX512-BF16 or AMX)."""
    replay_k: int = 3
    """At the end, greedy decoding of the held-out answers is replayed through the proposer (a chain of this
    many draft tokens, and EAGLE-2's tree of at most 16 nodes): the mean acceptance lengths bench measures on
    those prompts (replay). 0: skip it."""
    # train-eagle's own defaults of shared settings: what the recipe found best (benchmarks/draft_recipe.py,
    # docs/results: Qwen2.5-Coder-0.5B and SmolLM2-135M on 2 CPU cores). lr 1e-3 at 4 sequences a step, where
    # SpecForge's 1e-4 is for a global batch of 64 or more; 768 tokens holds most of a ShareGPT turn and its answer
    lr: float = 1e-3
    batch_size: int = 4
    seq_len: int = 768
    eval_every: int = 50
    save_every: int = 50

    RESUME_KEYS = L.TrainConfig.RESUME_KEYS + ("version", "draft_vocab_size", "ttt_steps", "aux_layers", "fc_init")
    EVAL_DATA_REPLACES_SPLIT = True  # with --eval-data every training sequence trains

    def validated(self) -> "EagleTrainConfig":
        L.need(self.version in (1, 3), f"--version must be 3 or 1, got {self.version}", "use --version 3 (EAGLE-3) or --version 1")
        super().validated()
        if self.ttt_steps is None:
            self.ttt_steps = 4 if self.version == 3 else 1
        L.at_least(self, "ttt_steps", 1)
        L.need(self.fc_init in (None, "random", "last"), f"--fc-init must be random or last, got {self.fc_init}",
               "use --fc-init last or random")
        L.at_least(self, "replay_k", 0)
        L.need(self.feature_loss >= 0 and (self.version == 3 or not self.feature_loss),
               f"--feature-loss must be >= 0 and is for EAGLE-3, got {self.feature_loss} (version {self.version})",
               "e.g. --feature-loss 0.1 with --version 3")
        L.folder_option("--cache-hidden-states", self.cache_hidden_states)
        L.need(0.0 <= self.prompt_rows <= 1.0, f"--prompt-rows must be in [0, 1], got {self.prompt_rows}", "e.g. --prompt-rows 0.2")
        L.need(self.draft_vocab_size is None or self.draft_vocab_size >= 1,
               f"--draft-vocab-size must be positive, got {self.draft_vocab_size}", "e.g. --draft-vocab-size 32000")
        if self.version == 1:  # EAGLE-1's fc reads (embedding, feature) and it scores the target's whole vocabulary
            for flag, given in (("--draft-vocab-size", self.draft_vocab_size is not None),
                                ("--aux-layers", self.aux_layers is not None), ("--fc-init", self.fc_init is not None)):
                L.need(not given, f"{flag} is an EAGLE-3 option: EAGLE-1 (--version 1) has no use for it",
                       f"drop {flag}, or train EAGLE-3 (--version 3)")
        elif self.fc_init is None:
            self.fc_init = "last"
        if self.aux_layers is not None:
            self.aux_layers = tuple(self.aux_layers)
        return self


def load_examples(cfg: EagleTrainConfig, loaded, log: Callable[[str], None],
                  progress: Callable[[str, int, int], None] = lambda *a: None,
                  records: list | None = None) -> tuple[list[list[int]], list[list[int]]]:
    """Training sequences (token ids, at most seq_len) and their learnt-token masks: --data records
    (``records``: already read), then the target's answers to --self-distill prompts
    (``specctl.training.data``: formats, chat templates, the answer cache; records that carry exact
    ``prompt_ids``/``response_ids`` keep them).

    Every position has a target distribution (EAGLE's loss is against it), prompts included; the
    mask says which tokens are answers, the rows ``--prompt-rows`` < 1 concentrates on.
    """
    from specctl.training import data as D

    ex = D.build_examples(cfg, loaded, log=log, progress=progress, records=records)
    if len(ex) < 2:
        raise DataError("fewer than 2 usable sequences in the training data", "pass more data (each record needs >= 4 tokens)")
    seqs, masks = [e.input_ids for e in ex], [list(e.loss_mask) for e in ex]
    log(f"{len(seqs)} sequences, {sum(map(len, seqs))} tokens ({sum(map(sum, masks))} answer tokens)")
    return seqs, masks


def load_sequences(cfg: EagleTrainConfig, loaded, log: Callable[[str], None]) -> list[list[int]]:
    """The token ids of ``load_examples``."""
    return load_examples(cfg, loaded, log)[0]


def build_draft(target, cfg: EagleTrainConfig, seqs: list[list[int]], tok) -> EagleDraft:
    """A fresh draft: lm_head rows and norm from the target's (EAGLE-3), d2t/t2d from token frequencies."""
    from specctl.drafts.draft_vocab import reduced_vocab_from_counts

    a = target.args
    n = min(cfg.draft_vocab_size or 32000, a.vocab_size) if cfg.version == 3 else a.vocab_size
    spec = spec_from_target(a, cfg.version, n, cfg.aux_layers)
    draft = EagleDraft(spec)
    if cfg.version == 3:
        counts = torch.zeros(a.vocab_size, dtype=torch.int64)
        for s in seqs:
            t = torch.tensor([i for i in s if i < a.vocab_size], dtype=torch.int64)
            counts.index_add_(0, t, torch.ones_like(t))
        always = [i for i in (getattr(tok, "all_special_ids", None) or []) if i < a.vocab_size]
        vocab = reduced_vocab_from_counts(counts, n, always)
        with torch.no_grad():
            draft.d2t.copy_(vocab.d2t)
            draft.t2d.copy_(vocab.t2d)
            draft.lm_head.weight.copy_(target.head_weight[vocab.target_ids].float())
            draft.norm.weight.copy_(target.norm.weight.float())
            if cfg.fc_init == "last":  # start from the deepest aux state: already in the space the LM head reads
                H = a.hidden_size
                draft.fc.weight.zero_()
                draft.fc.weight[:, -H:] = torch.eye(H)
    return draft



def replay(draft, loaded, source, idx: list[int], k: int, log) -> dict:
    """The held-out answers decoded greedily through the proposer, the target replaced by its cached states
    (``specctl.training.replay``): a chain of k and EAGLE-2's tree, as bench will run them."""
    from specctl.training.replay import TREE, replay_eagle

    t = time.perf_counter()
    out = {"chain": dict(replay_eagle(draft, loaded, source, idx, k), k=k),
           "tree": dict(replay_eagle(draft, loaded, source, idx, TREE["num_speculative_tokens"], TREE), **TREE)}
    log(f"held-out answers decoded greedily (the target's states replayed): mean acceptance length "
        f"{out['chain']['mean_acceptance_length']:.2f} with a chain of {k}, {out['tree']['mean_acceptance_length']:.2f} "
        f"with a tree of at most {TREE['speculative_num_draft_tokens']} nodes ({time.perf_counter() - t:.0f} s)")
    return out


def export_dir(cfg: EagleTrainConfig, model_path: str | Path | None = None) -> Path:
    """Where the draft goes: output itself when its name says eagle3 (eagle), else output/<target>-eagle3."""
    out, tag = Path(cfg.output), "eagle3" if cfg.version == 3 else "eagle"
    if tag in out.name.lower():
        return out
    return out / f"{Path(model_path or cfg.model).name}-{tag}"


def _stderr(m: str) -> None:
    print(m, file=sys.stderr)


def train(cfg: EagleTrainConfig, loaded=None, log: Callable[[str], None] = _stderr, command: str | None = None,
          progress: Callable[[str, int, int], None] = lambda *a: None) -> dict:
    """Run a whole training; returns the summary (metrics, export folder, timings). ``loaded``: the
    target already loaded (a LoadedModel); ``command``: the command line for the model card; ``progress``:
    (phase, done, total) for a progress bar (self-distillation, training steps)."""
    from specctl.models import resolve_model
    from specctl.runtime.loading import load_model
    from specctl.training import data as D

    cfg.validated()
    t_start = time.perf_counter()
    acc = L.accelerator(cfg)
    main = acc.is_main_process
    log = log if main else (lambda m: None)
    progress = progress if main else (lambda *a: None)
    L.check_push(cfg, acc)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    out = Path(cfg.output)
    resume_from = L.resume_point(cfg, log, legacy=out / LEGACY_CHECKPOINT)
    records = [r for p in cfg.data for r in D.read_records(p)]  # bad data fails before the model loads
    held_records = [r for p in cfg.eval_data for r in D.read_records(p, flag="--eval-data")]
    if loaded is None:
        path = resolve_model(cfg.model, dtype=cfg.dtype)
        log(f"loading target {path}")
        loaded = load_model(path, dtype=cfg.dtype, device=str(acc.device))
    path, target, dev = Path(loaded.path), loaded.model, acc.device
    V = target.args.vocab_size
    L.need(cfg.draft_vocab_size is None or cfg.draft_vocab_size <= V,
           f"--draft-vocab-size {cfg.draft_vocab_size} is more than the target's vocabulary ({V} tokens)",
           f"pass at most {V}, or leave it out (the default is min(32000, {V}))")
    with acc.main_process_first():  # one process writes the self-distillation cache, the others read it
        seqs, masks = load_examples(cfg, loaded, log, progress, records=records)
    rng = random.Random(cfg.seed)
    order = list(range(len(seqs)))
    rng.shuffle(order)
    n_eval = 0 if cfg.eval_split == 0 else max(1, int(round(cfg.eval_split * len(seqs))))
    eval_idx, train_idx = sorted(order[:n_eval]), order[n_eval:]
    n_train = len(seqs)
    if cfg.eval_data:  # evaluated on, never trained on: every training sequence trains
        held = [e for r in held_records for e in D.encode(loaded.tokenizer, r, cfg.seq_len, loaded.stop_token_ids)]
        L.need(bool(held), f"--eval-data {', '.join(cfg.eval_data)} has no sequence with tokens to learn",
               "give records with answers (e.g. the target's answers to bench's prompts)")
        log(f"evaluating on {len(held)} sequence(s) of --eval-data, training on all {n_train}")
        seqs, masks = seqs + [e.input_ids for e in held], masks + [list(e.loss_mask) for e in held]
        eval_idx, train_idx = list(range(n_train, len(seqs))), order

    draft = build_draft(target, cfg, seqs[:n_train], loaded.tokenizer).to(dev)
    spec = draft.spec
    key = {"model": str(path.resolve()), "version": cfg.version, "aux_layers": list(spec.aux_layers),
           "seq_len": cfg.seq_len, "dtype": cfg.dtype}
    with acc.main_process_first():  # one process writes the states cache
        source = StateSource(target, seqs, tuple(spec.aux_layers) if cfg.version == 3 else (), cfg.cache_hidden_states,
                             key, log, masks=masks)
    embed_w, head_w = target.embed.weight.to(dev), target.head_weight.to(dev)  # the draft reads them where it runs
    lengths = [len(x) for x in seqs]
    gbs = L.global_batch_size(cfg, acc)
    steps_per_epoch = len(batches(train_idx, lengths, gbs, 0))
    total = cfg.steps or max(1, math.ceil(cfg.epochs * steps_per_epoch))
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=cfg.lr, betas=(0.9, 0.95),
                            weight_decay=cfg.weight_decay)
    sched = L.warmup_cosine(opt, total, cfg.warmup)
    model, opt = acc.prepare(TttLoss(draft, embed_w, head_w, cfg.ttt_steps, cfg.feature_loss), opt)
    acc.register_for_checkpointing(sched)
    step, history, losses = 0, [], []
    if resume_from is not None and resume_from.name == LEGACY_CHECKPOINT.name:
        st = torch.load(resume_from, map_location="cpu", weights_only=False)
        draft.load_state_dict(st["draft"])
        opt.load_state_dict(st["opt"])
        sched.load_state_dict(st["sched"])
        step, history = st["step"], st["history"]
    elif resume_from is not None:
        state = C.load_checkpoint(resume_from, acc)
        L.check_global_batch(state, gbs)
        step, history, losses = state["step"], state["history"], state["losses"]

    def save(step: int) -> None:
        def write(d: Path) -> None:
            C.write_training_config(d, cfg.to_dict())
            C.write_trainer_state(d, {"step": step, "history": history, "losses": losses, "global_batch": gbs})

        log(f"checkpoint {C.save_checkpoint(out, step, write, cfg.keep_checkpoints, acc=acc)}")

    def run_eval() -> dict:
        draft.eval()
        r = evaluate(draft, embed_w, head_w, source, eval_idx, cfg.ttt_steps, cfg.batch_size) if eval_idx else {}
        draft.train()
        return r

    log(f"training EAGLE-{cfg.version}: {len(train_idx)} train / {len(eval_idx)} eval sequences, {total} steps of "
        f"{gbs} sequences ({acc.num_processes} process(es) x {cfg.grad_accum} micro-batch(es) of {cfg.batch_size}), "
        f"ttt {cfg.ttt_steps}, draft vocab {spec.draft_vocab_size}, aux layers {list(spec.aux_layers)}")
    bf16 = L.autocast_on(cfg, dev)
    model.train()
    t_loop, last, epoch_batches = time.perf_counter(), {}, (None, [])
    while step < total:
        epoch, pos = divmod(step, steps_per_epoch)  # the place in the data follows from the step: resume is exact
        if epoch_batches[0] != epoch:
            epoch_batches = (epoch, batches(train_idx, lengths, gbs, cfg.seed * 1000 + epoch))
        parts = [(to_device(source.batch(items, cfg.prompt_rows, cfg.seed * 1_000_003 + step), dev), w)
                 for items, w in L.shares(epoch_batches[1][pos], acc)]
        # each TTT step's loss is a mean over the scored rows of the whole global batch
        den = L.reduce_sum(acc, torch.stack([step_counts(draft, st, cfg.ttt_steps) * w for st, w in parts]).sum(0))
        scale = acc.num_processes * acc.gradient_accumulation_steps  # undoes DDP's mean and accelerate's 1/grad_accum
        step_loss = torch.zeros((), device=dev)
        for st, w in parts:
            with acc.accumulate(model):
                with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
                    loss, stats = model(st, den)
                L.backward_step(acc, model, opt, loss, w * scale, cfg.max_grad_norm)
                step_loss += w * loss.detach().float()
        sched.step()
        step += 1
        progress("train", step, total)
        losses.append(float(L.reduce_sum(acc, step_loss)))
        last = {"step": step, "loss": losses[-1],
                "train_acc": [c / r if r else 0.0 for c, r in zip(stats["correct"], stats["rows"])]}
        if step % 10 == 0 or step == total:
            log(f"step {step}/{total} loss {last['loss']:.3f} acc@0 {last['train_acc'][0]:.2f} "
                f"({time.perf_counter() - t_loop:.0f}s)")
        ckpt, evaluating = L.due(cfg, step, total)
        if evaluating:
            ev = run_eval()
            history.append(dict(last, **ev))
            if ev:
                log(f"eval @ {step}: per-position acceptance {[round(x, 3) for x in ev['acceptance_per_position']]}, "
                    f"mean acceptance length {ev['decoding_acceptance_length']:.2f} as greedy chain decoding of "
                    f"{cfg.ttt_steps} tokens walks the held-out answers ({ev['simulated_acceptance_length']:.2f} "
                    "averaged over every position)")
        if ckpt:
            save(step)
    export = export_dir(cfg, path)
    final = history[-1] if history else last
    if main and cfg.replay_k and eval_idx:
        final["replay"] = replay(draft, loaded, source, eval_idx, cfg.replay_k, log)
    ckpts = C.checkpoint_dirs(out)
    summary = {"version": cfg.version, "export": str(export), "checkpoint": str(ckpts[-1]) if ckpts else None,
               "steps": step, "train_sequences": len(train_idx), "eval_sequences": len(eval_idx),
               "draft_vocab_size": spec.draft_vocab_size, "aux_layers": list(spec.aux_layers), "ttt_steps": cfg.ttt_steps,
               "global_batch": gbs, "processes": acc.num_processes, "final": final, "losses": losses}
    if main:
        export_eagle(draft, export, loaded)
        C.write_training_config(out, cfg.to_dict())
        log(f"exported the draft to {export}")
        held_out = None
        if "acceptance_per_position" in final:
            acc_pos = final["acceptance_per_position"]
            held_out = {"mean_acceptance_length": final.get("decoding_acceptance_length",
                                                            final["simulated_acceptance_length"]),
                        "acceptance_rate": sum(acc_pos) / len(acc_pos),
                        "acceptance per position": [round(x, 4) for x in acc_pos],
                        "measured": f"teacher-forced greedy chains of {cfg.ttt_steps} on {len(eval_idx)} held-out "
                                    f"sequences ({final['eval_rows']} positions), not an end-to-end decode"}
        summary["hub"] = L.publish(export, cfg, method="eagle3" if cfg.version == 3 else "eagle", base_model=cfg.model,
                                   data=L.card_data(cfg, training_sequences=len(train_idx)), held_out=held_out,
                                   command=command or L.command_line("train-eagle", cfg), log=log,
                                   num_speculative_tokens=cfg.ttt_steps)
    summary["wall_s"] = round(time.perf_counter() - t_start, 1)
    if main:
        from specctl.files import write_json_atomic

        write_json_atomic(out / "train_summary.json", summary)
    acc.wait_for_everyone()
    return summary
