"""`specctl train-mtp`: train multi-token-prediction modules on a frozen target and export them.

Thin: parse, build MtpTrainConfig, call ``specctl.training.mtp.train_mtp``, render. Progress on
stderr, the summary on stdout (``--json`` for machines).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from specctl.commands._options import JsonOpt, ModelOpt, SeedOpt

HELP = """Train MTP (multi-token prediction) modules on a frozen target, for self-speculation with --method mtp.

Each module reads the target's hidden state and the next token's embedding and predicts one token
further (DeepSeek-V3's MTP); depth d of the draft reuses module (d-1) % --num-layers. Training
unrolls --depth steps with weights 0.6^(d-1), normalised, against the target's own greedy choices.
The result is saved as a draft folder in the layout vLLM loads for the target (--layout auto): MiMo's
dense MTP layout (architectures MiMoForCausalLM, model.mtp_layers.{i}.*), which vLLM runs as its
MiMoMTPModel for a Qwen2/Llama-shaped target with {"method": "mtp", "model": DRAFT,
"num_speculative_tokens": 1} and hf_overrides {"num_nextn_predict_layers": 1} on the target (vLLM's MiMo
MTP reads that from the target's config; serve --engine vllm adds it; vLLM runs MTP module 0 for each
draft step). Where vLLM has no MTP
architecture for the target (o_proj/MLP biases, sliding windows), or with --stitch (a copy of the
target carrying its MTP modules), the DeepSeek-V3 layout (num_nextn_predict_layers,
model.layers.{N+i}.*) is written with a warning: vLLM loads that only for DeepSeek-V3 targets,
specctl's runtime reads every layout. --layout mimo refuses up front what vLLM would not load. --self-distill PROMPTS (a file, or a workload name whose bench prompts are held out) has the
target answer those prompts first and trains on its answers.

Progress goes to stderr; the summary (eval acceptance, how to use the result) to stdout.

Examples:

  specctl train-mtp --model smollm2-135m --self-distill chat --distill-max-prompts 32 --output mtp-draft --steps 200

  specctl train-mtp --model ./my-model --data corpus/ --output my-model-mtp --stitch --epochs 2 --json

  specctl bench --model smollm2-135m --speculative-config '{"method": "mtp", "model": "mtp-draft", "num_speculative_tokens": 3}'
"""


def train_mtp_cmd(
    output: Annotated[Path, typer.Option("--output", "-o", help="Folder to write (draft folder, or the stitched model with --stitch).")],
    model: ModelOpt = None,
    data: Annotated[Optional[str], typer.Option("--data", "-d", help="Training text: .jsonl/.json/.txt file or a folder.")] = None,
    self_distill: Annotated[Optional[str], typer.Option("--self-distill", help="Prompts the target answers first (.jsonl/.txt file, or a workload name: chat, code-edit, agentic).")] = None,
    hold_out: Annotated[int, typer.Option("--hold-out", help="With a workload name: its first N prompts (those bench runs) are never trained on.")] = 8,
    distill_max_prompts: Annotated[Optional[int], typer.Option("--distill-max-prompts", help="Answer at most the first N prompts.")] = None,
    num_layers: Annotated[int, typer.Option("--num-layers", help="MTP modules to train (num_nextn_predict_layers).")] = 1,
    depth: Annotated[int, typer.Option("--depth", help="Draft steps unrolled in training (the k it is trained for).")] = 3,
    stitch: Annotated[bool, typer.Option("--stitch", help="Write a copy of the target with the MTP modules inside (DeepSeek-V3 layout: specctl's runtime).")] = False,
    layout: Annotated[str, typer.Option("--layout", help="auto (mimo where vLLM can load it, else deepseek_v3 with a warning), mimo (vLLM's MiMoMTPModel; refused up front where it cannot be loaded), deepseek_v3.")] = "auto",
    epochs: Annotated[int, typer.Option("--epochs", help="Passes over the training windows (unless --steps).")] = 1,
    steps: Annotated[Optional[int], typer.Option("--steps", help="Optimizer steps (overrides --epochs).")] = None,
    lr: Annotated[float, typer.Option("--lr", help="AdamW learning rate.")] = 1e-3,
    batch_size: Annotated[int, typer.Option("--batch-size", help="Windows per step.")] = 8,
    seq_len: Annotated[int, typer.Option("--seq-len", help="Tokens per window.")] = 256,
    eval_split: Annotated[float, typer.Option("--eval-split", help="Fraction of windows held out for eval.")] = 0.05,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from OUTPUT/checkpoint/state.pt.")] = False,
    max_new_tokens: Annotated[int, typer.Option("--distill-max-new-tokens", help="Answer length for --self-distill.")] = 128,
    dtype: Annotated[str, typer.Option("--dtype", help="Target dtype during training (modules train in fp32).")] = "float32",
    seed: SeedOpt = 0,
    json_out: JsonOpt = False,
) -> None:
    from specctl.errors import UsageError

    if data is None and self_distill is None:
        raise UsageError("no training data", "give --data FILE_OR_DIR and/or --self-distill PROMPTS")
    if not 0.0 <= eval_split < 1.0:
        raise UsageError(f"--eval-split must be in [0, 1), got {eval_split}", "e.g. --eval-split 0.05")
    for name, v in (("--num-layers", num_layers), ("--depth", depth), ("--batch-size", batch_size), ("--seq-len", seq_len)):
        if v < 1:
            raise UsageError(f"{name} must be >= 1, got {v}", f"pass e.g. {name} 1")
    if layout not in ("auto", "mimo", "deepseek_v3"):
        raise UsageError(f"unknown --layout '{layout}'", "use auto, mimo or deepseek_v3")

    from rich.console import Console

    err = Console(stderr=True, log_path=False)
    from specctl.models import DEFAULT_MODEL
    from specctl.training.mtp import MtpTrainConfig, train_mtp

    cfg = MtpTrainConfig(model=model or DEFAULT_MODEL, output=str(output), data=data, self_distill=self_distill,
                         num_layers=num_layers, depth=depth, epochs=epochs, steps=steps, lr=lr, batch_size=batch_size,
                         seq_len=seq_len, seed=seed, eval_split=eval_split, stitch=stitch, resume=resume,
                         distill_max_new_tokens=max_new_tokens, dtype=dtype, hold_out=hold_out,
                         distill_max_prompts=distill_max_prompts, layout=layout)
    summary = train_mtp(cfg, progress=err.log)
    if json_out:
        typer.echo(json.dumps(summary, indent=2))
        return
    render(summary)


def render(s: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"MTP modules → {s['output']} ({s['form']})", title_justify="left", show_header=False)
    t.add_column("", style="bold", no_wrap=True)
    t.add_column("")
    t.add_row("target", s["target"])
    t.add_row("modules / depth", f"{s['num_layers']} / {s['depth']}")
    t.add_row("training", f"{s['steps']} steps over {s['train_tokens']} tokens, final loss {s['final_loss']}, {s['seconds']} s")
    if s.get("eval"):
        e = s["eval"]
        t.add_row("eval top-1 per depth", ", ".join(f"{x:.1%}" for x in e["top1_per_depth"]))
        t.add_row("eval mean acceptance length", f"{e['mean_acceptance_length']:.2f}")
    use = s["use"]
    t.add_row("use", f"specctl bench --model {use['--model']} --speculative-config '{json.dumps(use['--speculative-config'])}'")
    if s.get("vllm"):
        v = s["vllm"]
        t.add_row("vLLM", f"LLM(model={v['model']!r}, hf_overrides={json.dumps(v['hf_overrides'])}, "
                          f"speculative_config={json.dumps(v['speculative_config'])})  (specctl serve --engine vllm adds "
                          "the hf_overrides itself)")
    t.add_row("layout", s.get("layout", "deepseek_v3"))
    Console().print(t)


def register(app: typer.Typer) -> None:
    app.command("train-mtp", help=HELP)(train_mtp_cmd)
