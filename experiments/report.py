"""The results table and loss curves, regenerated from the runs' metrics.

    python experiments/report.py [--collect RUNS --corpus CORPUS] [--results experiments/results]
                                 [--out docs/results.md]

--collect first copies what the report reads out of a runs folder (train_arms.py's) into
--results: per arm metrics.jsonl, info.json, training.json (the final model's
mhar_training.json), step0.json and calibration.jsonl where present, and the
corpus's stats.json. Then the markdown page (--out) and its PNG (beside it) are written from
--results alone, so the page can be regenerated anywhere.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from datetime import date
from pathlib import Path

from mhar_cli import folder_module

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plan import (  # noqa: E402
    ARMS, FROM_SCRATCH, MIDTRAIN, MIDTRAIN_FRACTION, MIDTRAIN_OPTIMISER, MIDTRAIN_SEED, OPTIMISER, RECIPES, SEED_PAIRS,
    SHAPES, non_embedding_parameters, step_tokens,
)

REPO = Path(__file__).resolve().parents[1]
CONTRACT = folder_module()  # mhar_hf.folder (record names and classes), without loading torch
TOKENS_PER_PARAMETER = 20  # the least budget per non-embedding parameter at which the comparison means much
ARM_FILES = {"run/metrics.jsonl": "metrics.jsonl", "info.json": "info.json",
             f"run/model/{CONTRACT.TRAINING_RECORD}": "training.json", "step0.json": "step0.json",
             "calibration/metrics.jsonl": "calibration.jsonl"}


def collect(runs: Path, corpus: Path | None, results: Path) -> None:
    results.mkdir(parents=True, exist_ok=True)
    for folder in sorted(p for p in runs.iterdir() if p.is_dir() and p.name in ARMS):
        for source, name in ARM_FILES.items():
            if (folder / source).is_file():
                (results / folder.name).mkdir(exist_ok=True)
                shutil.copyfile(folder / source, results / folder.name / name)
        if (folder / "info-calibration.json").is_file():
            shutil.copyfile(folder / "info-calibration.json", results / folder.name / "calibration-info.json")
    if corpus is not None and (corpus / "stats.json").is_file():
        shutil.copyfile(corpus / "stats.json", results / "corpus_stats.json")


def read_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def read_arm(results: Path, name: str) -> dict | None:
    folder = results / name
    if not (folder / "metrics.jsonl").is_file():
        return None
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    info, training_file = read_json(folder / "info.json") or {}, folder / "training.json"
    training = CONTRACT.TrainingRecord.read_file(training_file) if training_file.is_file() else None
    speeds = [r["tokens_per_s"] for r in records[1:]] or [records[-1]["tokens_per_s"]]
    vals = [(r["tokens"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    return {
        "records": records, "info": info, "finished": bool(info.get("finished")) and training is not None,
        "val_loss": training.final_val_loss if training else (vals[-1][1] if vals else None),
        "val_curve": vals, "tokens": records[-1]["tokens"], "steps": records[-1]["step"],
        "tokens_per_s": sorted(speeds)[len(speeds) // 2],
        "peak_gib": max((r.get("peak_memory_gib", 0.0) for r in records), default=0.0),
        "wall_s": info.get("wall_seconds"), "step0": read_json(folder / "step0.json"),
    }


def seed_noise(arms: dict) -> float | None:
    gaps = [abs(arms[a]["val_loss"] - arms[b]["val_loss"]) for a, b in SEED_PAIRS
            if arms.get(a) and arms.get(b) and arms[a]["finished"] and arms[b]["finished"]]
    return max(gaps) if gaps else None


def describe(name: str) -> str:
    arm = ARMS[name]
    if arm.mode in ("standard", "qwen3"):
        return "plain" + (" (Qwen3)" if arm.mode == "qwen3" else "")
    return f"{arm.mode}, H = {arm.heads}" + (f", {arm.block_layers}-layer blocks" if arm.block_layers else "")


def at_once(info: dict) -> list[int]:
    """How many arms trained at once beside this one (a list where its pieces ran in several sessions)."""
    value = info.get("parallel", 1)
    return value if isinstance(value, list) else [value]


def pieces_note(info: dict) -> str:
    pieces = info.get("pieces", [])
    return f", {len(pieces)} pieces" if len(pieces) > 1 else ""


def seed_of(name: str) -> int:
    return MIDTRAIN_SEED if ARMS[name].midtrain else ARMS[name].seed


def verdict(delta: float, noise: float | None) -> str:
    if noise is None:
        return "seed noise not yet measured"
    return "within seed noise" if abs(delta) <= noise else ("lower" if delta < 0 else "higher")


def results_table(arms: dict, names: list[str], baseline: str, noise: float | None, params: int) -> list[str]:
    lines = ["| arm | residual | seed | val loss | vs " + baseline + " | tokens | tokens / param | wall s | arms at once | "
             "tokens/s | peak GiB | status |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    base = arms.get(baseline)
    for name in names:
        arm = arms.get(name)
        if arm is None:
            lines.append(f"| {name} | {describe(name)} | {seed_of(name)} | | | | | | | | | not run yet |")
            continue
        loss = arm["val_loss"]
        if base and base["finished"] and name != baseline and loss is not None:
            delta = loss - base["val_loss"]
            gap = f"{delta:+.4f} ({verdict(delta, noise)})"
        else:
            gap = ""
        lines.append(
            f"| {name} | {describe(name)} | {seed_of(name)} | {loss:.4f} | {gap} | {arm['tokens'] / 1e6:.1f}M | "
            f"{arm['tokens'] / params:.1f} | {arm['wall_s'] or 0:.0f} | {', '.join(map(str, at_once(arm['info'])))} | "
            f"{arm['tokens_per_s']:,.0f} | {arm['peak_gib']:.1f} | "
            f"{'finished' if arm['finished'] else 'incomplete'}{pieces_note(arm['info'])} |"
        )
    return lines


def plot(arms: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, names, title in ((axes[0], FROM_SCRATCH + [b for _, b in SEED_PAIRS], "from scratch"),
                             (axes[1], MIDTRAIN, "mid-training miniature")):
        for name in names:
            arm = arms.get(name)
            if not arm or not arm["val_curve"]:
                continue
            curve = arm["val_curve"]
            source = arms.get(ARMS[name].convert_from or "")
            if ARMS[name].midtrain and source and source["val_curve"]:  # continues where the source ended
                offset, start = source["val_curve"][-1]
                curve = [(offset, start)] + [(offset + t, v) for t, v in curve]
            tokens, losses = zip(*curve)
            ax.plot([t / 1e6 for t in tokens], losses, marker=".", label=name,
                    linestyle="--" if "seed1" in name else "-")
        ax.set_xlabel("training tokens (M)")
        ax.set_ylabel("validation loss")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
            low = min(min(line.get_ydata()[len(line.get_ydata()) // 3:]) for line in ax.lines)
            high = max(max(line.get_ydata()[len(line.get_ydata()) // 3:]) for line in ax.lines)
            ax.set_ylim(low - 0.05 * (high - low + 0.1), high + 0.3 * (high - low + 0.1))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def observations(arms: dict, noise: float | None, params: int, tokens: int | None) -> list[str]:
    """Plain statements read off the finished from-scratch arms."""
    done = {n: arms[n] for n in FROM_SCRATCH + [b for _, b in SEED_PAIRS] if arms.get(n) and arms[n]["finished"]}
    lines = []
    if tokens and tokens < TOKENS_PER_PARAMETER * params:
        lines.append(f"- Every arm is early in training ({tokens / params:.1f} tokens per non-embedding "
                     "parameter): these are losses after the first few million tokens, not where the schemes end up.")
    if noise is not None:
        lines.append(f"- Two seeds of the same arm differ by up to {noise:.3f} in final loss here, so only gaps well "
                     "above that mean anything.")
    pairs = [(a, b) for a, b in (("full-h8", "plain"), ("full-h8-seed1", "plain-seed1")) if a in done and b in done]
    if len(pairs) == 2:
        gaps = [done[a]["val_loss"] - done[b]["val_loss"] for a, b in pairs]
        lines.append("- Full H = 8 against plain at the same seed: " + ", ".join(
            f"seed {seed_of(a)} {gap:+.4f}" for (a, _), gap in zip(pairs, gaps))
            + (" (lower at both seeds)." if all(g < 0 for g in gaps) else "."))
    heads = [(ARMS[n].heads, done[n]["val_loss"]) for n in ("full-h1", "full-h4", "full-h8", "full-h16") if n in done]
    if len(heads) >= 3:
        order = " < ".join(f"H = {h}" for h, _ in sorted(heads, key=lambda hv: hv[1]))
        lines.append(f"- Full mode by loss, lowest first: {order}.")
    if "plain" in done:
        beat = [n for n in done if not n.startswith("plain") and noise is not None
                and done["plain"]["val_loss"] - done[n]["val_loss"] > noise]
        if beat:
            lines.append(f"- Below plain by more than the seed noise: {', '.join(f'`{n}`' for n in beat)}.")
    side_by_side = [n for n in ("plain", "full-h1", "full-h8") if n in done]
    if len(side_by_side) == 3 and len({tuple(at_once(done[n]["info"])) for n in side_by_side}) == 1:
        lines.append(f"- Speed, trained side by side ({at_once(done['full-h8']['info'])[0]} arms at once): "
                     + ", ".join(f"{describe(n)} {done[n]['tokens_per_s']:,.0f} tokens/s" for n in side_by_side)
                     + " (`mhar train` runs the model eagerly, without torch.compile).")
    return lines


def claims(arms: dict, noise: float | None, results: Path) -> list[str]:
    """The paper's directions against what these runs show."""
    def loss(name):
        arm = arms.get(name)
        return arm["val_loss"] if arm and arm["finished"] else None

    def compare(a, b):
        if loss(a) is None or loss(b) is None:
            return "not run yet"
        delta = loss(a) - loss(b)
        return f"{a} {delta:+.4f} vs {b}: {verdict(delta, noise)}"

    heads = [(ARMS[n].heads, loss(n)) for n in ("full-h1", "full-h4", "full-h8", "full-h16")]
    if all(v is not None for _, v in heads):
        best = min(heads, key=lambda hv: hv[1])[0]
        shape = f"best H = {best}; " + ", ".join(f"H={h}: {v:.4f}" for h, v in heads)
    else:
        shape = "not run yet"
    step0_record = read_json(results / "midtrain-delta-h8" / "step0.json")
    if loss("midtrain-delta-h8") is not None and loss("midtrain-plain") is not None:
        mid = compare("midtrain-delta-h8", "midtrain-plain")
    else:
        mid = "not run yet"
    step0 = ("identical" if step0_record["identical"] else "DIFFERENT") if step0_record else "not run yet"
    return [
        "| claim | the paper (much larger budgets) | here |",
        "|---|---|---|",
        f"| MHAR beats the plain Transformer | lower validation loss | {compare('full-h8', 'plain')} |",
        f"| MHAR beats single-head Attention Residuals | lower loss than H = 1 | {compare('full-h8', 'full-h1')} |",
        f"| loss is U-shaped in H | optimum at H = 4 to 8 | {shape} |",
        f"| block mode keeps most of the gain | between plain and full | {compare('block-h8', 'plain')} |",
        f"| conversion is exact | converted model = source at step 0 | step-0 validation loss {step0} |",
        f"| a converted model gains from mid-training | lower loss than the plain control | {mid} |",
    ]


