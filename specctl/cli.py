"""The root ``specctl`` command: registers each command module and maps errors to exit codes.

Command modules import only typer/rich at module level; torch and transformers are imported
inside the command functions so that ``specctl --help`` answers fast.
"""

from __future__ import annotations

import os
import sys

import typer

from specctl.commands import (bench, build_vocab_map, models, recommend, serve, train_eagle, train_medusa,
                              train_mtp)

app = typer.Typer(
    name="specctl",
    help="Speculative decoding toolkit: one lossless runtime for every draft method.\n\n"
    "Example: specctl bench --method ngram --workload code-edit",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
# Each command module defines register(app), in the order ``specctl --help`` lists them.
for _module in (recommend, train_medusa, train_eagle, train_mtp, build_vocab_map, bench, serve, models):
    _module.register(app)


def _print_version(value: bool) -> None:
    if value:
        from specctl import __version__

        typer.echo(__version__)
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", help="Print the version and exit.", is_eager=True,
                                 callback=_print_version),
) -> None:
    """Speculative decoding toolkit."""


def main() -> None:
    """Console entry point: run the app, turning SpecctlError into one line and an exit code."""
    import specctl
    from specctl.errors import SpecctlError

    specctl.process_defaults()  # before any command loads torch
    debug = os.environ.get("SPECCTL_DEBUG") == "1"
    try:
        app()
    except SystemExit as e:
        if e.code != 130:  # typer turns a Ctrl-C into exit 130, silently
            raise
        _interrupted(e)
    except SpecctlError as e:
        if debug:
            raise
        print(f"Error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except KeyboardInterrupt as e:
        _interrupted(e)
    except Exception as e:  # an unexpected failure: still one line unless debugging
        if debug:
            raise
        print(f"Error: {type(e).__name__}: {e} (rerun with SPECCTL_DEBUG=1 for the traceback)", file=sys.stderr)
        sys.exit(1)


def _interrupted(e: BaseException) -> None:
    """Ctrl-C: one line on stderr (with what the command said to do next, a trainer's resume hint), exit 130."""
    hint = ""
    while e is not None and not hint:  # the KeyboardInterrupt is the cause of typer's Exit(130)
        hint = str(e) if isinstance(e, KeyboardInterrupt) else ""
        e = e.__cause__ or e.__context__
    print(f"Interrupted. {hint}".strip(), file=sys.stderr)
    sys.exit(130)


if __name__ == "__main__":
    main()
