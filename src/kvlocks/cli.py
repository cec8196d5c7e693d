"""The ``kvlocks`` command.

The product's subcommands live in ``kvlocks.commands.<name>``. Other installed packages add
theirs through the ``kvlocks.commands`` entry-point group (the lab adds ``eval``, ``fidelity``,
``compaction-study`` and ``bench``): each entry point names a module with ``add_parser(subparsers)``.
The product imports nothing from them; a command whose package lacks its optional dependencies
says which extra to install.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from importlib.metadata import entry_points

COMMANDS = ("demo", "generate", "compact")
ENTRY_POINT_GROUP = "kvlocks.commands"


def _add_plugin_commands(sub) -> None:
    for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        try:
            module = ep.load()
        except ImportError as exc:  # a plugin package installed without its extras
            p = sub.add_parser(ep.name, help=f"(unavailable: {exc.name or exc} is not installed)")
            p.set_defaults(func=_missing(ep.name, exc))
            continue
        module.add_parser(sub)


def _missing(name: str, exc: ImportError):
    def run(args):
        raise SystemExit(f"kvlocks {name}: needs {exc.name or exc}, which is not installed; "
                         f"install the lab: pip install kvlocks-lab")
    return run


def build_parser(*, plugins: bool = True) -> argparse.ArgumentParser:
    """The whole command line; every parser below it shows each option's default in ``--help``.

    ``plugins=False`` leaves out the entry-point commands (their parsers import their packages).
    """
    from kvlocks.commands.common import Parser

    parser = Parser(prog="kvlocks", description="Cheaper long-context decoding.")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log progress details and show the libraries' own loading output and warnings")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for name in COMMANDS:
        importlib.import_module(f"kvlocks.commands.{name}").add_parser(sub)
    if plugins:
        _add_plugin_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # a product command needs no plugin parser: skipping them keeps the checks before the model
    # load down to the time of importing torch
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(plugins=command not in COMMANDS).parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as exc:
        print(f"kvlocks {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
