"""Shared fixtures. Everything a test needs (models, tokenizers, data) is built here, offline."""

import json
import os
from pathlib import Path

# Triton reads this when a kernel is decorated, so it must be set before any kernel module is
# imported. On a machine with a GPU (MHAR_TEST_GPU=1) the kernels run natively instead.
if os.environ.get("MHAR_TEST_GPU") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

# transformers' own model tests run against MHAR from a scratch copy (transformers_suite/README.md),
# never in this suite.
collect_ignore = ["transformers_suite"]

# A subprocess still running after this long has hung. Never a speed check: a loaded CI machine
# may be many times slower than a quiet one.
HANG_GUARD_S = 1800

REAL_CONFIGS = Path(__file__).parent / "fixtures" / "real_configs"
REAL_CONFIG_NAMES = sorted(p.stem for p in REAL_CONFIGS.glob("*.json"))

# The sizes a shrunken real config gets; every other field of the published file is kept.
SHRUNK_SIZES = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, vocab_size=300)


def shrunk_real_config(name: str, **sizes) -> dict:
    """The published config.json of `name` with only its sizes made tiny (heads keep the
    published query/kv ratio; an explicit head_dim shrinks with them)."""
    config = json.loads((REAL_CONFIGS / f"{name}.json").read_text())
    sizes = {**SHRUNK_SIZES, **sizes}
    ratio = config["num_attention_heads"] // config.get("num_key_value_heads", config["num_attention_heads"])
    kv_heads = 2
    config.update(sizes, num_attention_heads=kv_heads * ratio, num_key_value_heads=kv_heads)
    if "head_dim" in config:
        config["head_dim"] = 16
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if isinstance(config.get(key), int) and config[key] >= config["vocab_size"]:
            config[key] = config["vocab_size"] - 1 - ("bos eos pad".split().index(key.split("_")[0]))
    if "max_window_layers" in config:
        config["max_window_layers"] = config["num_hidden_layers"]
    return config


@pytest.fixture(params=REAL_CONFIG_NAMES)
def real_config(request) -> dict:
    return shrunk_real_config(request.param)


@pytest.fixture(scope="session")
def tokenizer():
    from mhar_hf.tiny import demo_corpus, train_tokenizer

    return train_tokenizer([demo_corpus()], vocab_size=384)


@pytest.fixture(autouse=True)
def _seed_and_precision():
    torch.manual_seed(0)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 references must be real fp32
    yield
    torch.backends.cuda.matmul.allow_tf32 = tf32
