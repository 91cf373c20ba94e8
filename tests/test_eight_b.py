"""experiments/eight_b at --shape tiny on the CPU: the 8B path (checkpoint as the Hub ships it,
conversion, identity check, LoRA training of both models, generation) end to end, in seconds."""

import hashlib
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "experiments" / "eight_b"))
sys.path.insert(0, str(REPO / "benchmarks"))
import make_checkpoint  # noqa: E402
import run as eight_b  # noqa: E402
from results_log import read_results  # noqa: E402

PUBLISHED = json.loads((REPO / "tests" / "fixtures" / "real_configs" / "Llama-3.1-8B.json").read_text())


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """One run of every step but train-routing, in this process; (work folder, results folder, exit status)."""
    root = tmp_path_factory.mktemp("eight-b")
    work, results = root / "work", root / "results"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_DATASETS_CACHE", str(root / "datasets-cache"))
        status = eight_b.main(["--shape", "tiny", "--inline", "--work", str(work), "--results", str(results),
                               "convert", "verify", "train", "generate"])
    return work, results, status


def rows(results: Path, benchmark: str) -> list[dict]:
    return read_results(benchmark, results)


def test_the_checkpoint_is_laid_out_as_the_hub_ships_llama_3_1_8b(pipeline):
    work, _, status = pipeline
    assert status == 0
    folder = work / "llama-3.1-8b"
    config = json.loads((folder / "config.json").read_text())
    sizes = make_checkpoint.SHAPES["tiny"]["sizes"]
    assert {k: v for k, v in config.items() if k not in sizes and not k.endswith("_token_id")} == {
        k: v for k, v in PUBLISHED.items() if k not in sizes and not k.endswith("_token_id")}
    assert config["rope_scaling"]["rope_type"] == "llama3" and config["torch_dtype"] == "bfloat16"
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(folder.glob("model-*-of-*.safetensors"))
    assert len(shards) >= 2 and set(index["weight_map"].values()) == {s.name for s in shards}
    tensors = {}
    for shard in shards:
        with safe_open(str(shard), "pt") as handle:
            assert handle.metadata() == {"format": "pt"}
            found = {n: handle.get_tensor(n) for n in handle.keys()}
        assert sum(t.numel() * 2 for t in found.values()) <= 200_000 or len(found) == 1  # the tiny shard limit
        tensors.update(found)
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in tensors.values())
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    matrices = torch.cat([t.float().reshape(-1) for n, t in tensors.items() if not n.endswith("norm.weight")])
    assert abs(matrices.std().item() - PUBLISHED["initializer_range"]) < 1e-3 and abs(matrices.mean().item()) < 1e-3
    assert all(torch.equal(t, torch.ones_like(t)) for n, t in tensors.items() if n.endswith("norm.weight"))

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<|begin_of_text|>", "<|end_of_text|>")
    assert tokenizer("def f():")["input_ids"][0] == config["bos_token_id"] and len(tokenizer) <= config["vocab_size"]
    generation = json.loads((folder / "generation_config.json").read_text())
    assert generation["eos_token_id"] == config["eos_token_id"] and generation["do_sample"] is True
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.rope_parameters["rope_type"] == "llama3"


def test_the_weights_depend_on_the_seed_alone(tmp_path):
    def digest(folder):
        return [hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob("*.safetensors"))]

    one = make_checkpoint.make_checkpoint(tmp_path / "one", "tiny", seed=3, threads=1)
    four = make_checkpoint.make_checkpoint(tmp_path / "four", "tiny", seed=3, threads=4)
    make_checkpoint.make_checkpoint(tmp_path / "other", "tiny", seed=4, threads=4)
    assert one["threads"] == 1 and four["threads"] == 4
    assert digest(tmp_path / "one") == digest(tmp_path / "four") != digest(tmp_path / "other")


def test_conversion_and_identity_rows(pipeline):
    work, results, _ = pipeline
    (convert,) = rows(results, "eight_b_convert")
    metrics = convert["metrics"]
    assert metrics["ok"] and metrics["shards"] >= 2 and metrics["cp_s"] > 0 and metrics["convert_s"] > 0
    assert metrics["converted_bytes"] > metrics["source_bytes"] - 2_000  # routing tensors added (headers differ)
    assert json.loads((work / "llama-3.1-8b-mhar" / "config.json").read_text())["residual_heads"] == 8
    (verify,) = rows(results, "eight_b_verify")
    assert verify["config"]["attn_implementation"] == "sdpa"
    assert verify["metrics"]["identical"] and verify["metrics"]["logits_equal"] and verify["metrics"]["generations_match"]
    assert verify["metrics"]["max_abs_logit_diff"] == 0.0


