"""`specctl train-eagle`: train an EAGLE-3 (default) or EAGLE-1 draft for a target, export it for vLLM/SGLang.

Thin: parse, build an EagleTrainConfig, call ``specctl.training.eagle.train``, render the summary.
Progress on stderr, the summary on stdout (--json for machines).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from specctl.commands._options import DtypeOpt, JsonOpt, ModelOpt, SeedOpt

HELP = """Train an EAGLE draft (one decoder layer reading the target's hidden states) and export it in the layout vLLM and SGLang load.

EAGLE-3 (default): fc over the target's layers (2, L//2, L-3), a reduced draft vocabulary (--draft-vocab-size, d2t/t2d from the data's token frequencies), training-time test over --ttt-steps steps against the target's distribution. EAGLE-1 (--version 1): fc over (embedding, feature), the target's LM head, feature regression + 0.1 CE.

The target's states are computed online, or once into safetensors shards with --cache-hidden-states DIR (reused across epochs and runs). Each evaluation prints the per-position acceptance and the simulated acceptance length on the held-out split, and writes an atomic checkpoint (OUTPUT/checkpoint; --resume continues). Runs under `accelerate launch` unchanged.

The draft goes to OUTPUT when its name contains 'eagle3' ('eagle' for EAGLE-1), else to OUTPUT/<model>-eagle3. Serve it with --speculative-config '{"method": "eagle3", "model": "DIR", "num_speculative_tokens": 4}'.

Examples:

  specctl train-eagle --model smollm2-135m --self-distill code-edit --hold-out 10 --output runs/smollm2-eagle3 --steps 400

  specctl train-eagle --model ./my-llama --data sharegpt.json --output runs/llama-eagle --version 1 --epochs 2 --json
