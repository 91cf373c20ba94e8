"""`mhar eval DIR ...`: evaluate a model with lm-eval; `mhar eval compare RUN_A RUN_B`: paired test.

Both forms share one parser: the first positional is either a model folder or the word
`compare` (a model folder literally named `compare` is reached as `./compare`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

USAGE = """mhar eval DIR [--tasks gsm8k,gpqa_main_zeroshot] [--limit N] [--batch-size auto] [--output RUN]
                 [--data-dir DATA] [--include-path FOLDER ...] [--device DEVICE] [--max-gen-toks N] [--seed N]
       mhar eval compare RUN_A RUN_B"""

DESCRIPTION = """Evaluate DIR with the LM Evaluation Harness, by default with the paper's protocol
(gsm8k 5-shot strict-match exact match, gpqa_main_zeroshot accuracy), and write a run folder
(results.json, per-item samples_<task>.jsonl). Offline: --tasks gsm8k_local,gpqa_main_zeroshot_local
--data-dir DATA reads DATA/gsm8k/{train,test}.jsonl and DATA/gpqa/gpqa_main.csv.
`mhar eval compare RUN_A RUN_B` prints each run's accuracy, the discordant counts and the exact
McNemar p-value for every task both runs scored on the same items."""


def register(subparsers) -> None:
    from ..evaluate import PAPER_TASKS

    parser = subparsers.add_parser("eval", help="evaluate with lm-eval, or compare two runs (eval compare A B)",
                                   usage=USAGE, description=DESCRIPTION)
    parser.add_argument("path", metavar="DIR", help="a saved model folder, or `compare`")
    parser.add_argument("runs", nargs="*", metavar="RUN", help=argparse.SUPPRESS)
    parser.add_argument("--tasks", default=",".join(PAPER_TASKS), help="comma-separated task names (default: %(default)s)")
    parser.add_argument("--limit", type=int, help="only the first N items of each task (smoke runs)")
    parser.add_argument("--batch-size", default="auto", help="an integer or 'auto' (default: auto)")
    parser.add_argument("--output", type=Path, help="the run folder to write (default: DIR/eval/<UTC time>)")
    parser.add_argument("--data-dir", type=Path, help="folder of local data files for the *_local tasks")
    parser.add_argument("--include-path", type=Path, action="append", default=[],
                        help="an extra lm-eval task folder (repeatable)")
    parser.add_argument("--device", help="cpu, cuda, cuda:1... (default: cuda when available)")
    parser.add_argument("--max-gen-toks", type=int, help="cap on generated tokens (default: the task's, 256)")
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(run=run, parser=parser)


def run(args) -> int:
    if args.path == "compare":
        return run_compare(args)
    if args.runs:
        args.parser.error(f"unexpected arguments {' '.join(args.runs)} (to compare two runs: mhar eval compare RUN_A RUN_B)")
    from ..evaluate import evaluate

    tasks = [name.strip() for name in args.tasks.split(",") if name.strip()]
    evaluate(args.path, tasks, limit=args.limit, batch_size=args.batch_size, output=args.output,
             data_dir=args.data_dir, include_paths=args.include_path, device=args.device,
             max_gen_toks=args.max_gen_toks, seed=args.seed)
    return 0


def run_compare(args) -> int:
    if len(args.runs) != 2:
        args.parser.error("compare needs two run folders: mhar eval compare RUN_A RUN_B")
    defaults = {"limit": None, "output": None, "data_dir": None, "include_path": [], "device": None,
                "max_gen_toks": None}
    given = [name for name, default in defaults.items() if getattr(args, name) != default]
    if given:
        args.parser.error(f"--{given[0].replace('_', '-')} does not apply to compare")
    from ..compare import compare_runs, format_comparison

    print(format_comparison(compare_runs(*args.runs), *args.runs))
    return 0
