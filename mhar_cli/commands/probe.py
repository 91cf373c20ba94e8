"""`mhar probe DIR --data FILE`: what the routing heads of a saved MHAR model read, as a table,
JSON and pictures (DIR/probe/ by default)."""

from __future__ import annotations

from pathlib import Path


HELP = "measure and plot what each routing head reads on a text"


def add_arguments(parser) -> None:
    parser.add_argument("path", metavar="DIR", help="an MHAR model folder (save_pretrained, with its tokenizer)")
    parser.add_argument("--data", required=True, type=Path, help="a text file, or jsonl with a 'text' field")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens of the text to probe")
    parser.add_argument("--out", type=Path, help="output folder (default DIR/probe)")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per forward window")
    parser.add_argument("--slices", type=int, default=4, help="query slices S for width disagreement")
    parser.add_argument("--null-draws", type=int, default=4, help="random matched-norm queries per site")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random null queries")
    parser.add_argument("--device", help="torch device (default: cuda when available, else cpu)")


def run(args) -> int:
    import torch

    from mhar_hf.folder import PROBE_FILES
    from mhar_hf.probe import format_table, probe_folder

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    report, out = probe_folder(
        args.path,
        args.data,
        tokens=args.tokens,
        out=args.out,
        seq_len=args.seq_len,
        slices=args.slices,
        null_draws=args.null_draws,
        seed=args.seed,
        device=device,
    )
    print(format_table(report))
    print(f"wrote {', '.join(PROBE_FILES[:-1])} and {PROBE_FILES[-1]} to {out}")
    return 0
