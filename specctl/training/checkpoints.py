"""Training checkpoints and configs on disk, shared by every trainer.

A run's output folder holds ``training_config.json`` (every setting, as JSON) and
``checkpoints/step-NNNNNNN/`` folders, each complete once it has its final name (written into a temp
folder, then renamed); the newest ``keep`` are kept. What is inside a checkpoint is the trainer's.

What it does not know: draft networks and their export formats (``specctl.drafts``), torch.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from specctl.fetch import atomic_dir
from specctl.files import write_json_atomic

TRAINING_CONFIG = "training_config.json"
CHECKPOINTS = "checkpoints"

def checkpoint_dirs(output: str | Path) -> list[Path]:
    """Complete checkpoints under output/checkpoints/, oldest first (a folder is complete once renamed)."""
    root = Path(output) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and re.fullmatch(r"step-\d+", p.name)
             and (p / "trainer_state.json").is_file()]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def save_checkpoint(output: str | Path, step: int, write, keep: int = 2) -> Path:
    """Write checkpoint ``step`` atomically: ``write(tmp_folder)`` fills a temp folder, which is then
    renamed to output/checkpoints/step-NNNNNNN; older checkpoints beyond ``keep`` are removed."""
    final = Path(output) / CHECKPOINTS / f"step-{step:07d}"
    with atomic_dir(final) as tmp:
        write(tmp)
    if keep > 0:
        for old in checkpoint_dirs(output)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def write_training_config(folder: str | Path, config: dict) -> None:
    """The training config as JSON, beside every checkpoint and every export."""
    write_json_atomic(Path(folder) / TRAINING_CONFIG, config)
