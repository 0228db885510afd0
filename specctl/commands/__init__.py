"""One module per subcommand, each with ``register(app)``. Thin: parse the options, build a config,
call recommend / bench / training / runtime, render the result (rich on stderr, results on stdout,
``--json`` for scripts). Options shared by several commands are declared once (``_options``).

What it does not know: anything a command computes; torch is imported inside the command functions,
so ``specctl --help`` stays fast.
"""
