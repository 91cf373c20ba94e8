"""A saved folder with the remote-code bundle loads in a process that never imported mhar_hf."""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import HANG_GUARD_S
from test_modeling import build, randomise_routing

from mhar_hf import save_remote_code

LOADER = """
import sys, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True, attn_implementation="eager")
assert "mhar_hf" not in sys.modules, "the bundle imported the installed package"
assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
expected = torch.load(sys.argv[2])
with torch.no_grad():
    logits = model(expected["input_ids"]).logits
assert torch.equal(logits, expected["logits"]), (logits - expected["logits"]).abs().max()
print("remote-code load OK")
"""


@pytest.mark.parametrize("mode", ["full", "delta"])
def test_remote_code_bundle_loads_without_the_package(mode, tmp_path):
    model = randomise_routing(build(mode))
    model.save_pretrained(tmp_path / "model")
    save_remote_code(tmp_path / "model")
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_mhar.MHARForCausalLM"
    input_ids = torch.randint(2, 384, (2, 9))
    with torch.no_grad():
        torch.save({"input_ids": input_ids, "logits": model(input_ids).logits}, tmp_path / "expected.pt")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    env.pop("TRITON_INTERPRET", None)
    # run from an empty folder so that the repository checkout is not importable either
    result = subprocess.run([sys.executable, "-c", LOADER, str(tmp_path / "model"), str(tmp_path / "expected.pt")],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "remote-code load OK" in result.stdout


def test_bundle_needs_a_saved_mhar_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="save_pretrained"):
        save_remote_code(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="not an MHAR one"):
        save_remote_code(tmp_path)
