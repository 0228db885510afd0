"""`specctl train-mtp`: train multi-token-prediction modules on a frozen target and export them.

Thin: parse (the options shared with the other trainers come from ``_train_options``), build
MtpTrainConfig, call ``specctl.training.mtp.train_mtp``, render. Progress on stderr, the summary on
stdout (``--json`` for machines).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from specctl.commands._train_options import (HOLD_OUT, BatchSizeOpt, DataOpt, DeviceOpt, DistillMaxPromptsOpt,
                                             DistillSamplesOpt, DistillTemperatureOpt, EpochsOpt, EvalEveryOpt,
                                             EvalSplitOpt, GradAccumOpt, HoldOutOpt, JsonOpt, LrOpt, MaxNewTokensOpt,
                                             ModelOpt, OldMaxNewTokensOpt, OutputOpt, PushToHubOpt, ResumeOpt,
                                             SaveEveryOpt, SeedOpt, SelfDistillOpt, StepsOpt, command_line, config_from,
                                             main_process, progress_bars)

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

OUTPUT also gets training_config.json, checkpoints/step-NNNNNNN (every --save-every steps, accelerate's
save_state; --resume continues), data/self_distill.jsonl, and a model card (README.md; not with
--stitch). Runs under `accelerate launch` unchanged: each step learns from --batch-size x processes x
--grad-accum windows. Progress goes to stderr; the summary (eval acceptance, how to use the result) to stdout.

Examples:

  specctl train-mtp --model smollm2-135m --self-distill sharegpt --distill-max-prompts 32 --output mtp-draft --steps 200

  specctl train-mtp --model ./my-model --data corpus/ --output my-model-mtp --stitch --epochs 2 --json

  specctl train-mtp --model qwen2.5-coder-0.5b --data runs/q05/data/ --cache-hidden-states runs/q05/states --dtype bfloat16 --seq-len 768 --loss-vocab-size 16384 --prompt-rows 0.1 --output q05-mtp --steps 600

  accelerate launch --num_processes 2 -m specctl.cli train-mtp --model ./my-model --data corpus/ --output my-model-mtp --device cuda --push-to-hub me/my-model-mtp

  specctl bench --model smollm2-135m --speculative-config '{"method": "mtp", "model": "mtp-draft", "num_speculative_tokens": 3}'
"""


def train_mtp_cmd(
    ctx: typer.Context,
    output: OutputOpt,
    model: ModelOpt = None,
    data: DataOpt = None,
    self_distill: SelfDistillOpt = None,
    num_layers: Annotated[int, typer.Option("--num-layers", help="MTP modules to train (num_nextn_predict_layers).")] = 1,
    depth: Annotated[int, typer.Option("--depth", help="Draft steps unrolled in training (the k it is trained for).")] = 3,
    stitch: Annotated[bool, typer.Option("--stitch", help="Write a copy of the target with the MTP modules inside (DeepSeek-V3 layout: specctl's runtime).")] = False,
    layout: Annotated[str, typer.Option("--layout", help="auto (mimo where vLLM can load it, else deepseek_v3 with a warning), mimo (vLLM's MiMoMTPModel; refused up front where it cannot be loaded), deepseek_v3.")] = "auto",
    cache_hidden_states: Annotated[Optional[Path], typer.Option("--cache-hidden-states", help="A folder of the target's states (train-eagle's, made on the same data with the same --seq-len and --dtype, serves as is; made here if absent): train on the chat-templated sequences, their answers marked, instead of windows of text.")] = None,
    prompt_rows: Annotated[float, typer.Option("--prompt-rows", help="With --cache-hidden-states: the fraction of the non-answer rows learnt (answer rows always are).")] = 1.0,
    eval_data: Annotated[Optional[list[str]], typer.Option("--eval-data", help="With --cache-hidden-states: record files evaluated on, never trained on (repeatable; replaces --eval-split), e.g. the target's answers to bench's prompts.")] = None,
    loss_vocab_size: Annotated[Optional[int], typer.Option("--loss-vocab-size", help="The loss's softmax over the N most frequent target choices in the data (labels outside are not learnt); the export keeps the target's whole head. On a CPU the full head is most of a step (Qwen's 152k rows: ~10x).", show_default=False)] = None,
    soft_labels: Annotated[bool, typer.Option("--soft-labels/--hard-labels", help="Learn the target's distribution at each row (over the loss vocabulary), as EAGLE's trainers do, or only its argmax.")] = True,
    autocast: Annotated[Optional[bool], typer.Option("--autocast/--no-autocast", help="Run the modules' matmuls in bfloat16 (weights and optimizer stay fp32). Default: with a bf16 target (--dtype bfloat16) on CUDA or on a CPU with AVX512-BF16 or AMX.", show_default=False)] = None,
    epochs: EpochsOpt = 1.0,
    steps: StepsOpt = None,
    lr: LrOpt = 1e-3,
    batch_size: BatchSizeOpt = 8,
    grad_accum: GradAccumOpt = 1,
    seq_len: Annotated[int, typer.Option("--seq-len", help="Tokens per window.")] = 256,
    eval_split: EvalSplitOpt = 0.05,
    eval_every: EvalEveryOpt = 0,
    save_every: SaveEveryOpt = 50,
    resume: ResumeOpt = False,
    hold_out: HoldOutOpt = HOLD_OUT,
    distill_max_prompts: DistillMaxPromptsOpt = None,
    max_new_tokens: MaxNewTokensOpt = 128,
    distill_max_new_tokens: OldMaxNewTokensOpt = None,
    distill_temperature: DistillTemperatureOpt = 0.0,
    distill_samples: DistillSamplesOpt = 1,
    seed: SeedOpt = 0,
    dtype: Annotated[str, typer.Option("--dtype", help="Target dtype during training (modules train in fp32).")] = "float32",
    device: DeviceOpt = "auto",
    push_to_hub: PushToHubOpt = None,
    json_out: JsonOpt = False,
) -> None:
    from specctl.models import DEFAULT_MODEL
    from specctl.training.mtp import MtpTrainConfig, train_mtp

    cfg = config_from(MtpTrainConfig, locals(), model=model or DEFAULT_MODEL)
    from rich.console import Console

    err = Console(stderr=True, log_path=False)
    with progress_bars(err) as bar:
        summary = train_mtp(cfg, progress=err.log, command=command_line(ctx), bar=bar)
    if not main_process():
        return
    if json_out:
        typer.echo(json.dumps(summary, indent=2))
        return
    render(summary)


