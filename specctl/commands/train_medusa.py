"""`specctl train-medusa`: train Medusa heads on a target and export them in vLLM's layout.

Thin: parse the flags into a MedusaTrainConfig (the options shared with the other trainers come from
``_train_options``), call ``specctl.training.medusa.train``, render the summary. Progress and logs on
stderr, the summary on stdout (``--json`` for machines).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from specctl.commands._train_options import (HOLD_OUT, BatchSizeOpt, DataOpt, DeviceOpt, DistillMaxPromptsOpt,
                                             DistillSamplesOpt, DistillTemperatureOpt, DtypeOpt, EpochsOpt, EvalEveryOpt,
                                             EvalSplitOpt, GradAccumOpt, HoldOutOpt, JsonOpt, LrOpt, MaxNewTokensOpt,
                                             ModelOpt, OldMaxNewTokensOpt, OutputOpt, PushToHubOpt, ResumeOpt,
                                             SaveEveryOpt, SeedOpt, SelfDistillOpt, SeqLenOpt, StepsOpt, command_line,
                                             config_from, main_process, progress_bars)

HELP = """Train Medusa heads (arXiv 2401.10774) on a target model and export them in the layout vLLM loads.

Head k reads the target's last hidden state and predicts the token k+2 positions ahead; each is a
residual block (zero-initialised) and an LM head initialised from the target's. Medusa-1 (default)
keeps the target frozen; --joint (Medusa-2) trains it too through LoRA and exports the merged target
to OUTPUT/base. Data: --data files (prompt/response, messages or ShareGPT conversations, text) and/or
--self-distill prompts the target answers itself (a .jsonl/.txt prompt file, or a workload name:
sharegpt, code-edit; their first --hold-out prompts, the ones `specctl bench -n N` runs, are left out).

OUTPUT gets the heads (config.json + model.safetensors, vLLM's Medusa layout, with
training_config.json and a model card, README.md), checkpoints/ (every --save-every steps, atomic;
--resume continues from the latest) and data/self_distill.jsonl (answers are cached there as they are
written). Runs unchanged under `accelerate launch` on several devices. Progress on stderr; the
summary on stdout.

Examples:

  specctl train-medusa --model smollm2-135m --self-distill sharegpt --distill-max-prompts 500 --self-distill code-edit --num-heads 3 --output heads/

  specctl train-medusa -m ./my-model --data sharegpt.json --num-heads 4 --epochs 2 --save-every 200 --output run/ --json

  specctl train-medusa -m qwen2.5-coder-0.5b --data answers.jsonl --seq-len 768 --cache-hidden-states eagle-run/states --truncated-vocab-size 8192 --shared-lm-head --output heads/   (the target's states from a train-eagle run on the same data)

  accelerate launch --num_processes 2 -m specctl.cli train-medusa -m ./my-model --data sharegpt.json --output run/ --push-to-hub me/my-medusa

  specctl bench --model smollm2-135m --speculative-config '{"method": "medusa", "model": "heads/", "num_speculative_tokens": 3}'
"""


def train_medusa(
    ctx: typer.Context,
    output: OutputOpt,
    model: ModelOpt = None,
    data: DataOpt = None,
    self_distill: SelfDistillOpt = None,
    num_heads: Annotated[int, typer.Option("--num-heads", "-K", help="Number of heads (draft tokens per step).")] = 3,
    num_layers: Annotated[int, typer.Option("--num-layers", help="Residual blocks per head.")] = 1,
    epochs: EpochsOpt = 2.0,
    steps: StepsOpt = None,
    lr: LrOpt = 1e-3,
    batch_size: BatchSizeOpt = 8,
    grad_accum: GradAccumOpt = 1,
    seq_len: SeqLenOpt = 1024,
    eval_split: EvalSplitOpt = 0.05,
    eval_every: EvalEveryOpt = 0,
    save_every: SaveEveryOpt = 0,
    resume: ResumeOpt = False,
    joint: Annotated[bool, typer.Option("--joint", help="Medusa-2: train the target too, through LoRA.")] = False,
    lora_rank: Annotated[int, typer.Option("--lora-rank", help="--joint: LoRA rank.")] = 8,
    shared_lm_head: Annotated[bool, typer.Option("--shared-lm-head", help="All heads share one frozen copy of the target's LM head (vLLM original_lm_head).")] = False,
    truncated_vocab_size: Annotated[Optional[int], typer.Option("--truncated-vocab-size", help="Heads score only the N most frequent response tokens (vLLM token_map).")] = None,
    soft_labels: Annotated[bool, typer.Option("--soft-labels", help="Learn the target's distribution at each position, not the data's tokens.")] = False,
    cache_hidden_states: Annotated[Optional[Path], typer.Option("--cache-hidden-states", help="Folder of the target's states, computed once and reused (train-eagle's, made on the same data, serves as is).")] = None,
    hold_out: HoldOutOpt = HOLD_OUT,
    distill_max_prompts: DistillMaxPromptsOpt = None,
    max_new_tokens: MaxNewTokensOpt = 256,
    distill_max_new_tokens: OldMaxNewTokensOpt = None,
    distill_temperature: DistillTemperatureOpt = 0.0,
    distill_samples: DistillSamplesOpt = 1,
    seed: SeedOpt = 0,
    dtype: DtypeOpt = "bfloat16",
    device: DeviceOpt = "auto",
    push_to_hub: PushToHubOpt = None,
    json_out: JsonOpt = False,
) -> None:
    from rich.console import Console

    from specctl.models import DEFAULT_MODEL
    from specctl.training.medusa import MedusaTrainConfig

    cfg = config_from(MedusaTrainConfig, locals(), model=model or DEFAULT_MODEL, lora_alpha=2 * lora_rank)
    err = Console(stderr=True)
    from specctl.training.medusa import train

    with progress_bars(err) as progress:
        summary = train(cfg, log=lambda m: err.log(m), progress=progress, command=command_line(ctx))

    if not main_process():
        return
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
    t.add_row("loss", f"{s['first_loss']:.4f} → {s['final_loss']:.4f}"
              if s["first_loss"] is not None and s["final_loss"] is not None else "—")
    ev = s.get("eval") or {}
    if ev:
        t.add_row("held-out top-1 per head", " ".join(f"{x:.3f}" for x in ev["top1_per_head"]))
        t.add_row("held-out acceptance length", f"{ev['acceptance_length']:.3f} (greedy chain, teacher-forced, "
                                                f"{ev['positions']} positions)")
    if s.get("target"):
        t.add_row("serve with target", f"{s['target']} (the fine-tuned target these heads belong to)")
    if s.get("hub"):
        t.add_row("pushed to", s["hub"])
    t.add_row("wall time", f"{s['wall_s']:.0f} s")
    Console().print(t)


def register(app: typer.Typer) -> None:
    app.command("train-medusa", help=HELP)(train_medusa)
