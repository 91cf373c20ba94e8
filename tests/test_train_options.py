"""Training options: one dataclass, both command lines generated from it, and `--config` files
(the committed recipes among them) under the command line."""

from pathlib import Path

import pytest

from mhar_cli import command_parser
from mhar_hf.train.options import OPTIONS, TrainOptions, build_parser, load_config, parse

RECIPES = sorted((Path(__file__).parents[1] / "training" / "recipes").glob("*.yaml"))
REQUIRED = ["--model", "m", "--data", "d.jsonl", "--output", "o"]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_every_recipe_sets_known_options_and_the_command_line_wins(recipe):
    values = load_config(recipe)
    assert values and set(values) <= set(OPTIONS)
    for parser in (build_parser(), command_parser("train")):
        args = parse(parser, ["--config", str(recipe), *REQUIRED])
        for name, value in values.items():
            got = getattr(args, name)
            assert (list(got) if isinstance(got, tuple) else got) == value, name
        assert parse(parser, ["--config", str(recipe), *REQUIRED, "--lr", "1e-5"]).lr == 1e-5


def test_a_recipe_can_hold_the_required_options_too(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("model: m\ndata: [a.jsonl, b.jsonl]\noutput: o\nmax-steps: 7\n")
    args = parse(build_parser(), ["--config", str(config)])
    assert (args.model, args.data, args.output, args.max_steps) == (Path("m"), ["a.jsonl", "b.jsonl"], Path("o"), 7)


def test_bad_config_files_and_missing_options_are_named(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("seq_lenght: 4096\n")
    for argv, message in ((["--config", str(bad), *REQUIRED, "--max-steps", "2"], "unknown option 'seq_lenght'"),
                          (["--config", str(tmp_path / "none.yaml"), *REQUIRED], "no such file"),
                          (REQUIRED, "required (on the command line or in --config): --max-steps")):
        with pytest.raises(SystemExit):
            parse(build_parser(), argv)
        assert message in capsys.readouterr().err


def test_help_shows_every_option_with_its_default(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name, spec in OPTIONS.items():
        assert f"--{name.replace('_', '-')}" in text
    assert "(default: 4096)" in text and "(default: cosine)" in text
    assert TrainOptions().seq_length == 4096 and TrainOptions(lr=1e-3).lr == 1e-3
