"""What the three trainers (Medusa, EAGLE, MTP) do alike around their own networks and losses.

- ``TrainConfig``: the settings every trainer has, under one name each (CLI flag ``--x-y`` = field
  ``x_y``); ``MedusaTrainConfig``, ``EagleTrainConfig`` and ``MtpTrainConfig`` extend it with their own
  fields and check them in ``validated()``.
- ``accelerator``: one ``accelerate.Accelerator`` per run: the device (``--device``), DDP under
  ``accelerate launch``, gradient accumulation (``--grad-accum``). Checkpoints hold the network's own
  tensor names (not DDP's ``module.`` ones), so a run saved on N processes resumes on M.
- ``warmup_cosine``: transformers' warm-up + cosine schedule, down to 10% of the peak learning rate.
- ``shares``: a global batch cut into this process's micro-batches.
- ``resume_point``: which checkpoint ``--resume`` continues from (and what it refuses).
- ``publish``: the model card (``specctl.hub.write_model_card``) and ``--push-to-hub``.

Global batches. One optimizer step learns from one *global batch* of ``batch_size x processes x
grad_accum`` items, chosen from the step number alone (so a resumed run continues exactly, and N
processes with batch B take the same steps as one process with batch N*B). ``shares`` cuts it into
contiguous parts, micro-batch j of process r being part j*N + r. Worked: 2 processes, grad_accum 2,
global batch [a b c d e f g h] -> parts [a b][c d][e f][g h]; process 0 learns [a b] then [e f],
process 1 [c d] then [g h]. A part left empty by a short last batch runs on another part with
weight 0: DDP needs every process in every backward. A trainer's loss is a sum over the step's
tokens divided by the step's token count over every process and micro-batch, so the gradient is
the one-process gradient of the whole global batch.

What it does not know: the networks, their losses, data formats, the CLI.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar

from specctl.errors import SpecctlError, UsageError

Log = Callable[[str], None]


def _paths(x) -> list[str]:
    """None, one path or several -> a list of str."""
    if not x:
        return []
    return [str(x)] if isinstance(x, (str, os.PathLike)) else [str(p) for p in x]


@dataclass
class TrainConfig:
    """Settings every trainer shares; saved in training_config.json beside every checkpoint, with the
    trainer's name (``TRAINER``: another trainer's run folder is refused by name)."""

    TRAINER: ClassVar[str] = ""  # the command: "train-medusa", "train-eagle", "train-mtp"
    model: str
    """Target model: an HF folder, a .gguf file, a Hub id or a catalogue name."""
    output: str
    """Run folder: training_config.json, checkpoints/step-NNNNNNN/, data/self_distill.jsonl, the export."""
    data: list[str] = field(default_factory=list)
    """Training data files or folders (.jsonl/.json records, .txt/.py/.md text)."""
    self_distill: list[str] = field(default_factory=list)
    """Prompt sources the target answers itself (a .jsonl/.txt prompt file, or a workload name)."""
    hold_out: int = 8
    """For workload names in self_distill: the first N prompts (those `specctl bench -n N` runs) are never trained on."""
    distill_max_prompts: int | None = None
    """Answer at most the first N prompts of each self_distill source (after the hold-out)."""
    max_new_tokens: int = 256
    """Tokens the target writes per self-distilled answer."""
    distill_temperature: float = 0.0
    """0 = greedy self-distillation; > 0 samples (seeded)."""
    distill_samples: int = 1
    """Sampled answers per prompt (needs distill_temperature > 0)."""
    epochs: float = 1.0
    """Passes over the training data (unless steps is set)."""
    steps: int | None = None
    """Optimizer steps (overrides epochs)."""
    lr: float = 1e-3
    """Peak learning rate: linear warm-up over the first ``warmup`` of the steps, then cosine to 10%."""
    weight_decay: float = 0.0
    warmup: float = 0.05
    """Fraction of the steps with a linear warm-up."""
    max_grad_norm: float = 1.0
    """Gradient clipping (0: none)."""
    batch_size: int = 8
    """Sequences per micro-batch and process."""
    grad_accum: int = 1
    """Micro-batches per optimizer step (gradient accumulation)."""
    seq_len: int = 512
    """Longest training sequence in tokens."""
    seed: int = 0
    eval_split: float = 0.05
    """Fraction of the sequences held out for evaluation."""
    eval_data: list[str] = field(default_factory=list)
    """Record files evaluated on and never trained on (instead of --eval-split): e.g. the target's own
    answers to the prompts ``specctl bench`` measures, so training reports what bench will measure."""
    eval_every: int = 0
    """Evaluate every N steps (0: at each checkpoint and at the end)."""
    save_every: int = 0
    """Checkpoint every N steps and at the last one (0: no checkpoints, only the export)."""
    keep_checkpoints: int = 2
    """Newest checkpoints kept (0: all)."""
    dtype: str = "float32"
    """Target dtype (the draft trains in fp32)."""
    device: str = "auto"
    """auto (CUDA when available; each process its own GPU under accelerate launch), cpu, cuda, cuda:N."""
    resume: bool = False
    """Continue from the newest checkpoint in output/checkpoints."""
    push_to_hub: str | None = None
    """Hub repo (OWNER/NAME) the export and its model card are pushed to; checked before training."""

    # --eval-data is the held-out set instead of --eval-split's (train-eagle); elsewhere the split is taken anyway
    EVAL_DATA_REPLACES_SPLIT: ClassVar[bool] = False
    # settings a checkpoint was made with that --resume must find unchanged
    RESUME_KEYS: ClassVar[tuple[str, ...]] = ("data", "self_distill", "hold_out", "distill_max_prompts",
                                              "distill_samples", "seq_len", "seed", "eval_split", "eval_data")

    def __post_init__(self):
        self.data = _paths(self.data)
        self.eval_data = _paths(self.eval_data)
        self.self_distill = _paths(self.self_distill)

    def validated(self):
        """Check every shared setting (UsageError naming the flag and a fix); subclasses add theirs."""
        need(bool(self.data or self.self_distill), "no training data", "pass --data FILE and/or --self-distill PROMPTS")
        from specctl.training.data import check_prompt_source

        for spec in self.self_distill:  # a missing prompt file is said now, not after the model has loaded
            check_prompt_source(spec)
        for name, lo in (("batch_size", 1), ("grad_accum", 1), ("seq_len", 8), ("max_new_tokens", 1),
                         ("keep_checkpoints", 0), ("hold_out", 0), ("save_every", 0), ("eval_every", 0),
                         ("distill_samples", 1)):
            at_least(self, name, lo)
        need(self.distill_max_prompts is None or self.distill_max_prompts >= 1,
             f"--distill-max-prompts must be >= 1, got {self.distill_max_prompts}", "pass e.g. --distill-max-prompts 32")
        need(self.steps is None or self.steps >= 1, f"--steps must be >= 1, got {self.steps}", "pass e.g. --steps 500")
        need(self.epochs > 0, f"--epochs must be > 0, got {self.epochs}", "pass e.g. --epochs 2")
        need(self.lr > 0, f"--lr must be > 0, got {self.lr}", "pass e.g. --lr 1e-3")
        need(0 <= self.eval_split < 1, f"--eval-split must be in [0, 1), got {self.eval_split}", "pass e.g. --eval-split 0.05")
        need(0 <= self.warmup < 1, f"--warmup must be in [0, 1), got {self.warmup}", "pass e.g. --warmup 0.05")
        need(self.distill_temperature >= 0, "--distill-temperature must be >= 0", "use 0 for greedy")
        need(self.distill_samples == 1 or self.distill_temperature > 0, "several answers per prompt need sampling",
             "set --distill-temperature > 0 (e.g. 0.7) with --distill-samples")
        dev = self.device
        need(dev in ("auto", "cpu", "cuda") or (dev.startswith("cuda:") and dev[5:].isdigit()),
             f"unknown --device '{dev}'", "use auto, cpu, cuda or cuda:N")
        if self.push_to_hub is not None:
            from specctl.hub import is_hub_id

            need(is_hub_id(self.push_to_hub), f"--push-to-hub {self.push_to_hub!r} is not a Hub repo id",
                 "give it as OWNER/NAME, e.g. me/my-draft")
        need(bool(str(self.output).strip()), f"--output is {'blank' if self.output else 'empty'}",
             "give the run folder, e.g. --output runs/my-draft")
        from specctl.files import unwritable

        bad = unwritable(self.output, folder=True)
        need(bad is None, f"--output: {bad}", "choose a folder path you can write to (it is created if missing)")
        from specctl.runtime.loading import parse_dtype

        parse_dtype(self.dtype)
        return self

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), **({"trainer": self.TRAINER} if self.TRAINER else {})}


def _default(cfg, name: str):
    f = next(f for f in dataclasses.fields(cfg) if f.name == name)
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def need(ok: bool, problem: str, fix: str) -> None:
    if not ok:
        raise UsageError(problem, fix)


def folder_option(flag: str, path: str | None) -> None:
    """A folder option besides --output (--cache-hidden-states): a file there, or a missing folder that cannot be
    made, is a usage error now rather than an OSError after the model loads. An existing folder is taken as it
    is (a finished cache is only read, so it may be read-only)."""
    if not path:
        return
    from specctl.files import unwritable

    need(not (os.path.exists(path) and not os.path.isdir(path)), f"{flag} {path} is a file",
         "give a folder (it is created if missing)")
    bad = None if os.path.isdir(path) else unwritable(path, folder=True)
    need(bad is None, f"{flag}: {bad}", "choose a folder path you can write to (it is created if missing)")


def at_least(cfg, name: str, lo: int) -> None:
    v = getattr(cfg, name)
    flag = f"--{name.replace('_', '-')}"
    need(isinstance(v, int) and not isinstance(v, bool) and v >= lo, f"{flag} must be an integer >= {lo}, got {v}",
         f"pass {flag} {lo} or more")


# --------------------------------------------------------------------------- accelerate

def accelerator(cfg: TrainConfig, *, mixed_precision: str | None = None, find_unused: bool = False):
    """The run's Accelerator (see the module docstring). ``find_unused``: some parameters may get no
    gradient in a step (DDP must then look for them)."""
    import torch
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    dev = cfg.device
    if dev.startswith("cuda"):
        need(torch.cuda.is_available(), f"--device {dev}: no CUDA device is visible", "use --device cpu (or auto)")
        if ":" in dev:
            need(int(os.environ.get("WORLD_SIZE", "1")) == 1, f"--device {dev} names one GPU, but this run has several processes",
                 "drop --device: under accelerate launch each process takes its own GPU")
            torch.cuda.set_device(torch.device(dev))
    handlers = [DistributedDataParallelKwargs(find_unused_parameters=True)] if find_unused else []
    acc = Accelerator(cpu=dev == "cpu" or not torch.cuda.is_available(), mixed_precision=mixed_precision,
                      gradient_accumulation_steps=cfg.grad_accum, kwargs_handlers=handlers)
    acc.register_save_state_pre_hook(_save_unwrapped(acc))
    acc.register_load_state_pre_hook(_load_unwrapped(acc))
    return acc


def _save_unwrapped(acc):
    def hook(models, weights, output_dir):  # save_state then writes weights[i] as model[_i].safetensors
        for i, m in enumerate(models):
            weights[i] = acc.unwrap_model(m).state_dict()
    return hook


def _load_unwrapped(acc):
    def hook(models, input_dir):
        from safetensors.torch import load_file

        for i, m in enumerate(models):
            acc.unwrap_model(m).load_state_dict(load_file(os.path.join(input_dir, f"model{f'_{i}' if i else ''}.safetensors")))
        models.clear()  # loaded: accelerate loads the optimizer, the registered objects and the RNG states
    return hook


def warmup_cosine(optimizer, total_steps: int, warmup: float):
    """transformers' linear warm-up (round(warmup * total) steps) and cosine decay to 10% of the peak."""
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    return get_cosine_with_min_lr_schedule_with_warmup(optimizer, int(round(warmup * total_steps)), total_steps,
                                                       min_lr_rate=0.1)