def reference_op_note(arms: dict) -> list[str]:
    """Arms whose reads ran on the reference op (info.json `reads_on_reference_op`): under bf16 autocast
    over fp32 weights, the package before 8964f81 gave the fused path sources of two dtypes."""
    names = [n for n, a in arms.items() if a["info"].get("reads_on_reference_op")]
    if not names:
        return []
    return [", ".join(f"`{n}`" for n in names) + ": the reads ran on the reference op (under bf16 autocast the fused "
            "kernels received sources of two dtypes and the package fell back; fixed in 8964f81). The losses are the "
            "op's specification either way; these arms' tokens/s and peak memory are the reference op's, not the "
            "kernels'.", ""]


def plan_section() -> list[str]:
    return [
        "## How the runs are made",
        "",
        "Each GPU command (at most 10 minutes, on a machine that is given back 30 seconds after the command ends, "
        "so an arm must finish in the command that starts it) runs `experiments/run_on_gpu.sh`: it rebuilds the "
        "corpus (deterministic), trains the arms it is given with `experiments/train_arms.py` through `mhar train` "
        "(pieces that continue with `--resume` where one machine runs several), and brings back the metrics, which "
        "are committed under `experiments/results/`. The mid-training chain (source, conversion, both continuations) "
        "runs in one command. `experiments/README.md` has the commands.",
        "",
    ]


