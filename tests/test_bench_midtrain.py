"""training/bench_midtrain.py: its dry run on the CPU (`--tiny`) runs `mhar train` through
`accelerate launch` for each preset x loss x model and writes a row of the results schema per
run; its plan, budget, ratios and models are what the GPU command relies on."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_benchmark_results import schema_errors

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "training"))
sys.path.insert(0, str(REPO / "benchmarks"))
import bench_midtrain  # noqa: E402
import results_log  # noqa: E402

CONFIG_KEYS = {"part", "preset", "model", "architecture", "mode", "routing", "loss", "compile", "checkpointing",
               "seq_length", "batch_size", "steps", "warmup", "weights", "autocast"}


def run_script(tmp_path, *options):
    env = {**os.environ, "MHAR_COMMIT": "0123abc"}
    env.pop("PYTEST_CURRENT_TEST", None)
    env.pop("MHAR_RESULTS_DIR", None)
    command = [sys.executable, "training/bench_midtrain.py", "--out", str(tmp_path / "logs"), "--tiny", "--skip-fsdp",
               "--results", str(tmp_path), *options]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


def test_dry_run_on_the_cpu_writes_a_row_per_preset_loss_and_model(tmp_path):
    """Both presets (the 8B slice with activation checkpointing), one loss each, compiled (a cheap
    backend): 4 runs of mhar train, plain first, each row in the schema with x plain on delta's."""
    done = run_script(tmp_path, "--presets", "1B", "8B-slice", "--losses", "chunked@1B", "fused-linear@8B-slice",
                      "--compile-backend", "aot_eager")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = results_log.read_results("midtrain", tmp_path)
    assert [(r["config"]["preset"], r["config"]["loss"], r["config"]["model"]) for r in rows] == [
        ("tiny-1B", "chunked", "plain"), ("tiny-1B", "chunked", "delta"),
        ("tiny-8B-slice", "fused-linear", "plain"), ("tiny-8B-slice", "fused-linear", "delta")]
    assert [schema_errors(r, "midtrain") for r in rows] == [[]] * 4
    assert {(r["date"], r["commit"], r["gpu"]) for r in rows} == {(rows[0]["date"], "0123abc", "cpu")}
    architectures = ["Qwen3ForCausalLM", "MHARForCausalLM", "LlamaForCausalLM", "MHARForCausalLM"]
    for row, architecture in zip(rows, architectures):
        config, metrics = row["config"], row["metrics"]
        assert set(config) == CONFIG_KEYS
        assert config["architecture"] == architecture
        delta = config["model"] == "delta"
        assert (config["mode"], config["routing"]) == (("delta", "auto") if delta else (None, None))
        assert config["compile"] == "aot_eager"
        assert config["checkpointing"] == (config["preset"] == "tiny-8B-slice")
        assert (config["batch_size"], config["seq_length"], config["steps"], config["warmup"]) == (2, 64, 3, 1)
        assert metrics["tokens_per_s_median"] > 0 and metrics["first_step_s"] > 0 and metrics["wall_s"] > 0
        assert metrics["peak_memory_gib"] is None  # no GPU
        assert metrics["write_s"] is not None  # each model's folder written by its (first) run
        assert metrics["first_loss"] > 0 and metrics["last_loss"] > 0
        assert ("tokens_per_s_vs_plain" in metrics) == delta
        assert metrics.get("fell_back_to_reference") is (False if delta else None)
    for plain, delta in (rows[:2], rows[2:]):
        assert delta["metrics"]["tokens_per_s_vs_plain"] == pytest.approx(
            delta["metrics"]["tokens_per_s_median"] / plain["metrics"]["tokens_per_s_median"], abs=2e-3)
    assert "| 8B-slice | delta | fused-linear | aot_eager |" in done.stdout
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == sorted(
        [f"throughput_{p}_{m}_{l}.log" for p, l in (("1B", "chunked"), ("8B-slice", "fused-linear"))
         for m in ("plain", "delta")] + ["summary.json"])


