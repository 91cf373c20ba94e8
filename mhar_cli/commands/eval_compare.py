"""`mhar eval compare RUN_A RUN_B`: the paired comparison of two `mhar eval` runs."""

from __future__ import annotations

HELP = "compare two `mhar eval` runs of the same items"
DESCRIPTION = """Print each run's accuracy, the discordant counts and the exact McNemar p-value for
every task both runs scored on the same items."""


def add_arguments(parser) -> None:
    parser.add_argument("run_a", metavar="RUN_A", help="an `mhar eval` run folder")
    parser.add_argument("run_b", metavar="RUN_B", help="another run folder, of the same tasks and items")


def run(args) -> int:
    from mhar_hf.compare import compare_runs, format_comparison

    print(format_comparison(compare_runs(args.run_a, args.run_b), args.run_a, args.run_b))
    return 0
