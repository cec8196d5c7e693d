"""Subcommands of the ``kvlocks`` CLI: each module has ``add_parser(subparsers)``."""
