"""benchmarks/bench_generate.py: its dry run on the CPU writes a row per configuration, the plain
model and MHAR generating the same number of tokens; its shapes are what it says they are."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_benchmark_results import schema_errors
from transformers import AutoModelForCausalLM

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import bench_generate  # noqa: E402
import results_log  # noqa: E402

CONFIG_KEYS = {"shape", "model", "mode", "heads", "architecture", "cache", "path", "batch", "prompt", "new_tokens",
               "dtype", "attention", "layers", "hidden", "residual_num_blocks", "routing", "repeats", "compile"}


def test_dry_run_on_the_cpu_writes_a_row_per_configuration(tmp_path):
    env = {**os.environ, "MHAR_COMMIT": "0123abc"}
    env.pop("PYTEST_CURRENT_TEST", None)
    env.pop("MHAR_RESULTS_DIR", None)
    command = [sys.executable, "benchmarks/bench_generate.py", "--device", "cpu", "--tiny", "--shapes", "1B",
               "--batches", "2", "--prompt", "8", "--new-tokens", "4", "--repeats", "1", "--results", str(tmp_path)]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = results_log.read_results("generate", tmp_path)
    assert [(r["config"]["cache"], r["config"]["model"]) for r in rows] == [
        (cache, model) for cache in ("dynamic", "static") for model in ("plain", "delta", "full H=8")]
    assert [schema_errors(r, "generate") for r in rows] == [[]] * 6
    assert {(r["date"], r["commit"], r["gpu"]) for r in rows} == {(rows[0]["date"], "0123abc", "cpu")}
    for row in rows:
        config, metrics = row["config"], row["metrics"]
        assert set(config) == CONFIG_KEYS
        assert (config["shape"], config["batch"], config["prompt"], config["new_tokens"]) == ("tiny-1B", 2, 8, 4)
        assert config["path"] == {"dynamic": "eager", "static": "compiled"}[config["cache"]]
        plain = config["model"] == "plain"
        assert config["architecture"] == ("Qwen3ForCausalLM" if plain else "MHARForCausalLM")
        assert (config["mode"], config["heads"]) == (("plain", None) if plain else (config["model"].split()[0], 8))
        # every model generated exactly the tokens asked for: the plain model as many as MHAR
        assert metrics["new_tokens_generated"] == 4
        assert metrics["tokens_per_s"] > 0 and metrics["ttft_ms"] > 0 and metrics["decode_ms_per_token"] > 0
        assert metrics["peak_mem_gib"] is None  # no GPU
    for cache in ("dynamic", "static"):
        plain, *mhar = [r["metrics"] for r in rows if r["config"]["cache"] == cache]
        for metrics in mhar:
            assert metrics["ratio_vs_plain"] == round(metrics["tokens_per_s"] / plain["tokens_per_s"], 3)
            assert metrics["ttft_ratio_vs_plain"] == round(metrics["ttft_ms"] / plain["ttft_ms"], 3)
    for row in rows[3:]:  # compiled decoding: one graph for the step, no break (the routing reads traced into it)
        assert (row["metrics"]["graph_breaks"], row["metrics"]["graphs_compiled"]) == (0, 1)
        assert row["config"]["compile"] == {"backend": "aot_eager", "mode": None}
    assert "| tiny-1B | static | 2 | full H=8 |" in done.stdout


@pytest.mark.parametrize("shape, architecture", [("1B", "Qwen3ForCausalLM"), ("8B-slice", "LlamaForCausalLM")])
def test_the_plain_model_is_mhar_standard_without_routing(shape, architecture):
    """The plain model of a shape takes MHAR standard mode's weights, every one, and computes its
    logits: the same backbone."""
    config = bench_generate.mhar_config(shape, "standard", 8, tiny=True)
    settings = dict(dtype=torch.float32, attn_implementation="sdpa")
    mhar = AutoModelForCausalLM.from_config(config, **settings).eval()
    plain = AutoModelForCausalLM.from_config(bench_generate.plain_config(config), **settings).eval()
    assert type(plain).__name__ == architecture
    plain.load_state_dict(mhar.state_dict(), strict=True)
    ids = torch.randint(0, config.vocab_size, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, mhar(ids).logits, rtol=0, atol=0)


def test_the_8b_slice_is_llama_3_1_8b_with_8_layers_and_its_block_length():
    published = json.loads((REPO / "tests/fixtures/real_configs/Llama-3.1-8B.json").read_text())
    for mode in ("delta", "full"):
        config = bench_generate.mhar_config("8B-slice", mode, 8)
        assert (config.residual_mode, config.residual_heads, config.num_hidden_layers) == (mode, 8, 8)
        for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
                    "rms_norm_eps", "tie_word_embeddings"):
            assert getattr(config, key) == published[key], key
        assert config.rope_parameters["rope_type"] == "llama3"
    # delta blocks of 4 layers, as Llama-3.1-8B converted with 8 blocks (32 layers)
    assert bench_generate.mhar_config("8B-slice", "delta", 8).layers_per_block == 32 // 8
    one_b = bench_generate.mhar_config("1B", "full", 8)
    assert (one_b.hidden_size, one_b.num_hidden_layers, one_b.qk_norm) == (1280, 36, True)


def test_the_two_parts_cover_every_shape_and_cache_once(monkeypatch):
    pairs = [pair for part in bench_generate.PARTS.values() for pair in part]
    assert sorted(pairs) == sorted((s, c) for s in bench_generate.SHAPES for c in bench_generate.CACHES)
    monkeypatch.setattr(sys, "argv", ["bench_generate.py"])
    args = bench_generate.parse_args(["--device", "cpu", "--part", "1"])
    assert bench_generate.selection(args) == [("1B", "static")]
    assert (args.batches, args.prompt, args.new_tokens) == ((1, 8, 64), 512, 256)
    with pytest.raises(SystemExit):
        bench_generate.parse_args(["--device", "cpu", "--part", "1", "--shapes", "1B"])
