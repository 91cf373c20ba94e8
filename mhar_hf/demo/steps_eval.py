"""Demo steps: evaluate the final model with the harness on small synthetic local copies of the
paper's tasks, compare it item by item with its source model, and write its model card."""

from __future__ import annotations

import csv
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .pipeline import DemoContext

TASKS = ["gsm8k_local", "gpqa_main_zeroshot_local"]
ITEMS = 6
MAX_GEN_TOKS = 24  # a smoke run: the protocol's 256 would only lengthen the tiny model's babble


def write_synthetic_data(folder: Path) -> Path:
    """Invented GSM8K-style problems (`#### N` answers) and four-choice GPQA-style questions,
    in the original file formats, under `folder`/gsm8k and `folder`/gpqa."""
    (folder / "gsm8k").mkdir(parents=True)
    (folder / "gpqa").mkdir()
    problems = [(a, b) for a in range(2, 7) for b in range(3, 6)]
    for split, rows in (("train", problems[:5]), ("test", problems[5:5 + ITEMS])):
        with open(folder / "gsm8k" / f"{split}.jsonl", "w") as f:
            for a, b in rows:
                f.write(json.dumps({
                    "question": f"Ada has {a} bags with {b} apples in each. How many apples does she have?",
                    "answer": f"She has {a}*{b}=<<{a}*{b}={a * b}>>{a * b} apples.\n#### {a * b}",
                }) + "\n")
    with open(folder / "gpqa" / "gpqa_main.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["Question", "Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3"])
        for a, b in problems[:ITEMS]:
            writer.writerow([f"A box holds {a} rows of {b} eggs. How many eggs are in the box?",
                             a * b, a * b + 1, a + b, a * b - 2])
    return folder


def final_model(ctx: DemoContext) -> Path:
    return Path(ctx.artifacts.get("midtrained_path") or ctx.artifacts.get("converted_path") or ctx.artifacts["scratch_path"])


def step_evaluate(ctx: DemoContext) -> str:
    from ..compare import compare_runs
    from ..evaluate import evaluate
    from ..folder import EvalRecord

    data = write_synthetic_data(ctx.workdir / "eval-data")
    final = final_model(ctx)
    models = [final]
    if ctx.artifacts.get("llama_path") and final != Path(ctx.artifacts["scratch_path"]):
        models.append(Path(ctx.artifacts["llama_path"]))  # the source, for a paired comparison
    harness_log = logging.getLogger("lm_eval")
    level = harness_log.level
    harness_log.setLevel(logging.ERROR)  # its warnings about --limit and max_gen_toks are expected here
    try:
        runs = [evaluate(model, TASKS, limit=ITEMS, batch_size=ITEMS, data_dir=data, output=model / "eval" / "demo",
                         max_gen_toks=MAX_GEN_TOKS, seed=ctx.seed, report=lambda _: None) for model in models]
    finally:
        harness_log.setLevel(level)
    ctx.artifacts["eval_runs"] = runs
    scores = []
    info, results = EvalRecord.read_run(runs[0])
    for task in TASKS:
        metric = "{metric},{filter}".format(**info.primary[task])
        scores.append(f"{task} {results['results'][task][metric]:.2f}")
    line = f"{models[0].name} on {ITEMS} synthetic items per task: " + ", ".join(scores)
    if len(runs) == 2:
        pairs = compare_runs(runs[0], runs[1])
        line += "; vs source " + ", ".join(
            f"{p.task}: {p.only_a} vs {p.only_b} discordant, McNemar p={p.p_value:.2g}" for p in pairs)
    return line


def step_card(ctx: DemoContext) -> str:
    import yaml

    from ..card import write_card

    path = write_card(final_model(ctx), runs=ctx.artifacts["eval_runs"][:1], baselines=ctx.artifacts["eval_runs"][1:],
                      name="mhar-demo")
    ctx.artifacts["card_path"] = path
    metadata = yaml.safe_load(path.read_text().split("---\n")[1])
    results = sum(len(entry["results"]) for entry in metadata.get("model-index", []))
    pictures = path.read_text().count("](probe/")
    return f"wrote {path} (model-index with {results} results, {pictures} probe pictures)"
