"""The `mhar` command line.

Kept apart from `mhar_hf`, whose import loads torch and transformers' model code (and registers
the model with the Auto classes): `mhar --help` and `mhar info` start at once, and a command
imports what it needs when it runs. Each subcommand is a module of `mhar_cli.commands` with a
one-line `HELP`, `add_arguments(parser)` and `run(args)`; a command whose options may also come from a
file adds `parse(parser, argv)`.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from pathlib import Path

# command (one or two words): module in mhar_cli.commands, in the order `mhar --help` lists them
COMMANDS = {
    "info": "info",
    "demo": "demo",
    "convert": "convert",
    "verify-identity": "verify_identity",
    "train": "train",
    "probe": "probe",
    "eval": "eval",
    "eval compare": "eval_compare",
    "card": "card",
}
DESCRIPTION = "Multi-Head Attention Residuals for transformers"


def folder_module():
    """`mhar_hf.folder` (the model-folder contract: plain Python) without importing torch, for
    commands that answer at once. A plain `import mhar_hf.folder` runs `mhar_hf/__init__.py` first,
    which loads torch and transformers' model code (seconds); so while `mhar_hf` is not imported,
    the module's file is loaded on its own, under a name of this package. Once `mhar_hf` is
    imported, its own `mhar_hf.folder` is returned."""
    if "mhar_hf" in sys.modules:
        return importlib.import_module("mhar_hf.folder")
    name = f"{__name__}._mhar_hf_folder"
    if name not in sys.modules:
        package = importlib.util.find_spec("mhar_hf")  # finds the package without running it
        if package is None or not package.submodule_search_locations:
            raise ModuleNotFoundError("mhar_hf is not installed", name="mhar_hf")
        location = Path(next(iter(package.submodule_search_locations))) / "folder.py"
        spec = importlib.util.spec_from_file_location(name, location)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # before it runs: its dataclasses look their module up there
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name]


def command_module(name: str):
    return importlib.import_module(f"mhar_cli.commands.{COMMANDS[name]}")


def overview_parser() -> argparse.ArgumentParser:
    """`mhar` with the list of commands (each command's own parser is built only when it runs)."""
    parser = argparse.ArgumentParser(prog="mhar", description=DESCRIPTION)
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        if " " not in name:
            subparsers.add_parser(name, help=command_module(name).HELP, add_help=False)
    return parser


def command_parser(name: str) -> argparse.ArgumentParser:
    module = command_module(name)
    parser = argparse.ArgumentParser(prog=f"mhar {name}", description=getattr(module, "DESCRIPTION", module.HELP),
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    module.add_arguments(parser)
    parser.set_defaults(run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in COMMANDS:
        overview_parser().parse_args(argv)  # prints the commands, or says what is wrong, and exits
    words = 2 if " ".join(argv[:2]) in COMMANDS else 1
    name = " ".join(argv[:words])
    parser, module = command_parser(name), command_module(name)
    args = module.parse(parser, argv[words:]) if hasattr(module, "parse") else parser.parse_args(argv[words:])
    try:
        return args.run(args) or 0
    except (FileNotFoundError, ValueError, FileExistsError, NotADirectoryError) as error:
        print(f"mhar {name}: error: {error}", file=sys.stderr)
        return 2
