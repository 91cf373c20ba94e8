"""The experiments' tooling end to end on a CPU: corpus, initial models, `mhar train` in pieces,
conversion with the step-0 check, and the results page."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

EXPERIMENTS = Path(__file__).parents[1] / "experiments"
CORPUS_OPTIONS = ["--max-mb", "1", "--val-permille", "200", "--vocab-size", "400", "--tokenizer-mb", "1"]


def script(name: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, str(EXPERIMENTS / name), *args], capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def source_tree(root: Path) -> Path:
    """The demo text as a small tree of source and doc files, with a duplicate and files to skip."""
    from mhar_hf.tiny import demo_corpus

    paragraphs = [p.strip() for p in demo_corpus().split("\n\n") if p.strip()]
    for i in range(0, len(paragraphs), 4):
        path = root / f"pkg{i % 3}" / f"part{i}{('.py', '.md', '.rst', '.txt')[i // 4 % 4]}"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n\n".join(paragraphs[i : i + 4]) + "\n")
    (root / "pkg0" / "copy.md").write_text((root / "pkg0" / "part0.py").read_text())  # kept once
    (root / "pkg1" / "data.json").write_text("{}" * 200)  # not a source or doc file
    (root / "pkg1" / "binary.py").write_bytes(b"\xff\xfe" * 200)  # not UTF-8
    return root


@pytest.fixture
def corpus(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    tree = source_tree(tmp_path / "tree")
    script("build_corpus.py", "--out", str(tmp_path / "corpus"), "--root", str(tree), *CORPUS_OPTIONS)
    return tmp_path / "corpus"


def train_arms(corpus: Path, runs: Path, *arms: str) -> None:
    script("train_arms.py", "--corpus", str(corpus), "--runs", str(runs), "--shape", "tiny", "--tokens", "512",
           "--parallel", "2", "--piece-minutes", "2", *arms, timeout=240)
    for arm in arms:
        info = json.loads((runs / arm / "info.json").read_text())
        assert info["finished"] and len(info["pieces"]) == 1, info
        metrics = [json.loads(line) for line in (runs / arm / "run" / "metrics.jsonl").read_text().splitlines()]
        assert metrics[-1]["step"] == info["steps"] and metrics[-1]["val_loss"] is not None


def test_corpus_arms_and_report(corpus, tmp_path):
    stats = json.loads((corpus / "stats.json").read_text())
    assert stats["train"]["tokens"] > 0 and stats["val"]["files"] > 0 and stats["vocab_size"] == 400
    script("build_corpus.py", "--out", str(tmp_path / "again"), "--root", str(tmp_path / "tree"), *CORPUS_OPTIONS)
    for name in ("train.jsonl", "val.jsonl"):
        assert (corpus / name).read_bytes() == (tmp_path / "again" / name).read_bytes()
    train_docs = {json.loads(line)["text"] for line in (corpus / "train.jsonl").read_text().splitlines()}
    val_docs = {json.loads(line)["text"] for line in (corpus / "val.jsonl").read_text().splitlines()}
    assert not train_docs & val_docs and stats["train"]["files"] + stats["val"]["files"] == len(train_docs | val_docs)
    assert len(train_docs | val_docs) == len(list((tmp_path / "tree").rglob("part*")))  # the copy and the others skipped

    runs, results, page = tmp_path / "runs", tmp_path / "results", tmp_path / "docs" / "results.md"
    train_arms(corpus, runs, "plain", "full-h8")
    config = json.loads((runs / "full-h8" / "init" / "config.json").read_text())
    assert config["residual_mode"] == "full" and config["residual_heads"] == 8 and config["vocab_size"] == 400
    script("report.py", "--collect", str(runs), "--corpus", str(corpus), "--results", str(results), "--out", str(page))
    text = page.read_text()
    assert "| full-h8 | full, H = 8 | 0 |" in text and "| full-h1 | full, H = 1 | 0 | | |" in text  # not run yet
    assert "full-h8 " in text.split("MHAR beats the plain Transformer")[1].splitlines()[0]
    assert "`full-h1`" in text.split("## Still to run")[1] and "`plain`," not in text.split("## Still to run")[1]
    assert (page.parent / "results_loss.png").stat().st_size > 0 and (results / "corpus_stats.json").is_file()


def test_midtrain_conversion_starts_at_the_source_loss(corpus, tmp_path):
    runs = tmp_path / "runs"
    train_arms(corpus, runs, "qwen3-source", "midtrain-delta-h8")
    assert json.loads((runs / "qwen3-source" / "init" / "config.json").read_text())["model_type"] == "qwen3"
    converted = json.loads((runs / "midtrain-delta-h8" / "init" / "config.json").read_text())
    assert converted["residual_mode"] == "delta" and converted["residual_heads"] == 8
    step0 = json.loads((runs / "midtrain-delta-h8" / "step0.json").read_text())
    assert step0["identical"] and step0["source_val_loss"] == step0["converted_val_loss"]
