"""The `mhar` command line. Each subcommand lives in its own module under `mhar_hf.commands`
and adds itself through `register(subparsers)`; this file only dispatches."""

from __future__ import annotations

import argparse
import importlib
import sys

# Modules in mhar_hf.commands, in the order `mhar --help` lists them.
COMMANDS = ["info", "demo", "convert", "verify_identity", "train", "probe", "eval", "card"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mhar", description="Multi-Head Attention Residuals for transformers")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"mhar_hf.commands.{name}").register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args) or 0
    except (FileNotFoundError, ValueError, FileExistsError, NotADirectoryError) as error:
        print(f"mhar {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