def test_lora_runs_of_both_models_start_from_the_same_loss(pipeline):
    work, results, _ = pipeline
    runs = {(r["config"]["model"], r["config"].get("comparison", False)): r["metrics"] for r in rows(results, "eight_b_train")}
    mhar, llama = runs[("mhar-delta-h8", False)], runs[("llama", False)]
    assert len(mhar["losses"]) == len(llama["losses"]) == eight_b.SETTINGS["tiny"]["steps"]
    assert mhar["step0_loss"] == llama["step0_loss"]
    # the routers train: their gates leave 0 (one step's effect on the loss, lr x dL/dgate, is about
    # 1e-6 here, at the loss's last bits, so the losses after step 0 are no evidence either way)
    assert mhar["gate_abs_mean_last"] > 0 and mhar["tokens_per_s_median"] > 0
    comparison = runs[("mhar-delta-h8 vs llama", True)]
    assert comparison["step0_identical"] is True
    saved = load_file(str(work / "runs" / "mhar-lora" / "checkpoints" / "step-00000002" / "model.safetensors"))
    assert saved and all("lora_" in n or "modules_to_save" in n for n in saved)  # no frozen backbone in checkpoints


def test_generation_rows_of_the_plain_converted_and_midtrained_models(pipeline):
    _, results, _ = pipeline
    found = {(r["config"]["model"], r["config"]["batch"]): r["metrics"] for r in rows(results, "eight_b_generate")}
    batch = eight_b.SETTINGS["tiny"]["batch"]
    assert set(found) == {(m, b) for m in ("llama", "mhar-delta-h8", "mhar-delta-h8-midtrained") for b in (1, batch)}
    assert all(m["tokens_per_s"] > 0 and m["ttft_s"] > 0 for m in found.values())
    assert found[("mhar-delta-h8", 1)]["same_tokens_as_llama"] and found[("mhar-delta-h8", batch)]["same_tokens_as_llama"]
    assert found[("mhar-delta-h8-midtrained", 1)]["gate_abs_mean"] > 0
    for (model, b), metrics in found.items():  # timed in the same rounds as the plain model, against it
        assert metrics["repeats"] == eight_b.SETTINGS["tiny"]["repeats"]
        assert metrics["same_tokens_every_repeat"] is True  # the CPU's kernels are deterministic
        if model != "llama":
            plain = found[("llama", b)]
            assert metrics["tokens_per_s_ratio_vs_llama"] == pytest.approx(metrics["tokens_per_s"] / plain["tokens_per_s"])


def test_an_opened_gate_fails_the_identity_step(pipeline, tmp_path):
    work, _, _ = pipeline
    broken = tmp_path / "work"
    broken.mkdir()
    (broken / "llama-3.1-8b").symlink_to(work / "llama-3.1-8b")
    shutil.copytree(work / "llama-3.1-8b-mhar", broken / "llama-3.1-8b-mhar")
    file = broken / "llama-3.1-8b-mhar" / "model.safetensors"
    state = load_file(str(file))
    state["model.layers.1.attn_router.gate"] = torch.full((1,), 0.5, dtype=state["model.layers.1.attn_router.gate"].dtype)
    save_file(state, str(file), metadata={"format": "pt"})
    results = tmp_path / "results"
    assert eight_b.main(["--shape", "tiny", "--inline", "--work", str(broken), "--results", str(results), "verify"]) == 1
    (row,) = rows(results, "eight_b_verify")
    assert row["metrics"]["identical"] is False and row["metrics"]["exit_status"] == 1
    assert row["metrics"]["logits_equal"] is False and row["metrics"]["max_abs_logit_diff"] > 0


def test_verify_identity_passes_the_attention_implementation_on(pipeline, capsys):
    from mhar_cli import main as cli

    work, _, _ = pipeline
    args = ["verify-identity", str(work / "llama-3.1-8b"), str(work / "llama-3.1-8b-mhar"), "--dtypes", "float32",
            "--max-new-tokens", "1"]
    assert cli([*args, "--attn-implementation", "no-such-attention"]) == 2
    assert "no-such-attention" in capsys.readouterr().err
    assert cli([*args, "--attn-implementation", "eager"]) == 0


def test_pieces_past_the_deadline_are_skipped_and_fail_the_run(tmp_path):
    status = eight_b.main(["--shape", "tiny", "--inline", "--work", str(tmp_path / "work"), "--results",
                           str(tmp_path / "results"), "--deadline-minutes", "0", "convert"])
    assert status == 1 and not (tmp_path / "work" / "llama-3.1-8b").exists() and not (tmp_path / "results").exists()


def test_a_model_named_twice_for_generation_is_refused(tmp_path, capsys):
    """The models are loaded together and timed in turns: naming one twice is an error, not a second copy."""
    with pytest.raises(SystemExit) as exit_info:
        eight_b.main(["--shape", "tiny", "--work", str(tmp_path), "generate", "--generate-models", "llama,mhar,llama"])
    assert exit_info.value.code == 2
    assert "name each model once" in capsys.readouterr().err
