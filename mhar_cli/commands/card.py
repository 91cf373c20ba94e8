"""`mhar card DIR [--results RUN ...] [--baseline RUN ...]`: write DIR/README.md, the generated model card."""

from __future__ import annotations

from pathlib import Path


HELP = "write a model card (README.md with Hub metadata) for a saved model"


def add_arguments(parser) -> None:
    parser.add_argument("path", metavar="DIR", help="a saved MHAR model folder")
    parser.add_argument("--results", type=Path, nargs="+", metavar="RUN",
                        help="`mhar eval` run folders to report (default: every DIR/eval/* run)")
    parser.add_argument("--baseline", type=Path, nargs="+", metavar="RUN",
                        help="runs of another model (e.g. the source) on the same items: adds a paired comparison")
    parser.add_argument("--name", help="the model's name in the card and model-index (default: the folder name)")
    parser.add_argument("--overwrite", action="store_true", help="replace a README.md that `mhar card` did not write")


def run(args) -> int:
    from mhar_hf.card import write_card

    path = write_card(args.path, runs=args.results, name=args.name, baselines=args.baseline,
                      overwrite=args.overwrite)
    print(f"wrote {path}")
    return 0
