"""Options train-medusa, train-eagle and train-mtp share, declared once as ``Annotated`` aliases.

Each option is a field of ``specctl.training.loop.TrainConfig`` of the same name (``--max-new-tokens``
is ``max_new_tokens``); ``config_from`` builds a trainer's config from a command's parameters. A
command gives each option its own default only where the trainer's config has its own (``--lr``,
``--batch-size`` ...); ``--hold-out`` has one default everywhere. Old spellings users may have in
scripts stay as hidden aliases (``--distill-max-new-tokens``: train-medusa's and train-mtp's name for
``--max-new-tokens``). ``progress_bars`` wraps a trainer's run: a Ctrl-C in it leaves saying how to resume.

What it does not know: training; nothing here imports torch.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Annotated, Optional

import typer

from specctl.commands._options import DeviceOpt, DtypeOpt, JsonOpt, ModelOpt, SeedOpt

__all__ = ["OutputOpt", "ModelOpt", "DataOpt", "SelfDistillOpt", "HoldOutOpt", "HOLD_OUT", "DistillMaxPromptsOpt",
           "MaxNewTokensOpt", "OldMaxNewTokensOpt", "DistillTemperatureOpt", "DistillSamplesOpt", "EpochsOpt",
           "StepsOpt", "LrOpt", "BatchSizeOpt", "GradAccumOpt", "SeqLenOpt", "EvalSplitOpt", "EvalEveryOpt",
           "SaveEveryOpt", "ResumeOpt", "PushToHubOpt", "SeedOpt", "DtypeOpt", "DeviceOpt", "JsonOpt",
           "config_from", "command_line", "main_process", "progress_bars", "resume_hint"]

HOLD_OUT = 8  # the workload prompts `specctl bench -n 8` runs are never trained on


def _output_path(value: str) -> Path:
    """--output as given: an empty one (which pathlib would read as the current folder) is refused."""
    if not value.strip():
        from specctl.errors import UsageError

        raise UsageError(f"--output is {'blank' if value else 'empty'}", "give the run folder, e.g. --output runs/my-draft")
    return Path(value)


OutputOpt = Annotated[Path, typer.Option(
    "--output", "-o", parser=_output_path, metavar="PATH",
    help="Run folder (new, empty, or an earlier run's): training_config.json, checkpoints/step-NNNNNNN/, "
    "data/self_distill.jsonl, and the export (with its model card, README.md).")]
DataOpt = Annotated[Optional[list[str]], typer.Option(
    "--data", "-d", help="Training data (repeatable): .jsonl/.json records (prompt+response, messages, ShareGPT "
    "conversations, text; self-distilled records keep their exact ids), .txt/.py/.md text, or a folder of them.")]
SelfDistillOpt = Annotated[Optional[list[str]], typer.Option(
    "--self-distill", help="Prompts the target answers itself, as data (repeatable): a .jsonl/.txt prompt file or a "
    "workload name (sharegpt, code-edit, agentic; the evaluation workloads chat, mt-bench, humaneval and math are "
    "refused).")]
HoldOutOpt = Annotated[int, typer.Option(
    "--hold-out", help="With a workload name for --self-distill: its first N prompts (those `specctl bench -n N` runs) "
    "are never trained on.")]
DistillMaxPromptsOpt = Annotated[Optional[int], typer.Option(
    "--distill-max-prompts", help="Answer at most the first N prompts of each --self-distill source.")]
MaxNewTokensOpt = Annotated[int, typer.Option("--max-new-tokens", help="Self-distillation: tokens per answer.")]
OldMaxNewTokensOpt = Annotated[Optional[int], typer.Option("--distill-max-new-tokens", hidden=True,
                                                           help="Old name of --max-new-tokens.")]
DistillTemperatureOpt = Annotated[float, typer.Option(
    "--distill-temperature", help="Self-distillation: 0 = greedy answers; > 0 samples them (seeded).")]
DistillSamplesOpt = Annotated[int, typer.Option(
    "--distill-samples", help="Sampled answers per prompt, decoded as one batch (with --distill-temperature > 0).")]
EpochsOpt = Annotated[float, typer.Option("--epochs", help="Passes over the training data (unless --steps).")]
StepsOpt = Annotated[Optional[int], typer.Option("--steps", help="Optimizer steps (overrides --epochs).")]
LrOpt = Annotated[float, typer.Option("--lr", help="Peak learning rate (AdamW; linear warm-up, cosine decay to 10%).")]
BatchSizeOpt = Annotated[int, typer.Option("--batch-size", "-b", help="Sequences per micro-batch and process.")]
GradAccumOpt = Annotated[int, typer.Option(
    "--grad-accum", help="Micro-batches per optimizer step (gradient accumulation): a step learns from batch size x "
    "processes x this many sequences.")]
SeqLenOpt = Annotated[int, typer.Option("--seq-len", help="Longest training sequence in tokens (longer ones are cut).")]
EvalSplitOpt = Annotated[float, typer.Option("--eval-split", help="Fraction of the sequences held out for evaluation.")]
EvalEveryOpt = Annotated[int, typer.Option("--eval-every", help="Evaluate every N steps (0: at each checkpoint and at the end).")]
SaveEveryOpt = Annotated[int, typer.Option(
    "--save-every", help="Checkpoint (atomically, into OUTPUT/checkpoints/) every N steps and at the last one; "
    "0: none, only the export.")]
ResumeOpt = Annotated[bool, typer.Option(
    "--resume", help="Continue from the newest checkpoint in OUTPUT/checkpoints/ (or one an older specctl wrote).")]
PushToHubOpt = Annotated[Optional[str], typer.Option(
    "--push-to-hub", metavar="REPO", help="Push the export and its model card to this Hub repo (OWNER/NAME); refused "
    "before training when no token is configured or the Hub is offline.")]


_running: dict = {}  # the config of the training command in progress (config_from), for resume_hint


def config_from(cls, params: dict, **overrides):
    """The trainer config ``cls`` from a command's parameters (those named as its fields; paths as str,
    --max-new-tokens or its old spelling), validated; kept as the running command's, for ``resume_hint``."""
    import dataclasses

    names = {f.name for f in dataclasses.fields(cls)}
    kw = {k: (str(v) if isinstance(v, Path) else v) for k, v in params.items() if k in names}
    for k in ("data", "self_distill", "eval_data"):
        kw[k] = [str(x) for x in (kw.get(k) or [])]
    if params.get("distill_max_new_tokens") is not None:
        kw["max_new_tokens"] = params["distill_max_new_tokens"]
    kw.update(overrides)
    cfg = cls(**kw).validated()
    _running["cfg"] = cfg
    return cfg


