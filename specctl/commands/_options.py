"""Options shared by several commands, declared once as ``Annotated`` aliases."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

ModelOpt = Annotated[
    Optional[str],
    typer.Option(
        "--model", "-m",
        help="Target model: a local HF folder, a .gguf file, a catalogue name (see `specctl models list`), or a "
        "Hugging Face Hub id (OWNER/NAME, from the local HF cache or downloaded). "
        "Default: smollm2-135m, pulled on first use.",
    ),
]
DtypeOpt = Annotated[str, typer.Option("--dtype", help="Weights and compute dtype: bfloat16 (fast on CPU) or float32.")]
DeviceOpt = Annotated[str, typer.Option("--device", help="cpu, cuda, cuda:N, or auto (cuda when available).")]
SeedOpt = Annotated[int, typer.Option("--seed", help="Seed for sampling and any randomness.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON on stdout instead of tables.")]
QuantizationOpt = Annotated[str, typer.Option(
    "--quantization", metavar="[none|gguf]",
    help="Weights as stored (vLLM's flag): none (dense; a .gguf is converted once to dense), or gguf (run a GGUF's "
    "quantized blocks as they are, on the CPU: --model FILE.gguf, or a catalogue name, whose GGUF is kept).")]


def use_quantization(value: str) -> str | None:
    """``--quantization`` as ``resolve_model`` takes it: None (dense) or "gguf" (an unknown value: a usage error)."""
    from specctl.models import normalize_quantization

    return normalize_quantization(value)


def use_kernels(mode: str) -> None:
    """``--kernels`` becomes the process's bf16 CPU path (an unknown mode: a usage error naming the choices)."""
    from specctl.modeling import set_kernels

    set_kernels(mode)


KernelsOpt = Annotated[str, typer.Option(
    "--kernels", help="bf16 CPU kernels: auto (specctl's row-independent C++ kernels where the CPU has AMX, "
    "AVX-512 or AVX2 with FMA, else torch's), fused (those or an error), torch (torch's own ops).")]
