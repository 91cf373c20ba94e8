"""`mhar eval DIR ...`: evaluate a model with lm-eval (`mhar eval compare` is its own command)."""

from __future__ import annotations

from pathlib import Path

HELP = "evaluate with lm-eval; `mhar eval compare RUN_A RUN_B` compares two runs"
DESCRIPTION = """Evaluate DIR with the LM Evaluation Harness, by default with the paper's protocol
(gsm8k 5-shot strict-match exact match, gpqa_main_zeroshot accuracy), and write a run folder
(results.json, per-item samples_<task>.jsonl). Offline: --tasks gsm8k_local,gpqa_main_zeroshot_local
--data-dir DATA reads DATA/gsm8k/{train,test}.jsonl and DATA/gpqa/gpqa_main.csv. To compare two
runs: mhar eval compare RUN_A RUN_B (a model folder named `compare` is reached as ./compare)."""


def add_arguments(parser) -> None:
    from mhar_hf.evaluate import PAPER_TASKS

    parser.add_argument("path", metavar="DIR", help="a saved model folder")
    parser.add_argument("--tasks", default=",".join(PAPER_TASKS), help="comma-separated task names")
    parser.add_argument("--limit", type=int, help="only the first N items of each task (smoke runs)")
    parser.add_argument("--batch-size", default="auto", help="an integer or 'auto'")
    parser.add_argument("--output", type=Path, help="the run folder to write (default: DIR/eval/<UTC time>)")
    parser.add_argument("--data-dir", type=Path, help="folder of local data files for the *_local tasks")
    parser.add_argument("--include-path", type=Path, action="append", default=[],
                        help="an extra lm-eval task folder (repeatable)")
    parser.add_argument("--device", help="cpu, cuda, cuda:1... (default: cuda when available)")
    parser.add_argument("--max-gen-toks", type=int, help="cap on generated tokens (default: the task's, 256)")
    parser.add_argument("--seed", type=int, default=0)


def run(args) -> int:
    from mhar_hf.evaluate import evaluate

    tasks = [name.strip() for name in args.tasks.split(",") if name.strip()]
    evaluate(args.path, tasks, limit=args.limit, batch_size=args.batch_size, output=args.output,
             data_dir=args.data_dir, include_paths=args.include_path, device=args.device,
             max_gen_toks=args.max_gen_toks, seed=args.seed)
    return 0
