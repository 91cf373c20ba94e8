"""The `mhar` command line: info and the end-to-end demo."""

import subprocess
import sys

import pytest
import torch
from conftest import HANG_GUARD_S
from test_modeling import build, randomise_routing

from mhar_cli import main
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
    result = subprocess.run([sys.executable, "-m", "mhar_cli", "demo", "--workdir", str(tmp_path)],
                            capture_output=True, text=True)
    assert result.returncode == 2 and "not empty" in result.stderr
    assert (tmp_path / "keep.txt").read_text() == "mine"


def test_the_demo_says_where_its_files_are(tmp_path, monkeypatch, capsys):
    """Never a temporary folder that is already gone."""
    from mhar_hf.demo import pipeline

    workdirs = []
    monkeypatch.setattr(pipeline, "run_demo", lambda workdir, seed=0: workdirs.append(workdir))
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "now removed: pass --workdir DIR to keep them" in out and str(workdirs[0]) not in out
    assert not workdirs[0].exists()
    assert main(["demo", "--workdir", str(tmp_path / "kept")]) == 0
    assert f"are in {tmp_path / 'kept'}" in capsys.readouterr().out


def test_help_and_info_start_without_torch(tmp_path):
    """`mhar --help` and `mhar info` import neither torch nor transformers (seconds each), so
    they answer at once."""
    model = build("delta")
    model.save_pretrained(tmp_path)
    script = ("import sys\nfrom mhar_cli import main\n"
              "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
              f"assert main(['info', {str(tmp_path)!r}]) == 0\n"
              "heavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules)\n"
              "print('heavy:', heavy)\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert result.returncode == 0, result.stderr
    assert "heavy: []" in result.stdout and "routing" in result.stdout and "COMMAND" in result.stdout


def test_each_command_has_its_own_help(capsys):
    for argv, expected in ((["eval", "compare", "--help"], "usage: mhar eval compare [-h] RUN_A RUN_B"),
                           (["convert", "--help"], "(default: 8)"), (["eval", "--help"], "usage: mhar eval")):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 0 and expected in capsys.readouterr().out, argv
    with pytest.raises(SystemExit) as exit_:
        main(["convrt"])
    assert exit_.value.code == 2 and "invalid choice: 'convrt'" in capsys.readouterr().err
