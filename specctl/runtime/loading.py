"""Loading a target for the runtime: a dense HF folder (or a GGUF file, run quantized) as a
``LoadedModel`` (the model, its tokenizer, its stop tokens), and the ``--dtype``/``--device`` names.

What it does not know: running a model (``specctl.runtime.runner``), where models come from
(``specctl.models`` resolves ``--model`` to a folder or file).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from specctl.errors import ModelError, UsageError
from specctl.modeling import Transformer, load_transformer

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32,
          "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise UsageError(f"unknown dtype '{name}'", "use bfloat16 or float32") from None


def parse_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise UsageError(f"unknown device '{name}'", "use cpu, cuda, cuda:N or auto") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda was asked for but no CUDA device is available", "use --device cpu")
    return dev


@dataclass
class LoadedModel:
    """A target as loaded from a folder: the model, its tokenizer, and its stop tokens."""

    path: Path
    model: Transformer
    tokenizer: object
    stop_token_ids: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @property
    def name(self) -> str:
        return self.path.name


def load_model(path: str | Path, dtype: str = "bfloat16", device: str = "cpu") -> LoadedModel:
    """Load a dense HF folder (see ``specctl.models.resolve_model``) into the own runtime; a ``.gguf``
    file (what ``resolve_model(..., quantization="gguf")`` gives) runs quantized, its weights as stored
    (``load_gguf_model``, over ``specctl.runtime.quant``)."""
    from transformers import AutoTokenizer

    path = Path(path)
    if path.suffix.lower() == ".gguf" and path.is_file():
        return load_gguf_model(path, dtype, device)
    tdtype, tdev = parse_dtype(dtype), parse_device(device)
    model = load_transformer(path, tdtype, tdev)
    try:
        tok = AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # noqa: BLE001 - any tokenizer failure is a model-folder problem
        raise ModelError(f"cannot load the tokenizer from {path} ({type(e).__name__})",
                         "the folder needs tokenizer.json or tokenizer_config.json") from None
    return LoadedModel(path, model, tok, stop_token_ids(path, tok), tdtype, tdev)


def stop_token_ids(path: Path, tokenizer) -> tuple[int, ...]:
    """EOS ids from generation_config.json (int or list) plus the tokenizer's eos token."""
    ids: set[int] = set()
    gen = path / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return tuple(sorted(ids))


def load_gguf_model(path: str | Path, dtype: str = "bfloat16", device: str = "cpu"):
    """A LoadedModel over a GGUF file run quantized: the model, the tokenizer transformers
    converts from the GGUF, and the stop tokens its metadata names."""
    from gguf import GGUFReader
    from transformers import AutoTokenizer

    from specctl.runtime.quant import _field, load_gguf_transformer

    path = Path(path)
    tdtype, tdev = parse_dtype(dtype), parse_device(device)
    model = load_gguf_transformer(path, tdtype, tdev)
    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:  # noqa: BLE001 - any tokenizer failure is a file problem
        raise ModelError(f"cannot read the tokenizer of {path} ({type(e).__name__})",
                         "give a GGUF with its tokenizer (tokenizer.ggml.*)") from None
    stops = {int(v) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
             if (v := _field(GGUFReader(str(path)), k)) is not None}
    if getattr(tok, "eos_token_id", None) is not None:
        stops.add(int(tok.eos_token_id))
    print(f"specctl: {path.name} runs quantized ({model.cpu_kernels})", file=sys.stderr)
    return LoadedModel(path, model, tok, tuple(sorted(stops)), tdtype, tdev)
