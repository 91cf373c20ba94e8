"""`mhar info PATH`: the config of a saved MHAR model and its parameter counts."""

from __future__ import annotations

from pathlib import Path

HELP = "print a saved model's config and parameter counts"


def add_arguments(parser) -> None:
    parser.add_argument("path", help="a folder written by save_pretrained")


def run(args) -> int:
    from .. import folder_module

    contract = folder_module()  # mhar_hf.folder, without torch
    folder = Path(args.path)
    config = contract.read_mhar_config(folder)
    keys = ["residual_mode", "residual_heads", "residual_num_blocks", "residual_block_layers", "hidden_size",
            "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size",
            "qk_norm", "qkv_bias", "attention_bias", "tie_word_embeddings", "dtype", "rope_parameters"]
    width = max(map(len, keys))
    for key in keys:
        print(f"{key:<{width}}  {config.get(key)}")
    counts = contract.parameter_counts(folder)
    share = counts["routing"] / max(counts["total"], 1)
    print(f"{'parameters':<{width}}  {counts['total']:,} (backbone {counts['backbone']:,}, "
          f"routing {counts['routing']:,} = {share:.4%})")
    return 0
