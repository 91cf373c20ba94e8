"""`mhar info PATH`: the config of a saved MHAR model and its parameter counts."""

from __future__ import annotations

import json
from pathlib import Path


def register(subparsers) -> None:
    parser = subparsers.add_parser("info", help="print a saved model's config and parameter counts")
    parser.add_argument("path", help="a folder written by save_pretrained")
    parser.set_defaults(run=run)


def parameter_counts(path: str | Path) -> dict[str, int]:
    """Backbone and routing parameter counts, read from the checkpoint headers (no weights loaded)."""
    from safetensors import safe_open

    folder = Path(path)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    counts = {"backbone": 0, "routing": 0}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                numel = 1
                for size in f.get_slice(name).get_shape():
                    numel *= size
                counts["routing" if "_router." in name else "backbone"] += numel
    counts["total"] = counts["backbone"] + counts["routing"]
    return counts


def run(args) -> int:
    folder = Path(args.path)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} not found: PATH must be a folder written by save_pretrained")
    config = json.loads(config_file.read_text())
    if config.get("model_type") != "mhar":
        raise ValueError(f"{folder} holds a {config.get('model_type')!r} model, not an MHAR one")
    keys = ["residual_mode", "residual_heads", "residual_num_blocks", "residual_block_layers", "hidden_size",
            "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size",
            "qk_norm", "qkv_bias", "attention_bias", "tie_word_embeddings", "dtype", "rope_parameters"]
    width = max(map(len, keys))
    for key in keys:
        print(f"{key:<{width}}  {config.get(key)}")
    counts = parameter_counts(folder)
    share = counts["routing"] / max(counts["total"], 1)
    print(f"{'parameters':<{width}}  {counts['total']:,} (backbone {counts['backbone']:,}, "
          f"routing {counts['routing']:,} = {share:.4%})")
    return 0
