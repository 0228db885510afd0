"""Fetching packages from the registry, the cache folder, checksums and all-or-nothing folders.

What it knows: where specctl keeps downloaded and converted things (``cache_dir``), how to ask pip
for packages without their dependencies (``pip_download``), how to hash a large file without
reading it into memory (``sha256_file``), and how to build a folder so that it either appears
whole or not at all (``atomic_dir``).

What it does not know: which packages hold which models or data (``specctl.models`` and the data
modules decide that), nor how to unpack or convert them. It never prints: failures are raised as
``specctl.errors.FetchError`` with one line naming the problem and the fix. It imports no torch.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from specctl.errors import FetchError

__all__ = ["cache_dir", "pip_download", "sha256_file", "atomic_dir"]

_CHUNK = 1 << 20


def cache_dir() -> Path:
    """The specctl cache folder: ``$SPECCTL_CACHE`` if set, else the platform's user cache dir.

    Created on demand.
    """
    env = os.environ.get("SPECCTL_CACHE")
    if env:
        path = Path(env).expanduser()
    else:
        import platformdirs

        path = Path(platformdirs.user_cache_dir("specctl"))
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise FetchError(
            f"cannot create the cache folder {path} ({e.strerror})",
            "Set SPECCTL_CACHE to a writable folder",
        ) from e
    return path


def _normalize(name: str) -> str:
    """A project name as wheel file names spell it (PEP 503 normalisation, ``_`` separator)."""
    return re.sub(r"[-_.]+", "_", name).lower()


def _requirement_name(req: str) -> str:
    """The project name of a requirement string such as ``pkg==1.0`` or ``pkg[extra]>=2``."""
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
    if not m:
        raise FetchError(f"cannot read a package name from requirement {req!r}", "Write it as NAME==VERSION")
    return m.group(1)


def _requirement_version(req: str) -> str | None:
    m = re.search(r"===?\s*([A-Za-z0-9][A-Za-z0-9._+!-]*)\s*$", req)
    return m.group(1) if m else None


def _find_downloaded(req: str, dest: Path) -> Path | None:
    """The file pip put in ``dest`` for ``req`` (a wheel, or an sdist when no wheel exists)."""
    name, version = _normalize(_requirement_name(req)), _requirement_version(req)
    found = []
    for f in dest.iterdir():
        if not f.is_file():
            continue
        stem = f.name
        for ext in (".whl", ".tar.gz", ".zip"):
            if stem.endswith(ext):
                stem = stem[: -len(ext)]
                break
        else:
            continue
        if f.name.endswith(".whl"):
            parts = stem.split("-")
            if len(parts) < 2:
                continue
            fname, fversion = parts[0], parts[1]
        else:  # sdist: NAME-VERSION, and NAME may hold dashes
            fname, _, fversion = stem.rpartition("-")
        if _normalize(fname) != name or (version is not None and fversion != version):
            continue
        found.append(f)
    if not found:
        return None
    # Prefer a wheel; among several, the newest file.
    found.sort(key=lambda p: (p.name.endswith(".whl"), p.stat().st_mtime))
    return found[-1]


def pip_download(requirements: list[str], dest: Path) -> list[Path]:
    """Download ``requirements`` (without their dependencies) into ``dest`` with pip.

    Returns the downloaded files, one per requirement, in the order given. Files already in
    ``dest`` are reused by pip. Raises ``FetchError`` when pip fails or a file is missing after.
    """
    requirements = list(requirements)
    if not requirements:
        return []
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    if all(_requirement_version(r) for r in requirements):  # pinned, all already here: no index (works offline)
        have = [_find_downloaded(r, dest) for r in requirements]
        if all(f is not None for f in have):
            return have
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dest), *requirements]
    names = ", ".join(_requirement_name(r) for r in requirements[:3])
    if len(requirements) > 3:
        names += f" and {len(requirements) - 3} more"
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        raise FetchError(f"cannot run pip to download {names} ({e})", "Install pip in this Python environment") from e
    if proc.returncode != 0:
        lines = [ln.strip() for ln in (proc.stderr or proc.stdout or "").splitlines() if ln.strip()]
        errors = [ln for ln in lines if ln.startswith("ERROR")]
        reason = (errors[0] if errors else (lines[-1] if lines else f"exit code {proc.returncode}"))
        reason = reason.removeprefix("ERROR:").strip()
        raise FetchError(
            f"pip could not download {names}: {reason}",
            "Check network access to PyPI (or pip's index settings: pip config list) and retry",
        )
    out = []
    for req in requirements:
        f = _find_downloaded(req, dest)
        if f is None:
            raise FetchError(
                f"pip reported success but no file for {req} is in {dest}",
                "Delete that folder and retry",
            )
        out.append(f)
    return out


def sha256_file(path: str | os.PathLike) -> str:
    """The hex SHA-256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


@contextmanager
def atomic_dir(final: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty sibling temp folder; on success move it to ``final``, on error remove it.

    Nothing half-written is ever visible at ``final``. An existing ``final`` is replaced (moved
    aside first, removed once the new one is in place).
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp = final.parent / f".{final.name}.tmp-{tag}"
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if final.exists():
        old = final.parent / f".{final.name}.old-{tag}"
        os.replace(final, old)
    try:
        os.replace(tmp, final)
    except BaseException:
        if old is not None and not final.exists():
            os.replace(old, final)
            old = None
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
