"""Model cards: Hub metadata parsed back from the front matter, provenance, evaluation results
and probe pictures in the body, and the refusals."""

import json
from math import comb
from pathlib import Path

import pytest
import yaml

from mhar_cli import main
from mhar_hf.card import build_card, hub_id, write_card

SOURCE = "meta-llama/Llama-3.2-1B"


def save_tiny(path: Path, tokenizer, **overrides) -> Path:
    from transformers import AutoModelForCausalLM

    from mhar_hf import save_remote_code
    from mhar_hf.tiny import tiny_config

    model = AutoModelForCausalLM.from_config(tiny_config(vocab_size=len(tokenizer), **overrides))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    save_remote_code(path)
    return path


def write_run(folder: Path, model: Path, scores: dict[str, tuple[str, str, float, int]], limit=None,
              outcomes: dict[str, list[bool]] | None = None) -> Path:
    """A run folder as `mhar eval` writes it: task -> (metric, filter, value, n-shot), and, for
    the tasks in `outcomes`, the per-item right/wrong lines."""
    folder.mkdir(parents=True)
    for task, items in (outcomes or {}).items():
        metric, filter_name = scores[task][:2]
        lines = [{"doc_id": i, "doc_hash": f"h{i}", "filter": filter_name, metric: float(ok), "correct": ok}
                 for i, ok in enumerate(items)]
        (folder / f"samples_{task}.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    results = {
        "results": {t: {f"{m},{f}": v, f"{m}_stderr,{f}": 0.01} for t, (m, f, v, _) in scores.items()},
        "configs": {t: {"dataset_path": "openai/gsm8k" if "gsm8k" in t else "Idavidrein/gpqa",
                        "dataset_name": "main" if "gsm8k" in t else "gpqa_main",
                        "test_split": "test" if "gsm8k" in t else None, "validation_split": "train"}
                    for t in scores},
        "n-shot": {t: shots for t, (_, _, _, shots) in scores.items()},
        "n-samples": {t: {"original": 100, "effective": limit or 100} for t in scores},
        "mhar": {"model": str(model.resolve()), "tasks": list(scores), "limit": limit, "date": "2026-12-02T00:00:00+00:00",
                 "lm_eval_version": "0.4.13",
                 "primary": {t: {"metric": m, "filter": f} for t, (m, f, _, _) in scores.items()}},
    }
    (folder / "results.json").write_text(json.dumps(results))
    return folder


def split_card(text: str) -> tuple[dict, str]:
    assert text.startswith("---\n")
    front, body = text[4:].split("\n---\n", 1)
    return yaml.safe_load(front), body


@pytest.fixture
def converted(tmp_path, tokenizer):
    model = save_tiny(tmp_path / "Tiny-MHAR", tokenizer, residual_mode="delta", residual_heads=8, residual_num_blocks=2)
    (model / "mhar_conversion.json").write_text(json.dumps({
        "source": SOURCE, "source_model_type": "llama", "heads": 8, "num_blocks": 2, "dtype": "keep",
        "source_files": ["model.safetensors"], "mhar_hf_version": "0.1.0", "date": "2026-12-02T00:00:00+00:00"}))
    return model