def test_a_run_past_the_budget_is_skipped_and_has_no_row(tmp_path):
    done = run_script(tmp_path, "--presets", "1B", "--no-compile", "--budget-s", "0")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "skipped 1B plain fused-linear" in done.stdout
    assert done.stdout.count("skipped (time)") == 4  # 2 losses x 2 models in the table
    assert results_log.read_results("midtrain", tmp_path) == []


def test_the_defaults_are_the_targets_command_and_fit_one_10_minute_command():
    args = bench_midtrain.parse_args(["--out", "x", "--skip-fsdp"])
    assert (args.presets, args.models, args.losses, args.compile, args.compile_backend) == (
        ["1B", "8B-slice"], ["plain", "delta"], ["fused-linear", "chunked"], True, "inductor")
    runs = bench_midtrain.plan(args)
    assert [(r["preset"], r["loss"], r["model"]) for r in runs] == [
        (p, l, m) for p in ("1B", "8B-slice") for l in ("fused-linear", "chunked") for m in ("plain", "delta")]
    # a model's first run writes its folder and compiles cold
    (first, later), (slice_first, slice_later) = bench_midtrain.ESTIMATE_S["1B"], bench_midtrain.ESTIMATE_S["8B-slice"]
    assert [r["estimate_s"] for r in runs] == [first, first, later, later, slice_first, slice_first, slice_later,
                                               slice_later]
    assert sum(r["estimate_s"] for r in runs) <= args.budget_s <= 600 - 2 * bench_midtrain.GRACE_S
    slice_run = runs[-1]
    assert (slice_run["batch_size"], slice_run["seq_length"], slice_run["checkpointing"]) == (4, 4096, True)
    assert (runs[0]["batch_size"], runs[0]["seq_length"], runs[0]["checkpointing"]) == (4, 4096, False)
    assert not bench_midtrain.parse_args(["--out", "x", "--no-compile"]).compile
    overridden = bench_midtrain.plan(bench_midtrain.parse_args(["--out", "x", "--presets", "100M", "--batch-size", "2",
                                                                "--steps", "6", "--warmup", "2"]))
    assert {(r["batch_size"], r["seq_length"], r["steps"], r["warmup"]) for r in overridden} == {(2, 2048, 6, 2)}


def test_losses_by_preset():
    parse = bench_midtrain.parse_losses
    assert parse(["fused-linear", "chunked@1B"], ["1B", "8B-slice"]) == {
        "1B": ["fused-linear", "chunked"], "8B-slice": ["fused-linear"]}
    assert parse(["chunked@100M,8B-slice", "fused-linear"], ["8B-slice"]) == {"8B-slice": ["chunked", "fused-linear"]}
    for bad in (["labels"], ["chunked@2B"]):
        with pytest.raises(ValueError):
            parse(bad, ["1B"])
    with pytest.raises(SystemExit):
        bench_midtrain.parse_args(["--out", "x", "--losses", "chunked@7B"])
    with pytest.raises(SystemExit):
        bench_midtrain.parse_args(["--out", "x", "--steps", "4", "--warmup", "4"])


def results(**peaks):
    """Throughput results of one preset: (model, loss) -> (tokens/s, peak GiB)."""
    base = dict(preset="1B", compile="inductor", checkpointing=False, seq_length=4096, batch_size=4, steps=12,
                warmup=4, write_s=None, wall_s=40.0, first_step_s=12.0, first_loss=12.0, last_loss=9.0)
    made = []
    for key, (tokens, peak) in peaks.items():
        model, loss = key.split("_", 1)
        made.append(dict(base, model=model, loss=loss.replace("_", "-"), mode=bench_midtrain.MODELS[model],
                         architecture="MHARForCausalLM" if model != "plain" else "Qwen3ForCausalLM",
                         fell_back_to_reference=False if model != "plain" else None,
                         tokens_per_s_median=tokens, peak_memory_gib=peak))
    return made