def global_batch_size(cfg: TrainConfig, acc) -> int:
    return cfg.batch_size * acc.num_processes * acc.gradient_accumulation_steps


def shares(batch: list, acc) -> list[tuple[list, float]]:
    """A global batch -> this process's micro-batches, each with its weight (0: an empty part's stand-in)."""
    W, r, G = acc.num_processes, acc.process_index, acc.gradient_accumulation_steps
    cuts = [k * len(batch) // (W * G) for k in range(W * G + 1)]
    out = []
    for j in range(G):
        part = batch[cuts[j * W + r]:cuts[j * W + r + 1]]
        out.append((part, 1.0) if part else (batch[:max(1, cuts[1])], 0.0))
    return out


def backward_step(acc, model, opt, loss, weight: float, max_grad_norm: float) -> None:
    """One micro-batch inside ``acc.accumulate(model)``: backward of loss x weight, then (once the
    accumulation is complete, as accelerate decides) gradient clipping and the optimizer step."""
    acc.backward(loss * weight)
    if acc.sync_gradients and max_grad_norm > 0:
        acc.clip_grad_norm_(model.parameters(), max_grad_norm)
    opt.step()
    opt.zero_grad(set_to_none=True)


def reduce_sum(acc, x):
    """A tensor summed over every process."""
    return acc.reduce(x, reduction="sum") if acc.num_processes > 1 else x


def due(cfg: TrainConfig, step: int, total: int) -> tuple[bool, bool]:
    """(checkpoint, evaluate) at this step: a checkpoint every ``save_every`` steps and at the last (--resume
    can extend a run); an evaluation every ``eval_every`` steps, or at each checkpoint where it is 0, and at
    the last step."""
    ckpt = bool(cfg.save_every) and (step % cfg.save_every == 0 or step == total)
    every = cfg.eval_every
    return ckpt, (step % every == 0 if every else ckpt) or step == total


# --------------------------------------------------------------------------- resume

# settings a resumed run may extend: more data after the sources it started with (a run that has stopped
# improving goes on over more), the data loaders deterministic over the longer list
GROWABLE_KEYS = ("data", "self_distill")


def held_out_from_data(cfg: TrainConfig) -> bool:
    """Whether the run evaluates on a seeded split of its data: more data would reshuffle that split (a
    sequence trained on could land in it), so such a run cannot grow."""
    return cfg.eval_split > 0 and not (cfg.eval_data and cfg.EVAL_DATA_REPLACES_SPLIT)


def resume_point(cfg: TrainConfig, log: Log, legacy: Path | None = None) -> Path | None:
    """The checkpoint ``--resume`` continues from: the newest in output/checkpoints/, else ``legacy`` (a
    file of the layout before it) when it exists. Without --resume a run folder that holds checkpoints
    is refused; so is a checkpoint made with other ``RESUME_KEYS`` settings (``GROWABLE_KEYS`` may gain
    sources after the checkpoint's), a folder with an export
    but no checkpoint (a new run there would overwrite it), and a non-empty folder that holds no run at
    all (``is_run_folder``: the user's own files, which the export would overwrite)."""
    from specctl.training import checkpoints as C

    out = Path(cfg.output)
    ckpts = C.checkpoint_dirs(out)
    old_layout = legacy is not None and legacy.is_file()
    if ckpts:
        check_trainer(cfg, out, ckpts[-1])
    if not ckpts and not old_layout and not is_run_folder(out):
        found = sorted(p.name for p in out.iterdir() if not p.name.startswith("."))
        raise SpecctlError(f"--output {out} already holds files of its own ({', '.join(found[:3])}"
                           f"{', ...' if len(found) > 3 else ''}) and no specctl training run",
                           "choose a new or empty --output folder: the export would overwrite them")
    if not ckpts and not old_layout and (out / C.TRAINING_CONFIG).is_file():
        # a finished run that kept no checkpoint: nothing to continue, and a new run would replace its export
        raise UsageError(f"{out} holds an earlier run's export ({C.TRAINING_CONFIG}) and no checkpoint",
                         "choose another --output, or delete that export to train again there "
                         "(its data/ cache is reused)")
    if not cfg.resume:
        if ckpts or old_layout:
            latest = ckpts[-1].name if ckpts else legacy.relative_to(out)
            raise UsageError(f"{out} already holds checkpoints (latest {latest})",
                             "pass --resume to continue that run, or choose another --output")
        return None
    if ckpts:
        folder = ckpts[-1]
        old = json.loads((folder / C.TRAINING_CONFIG).read_text())
        for key in cfg.RESUME_KEYS:
            now = json.loads(json.dumps(getattr(cfg, key)))
            was = old.get(key, json.loads(json.dumps(_default(cfg, key))))  # a setting newer than the checkpoint
            if (key in GROWABLE_KEYS and isinstance(was, list) and now[:len(was)] == was and len(now) > len(was)
                    and not held_out_from_data(cfg)):
                log(f"--resume: {len(now) - len(was)} more --{key.replace('_', '-')} source(s) than in {folder.name} "
                    f"({', '.join(map(str, now[len(was):]))}): the run goes on over all of them")
                continue
            if was != now:
                raise UsageError(f"--resume: {key} was {was!r} in {folder.name}, now {now!r}",
                                 f"resume with the same --{key.replace('_', '-')}"
                                 f"{' (more may follow them where --eval-data or --eval-split 0 keeps the held-out set apart)' if key in GROWABLE_KEYS else ''}"
                                 ", or start a new --output")
        log(f"resuming from {folder}")
        return folder
    if old_layout:
        log(f"resuming from {legacy} (a checkpoint of the layout before checkpoints/)")
        return legacy
    log(f"--resume: no checkpoint in {out / C.CHECKPOINTS}; starting a new run")
    return None


def some(names) -> str:
    """The first three of ``names``, sorted, and "..." for the rest (a one-line message's list)."""
    names = sorted(names)
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


def run_settings(checkpoint: Path) -> dict:
    """The training_config.json beside a checkpoint (a folder, or the old single file): {} where it is missing
    or unreadable."""
    from specctl.training import checkpoints as C

    try:
        d = json.loads(((checkpoint if checkpoint.is_dir() else checkpoint.parent) / C.TRAINING_CONFIG).read_text())
    except (OSError, ValueError):
        return {}
    return d if isinstance(d, dict) else {}


def made_by(cfg: TrainConfig, settings: dict) -> str | None:
    """Which other trainer made a run whose training_config.json is ``settings``: its recorded name where that
    is not ``cfg``'s, or, for a run from before names were recorded, "another trainer" when it has settings
    that ``cfg``'s trainer has not (its own keys: a Medusa run's num_heads, an EAGLE run's ttt_steps). None:
    ``cfg``'s own (or nothing to tell)."""
    was = settings.get("trainer")
    if isinstance(was, str) and was:
        return None if was == cfg.TRAINER else was
    other = set(settings) - {f.name for f in dataclasses.fields(cfg)} - {"trainer"}
    return f"another trainer (settings {some(other)})" if other and cfg.TRAINER else None


def check_trainer(cfg: TrainConfig, out: Path, checkpoint: Path) -> None:
    """A run folder whose ``checkpoint`` another trainer made: one line naming it, before any data or model is
    read (with or without --resume: resuming it here would load the wrong modules)."""
    was = made_by(cfg, run_settings(checkpoint))
    if was is not None:
        raise UsageError(f"{out} holds a run that {was} made ({checkpoint.relative_to(out)}), not {cfg.TRAINER}",
                         f"give {cfg.TRAINER} a new --output (resume that run with the command that made it)")


def is_run_folder(out: Path) -> bool:
    """Whether a training run may write into ``out``: it is missing or empty (dot files aside), or it holds
    what a specctl run leaves (checkpoints/, training_config.json, train_summary.json, a self-distillation
    cache), so an interrupted run's folder (the export half written, say) is one."""
    from specctl.training import checkpoints as C
    from specctl.training.data import DISTILL_CACHES

    if not out.is_dir() or all(p.name.startswith(".") for p in out.iterdir()):
        return True
    return ((out / C.CHECKPOINTS).is_dir() or (out / C.TRAINING_CONFIG).is_file()
            or (out / "train_summary.json").is_file() or any((out / c).is_file() for c in DISTILL_CACHES))


def check_global_batch(state: dict, size: int) -> None:
    """A checkpoint's global batch must be this run's (batch size x processes x grad accum)."""
    was = state.get("global_batch")
    need(was in (None, size), f"--resume: the checkpoint's steps had {was} sequences each, this run's have {size} "
         "(--batch-size x processes x --grad-accum)", "resume with a batch size, process count and --grad-accum "
         f"whose product is {was}")


# --------------------------------------------------------------------------- model card and the Hub

def check_push(cfg: TrainConfig, acc) -> None:
    """Refuse --push-to-hub before any training when it could not be done at the end (no token, offline)."""
    if cfg.push_to_hub and acc.is_main_process:
        from specctl.hub import check_push_access

        check_push_access(cfg.push_to_hub)


def command_line(name: str, cfg: TrainConfig) -> str:
    """A command that repeats this run: the settings that differ from the defaults, as flags."""
    parts = ["specctl", name]
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if v == _default(cfg, f.name) or v is None or f.name in ("resume", "push_to_hub"):
            continue
        flag = f"--{f.name.replace('_', '-')}"
        if isinstance(v, bool):
            parts.append(flag)
        elif isinstance(v, list):  # a repeatable option
            parts += [x for item in v for x in (flag, str(item))]
        elif isinstance(v, tuple):  # a comma-separated one
            parts += [flag, ",".join(map(str, v))]
        else:
            parts += [flag, str(v)]
    import shlex

    return shlex.join(parts)


def publish(folder: Path, cfg: TrainConfig, *, method: str, base_model: str, data: Any, held_out: dict | None,
            command: str, log: Log, num_speculative_tokens: int | None = None) -> str | None:
    """The model card in ``folder`` (README.md), then ``--push-to-hub``; returns the repo's URL or None."""
    from specctl import hub

    hub.write_model_card(folder, base_model=base_model, method=method, data=data, command=command,
                         held_out=held_out, repo=cfg.push_to_hub, num_speculative_tokens=num_speculative_tokens)
    if not cfg.push_to_hub:
        return None
    url = hub.push_to_hub(folder, cfg.push_to_hub)
    log(f"pushed {folder} to {url}")
    return url


def card_data(cfg: TrainConfig, **counts) -> dict:
    """What a model card says the draft was trained on."""
    out: dict[str, Any] = {}
    if cfg.data:
        out["data files"] = cfg.data
    if cfg.self_distill:
        out["self-distilled"] = (f"the target's own answers to {', '.join(cfg.self_distill)} "
                                 f"(first {cfg.hold_out} prompts of a workload held out; up to {cfg.max_new_tokens} "
                                 f"tokens, temperature {cfg.distill_temperature})")
    out.update({k.replace("_", " "): v for k, v in counts.items()})
    return out


def autocast_on(cfg, device) -> bool:
    """``cfg.autocast`` as given, else on where bf16 matmuls are native: a bf16 target (``cfg.dtype``) on CUDA,
    or on a CPU with AVX512-BF16 (AMX CPUs have it too); elsewhere bf16 would be emulated, slower than fp32."""
    if cfg.autocast is not None:
        return cfg.autocast
    if cfg.dtype != "bfloat16":
        return False
    if device.type == "cuda":
        import torch

        return torch.cuda.is_bf16_supported()
    from specctl.kernels import cpu

    return device.type == "cpu" and cpu.has("avx512_bf16")
