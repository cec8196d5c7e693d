"""The ``kvlocks`` command. Each subcommand lives in ``kvlocks.commands.<name>``."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

COMMANDS = ("demo", "generate", "eval", "fidelity", "compact", "compaction_study", "bench")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvlocks", description="Cheaper long-context decoding.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        importlib.import_module(f"kvlocks.commands.{name}").add_parser(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as exc:
        print(f"kvlocks {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
