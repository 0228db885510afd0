"""`specctl train-eagle`: train an EAGLE-3 (default) or EAGLE-1 draft for a target, export it for vLLM/SGLang.

Thin: parse (the options shared with the other trainers come from ``_train_options``), build an
EagleTrainConfig, call ``specctl.training.eagle.train``, render the summary. Progress on stderr, the
summary on stdout (--json for machines).
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

HELP = """Train an EAGLE draft (one decoder layer reading the target's hidden states) and export it in the layout vLLM and SGLang load.

EAGLE-3 (default): fc over the target's layers (2, L//2, L-3), a reduced draft vocabulary (--draft-vocab-size, d2t/t2d from the data's token frequencies), training-time test over --ttt-steps steps against the target's distribution. EAGLE-1 (--version 1): fc over (embedding, feature), the target's LM head, feature regression + 0.1 CE.

The target's states are computed online, or once into safetensors shards with --cache-hidden-states DIR (reused across epochs and runs). Each evaluation (--eval-every) prints the per-position acceptance and the mean acceptance length greedy chain decoding would measure on the held-out split (or on --eval-data: give it the target's answers to bench's prompts and it is what `specctl bench` measures); checkpoints go to OUTPUT/checkpoints/step-NNNNNNN every --save-every steps (accelerate's save_state, atomic; --resume continues). Runs under `accelerate launch` unchanged: each step learns from --batch-size x processes x --grad-accum sequences, so the loss curve does not depend on how the batch is split.

The draft goes to OUTPUT when its name contains 'eagle3' ('eagle' for EAGLE-1), else to OUTPUT/<model>-eagle3, with a model card (README.md). Serve it with --speculative-config '{"method": "eagle3", "model": "DIR", "num_speculative_tokens": 4}'.

Examples:

  specctl train-eagle --model smollm2-135m --self-distill code-edit --hold-out 10 --output runs/smollm2-eagle3 --steps 400

  specctl train-eagle --model ./my-llama --data sharegpt.json --output runs/llama-eagle --version 1 --epochs 2 --json

  accelerate launch --num_processes 4 -m specctl.cli train-eagle --model ./my-llama --data sharegpt.json --output runs/llama-eagle3 --grad-accum 2 --push-to-hub me/llama-eagle3
