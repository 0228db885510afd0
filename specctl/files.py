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

_UMASK = os.umask(0o022)
os.umask(_UMASK)


def write_atomic(path: str | os.PathLike, write: Callable[[Path], Any]) -> Path:
    """``write(tmp)`` fills a temp sibling of ``path``, which is then renamed over ``path``, with the mode
    a plain ``open`` gives under the umask (safetensors writes 0600: weights a server running as another
    user could not read)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        write(tmp)
        if tmp.is_file():
            give_umask_mode(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def give_umask_mode(path: str | os.PathLike) -> None:
    """Set a file's mode to the one a plain ``open`` gives under the umask (0644 under the usual 022)."""
    os.chmod(path, 0o666 & ~_UMASK)


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


def unwritable(path: str | os.PathLike, folder: bool) -> str | None:
    """Why ``path`` (a folder to create or fill when ``folder``, else a file to write) cannot be written,
    or None: checked before hours of work rather than at the save after them."""
    path = Path(path)
    if path.exists() and path.is_dir() != folder:
        return f"{path} is {'a file' if folder else 'a folder'}, not {'a folder' if folder else 'a file'}"
    anc = path if folder and path.exists() else path.parent
    while not anc.exists() and anc != anc.parent:
        anc = anc.parent
    if not anc.is_dir():
        return f"{anc} is a file, so {path} cannot be made inside it"
    if not os.access(anc, os.W_OK | os.X_OK):
        return f"{anc} is not writable"
    # root passes the permission check everywhere, /proc and read-only mounts included: try a file there
    probe = anc / f".specctl-write-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        probe.open("xb").close()
        probe.unlink()
    except OSError as e:
        return f"cannot create a file in {anc} ({e.strerror or type(e).__name__})"
    return None
