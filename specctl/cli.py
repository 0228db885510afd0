"""The root ``specctl`` command: registers each command module and maps errors to exit codes.

Command modules import only typer/rich at module level; torch and transformers are imported
inside the command functions so that ``specctl --help`` answers fast.
"""

from __future__ import annotations

import os
import sys

import typer
from typer.core import TyperGroup

from specctl.commands import (bench, build_vocab_map, models, recommend, serve, train_eagle, train_medusa,
                              train_mtp)

class _Interrupted(Exception):
    """Ctrl-C in a command, carried past typer (which turns a KeyboardInterrupt into a silent exit 130) to
    ``main``; its cause is the KeyboardInterrupt, whose text is the command's hint (a trainer's resume)."""


class _Group(TyperGroup):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt as e:
            raise _Interrupted() from e


app = typer.Typer(
    cls=_Group,
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
        rv = app(standalone_mode=False)  # click's errors come here, to be one line (its own are a box of several)
    except (_Interrupted, typer.Abort, KeyboardInterrupt) as e:  # Ctrl-C (the KeyboardInterrupt is the cause)
        _interrupted(e)
    except SpecctlError as e:
        if debug:
            raise
        print(f"Error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except Exception as e:  # an unexpected failure: still one line unless debugging
        if hasattr(e, "format_message") and hasattr(e, "exit_code"):  # click's (typer's copy of it): a bad option
            _click_error(e)
        if debug:
            raise
        print(f"Error: {type(e).__name__}: {e} (rerun with SPECCTL_DEBUG=1 for the traceback)", file=sys.stderr)
        sys.exit(1)
    if rv == 130:  # a Ctrl-C outside a command (typer's silent exit 130)
        _interrupted(KeyboardInterrupt())
    sys.exit(rv if isinstance(rv, int) else 0)  # typer.Exit(code) comes back as the code


def _click_error(e) -> None:
    """A click error (a missing or malformed option, an unknown command): one line naming the problem and the
    command's --help, its exit code (2 for usage); click's own is a box of several lines. No arguments at all
    (its message empty) shows the help, as click does."""
    message = e.format_message().strip()
    if not message:
        e.show()
        sys.exit(e.exit_code)
    ctx = getattr(e, "ctx", None)
    where = f" see '{ctx.command_path} --help'" if ctx is not None else ""
    print(f"Error: {message.rstrip('.')}.{where}", file=sys.stderr)
    sys.exit(e.exit_code)


def _interrupted(e: BaseException) -> None:
    """Ctrl-C: one line on stderr (with what the command said to do next, a trainer's resume hint), exit 130."""
    hint = ""
    while e is not None and not hint:  # the KeyboardInterrupt is the cause of _Interrupted
        hint = str(e) if isinstance(e, KeyboardInterrupt) else ""
        e = e.__cause__ or e.__context__
    print(f"Interrupted. {hint}".strip(), file=sys.stderr)
    sys.exit(130)


if __name__ == "__main__":
    main()
