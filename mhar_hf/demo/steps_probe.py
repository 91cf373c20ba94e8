"""Demo step: probe what the demo's final model routes to, on the embedded text."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .pipeline import DemoContext

PROBE_TOKENS = 2048


def step_probe(ctx: DemoContext) -> str:
    from transformers import AutoModelForCausalLM

    from ..probe import probe_model, write_outputs

    path = ctx.artifacts.get("midtrained_path") or ctx.artifacts.get("converted_path") or ctx.artifacts["scratch_path"]
    model = AutoModelForCausalLM.from_pretrained(path)
    ids = torch.tensor(ctx.artifacts["tokenizer"](ctx.artifacts["text"])["input_ids"][:PROBE_TOKENS])
    report = probe_model(model, ids, seq_len=256)
    report["model"]["path"] = str(path)
    report["data"]["file"] = "the embedded demo text"
    out = path / "probe"
    write_outputs(report, out)
    ctx.artifacts["probe_dir"] = out
    summary = report["summary"]
    line = (
        f"{path.name} ({report['model']['residual_mode']}, H={report['model']['residual_heads']}): width disagreement "
        f"{summary['width_disagreement']:.3f} vs null {summary['null_disagreement']:.3f} "
        f"(excess {summary['learned_excess']:+.3f})"
    )
    if summary["mean_head_deviation"] is not None:
        line += f", mean head deviation {summary['mean_head_deviation']:.3f}"
    if summary["zero_queries"] or summary["zero_gates"]:
        line += " [untrained routing: queries or gates are zero]"
    return f"{line}; wrote {out}"
