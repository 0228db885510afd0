"""train-mtp's run folders (``specctl.training.mtp``): which checkpoint ``--resume`` continues from, and
the checkpoints it refuses before any work (another trainer's, or one made for other sizes or another
layout), told from their tensors' shapes (a safetensors header, or the old single torch file).

What it does not know: training, the modules themselves (``train_mtp`` builds them on the meta device for
the shapes to compare with).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specctl.errors import ModelError
from specctl.training import checkpoints as C
from specctl.training import loop as L

LEGACY_CHECKPOINT = Path("checkpoint") / "state.pt"  # before checkpoints/: one torch.save'd dict


def newest_checkpoint(out: Path) -> Path | None:
    """The checkpoint ``--resume`` continues from (``L.resume_point``'s choice): the newest folder in
    out/checkpoints/, else the old single file ``LEGACY_CHECKPOINT``; None where there is neither."""
    ckpts = C.checkpoint_dirs(out)
    return ckpts[-1] if ckpts else (out / LEGACY_CHECKPOINT if (out / LEGACY_CHECKPOINT).is_file() else None)


def read_checkpoint(path: Path) -> tuple[dict[str, tuple[int, ...]], dict]:
    """(name -> shape of its module tensors, its state) of a checkpoint folder (its model.safetensors header,
    its trainer_state.json) or of the old single file (its "stack"; the whole file is the state)."""
    if path.is_dir():
        from specctl.models import open_safetensors

        shapes = {}
        if (path / "model.safetensors").is_file():
            with open_safetensors(path / "model.safetensors") as fh:
                shapes = {k: tuple(fh.get_slice(k).get_shape()) for k in fh.keys()}
        return shapes, json.loads((path / C.TRAINER_STATE).read_text())
    st = torch.load(path, map_location="cpu", weights_only=False)
    st = st if isinstance(st, dict) else {}
    if isinstance(st.get("stack"), dict):
        return {f"stack.{k}": tuple(v.shape) for k, v in st["stack"].items()}, st
    return {f"{k}.*": () for k in st}, st  # another trainer's file: its entries, to name them


def refuse_foreign_checkpoint(cfg: L.TrainConfig, out: Path, path: Path, found: dict[str, tuple[int, ...]],
                              want: dict[str, tuple[int, ...]]) -> None:
    """Checkpoint ``path`` in run folder ``out`` with tensors ``found``, none of them train-mtp's (``want``),
    is another trainer's (a copied train-eagle run, say): one line (ModelError) before any data or model is
    read, with or without --resume (``resume_point`` would advise resuming it). Its tensors say it is not
    train-mtp's (an old single-file checkpoint has no settings beside it); its settings (``L.made_by``) whose it is."""
    if set(found) & set(want):
        return
    why = (f"its weights are {L.some({k.split('.', 1)[0] + '.*' for k in found})}, train-mtp's are "
           f"{L.some({k.split('.', 1)[0] + '.*' for k in want})}") if found else "it holds no module weights"
    was = L.made_by(cfg, L.run_settings(path))
    if was:
        why += f"; {was} made it"
    raise ModelError(f"{out} holds a checkpoint train-mtp did not make ({path.relative_to(out)}: {why})",
                     "give train-mtp a new --output (resume that run with the trainer that made it)")


def misfit_reason(found: dict[str, tuple[int, ...]], want: dict[str, tuple[int, ...]]) -> str | None:
    """Why train-mtp checkpoint tensors ``found`` cannot be loaded as this run's ``want``, or None where they fit."""
    missing, extra = set(want) - set(found), set(found) - set(want)
    if missing or extra:
        return ", ".join(([f"{len(missing)} tensors missing ({L.some(missing)})"] if missing else [])
                         + ([f"{len(extra)} unexpected ({L.some(extra)})"] if extra else []))
    bad = next((k for k in want if found[k] != want[k]), None)
    return None if bad is None else f"{bad} is {list(found[bad])} there, {list(want[bad])} for this target"


def check_resumable(path: Path, found: dict[str, tuple[int, ...]], state: dict, want: dict[str, tuple[int, ...]],
                    layout: str, global_batch: int) -> None:
    """A train-mtp checkpoint this run could not load (another target's sizes, another layout, another global
    batch) is one line before the target's states are computed, not a state_dict error after them."""
    why = misfit_reason(found, want)
    if why is not None:
        was = L.run_settings(path).get("model")
        raise ModelError(f"--resume: the checkpoint {path} does not fit this run ({why})", "resume with the --model "
                         f"it was trained for{f' ({was})' if was else ''}, or choose a new --output")
    legacy = path.is_file()
    was_layout = state.get("layout", "deepseek_v3" if legacy else None)  # the old file predates other layouts
    L.need(was_layout == layout, f"the checkpoint {path} was trained for the {was_layout} layout, not {layout}",
           f"pass --layout {was_layout}, or drop --resume")
    if not legacy:
        L.check_global_batch(state, global_batch)
