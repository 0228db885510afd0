"""Atomic writes: a reader sees the old file or the new one, whole, never half of one.

Every file specctl writes that a user or a later run reads (exported drafts, checkpoints, reports,
caches, vocabulary maps) goes through ``write_atomic``: the content is written to a temp sibling,
then renamed over the target (``os.replace`` is atomic on one filesystem). A failure removes the
temp file and leaves the old content in place.

What it does not know: formats (callers pass a writer), torch.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any, Callable


def write_atomic(path: str | os.PathLike, write: Callable[[Path], Any]) -> Path:
    """``write(tmp)`` fills a temp sibling of ``path``, which is then renamed over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> Path:
    def write(tmp: Path) -> None:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())

    return write_atomic(path, write)


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    return write_bytes_atomic(path, text.encode("utf-8"))


def write_json_atomic(path: str | os.PathLike, obj, indent: int | None = 2) -> Path:
    return write_text_atomic(path, json.dumps(obj, indent=indent, default=str) + "\n")
