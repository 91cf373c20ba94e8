"""Facts about a saved MHAR model folder, read without loading the weights."""

from __future__ import annotations

import json
import os
from pathlib import Path


def read_mhar_config(path: str | os.PathLike) -> dict:
    """The raw config.json of an MHAR model folder; a clear error when it is not one."""
    folder = Path(path)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} not found: pass a model folder written by save_pretrained")
    config = json.loads(config_file.read_text())
    if config.get("model_type") != "mhar":
        raise ValueError(f"{folder} holds a {config.get('model_type')!r} model, not an MHAR one (model_type 'mhar')")
    return config


def parameter_counts(path: str | os.PathLike) -> dict[str, int]:
    """Backbone and routing parameter counts, from the safetensors headers."""
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
