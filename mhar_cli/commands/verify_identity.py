"""`mhar verify-identity SRC DST`: check that a converted model computes exactly what its source does."""

from __future__ import annotations


HELP = "compare a converted MHAR model with its source: logits bit for bit, greedy generations"
DESCRIPTION = "Exit status 0 when logits are bit-equal and greedy generations match in every dtype, 1 otherwise."


def add_arguments(parser) -> None:
    from mhar_hf.verify import DEFAULT_DTYPES

    parser.add_argument("src", help="the source checkpoint folder")
    parser.add_argument("dst", help="the converted MHAR model folder")
    parser.add_argument("--dtypes", nargs="+", default=list(DEFAULT_DTYPES), help="dtypes to check")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="greedy tokens per prompt")
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    parser.add_argument("--attn-implementation", default="eager",
                        help="token attention of both models: eager, sdpa, flash_attention_2, flex_attention")


def run(args) -> int:
    from mhar_hf.verify import verify_identity

    report = verify_identity(args.src, args.dst, dtypes=args.dtypes, max_new_tokens=args.max_new_tokens,
                             device=args.device, attn_implementation=args.attn_implementation)
    print(report.summary())
    return 0 if report.ok else 1