@contextlib.contextmanager
def progress_bars(err):
    """A (phase, done, total) callback drawing one rich bar per phase on ``err`` (a stderr Console; none when
    it is not a terminal): self-distillation, feature extraction, training steps. A Ctrl-C inside leaves
    as a KeyboardInterrupt saying how to resume (``resume_hint``), which the CLI prints."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    try:
        with Progress(TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), TimeRemainingColumn(), console=err, transient=True,
                      disable=not err.is_terminal) as prog:
            tasks: dict[str, int] = {}

            def progress(phase: str, done: int, total: int) -> None:
                if phase not in tasks:
                    tasks[phase] = prog.add_task(phase, total=total)
                prog.update(tasks[phase], completed=done, total=total)

            yield progress
    except KeyboardInterrupt:
        raise KeyboardInterrupt(resume_hint()) from None


def resume_hint() -> str:
    """What to do after an interrupted training command: resume from its newest checkpoint, if it has one."""
    from specctl.training.checkpoints import checkpoint_dirs

    cfg = _running.get("cfg")
    ckpts = checkpoint_dirs(cfg.output) if cfg is not None else []
    if not ckpts:
        return ""
    again = "run the same command again" if cfg.resume else "resume with the same command plus --resume"
    return f"The newest checkpoint is {ckpts[-1]}: {again}."


def main_process() -> bool:
    """Whether this process prints the summary (under ``accelerate launch`` one does, the others are silent)."""
    from accelerate import PartialState

    return PartialState().is_main_process


def command_line(ctx: typer.Context) -> str:
    """The running command as the user gave it (the options set, not the defaults), for the model card."""
    import shlex

    parts = ["specctl", ctx.info_name or ""]
    for p in ctx.command.params:
        source = ctx.get_parameter_source(p.name)
        if p.param_type_name != "option" or source is None or source.name.startswith("DEFAULT"):
            continue
        v = ctx.params.get(p.name)
        flag = next((o for o in p.opts if o.startswith("--")), p.opts[0])
        if p.is_flag:
            parts += [flag] if v else list(p.secondary_opts[:1])
        elif p.multiple:
            parts += [x for item in v or () for x in (flag, str(item))]
        elif v is not None:
            parts += [flag, str(v)]
    return shlex.join(parts)