"""


def train_eagle_cmd(
    ctx: typer.Context,
    output: OutputOpt,
    model: ModelOpt = None,
    data: DataOpt = None,
    self_distill: SelfDistillOpt = None,
    version: Annotated[int, typer.Option("--version", help="3 = EAGLE-3, 1 = EAGLE-1.")] = 3,
    draft_vocab_size: Annotated[Optional[int], typer.Option("--draft-vocab-size", help="EAGLE-3 reduced draft vocabulary (default min(32000, V)).")] = None,
    ttt_steps: Annotated[Optional[int], typer.Option("--ttt-steps", help="Training-time-test steps (default 4 for EAGLE-3, 1 for EAGLE-1).")] = None,
    aux_layers: Annotated[Optional[str], typer.Option("--aux-layers", help="EAGLE-3 target layers, comma separated (default 2,L//2,L-3).")] = None,
    epochs: EpochsOpt = 1.0,
    steps: StepsOpt = None,
    lr: LrOpt = 1e-3,
    batch_size: BatchSizeOpt = 4,
    grad_accum: GradAccumOpt = 1,
    seq_len: SeqLenOpt = 768,
    eval_split: EvalSplitOpt = 0.05,
    eval_data: Annotated[Optional[list[str]], typer.Option("--eval-data", help="Record files evaluated on, never trained on (repeatable; replaces --eval-split): e.g. the target's own greedy answers to the prompts `specctl bench` will run, so the acceptance printed is what bench measures.")] = None,
    eval_every: EvalEveryOpt = 50,
    save_every: SaveEveryOpt = 50,
    resume: ResumeOpt = False,
    hold_out: HoldOutOpt = HOLD_OUT,
    distill_max_prompts: DistillMaxPromptsOpt = None,
    max_new_tokens: MaxNewTokensOpt = 256,
    distill_max_new_tokens: OldMaxNewTokensOpt = None,
    distill_temperature: DistillTemperatureOpt = 0.0,
    distill_samples: DistillSamplesOpt = 1,
    prompt_rows: Annotated[float, typer.Option("--prompt-rows", help="Fraction of the prompt rows of chat records unrolled and learnt per step (answer rows always are); below 1 spends the compute on the answers.")] = 0.1,
    fc_init: Annotated[Optional[str], typer.Option("--fc-init", help="EAGLE-3 fc initialisation: last (the default: identity on the deepest aux layer, so the draft starts in the space the LM head reads), or random.", show_default=False)] = None,
    feature_loss: Annotated[float, typer.Option("--feature-loss", help="EAGLE-3: weight of a smooth-L1 loss pulling the draft's final-normed state toward the target's, beside the soft cross-entropy (0: none).")] = 0.0,
    replay_k: Annotated[int, typer.Option("--replay-k", help="At the end, decode the held-out answers greedily through the proposer, the target's states replayed: the mean acceptance length bench measures with a chain of this many draft tokens, and with EAGLE-2's tree of at most 16 nodes (0: skip).")] = 3,
    autocast: Annotated[Optional[bool], typer.Option("--autocast/--no-autocast", help="Run the draft's matmuls in bfloat16 (weights and optimizer stay fp32). Default: with a bf16 target (--dtype bfloat16) on CUDA or on a CPU with AVX512-BF16 or AMX, where bf16 is native.", show_default=False)] = None,
    cache_hidden_states: Annotated[Optional[Path], typer.Option("--cache-hidden-states", help="Folder for the target's states (safetensors shards), computed once.")] = None,
    seed: SeedOpt = 0,
    dtype: DtypeOpt = "float32",
    device: DeviceOpt = "auto",
    push_to_hub: PushToHubOpt = None,
    json_out: JsonOpt = False,
) -> None:
    from specctl.errors import UsageError
    from specctl.models import DEFAULT_MODEL
    from specctl.training.eagle import EagleTrainConfig

    aux = None
    if aux_layers:
        try:
            aux = tuple(int(x) for x in aux_layers.split(","))
        except ValueError:
            raise UsageError(f"--aux-layers '{aux_layers}' is not a comma-separated list of integers", "e.g. --aux-layers 2,15,27") from None
    cfg = config_from(EagleTrainConfig, locals(), model=model or DEFAULT_MODEL, aux_layers=aux)

    from rich.console import Console

    err = Console(stderr=True, log_path=False)
    from specctl.training.eagle import train

    with progress_bars(err) as progress:
        summary = train(cfg, log=err.log, command=command_line(ctx), progress=progress)
    if not main_process():
        return
    if json_out:
        typer.echo(json.dumps(summary, indent=2))
        return
    final = summary.get("final") or {}
    typer.echo(f"EAGLE-{summary['version']} draft: {summary['export']}")
    typer.echo(f"steps {summary['steps']} of {summary['global_batch']} sequences, {summary['train_sequences']} train / "
               f"{summary['eval_sequences']} eval sequences, draft vocab {summary['draft_vocab_size']}, aux layers "
               f"{summary['aux_layers']}, {summary['wall_s']} s")
    if "acceptance_per_position" in final:
        acc = ", ".join(f"{x:.2f}" for x in final["acceptance_per_position"])
        typer.echo(f"held-out per-position acceptance [{acc}], mean acceptance length "
                   f"{final.get('decoding_acceptance_length', final['simulated_acceptance_length']):.2f} as greedy "
                   f"decoding of {summary['ttt_steps']} draft tokens walks the held-out answers (what bench measures)")
    for name, r in (final.get("replay") or {}).items():
        shape = (f"a chain of {r['k']}" if name == "chain" else
                 f"a tree of at most {r['speculative_num_draft_tokens']} nodes, {r['num_speculative_tokens']} deep")
        typer.echo(f"held-out mean acceptance length {r['mean_acceptance_length']:.2f} with {shape} (greedy decoding "
                   f"replayed through the proposer on the target's states: what bench measures on those prompts)")
    if summary.get("hub"):
        typer.echo(f"pushed to {summary['hub']}")
    method = "eagle3" if summary["version"] == 3 else "eagle"
    typer.echo(f"use: --speculative-config '{{\"method\": \"{method}\", \"model\": \"{summary['export']}\", \"num_speculative_tokens\": 4}}'")


def register(app: typer.Typer) -> None:
    app.command("train-eagle", help=HELP, no_args_is_help=True)(train_eagle_cmd)
