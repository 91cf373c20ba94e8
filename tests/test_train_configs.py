"""The accelerate configs in training/configs/ use only options `accelerate launch` knows, and
the FSDP2 ones wrap the model's real decoder-layer class."""

import argparse
from pathlib import Path

import pytest
import yaml

from mhar_hf import modeling_mhar

CONFIGS = sorted((Path(__file__).parents[1] / "training" / "configs").glob("*.yaml"))


def launch_options() -> set[str]:
    from accelerate.commands.launch import launch_command_parser

    parser = launch_command_parser()
    return {a.dest for a in parser._actions if isinstance(a, argparse.Action)}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_is_known_to_accelerate(path):
    from accelerate.commands.config.config_args import ClusterConfig

    ClusterConfig.from_yaml_file(str(path))  # raises on keys accelerate does not know
    config = yaml.safe_load(path.read_text())
    known = launch_options()
    assert config["distributed_type"] in ("NO", "MULTI_GPU", "FSDP")
    if config["distributed_type"] == "FSDP":
        fsdp = config["fsdp_config"]
        assert set(fsdp) <= known, set(fsdp) - known
        assert fsdp["fsdp_version"] == 2 and fsdp["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
        layer = getattr(modeling_mhar, fsdp["fsdp_transformer_layer_cls_to_wrap"])
        assert layer.__name__ in modeling_mhar.MHARPreTrainedModel._no_split_modules


def test_every_kind_of_run_has_a_config():
    assert {p.stem for p in CONFIGS} == {"cpu_smoke", "single_gpu", "fsdp2_multi_gpu", "fsdp2_multi_node"}
