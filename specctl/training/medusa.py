"""Medusa heads (Cai et al., arXiv 2401.10774): the train-medusa config and the run.

Head k reads the target's last hidden state and predicts the token k+2 positions ahead (the index
convention, losses and metrics are in ``medusa_losses``). Medusa-1 keeps the target frozen; Medusa-2
(``joint``) trains it too, through LoRA (peft). A run: the data (``specctl.training.data``: records
and self-distilled answers), fresh heads (zero-initialised residual blocks, LM heads from the
target's) or the checkpoint's, the loop (``medusa_runs``: one process or many under ``accelerate
launch``), then the export in vLLM's layout at the output folder's root, its model card, and
--push-to-hub.

What it does not know: the CLI, the network and its file layouts (``specctl.drafts.medusa``), verification.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from specctl.drafts.medusa import MedusaHeads
from specctl.training import loop as L
from specctl.training.medusa_losses import ProgressFn


def _noop(*_a, **_k) -> None:
    return None


@dataclass
class MedusaTrainConfig(L.TrainConfig):
    """Every setting of a train-medusa run (saved as training_config.json beside every checkpoint);
    the shared ones are ``TrainConfig``'s."""

    TRAINER = "train-medusa"  # a class attribute (no annotation): not a setting
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
    cache_hidden_states: str | None = None
    """Medusa-1: a folder of the target's states (train-eagle's --cache-hidden-states, made on the same data,
    sequence length and dtype, serves as is); the sequences it lacks are computed and added."""
    joint: bool = False
    """Medusa-2: train the target too, through LoRA (loss = CE_base + 0.2 x heads' loss)."""
    lora_rank: int = 8
    lora_alpha: int = 16
    base_lr: float | None = None
    """Joint: learning rate of the LoRA weights (default lr / 4)."""
    export_dtype: str | None = None
    """Dtype of the exported heads (default: dtype)."""
    # train-medusa's own defaults of shared settings
    epochs: float = 2.0
    seq_len: int = 1024
    dtype: str = "bfloat16"
    """Target dtype for self-distillation and hidden states; bf16 also turns on bf16 autocast for the heads."""

    RESUME_KEYS = L.TrainConfig.RESUME_KEYS + ("num_heads", "num_layers", "fc_bias", "shared_lm_head",
                                               "truncated_vocab_size", "soft_labels", "joint", "lora_rank", "batch_size")

    def validated(self) -> "MedusaTrainConfig":
        super().validated()
        for name, lo in (("num_heads", 1), ("num_layers", 1), ("lora_rank", 1)):
            L.at_least(self, name, lo)
        L.need(self.truncated_vocab_size is None or self.truncated_vocab_size >= 2,
               f"--truncated-vocab-size must be >= 2, got {self.truncated_vocab_size}", "pass e.g. --truncated-vocab-size 8192")
        # vLLM (0.32) sizes per-head LM heads to the whole vocabulary and cuts loaded heads to the token map,
        # then fails; it loads a truncated vocabulary only as one shared head (original_lm_head)
        L.need(self.truncated_vocab_size is None or self.shared_lm_head,
               "--truncated-vocab-size needs --shared-lm-head: vLLM loads a token_map only with one LM head shared by the heads",
               "add --shared-lm-head, or drop --truncated-vocab-size for a full-vocabulary LM head per head")
        L.need(not (self.joint and self.shared_lm_head), "--joint and --shared-lm-head do not go together",
               "the shared LM head is the target's own, which --joint changes; drop one of them")
        L.folder_option("--cache-hidden-states", self.cache_hidden_states)
        if self.export_dtype:
            from specctl.runtime.loading import parse_dtype

            parse_dtype(self.export_dtype)
        return self


def train(cfg: MedusaTrainConfig, log: Callable[[str], None] = _noop, progress: ProgressFn = _noop,
          command: str | None = None) -> dict:
    """Run a whole train-medusa job (data, self-distillation, training, checkpoints, export, model card).
    ``command``: the command line for the model card."""
    import json

    from accelerate.utils import set_seed

    from specctl.drafts import medusa as M
    from specctl.errors import UsageError
    from specctl.files import write_json_atomic
    from specctl.models import resolve_model
    from specctl.runtime.loading import load_model, parse_dtype
    from specctl.training import data as D
    from specctl.training.medusa_runs import _FrozenRun, _JointRun

    cfg.validated()
    t0 = time.perf_counter()
    acc = L.accelerator(cfg, mixed_precision="bf16" if parse_dtype(cfg.dtype) == torch.bfloat16 else "no")
    main, rank, world = acc.is_main_process, acc.process_index, acc.num_processes
    log = log if main else _noop
    progress = progress if main else _noop
    L.check_push(cfg, acc)
    set_seed(cfg.seed)
    out = Path(cfg.output)
    resume_from = L.resume_point(cfg, log)
    state = json.loads((resume_from / "trainer_state.json").read_text()) if resume_from is not None else {}

    records = [r for p in cfg.data for r in D.read_records(p)]  # bad data fails before the model loads
    path = resolve_model(cfg.model, dtype=cfg.dtype)
    log(f"loading target {path} ({cfg.dtype}, {acc.device})")
    loaded = load_model(path, dtype=cfg.dtype, device=str(acc.device))
    V = loaded.model.args.vocab_size
    L.need(cfg.truncated_vocab_size is None or cfg.truncated_vocab_size <= V,
           f"--truncated-vocab-size {cfg.truncated_vocab_size} is more than the target's vocabulary ({V} tokens)",
           f"pass at most {V}, or drop it to score the whole vocabulary")
    with acc.main_process_first():  # one process writes the self-distillation cache, the others read it
        examples = D.build_examples(cfg, loaded, log=log, progress=progress, records=records)
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
        if cfg.truncated_vocab_size and cfg.truncated_vocab_size < V:
            token_map = D.top_tokens(examples, cfg.truncated_vocab_size, V,
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
        ev = summary["eval"]
        if ev.get("rank_accuracy"):  # held-out accuracy of each head's top-R tokens: "auto" trees
            notes["rank_accuracy"] = ev["rank_accuracy"]
        if cfg.joint:
            notes["base_dir"] = "base"  # the fine-tuned target these heads belong to
            run.export_base(out / "base")
        M.save_medusa(run.heads, out, export_dtype, notes)
        from specctl.training import checkpoints as C

        C.write_training_config(out, cfg.to_dict())
        log(f"exported {cfg.num_heads} heads to {out}")
        held_out = None
        if ev.get("acceptance_length") is not None:
            held_out = {"mean_acceptance_length": ev["acceptance_length"],
                        "acceptance_rate": (ev["acceptance_length"] - 1) / cfg.num_heads,
                        "top-1 per head": ev["top1_per_head"],
                        "measured": f"teacher-forced greedy chains of {cfg.num_heads} heads over {ev['positions']} "
                                    "positions of the held-out sequences, not an end-to-end decode"}
        # Medusa-2: the heads belong to the fine-tuned target in base/, which is what to serve them with
        target = str((out / "base").resolve()) if cfg.joint else cfg.model
        if cfg.joint:
            summary["target"] = target
        summary["hub"] = L.publish(out, cfg, method="medusa", base_model=target, held_out=held_out,
                                   data=L.card_data(cfg, training_sequences=summary["train_sequences"] * world),
                                   command=command or L.command_line("train-medusa", cfg), log=log)
        summary["wall_s"] = round(time.perf_counter() - t0, 1)
        write_json_atomic(out / "train_summary.json", summary)
    acc.wait_for_everyone()
    summary.setdefault("wall_s", round(time.perf_counter() - t0, 1))
    return summary