def test_metadata_and_body_from_every_input(converted):
    write_run(converted / "eval" / "20261202-000000", converted, {
        "gsm8k": ("exact_match", "strict-match", 0.4125, 5), "gpqa_main_zeroshot": ("acc", "none", 0.28125, 0)})
    (converted / "mhar_training.json").write_text(json.dumps({
        "source_model": str(converted), "steps": 40, "tokens": 81920, "seq_length": 256,
        "final_train_loss": 2.5, "final_val_loss": 2.75, "lr_schedule": {"schedule": "cosine", "peak_lr": 4e-4}}))
    (converted / "probe").mkdir()
    (converted / "probe" / "routing_heatmap.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    (converted / "probe" / "probe.json").write_text(json.dumps({"summary": {"learned_excess": 0.0123, "notes": ["x"]}}))

    path = write_card(converted)  # runs found under DIR/eval/
    metadata, body = split_card(path.read_text())

    assert metadata["library_name"] == "transformers"
    assert metadata["pipeline_tag"] == "text-generation"
    assert metadata["base_model"] == SOURCE
    assert {"mhar", "residual-mode-delta", "custom_code"} <= set(metadata["tags"])
    [index] = metadata["model-index"]
    assert index["name"] == "Tiny-MHAR"
    got = {r["dataset"]["name"]: (r["metrics"][0]["type"], r["metrics"][0]["value"], r["dataset"]["args"]["num_few_shot"],
                                  r["dataset"]["type"], r["dataset"]["split"]) for r in index["results"]}
    assert got == {"gsm8k": ("exact_match", 0.4125, 5, "openai/gsm8k", "test"),
                   "gpqa_main_zeroshot": ("acc", 0.28125, 0, "Idavidrein/gpqa", "train")}

    assert "| residual mode | `delta` |" in body and "| routing heads (H) | 8 |" in body
    assert "| routing blocks | 2 |" in body
    assert f"| source | {SOURCE} |" in body and "| source_model_type | llama |" in body
    assert "| steps | 40 |" in body and "| final_val_loss | 2.75 |" in body
    assert "| gsm8k | openai/gsm8k/main | 5 | 100 | exact_match (strict-match) | 0.4125 | 0.0100 |" in body
    assert "](probe/routing_heatmap.png)" in body and "head_deviation.png" not in body
    assert "| learned_excess | 0.0123 |" in body
    assert "smoke run" not in body


def test_minimal_folder_chain_and_limited_runs(tmp_path, tokenizer, converted):
    """A mid-trained folder: no conversion file of its own, its training metadata points at the
    converted folder, whose provenance gives base_model. A --limit run is labelled as such."""
    trained = save_tiny(tmp_path / "trained", tokenizer, residual_mode="delta", residual_heads=8, residual_num_blocks=2)
    (trained / "mhar_training.json").write_text(json.dumps({"source_model": str(converted), "steps": 3}))
    run = write_run(tmp_path / "run", trained, {"gsm8k": ("exact_match", "strict-match", 0.5, 5)}, limit=4)
    metadata, body = split_card(build_card(trained, runs=[run], name="org/trained"))
    assert metadata["base_model"] == SOURCE
    [result] = metadata["model-index"][0]["results"]
    assert result["dataset"]["args"] == {"num_few_shot": 5, "limit": 4}
    assert "first 4 items" in result["metrics"][0]["name"]
    assert "first 4 items only" in body and "## Conversion" in body
    assert 'from_pretrained("org/trained", trust_remote_code=True)' in body

    bare = save_tiny(tmp_path / "bare", tokenizer)
    metadata, body = split_card(build_card(bare))
    assert "base_model" not in metadata and "model-index" not in metadata
    assert "## Conversion" not in body and "## Routing probe" not in body and "No evaluation runs" in body


def test_paired_comparison_with_a_baseline(tmp_path, converted):
    ours = [True, True, False, True, True, False, True, True, True, False, True, True]
    theirs = [True, False, False, False, True, False, False, True, False, False, True, False]
    scores = {"gsm8k": ("exact_match", "strict-match", sum(ours) / 12, 5)}
    run = write_run(converted / "eval" / "full", converted, scores, outcomes={"gsm8k": ours})
    source = tmp_path / "llama-source"
    baseline = write_run(tmp_path / "source_run", source, {"gsm8k": scores["gsm8k"][:2] + (sum(theirs) / 12, 5)},
                         outcomes={"gsm8k": theirs})
    only_ours = sum(a and not b for a, b in zip(ours, theirs))
    only_theirs = sum(b and not a for a, b in zip(ours, theirs))
    n = only_ours + only_theirs
    p = min(1.0, 2 * sum(comb(n, k) for k in range(min(only_ours, only_theirs) + 1)) / 2**n)
    assert (only_ours, only_theirs) == (5, 0)
    metadata, body = split_card(build_card(converted, runs=[run], baselines=[baseline]))
    assert "## Paired comparison with llama-source" in body
    assert (f"| gsm8k | exact_match (strict-match) | 12 | {sum(ours) / 12:.4f} | {sum(theirs) / 12:.4f} | "
            f"{only_ours} | {only_theirs} | {p:.4g} |") in body
    assert len(metadata["model-index"][0]["results"]) == 1  # the baseline's numbers are not this model's

    other_items = write_run(tmp_path / "short_run", source, scores, outcomes={"gsm8k": theirs[:6]})
    with pytest.raises(ValueError, match="pairs with none of the model's runs"):
        build_card(converted, runs=[run], baselines=[other_items])


def test_hub_id():
    assert hub_id("meta-llama/Llama-3.1-8B") == "meta-llama/Llama-3.1-8B"
    assert hub_id("/cache/hub/models--Qwen--Qwen3-8B/snapshots/abc123") == "Qwen/Qwen3-8B"
    assert hub_id("/work/models/llama") is None
    assert hub_id(None) is None


def test_refusals(tmp_path, tokenizer, converted, capsys):
    from transformers import LlamaConfig

    llama = tmp_path / "llama"
    llama.mkdir()
    LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                num_attention_heads=2).save_pretrained(llama)
    with pytest.raises(ValueError, match="not an MHAR one"):
        build_card(llama)
    with pytest.raises(FileNotFoundError, match="config.json"):
        build_card(tmp_path / "nothing")

    other = write_run(tmp_path / "other_run", llama, {"gsm8k": ("exact_match", "strict-match", 0.1, 5)})
    with pytest.raises(ValueError, match="not .*Tiny-MHAR"):
        build_card(converted, runs=[other])

    (converted / "README.md").write_text("# my notes\n")
    assert main(["card", str(converted)]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert (converted / "README.md").read_text() == "# my notes\n"
    assert main(["card", str(converted), "--overwrite"]) == 0
    generated = (converted / "README.md").read_text()
    assert main(["card", str(converted)]) == 0  # a generated card is simply regenerated
    assert (converted / "README.md").read_text() == generated


def test_a_verification_record_reads_as_text(converted):
    """The converter's verification (a list of per-dtype results) renders as words, not as
    Python reprs."""
    record = json.loads((converted / "mhar_conversion.json").read_text())
    record["verification"] = {"ok": True, "prompts": 3, "results": [
        {"dtype": "float32", "max_abs_logit_diff": 0.0, "logits_equal": True, "generations_match": True},
        {"dtype": "bfloat16", "max_abs_logit_diff": 0.0, "logits_equal": True, "generations_match": True}]}
    (converted / "mhar_conversion.json").write_text(json.dumps(record))
    _, body = split_card(build_card(converted))
    row = next(line for line in body.splitlines() if line.startswith("| verification.results |"))
    assert "{" not in row and "'" not in row
    assert "dtype: float32, max_abs_logit_diff: 0, logits_equal: True, generations_match: True; dtype: bfloat16" in row
