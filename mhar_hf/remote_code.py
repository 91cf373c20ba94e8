"""Write the flat trust_remote_code bundle next to saved weights.

The bundle is the three files that define the model (config, modeling, routing op), copied
as they are, plus an `auto_map` in config.json. A process that never imported `mhar_hf` can
then load the folder with `AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)`.
The fused kernels are not part of it: the routing op uses them only when `mhar_hf` is installed.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from .folder import read_mhar_config, write_atomically

BUNDLE_FILES = ("configuration_mhar.py", "modeling_mhar.py", "routing.py")
AUTO_MAP = {
    "AutoConfig": "configuration_mhar.MHARConfig",
    "AutoModel": "modeling_mhar.MHARModel",
    "AutoModelForCausalLM": "modeling_mhar.MHARForCausalLM",
}


def save_remote_code(path: str | os.PathLike) -> None:
    """Copy the model's source files into `path` and add `auto_map` to its config.json."""
    folder = Path(path)
    config_file = folder / "config.json"
    config = read_mhar_config(folder)
    package = Path(__file__).parent
    for name in BUNDLE_FILES:
        shutil.copyfile(package / name, folder / name)
    config["auto_map"] = AUTO_MAP
    write_atomically(config_file, json.dumps(config, indent=2, sort_keys=True) + "\n")
