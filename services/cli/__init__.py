"""The `blockspec` command line: one module per group of commands, `main` the parser and the serving commands."""
