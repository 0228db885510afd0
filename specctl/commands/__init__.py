"""One module per subcommand. Thin: parse, build config, call runtime/training, render."""