def render(s: dict) -> None:
    """The facts as a table, then the commands that use the result as plain lines (whole, to be copied:
    a table cell would cut or fold them), naming the target as the user did."""
    import shlex

    from rich.console import Console
    from rich.table import Table

    from specctl.models import CATALOGUE

    t = Table(title=f"MTP modules → {s['output']} ({s['form']})", title_justify="left", show_header=False)
    t.add_column("", style="bold", no_wrap=True)
    t.add_column("", overflow="fold")  # a long path folds instead of ending in "…"
    model = s.get("model", s["target"])
    t.add_row("target", model if model == s["target"] else f"{model} ({s['target']})")
    t.add_row("modules / depth", f"{s['num_layers']} / {s['depth']}")
    loss = ("" if s.get("final_loss") is None
            else f", loss {s['first_loss']:.4f} → {s['final_loss']:.4f} (first → last step)")
    t.add_row("training", f"{s['steps']} steps over {s['train_tokens']} tokens{loss}, {s['seconds']} s")
    if s.get("eval"):
        e = s["eval"]
        t.add_row("eval top-1 per depth", ", ".join(f"{x:.1%}" for x in e["top1_per_depth"]))
        t.add_row("eval mean acceptance length", f"{e['mean_acceptance_length']:.2f}")
    t.add_row("layout", s.get("layout", "deepseek_v3"))
    if s.get("hub"):
        t.add_row("pushed to", s["hub"])
    Console().print(t)
    use = s["use"]
    typer.echo(f"use: specctl bench --model {shlex.quote(use['--model'])} --speculative-config "
               f"{shlex.quote(json.dumps(use['--speculative-config']))}")
    if s.get("vllm"):
        v = s["vllm"]
        typer.echo(f"vLLM: specctl serve --engine vllm --model {shlex.quote(model)} --speculative-config "
                   f"{shlex.quote(json.dumps(v['speculative_config']))}  (it adds hf_overrides "
                   f"{json.dumps(v['hf_overrides'])} itself)")
        if str(model).strip().lower() not in CATALOGUE:  # only specctl knows a catalogue name: vLLM's API does not
            typer.echo(f"vLLM (Python): LLM(model={v['model']!r}, hf_overrides={json.dumps(v['hf_overrides'])}, "
                       f"speculative_config={json.dumps(v['speculative_config'])})")
    elif s.get("vllm_unavailable"):
        typer.echo(f"vLLM: not offered: {s['vllm_unavailable']}")


def register(app: typer.Typer) -> None:
    app.command("train-mtp", help=HELP)(train_mtp_cmd)
