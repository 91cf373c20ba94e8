"""`mhar demo`: run the whole path on the tiny embedded default."""

from __future__ import annotations

import tempfile
from pathlib import Path


HELP = "run the whole path on a tiny model and the embedded text"


def add_arguments(parser) -> None:
    parser.add_argument("--workdir", type=Path, help="where to write models (default: a temporary folder)")
    parser.add_argument("--seed", type=int, default=0)


def run(args) -> int:
    from mhar_hf.demo.pipeline import run_demo

    if args.workdir is not None:
        if args.workdir.exists() and any(args.workdir.iterdir()):
            raise FileExistsError(f"--workdir {args.workdir} is not empty: choose a new folder")
        run_demo(args.workdir, seed=args.seed)
        print(f"the demo's models and runs are in {args.workdir}")
        return 0
    with tempfile.TemporaryDirectory(prefix="mhar-demo-") as tmp:
        run_demo(Path(tmp), seed=args.seed)
    print("the demo's models and runs were in a temporary folder, now removed: pass --workdir DIR to keep them")
    return 0
