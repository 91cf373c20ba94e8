import json

import pytest
from conftest import shrunk_real_config

import mhar_hf
from mhar_hf import MHARConfig
from mhar_hf.tiny import tiny_config


@pytest.mark.parametrize(
    "fields, named",
    [
        (dict(residual_mode="dense"), "residual_mode"),
        (dict(residual_heads=3), "residual_heads"),  # 64 is not a multiple of 3
        (dict(residual_heads=0), "residual_heads"),
        (dict(residual_num_blocks=0), "residual_num_blocks"),
        (dict(residual_mode="block", residual_block_layers=9), "residual_block_layers"),
        (dict(routing_implementation="cuda"), "routing_implementation"),
    ],
)
def test_invalid_fields_raise_a_value_error_naming_the_field(fields, named):
    with pytest.raises(ValueError, match=named):
        tiny_config(**fields)


def test_error_for_heads_lists_allowed_values():
    with pytest.raises(ValueError, match=r"\[1, 2, 4, 8, 16, 32, 64\]"):
        tiny_config(residual_heads=6)


@pytest.mark.parametrize(
    "name, width, layers, heads, kv_heads, ffn",
    [
        ("100M", 512, 12, 8, 4, 1536),
        ("350M", 1024, 24, 16, 8, 4096),
        ("1B", 1280, 36, 16, 8, 5120),
        ("8B", 4096, 32, 32, 8, 14336),
    ],
)
def test_presets_have_the_papers_shapes(name, width, layers, heads, kv_heads, ffn):
    config = MHARConfig.from_preset(name, residual_heads=4)
    got = (config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
           config.num_key_value_heads, config.intermediate_size)
    assert got == (width, layers, heads, kv_heads, ffn)
    assert config.residual_heads == 4


def test_from_scratch_presets_are_qwen3_style_and_8b_is_llama31():
    small = MHARConfig.from_preset("100M")
    assert small.qk_norm and small.tie_word_embeddings and small.rope_parameters["rope_theta"] == 1e4
    assert small.residual_heads == 8  # the paper's default H
    big = MHARConfig.from_preset("8B")
    published = json.loads(open("tests/fixtures/real_configs/Llama-3.1-8B.json").read())
    assert big.rope_parameters["rope_type"] == "llama3"
    assert big.rope_parameters["rope_theta"] == published["rope_theta"]
    assert big.vocab_size == published["vocab_size"] and not big.tie_word_embeddings


def test_unknown_preset():
    with pytest.raises(ValueError, match="100M"):
        MHARConfig.from_preset("3B")


def test_layers_per_block():
    assert tiny_config(num_hidden_layers=13, residual_mode="delta", residual_num_blocks=4).layers_per_block == 4
    assert tiny_config(num_hidden_layers=13, residual_mode="block", residual_block_layers=3).layers_per_block == 3
    assert tiny_config(num_hidden_layers=12, residual_mode="block", residual_num_blocks=4).layers_per_block == 3


def test_real_llama_config_fields_survive_a_round_trip(tmp_path):
    fields = shrunk_real_config("Llama-3.1-8B")
    fields.pop("model_type")
    config = MHARConfig(**fields, residual_mode="delta", residual_heads=4, residual_num_blocks=3)
    config.save_pretrained(tmp_path)
    loaded = mhar_hf.MHARConfig.from_pretrained(tmp_path)
    assert loaded.rope_parameters == config.rope_parameters
    assert loaded.rope_parameters["rope_type"] == "llama3"
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "mhar" and "rope_theta" not in saved and "torch_dtype" not in saved
    assert (loaded.residual_mode, loaded.residual_heads, loaded.residual_num_blocks) == ("delta", 4, 3)


@pytest.mark.parametrize("mode", ["full", "block", "delta"])
def test_the_default_block_count_fits_models_of_few_layers(mode):
    """residual_num_blocks=8 (the default) on a 4-layer model: one block per layer, not an error."""
    config = tiny_config(residual_mode=mode, num_hidden_layers=4, residual_num_blocks=8)
    assert config.layers_per_block == 1
