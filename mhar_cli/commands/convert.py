"""`mhar convert SRC DST`: lift a Llama-family checkpoint into an identity-preserving MHAR delta model."""

from __future__ import annotations


HELP = "convert a Llama/Mistral/Qwen2/Qwen3 checkpoint into an MHAR delta model with identical outputs"
DESCRIPTION = ("Stream a pretrained checkpoint into an MHAR model in delta mode: backbone tensors copied byte for "
               "byte, routing tensors added with zero gates, so the outputs are unchanged.")


def add_arguments(parser) -> None:
    from mhar_hf.convert import DTYPE_CHOICES

    parser.add_argument("src", help="a local Hugging Face checkpoint folder (or a hub id, when it can be fetched)")
    parser.add_argument("dst", help="the folder to write; it must not exist or be empty (see --overwrite)")
    parser.add_argument("--heads", type=int, default=8, help="routing heads H (must divide hidden_size)")
    parser.add_argument("--num-blocks", type=int, default=8,
                        help="depth blocks of delta mode (a model with fewer layers gets a block per layer)")
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default="keep",
                        help="keep the stored dtypes or cast every tensor")
    parser.add_argument("--max-shard-size", default="5GB", help="output shard limit, e.g. 5GB or 4GiB")
    parser.add_argument("--verify", action="store_true",
                        help="check fp32 and bf16 logits and greedy generations against the source before finishing")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty DST")


def run(args) -> int:
    from mhar_hf.convert import convert_checkpoint

    convert_checkpoint(args.src, args.dst, heads=args.heads, num_blocks=args.num_blocks, dtype=args.dtype,
                       max_shard_size=args.max_shard_size, verify=args.verify, overwrite=args.overwrite)
    return 0