def test_ratios_rows_and_targets():
    made = results(plain_fused_linear=(40000.0, 48.0), delta_fused_linear=(39000.0, 50.0),
                   plain_chunked=(42000.0, 70.0), delta_chunked=(40000.0, 72.0))
    made.append(dict(made[-1], model="standard", mode="standard", status="out of memory"))
    bench_midtrain.add_ratios(made)
    by = {(r["model"], r["loss"]): r for r in made}
    assert by["delta", "fused-linear"]["tokens_per_s_vs_plain"] == pytest.approx(39 / 40)
    assert by["delta", "chunked"]["peak_memory_vs_plain"] == pytest.approx(72 / 70)
    assert by["delta", "fused-linear"]["peak_memory_vs_chunked"] == pytest.approx(50 / 72)
    assert by["plain", "fused-linear"]["peak_memory_vs_chunked"] == pytest.approx(48 / 70)
    assert not {"tokens_per_s_vs_plain", "peak_memory_vs_chunked"} & set(by["plain", "chunked"])
    args = bench_midtrain.parse_args(["--out", "x"])
    rows = bench_midtrain.result_rows({"throughput": made + [dict(made[0], status="skipped (time)")]}, args)
    assert len(rows) == 5  # the skipped run has no row
    config, metrics = rows[1]
    assert (config["preset"], config["model"], config["loss"], config["compile"], config["mode"]) == (
        "1B", "delta", "fused-linear", "inductor", "delta")
    assert metrics == dict(tokens_per_s_median=39000, tokens_per_s_vs_plain=0.975, peak_memory_gib=50.0,
                           peak_memory_vs_plain=1.042, peak_memory_vs_chunked=0.694, first_step_s=12.0,
                           first_loss=12.0, last_loss=9.0, write_s=None, wall_s=40.0, fell_back_to_reference=False)
    assert rows[-1][1] == {"out_of_memory": True, "fell_back_to_reference": False}
    for config, figures in rows:
        row = dict(benchmark="midtrain", date="2026-12-07", commit="0123abc", gpu="NVIDIA H100 80GB HBM3", torch=None,
                   triton=None, transformers=None, config=config, metrics=figures)
        assert schema_errors(row, "midtrain") == []
    table = bench_midtrain.markdown(made)
    assert "| 1B | delta | fused-linear | inductor | 39,000 | 0.975 | 50.00 | 1.042 | 0.694 |" in table
    assert "| 1B | standard | chunked | inductor | out of memory | | | | |" in table
    assert bench_midtrain.target_lines(made) == [
        "1B delta, fused-linear, compiled: 0.975x plain tokens/s (target >= 0.97): met",
        "1B delta peak memory, fused-linear / chunked: 0.694 (target <= 0.7): met",
        "1B delta, chunked, compiled: 0.952x plain tokens/s (target >= 0.97): missed"]


def test_the_models_are_bench_trains_and_the_slice_is_llama_3_1_8b_with_8_layers():
    from mhar_hf import MHARConfig

    published = json.loads((REPO / "tests/fixtures/real_configs/Llama-3.1-8B.json").read_text())
    delta = bench_midtrain.model_config("8B-slice", "delta")
    expected = MHARConfig.from_preset("8B", num_hidden_layers=8, residual_mode="delta", residual_heads=8,
                                      residual_num_blocks=8)
    ignored = {"dtype", "architectures", "transformers_version"}
    assert {k: v for k, v in delta.to_diff_dict().items() if k not in ignored} == {
        k: v for k, v in expected.to_diff_dict().items() if k not in ignored}
    assert (delta.architectures, delta.routing_implementation) == (["MHARForCausalLM"], "auto")
    plain = bench_midtrain.model_config("8B-slice", "plain")
    assert (type(plain).__name__, plain.architectures, plain.num_hidden_layers) == (
        "LlamaConfig", ["LlamaForCausalLM"], 8)
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
                "rms_norm_eps", "tie_word_embeddings"):
        assert getattr(plain, key) == published[key] == getattr(delta, key), key
    one_b = bench_midtrain.model_config("1B", "plain")
    assert (type(one_b).__name__, one_b.hidden_size, one_b.num_hidden_layers) == ("Qwen3Config", 1280, 36)
    standard = bench_midtrain.model_config("1B", "standard")
    assert (standard.residual_mode, standard.num_hidden_layers) == ("standard", 36)
    tiny = bench_midtrain.model_config("1B", "delta", tiny=True)
    assert (tiny.hidden_size, tiny.num_hidden_layers, tiny.residual_mode, tiny.qk_norm) == (64, 4, "delta", True)