"""


def train_eagle_cmd(
    output: Annotated[Path, typer.Option("--output", "-o", help="Run folder (checkpoint/ and the exported draft).")],
    model: ModelOpt = None,
    data: Annotated[Optional[list[Path]], typer.Option("--data", "-d", help="Training data: .jsonl/.json (text, prompt+response, messages, ShareGPT conversations; self-distilled records keep their exact ids) or text (repeatable).")] = None,
    version: Annotated[int, typer.Option("--version", help="3 = EAGLE-3, 1 = EAGLE-1.")] = 3,
    draft_vocab_size: Annotated[Optional[int], typer.Option("--draft-vocab-size", help="EAGLE-3 reduced draft vocabulary (default min(32000, V)).")] = None,
    ttt_steps: Annotated[Optional[int], typer.Option("--ttt-steps", help="Training-time-test steps (default 4 for EAGLE-3, 1 for EAGLE-1).")] = None,
    aux_layers: Annotated[Optional[str], typer.Option("--aux-layers", help="EAGLE-3 target layers, comma separated (default 2,L//2,L-3).")] = None,
    epochs: Annotated[int, typer.Option("--epochs", help="Passes over the training split.")] = 1,
    steps: Annotated[Optional[int], typer.Option("--steps", help="Stop after this many optimizer steps.")] = None,
    lr: Annotated[float, typer.Option("--lr", help="AdamW peak learning rate.")] = 3e-4,
    batch_size: Annotated[int, typer.Option("--batch-size", help="Sequences per step.")] = 4,
    seq_len: Annotated[int, typer.Option("--seq-len", help="Tokens per sequence (longer ones are cut).")] = 512,
    seed: SeedOpt = 0,
    eval_split: Annotated[float, typer.Option("--eval-split", help="Fraction of sequences held out for evaluation.")] = 0.05,
    eval_every: Annotated[int, typer.Option("--eval-every", help="Steps between evaluations and checkpoints.")] = 50,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from OUTPUT/checkpoint.")] = False,
    self_distill: Annotated[Optional[list[str]], typer.Option("--self-distill", help="Prompts the target answers (greedy) as data: a workload name (code-edit, chat) or a .jsonl/.txt prompt file (repeatable).")] = None,
    distill_max_prompts: Annotated[Optional[int], typer.Option("--distill-max-prompts", help="Answer at most the first N prompts of each --self-distill source.")] = None,
    prompt_rows: Annotated[float, typer.Option("--prompt-rows", help="Fraction of the prompt rows of chat records unrolled and learnt per step (answer rows always are); below 1 spends the compute on the answers.")] = 1.0,
    fc_init: Annotated[str, typer.Option("--fc-init", help="EAGLE-3 fc initialisation: random, or last (identity on the deepest aux layer: the draft starts in the space the LM head reads).")] = "random",
    autocast: Annotated[bool, typer.Option("--autocast", help="Run the draft's matmuls in bfloat16 (weights and optimizer stay fp32).")] = False,
    hold_out: Annotated[int, typer.Option("--hold-out", help="With a workload name for --self-distill: leave its first N prompts out (those `specctl bench -n N` runs).")] = 0,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", help="Self-distillation: tokens per answer.")] = 256,
    cache_hidden_states: Annotated[Optional[Path], typer.Option("--cache-hidden-states", help="Folder for the target's states (safetensors shards), computed once.")] = None,
    dtype: DtypeOpt = "float32",
    json_out: JsonOpt = False,
) -> None:
    from specctl.errors import UsageError

    aux = None
    if aux_layers:
        try:
            aux = tuple(int(x) for x in aux_layers.split(","))
        except ValueError:
            raise UsageError(f"--aux-layers '{aux_layers}' is not a comma-separated list of integers", "e.g. --aux-layers 2,15,27") from None
    from specctl.training.eagle import EagleTrainConfig

    cfg = EagleTrainConfig(
        model=model or "smollm2-135m", output=str(output), data=[str(d) for d in data] if data else None, version=version,
        draft_vocab_size=draft_vocab_size, ttt_steps=ttt_steps, aux_layers=aux, epochs=epochs, steps=steps, lr=lr,
        batch_size=batch_size, seq_len=seq_len, seed=seed, eval_split=eval_split, resume=resume,
        self_distill=list(self_distill) if self_distill else None, distill_max_prompts=distill_max_prompts,
        prompt_rows=prompt_rows, fc_init=fc_init, autocast=autocast, hold_out=hold_out, max_new_tokens=max_new_tokens,
        cache_hidden_states=str(cache_hidden_states) if cache_hidden_states else None, dtype=dtype,
        eval_every=eval_every,
    ).validated()

    from rich.console import Console

    err = Console(stderr=True, log_path=False)
    from specctl.models import resolve_model

    cfg.model = str(resolve_model(cfg.model, dtype=cfg.dtype))
    from specctl.training.eagle import train

    summary = train(cfg, log=err.log)
    if json_out:
        typer.echo(json.dumps(summary, indent=2))
        return
    final = summary.get("final") or {}
    typer.echo(f"EAGLE-{summary['version']} draft: {summary['export']}")
    typer.echo(f"steps {summary['steps']}, {summary['train_sequences']} train / {summary['eval_sequences']} eval sequences, "
               f"draft vocab {summary['draft_vocab_size']}, aux layers {summary['aux_layers']}, {summary['wall_s']} s")
    if "acceptance_per_position" in final:
        acc = ", ".join(f"{x:.2f}" for x in final["acceptance_per_position"])
        typer.echo(f"held-out per-position acceptance [{acc}], simulated acceptance length "
                   f"{final['simulated_acceptance_length']:.2f}")
    method = "eagle3" if summary["version"] == 3 else "eagle"
    typer.echo(f"use: --speculative-config '{{\"method\": \"{method}\", \"model\": \"{summary['export']}\", \"num_speculative_tokens\": 4}}'")


def register(app: typer.Typer) -> None:
    app.command("train-eagle", help=HELP, no_args_is_help=True)(train_eagle_cmd)
