"""`specctl train-medusa`: train Medusa heads on a target and export them in vLLM's layout.

Thin: parse the flags into a MedusaTrainConfig, call ``specctl.training.medusa.train``, render the
summary. Progress and logs on stderr, the summary on stdout (``--json`` for machines).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from specctl.commands._options import DtypeOpt, JsonOpt, ModelOpt, SeedOpt

HELP = """Train Medusa heads (arXiv 2401.10774) on a target model and export them in the layout vLLM loads.

Head k reads the target's last hidden state and predicts the token k+2 positions ahead; each is a
residual block (zero-initialised) and an LM head initialised from the target's. Medusa-1 (default)
keeps the target frozen; --joint (Medusa-2) trains it too through LoRA and exports the merged target
to OUTPUT/base. Data: --data files (prompt/response, messages or ShareGPT conversations, text) and/or
--self-distill prompts the target answers itself (a .jsonl/.txt prompt file, or a workload name:
code-edit, chat; their first --hold-out prompts, the ones `specctl bench -n N` runs, are left out).

OUTPUT gets the heads (config.json + model.safetensors, vLLM's Medusa layout, with
training_config.json), checkpoints/ (every --save-every steps, atomic; --resume continues from the
latest) and data/self_distill.jsonl (answers are cached there as they are written). Runs unchanged
under `accelerate launch` on several devices. Progress on stderr; the summary on stdout.

Examples:

  specctl train-medusa --model smollm2-135m --self-distill chat --self-distill code-edit --num-heads 3 --output heads/

  specctl train-medusa -m ./my-model --data sharegpt.json --num-heads 4 --epochs 2 --save-every 200 --output run/ --json

  specctl bench --model smollm2-135m --speculative-config '{"method": "medusa", "model": "heads/", "num_speculative_tokens": 3}'
