"""The `mhar` command line: info and the end-to-end demo."""

import subprocess
import sys

import torch
from test_modeling import build, randomise_routing

from mhar_hf.cli import main
from mhar_hf.demo.pipeline import STEPS, run_demo


def test_info_prints_config_and_parameter_counts(tmp_path, capsys):
    model = randomise_routing(build("delta"))
    model.save_pretrained(tmp_path)
    assert main(["info", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    routing = sum(p.numel() for n, p in model.named_parameters() if "_router." in n)
    backbone = sum(p.numel() for n, p in model.named_parameters() if "_router." not in n)
    assert f"backbone {backbone:,}, routing {routing:,}" in out
    assert "residual_mode" in out and "delta" in out


def test_info_on_a_folder_without_a_model(tmp_path, capsys):
    assert main(["info", str(tmp_path)]) == 2
    assert "config.json not found" in capsys.readouterr().err


def test_demo_runs_every_step(tmp_path):
    reports = []
    ctx = run_demo(tmp_path / "demo", report=reports.append)
    assert len(reports) == len(STEPS) + 1
    for index, (name, _) in enumerate(STEPS, 1):
        assert reports[index - 1].startswith(f"[{index}/{len(STEPS)}] {name}")
    assert (ctx.artifacts["scratch_path"] / "config.json").exists()
    assert torch.is_tensor(next(ctx.artifacts["scratch_model"].parameters()))


def test_demo_refuses_a_non_empty_workdir(tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    result = subprocess.run([sys.executable, "-m", "mhar_hf.cli", "demo", "--workdir", str(tmp_path)],
                            capture_output=True, text=True)
    assert result.returncode == 2 and "not empty" in result.stderr
    assert (tmp_path / "keep.txt").read_text() == "mine"