TRAINING_CODE = ["mhar_hf/train", "mhar_hf/modeling_mhar.py", "mhar_hf/routing.py", "mhar_hf/ops"]


def commit_note(commits: list[str]) -> str:
    """What the commit labels mean, and whether the model and training code differ between them."""
    note = " (A+B: the package at A, run with `experiments/` at B.)" if any("+" in c for c in commits) else ""
    packages = sorted({c.split("+")[0] for c in commits if c != "?"})
    if len(packages) > 1:
        changed = subprocess.run(["git", "diff", "--name-only", packages[0], packages[-1], "--", *TRAINING_CODE],
                                 cwd=REPO, capture_output=True, text=True).stdout.split()
        note += (f" Model and training files changed between {packages[0]} and {packages[-1]}: "
                 + (", ".join(f"`{f}`" for f in changed) or "none") + ".")
    return note


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write_page(results: Path, out: Path) -> str:
    arms = {name: read_arm(results, name) for name in ARMS}
    arms = {k: v for k, v in arms.items() if v is not None}
    shape = next((a["info"].get("shape") for a in arms.values() if a["info"].get("shape")), "small")
    params = non_embedding_parameters(SHAPES[shape])
    noise = seed_noise(arms)
    corpus = read_json(results / "corpus_stats.json")
    finished = [arms[n]["tokens"] for n in FROM_SCRATCH if arms.get(n) and arms[n]["finished"]]
    tokens = max(finished) if finished else None
    picture = out.with_name(out.stem + "_loss.png")
    plot(arms, picture)
    devices = sorted({a["info"].get("device", "?") for a in arms.values()})
    commits = sorted({a["info"].get("commit") or "?" for a in arms.values()})
    dates = sorted({a["info"].get("started", "?")[:10] for a in arms.values()})
    recipe = RECIPES[shape]
    lines = [
        "# Does MHAR help? The paper's claims at small scale",
        "",
        f"Regenerated by `python experiments/report.py` on {date.today().isoformat()} (tree {git_commit()}) from "
        "`experiments/results/`. Runs: " + (", ".join(dates) or "none yet") + "; device: " + (", ".join(devices) or "none")
        + "; commit the runs trained at: " + (", ".join(commits) or "none") + "." + commit_note(commits),
        "How to rerun, and the plan, are in `experiments/README.md`.",
        "",
        "## Setup",
        "",
        f"- Model: shape `{shape}` of `experiments/plan.py`: {SHAPES[shape]['num_hidden_layers']} layers, hidden "
        f"{SHAPES[shape]['hidden_size']}, MLP {SHAPES[shape]['intermediate_size']}, {SHAPES[shape]['num_attention_heads']} "
        f"attention heads, Qwen3-style (q/k norm, tied embeddings); {params / 1e6:.2f}M non-embedding parameters.",
        f"- Training: `mhar train`, sequences of {recipe['seq_length']} tokens, {step_tokens(recipe):,} tokens per step "
        f"({recipe['batch_size']} sequences x {recipe['grad_accum']} micro-batches), AdamW {tuple(OPTIMISER['adam_betas'])}, "
        f"weight decay {OPTIMISER['weight_decay']}, clipping {OPTIMISER['clip']}, peak LR {OPTIMISER['lr']:g} with "
        f"{recipe['warmup_fraction']:.0%} warm-up and a {OPTIMISER['schedule']} to {OPTIMISER['min_lr_ratio']:g}x, "
        "bf16 autocast over fp32 weights on the GPU; the same seed, data order and token budget in every from-scratch arm.",
    ]
    if corpus:
        lines.append(
            f"- Corpus (`experiments/build_corpus.py`): the Python sources and docs installed on the GPU machine, split by "
            f"file: train {corpus['train']['files']:,} files, {corpus['train']['tokens'] / 1e6:.1f}M tokens; validation "
            f"{corpus['val']['files']:,} files, {corpus['val']['tokens'] / 1e6:.2f}M tokens (the loss below is on "
            f"{recipe['val_sequences']} packed sequences of these held-out files); byte-level BPE of "
            f"{corpus['vocab_size']:,} tokens.")
    if tokens:
        lines.append(f"- Budget: {tokens / 1e6:.1f}M tokens per from-scratch arm ({tokens / params:.1f} tokens per "
                     "non-embedding parameter).")
    parallel = sorted({n for a in arms.values() for n in at_once(a["info"])})
    lines += [
        "",
        "## From scratch",
        "",
        f"Final validation loss per arm. Arms trained {' or '.join(map(str, parallel))} at a time on one GPU, so "
        "tokens/s and wall time are per arm under that sharing; peak memory is "
        "`torch.cuda.max_memory_allocated` of the arm's process.",
        "",
        *results_table(arms, FROM_SCRATCH + [b for _, b in SEED_PAIRS], "plain", noise, params),
        "",
        *[f"`{n}`: {a['info']['note']}.\n" for n, a in arms.items() if a["info"].get("note")],
        *reference_op_note(arms),
        ("Seed noise (largest final-loss gap between the two seeds of plain and of full H = 8): "
         f"{noise:.4f}. A gap no larger than that is marked within seed noise." if noise is not None
         else "Seed noise: the second-seed arms have not run yet, so no gap can be called significant."),
        "",
        "## What these runs show",
        "",
        *observations(arms, noise, params, tokens),
        "",
        "## The paper's directions, side by side",
        "",
        "The paper's numbers come from budgets thousands of times larger; compare directions and gaps, not losses.",
        "",
        *claims(arms, noise, results),
        "",
        "## Mid-training in miniature",
        "",
        "A plain Qwen3 model of the same shape is pre-trained with the same recipe (`qwen3-source`), converted with "
        "`mhar convert --heads 8 --num-blocks 3 --verify` (delta mode), and both it and the plain model continue "
        f"for {MIDTRAIN_FRACTION:.0%} of the budget (peak LR {MIDTRAIN_OPTIMISER['lr']:g}, data order of seed "
        f"{MIDTRAIN_SEED}).",
        "",
        *results_table(arms, MIDTRAIN, "midtrain-plain", noise, params),
        "",
    ]
    step0 = read_json(results / "midtrain-delta-h8" / "step0.json")
    if step0:
        lines += [f"Step 0: source {step0['source_val_loss']:.6f}, converted {step0['converted_val_loss']:.6f} "
                  f"({'identical' if step0['identical'] else 'different'}).", ""]
    lines += [f"![validation loss curves]({picture.name})", ""]
    sparse = [n for n, a in arms.items() if not ARMS[n].midtrain and 0 < len(a["val_curve"]) < RECIPES[shape]["evals"] // 2]
    if sparse:
        lines += ["Validated at fewer steps than the others (their runs set a coarser `--eval-every`): "
                  + ", ".join(f"`{n}` ({len(arms[n]['val_curve'])} points)" for n in sparse) + ".", ""]
    lines += plan_section()
    missing = [n for n in FROM_SCRATCH + [b for _, b in SEED_PAIRS] + MIDTRAIN if not (arms.get(n) and arms[n]["finished"])]
    lines += ["## Still to run", "", ("Every arm has run." if not missing else "Arms without a finished run: "
                                      + ", ".join(f"`{n}`" for n in missing) + ".")]
    if tokens and tokens < TOKENS_PER_PARAMETER * params:
        lines += ["", f"The budget ({tokens / params:.1f} tokens per non-embedding parameter) is below the "
                  f"{TOKENS_PER_PARAMETER} the comparison needs ({TOKENS_PER_PARAMETER * params / 1e6:.0f}M tokens per arm at "
                  "this shape): every arm has to run again at that budget before the comparison answers the question."]
    text = "\n".join(lines) + "\n"
    out.write_text(text)
    return text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--collect", type=Path, metavar="RUNS", help="copy the results out of this runs folder first")
    parser.add_argument("--corpus", type=Path, help="with --collect: the corpus folder (its stats.json)")
    parser.add_argument("--results", type=Path, default=REPO / "experiments" / "results")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "results.md")
    args = parser.parse_args(argv)
    if args.collect:
        collect(args.collect, args.corpus, args.results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_page(args.results, args.out)
    print(args.out)


if __name__ == "__main__":
    main()