"""


def train_medusa(
    output: Annotated[Path, typer.Option("--output", "-o", help="Run folder: exported heads at its root, checkpoints/ and data/ inside.")],
    model: ModelOpt = None,
    data: Annotated[Optional[list[str]], typer.Option("--data", "-d", help="Training data: .jsonl/.json records, .txt, or a folder (repeatable).")] = None,
    self_distill: Annotated[Optional[list[str]], typer.Option("--self-distill", help="Prompts the target answers itself: a .jsonl/.txt file or a workload name (repeatable).")] = None,
    num_heads: Annotated[int, typer.Option("--num-heads", "-K", help="Number of heads (draft tokens per step).")] = 3,
    num_layers: Annotated[int, typer.Option("--num-layers", help="Residual blocks per head.")] = 1,
    epochs: Annotated[float, typer.Option("--epochs", help="Passes over the training data (unless --steps).")] = 2.0,
    steps: Annotated[Optional[int], typer.Option("--steps", help="Optimizer steps (overrides --epochs).")] = None,
    lr: Annotated[float, typer.Option("--lr", help="Peak learning rate (linear warm-up, cosine decay to 10%).")] = 1e-3,
    batch_size: Annotated[int, typer.Option("--batch-size", "-b", help="Sequences per step and device.")] = 8,
    seq_len: Annotated[int, typer.Option("--seq-len", help="Longest training sequence in tokens.")] = 1024,
    eval_split: Annotated[float, typer.Option("--eval-split", help="Fraction of sequences held out for evaluation.")] = 0.05,
    eval_every: Annotated[int, typer.Option("--eval-every", help="Evaluate every N steps (0: at checkpoints and the end).")] = 0,
    save_every: Annotated[int, typer.Option("--save-every", help="Checkpoint every N steps (0: only the final export).")] = 0,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from the latest checkpoint in OUTPUT/checkpoints.")] = False,
    joint: Annotated[bool, typer.Option("--joint", help="Medusa-2: train the target too, through LoRA.")] = False,
    lora_rank: Annotated[int, typer.Option("--lora-rank", help="--joint: LoRA rank.")] = 8,
    shared_lm_head: Annotated[bool, typer.Option("--shared-lm-head", help="All heads share one frozen copy of the target's LM head (vLLM original_lm_head).")] = False,
    truncated_vocab_size: Annotated[Optional[int], typer.Option("--truncated-vocab-size", help="Heads score only the N most frequent response tokens (vLLM token_map).")] = None,
    soft_labels: Annotated[bool, typer.Option("--soft-labels", help="Learn the target's distribution at each position, not the data's tokens.")] = False,
    hold_out: Annotated[int, typer.Option("--hold-out", help="Workload prompts never trained on (the first N, seed 0).")] = 8,
    distill_max_prompts: Annotated[Optional[int], typer.Option("--distill-max-prompts", help="Answer at most the first N prompts of each --self-distill source.")] = None,
    distill_max_new_tokens: Annotated[int, typer.Option("--distill-max-new-tokens", help="Tokens per self-distilled answer.")] = 256,
    distill_temperature: Annotated[float, typer.Option("--distill-temperature", help="0 = greedy self-distillation.")] = 0.0,
    distill_samples: Annotated[int, typer.Option("--distill-samples", help="Sampled answers per prompt, decoded as one batch (with --distill-temperature > 0).")] = 1,
    seed: SeedOpt = 0,
    dtype: DtypeOpt = "bfloat16",
    json_out: JsonOpt = False,
) -> None:
    from rich.console import Console

    from specctl.models import DEFAULT_MODEL
    from specctl.training.medusa import MedusaTrainConfig

    cfg = MedusaTrainConfig(
        model=model or DEFAULT_MODEL, output=str(output), data=list(data or []), self_distill=list(self_distill or []),
        hold_out=hold_out, distill_max_prompts=distill_max_prompts, distill_max_new_tokens=distill_max_new_tokens, distill_temperature=distill_temperature, distill_samples=distill_samples,
        num_heads=num_heads, num_layers=num_layers, shared_lm_head=shared_lm_head,
        truncated_vocab_size=truncated_vocab_size, soft_labels=soft_labels, joint=joint, lora_rank=lora_rank,
        lora_alpha=2 * lora_rank, epochs=epochs, steps=steps, lr=lr, batch_size=batch_size, seq_len=seq_len,
        seed=seed, eval_split=eval_split, eval_every=eval_every, save_every=save_every, dtype=dtype, resume=resume,
    ).validated()

    err = Console(stderr=True)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from specctl.training.medusa import train

    with Progress(TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), TimeRemainingColumn(), console=err, transient=True,
                  disable=not err.is_terminal) as prog:
        tasks: dict[str, int] = {}

        def progress(phase: str, done: int, total: int) -> None:
            if phase not in tasks:
                tasks[phase] = prog.add_task(phase, total=total)
            prog.update(tasks[phase], completed=done, total=total)

        summary = train(cfg, log=lambda m: err.log(m), progress=progress)

    if json_out:
        typer.echo(json.dumps(summary, indent=2))
        return
    render(summary)


def render(s: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"Medusa heads → {s['output']}", title_justify="left", show_header=False)
    t.add_column("", style="bold", no_wrap=True)
    t.add_column("")
    t.add_row("mode", s["mode"])
    t.add_row("steps", f"{s['steps']} ({s['epochs']} epochs, {s['train_sequences']} training sequences)")
    t.add_row("loss", f"{s['first_loss']:.4f} → {s['final_loss']:.4f}" if s["first_loss"] is not None else "—")
    ev = s.get("eval") or {}
    if ev:
        t.add_row("held-out top-1 per head", " ".join(f"{x:.3f}" for x in ev["top1_per_head"]))
        t.add_row("held-out acceptance length", f"{ev['acceptance_length']:.3f} (greedy chain, teacher-forced, "
                                                f"{ev['positions']} positions)")
    t.add_row("wall time", f"{s['wall_s']:.0f} s")
    Console().print(t)


def register(app: typer.Typer) -> None:
    app.command("train-medusa", help=HELP)(train_medusa)
