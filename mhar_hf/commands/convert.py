"""`mhar convert SRC DST`: lift a Llama-family checkpoint into an identity-preserving MHAR delta model."""

from __future__ import annotations


def register(subparsers) -> None:
    from ..convert import DTYPE_CHOICES

    parser = subparsers.add_parser(
        "convert",
        help="convert a Llama/Mistral/Qwen2/Qwen3 checkpoint into an MHAR delta model with identical outputs",
        description="Stream a pretrained checkpoint into an MHAR model in delta mode: backbone tensors copied "
        "byte for byte, routing tensors added with zero gates, so the outputs are unchanged.",
    )
    parser.add_argument("src", help="a local Hugging Face checkpoint folder (or a hub id, when it can be fetched)")
    parser.add_argument("dst", help="the folder to write; it must not exist or be empty (see --overwrite)")
    parser.add_argument("--heads", type=int, default=8, help="routing heads H (must divide hidden_size; default 8)")
    parser.add_argument("--num-blocks", type=int, default=8, help="depth blocks (at most the layer count; default 8)")
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default="keep",
                        help="keep the stored dtypes (default) or cast every tensor")
    parser.add_argument("--max-shard-size", default="5GB", help="output shard limit, e.g. 5GB or 4GiB (default 5GB)")
    parser.add_argument("--verify", action="store_true",
                        help="check fp32 and bf16 logits and greedy generations against the source before finishing")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty DST")
    parser.set_defaults(run=run)


def run(args) -> int:
    from ..convert import convert_checkpoint

    convert_checkpoint(args.src, args.dst, heads=args.heads, num_blocks=args.num_blocks, dtype=args.dtype,
                       max_shard_size=args.max_shard_size, verify=args.verify, overwrite=args.overwrite)
    return 0
