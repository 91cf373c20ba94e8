"""Demo step: mid-train the converted delta model on the embedded text with the real training
script (`mhar_hf.train`), in this process: packing, AdamW groups, warm-up + cosine, z-loss,
weight EMA, checkpoints, validation loss, final save with the remote-code bundle."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .pipeline import DemoContext

MIDTRAIN_STEPS = 30


def step_midtrain(ctx: DemoContext, steps: int = MIDTRAIN_STEPS) -> str:
    from ..folder import TrainingRecord
    from ..train import build_parser, train

    source = ctx.artifacts.get("converted_path") or ctx.artifacts["scratch_path"]
    data = ctx.workdir / "midtrain.jsonl"
    paragraphs = [p.strip() for p in ctx.artifacts["text"].split("\n\n") if p.strip()]
    data.write_text("".join(json.dumps({"text": p}) + "\n" for p in paragraphs))
    args = build_parser().parse_args([
        "--model", str(source), "--data", str(data), "--output", str(ctx.workdir / "midtrain"),
        "--seq-length", "64", "--batch-size", "4", "--max-steps", str(steps), "--warmup-steps", "5",
        "--lr", "2e-3", "--min-lr-ratio", "0.1", "--z-loss", "1e-4", "--ema-decay", "0.9",
        "--val-sequences", "8", "--eval-every", "10", "--save-every", "15", "--seed", str(ctx.seed),
        "--report-to", "none",
    ])
    path = train(args)
    ctx.artifacts["midtrained_path"] = path
    meta = TrainingRecord.read(path)
    metrics = [json.loads(line) for line in (path.parent / "metrics.jsonl").read_text().splitlines()]
    vals = [m["val_loss"] for m in metrics if "val_loss" in m]
    return (f"{meta.steps} steps, {meta.tokens:,} tokens: train loss {metrics[0]['loss']:.2f} -> "
            f"{meta.final_train_loss:.2f}, val loss {vals[0]:.2f} -> {vals[-1]:.2f}, "
            f"|gate| mean {metrics[-1].get('gate_abs_mean', 0):.4f}; EMA model saved to {path}")
