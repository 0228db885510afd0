"""Training checkpoints and configs on disk, shared by every trainer.

A run's output folder holds ``training_config.json`` (every setting, as JSON) and
``checkpoints/step-NNNNNNN/`` folders, each complete once it has its final name (written into a temp
folder, then renamed); the newest ``keep`` are kept. A folder holds ``trainer_state.json`` (step,
history: the trainer's), ``training_config.json``, and either what the trainer writes itself or,
with an ``accelerate.Accelerator``, what ``accelerator.save_state`` writes (the model's weights under
its own tensor names, the optimizer, the registered objects such as the schedule, every process's RNG
state), which ``load_checkpoint`` reads back.

What it does not know: draft networks and their export formats (``specctl.drafts``); accelerate is
imported only by the calls that take an Accelerator.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Callable

from specctl.fetch import atomic_dir
from specctl.files import write_json_atomic

TRAINING_CONFIG = "training_config.json"
CHECKPOINTS = "checkpoints"
TRAINER_STATE = "trainer_state.json"


def checkpoint_dirs(output: str | Path) -> list[Path]:
    """Complete checkpoints under output/checkpoints/, oldest first (a folder is complete once renamed)."""
    root = Path(output) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and re.fullmatch(r"step-\d+", p.name)
             and (p / TRAINER_STATE).is_file()]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def save_checkpoint(output: str | Path, step: int, write: Callable[[Path], None], keep: int = 2, acc=None) -> Path:
    """Write checkpoint ``step`` atomically: a temp folder is filled, then renamed to
    output/checkpoints/step-NNNNNNN; older checkpoints beyond ``keep`` are removed (0: none).

    Without ``acc``: ``write(tmp)`` fills it (call this on one process). With ``acc`` every process
    calls it: each saves its part of ``acc.save_state`` into the main process's temp folder, and
    ``write(tmp)`` runs on the main process only.
    """
    final = Path(output) / CHECKPOINTS / f"step-{step:07d}"
    if acc is None:
        with atomic_dir(final) as tmp:
            write(tmp)
    else:
        from accelerate.utils import broadcast_object_list

        if acc.is_main_process:
            with atomic_dir(final) as tmp:
                broadcast_object_list([str(tmp)])
                acc.save_state(str(tmp))
                write(tmp)
                acc.wait_for_everyone()  # every process has written its RNG state into tmp
        else:
            tmp = broadcast_object_list([None])[0]
            acc.save_state(tmp)
            acc.wait_for_everyone()
        acc.wait_for_everyone()  # the checkpoint has its final name everywhere
    if keep > 0 and (acc is None or acc.is_main_process):
        for old in checkpoint_dirs(output)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(folder: str | Path, acc) -> dict:
    """Restore what ``save_checkpoint(..., acc=acc)`` saved into the prepared objects; returns the trainer state."""
    acc.load_state(str(folder))
    return json.loads((Path(folder) / TRAINER_STATE).read_text())


def write_trainer_state(folder: str | Path, state: dict) -> None:
    write_json_atomic(Path(folder) / TRAINER_STATE, state)


def write_training_config(folder: str | Path, config: dict) -> None:
    """The training config as JSON, beside every checkpoint and every export."""
    write_json_atomic(Path(folder) / TRAINING_CONFIG, config)
