"""Command-line arguments of `python -m mhar_hf.train` and `mhar train` (one parser for both)."""

from __future__ import annotations

import argparse
from pathlib import Path

from .optim import SCHEDULES

LORA_TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    io = parser.add_argument_group("model, data and output")
    io.add_argument("--model", required=True, type=Path, help="a saved model folder (e.g. a converted delta MHAR model)")
    io.add_argument("--tokenizer", type=Path, help="tokenizer folder (default: --model)")
    io.add_argument("--data", required=True, nargs="+", metavar="PATH",
                    help=".jsonl/.json/.parquet/.txt files, save_to_disk folders or datasets names")
    io.add_argument("--data-name", help="datasets config name (for a datasets name in --data)")
    io.add_argument("--data-split", default="train")
    io.add_argument("--text-field", default="text", help="column that holds the documents")
    io.add_argument("--streaming", action="store_true", help="read the data as a stream (corpora larger than the disk cache)")
    io.add_argument("--shuffle-buffer", type=int, default=10_000, help="streaming: seeded shuffle buffer (0: file order)")
    io.add_argument("--val-sequences", type=int, default=64, help="packed sequences held out for validation")
    io.add_argument("--val-data", nargs="+", metavar="PATH",
                    help="take the validation sequences from these sources (same kinds as --data) "
                         "instead of holding them out of --data")
    io.add_argument("--output", required=True, type=Path, help="run folder: checkpoints/, logs/, metrics.jsonl, model/")

    run = parser.add_argument_group("batch and length")
    run.add_argument("--seq-length", type=int, default=4096)
    run.add_argument("--batch-size", type=int, default=1, help="sequences per process per micro-batch")
    run.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    run.add_argument("--max-steps", type=int, required=True, help="optimizer steps")
    run.add_argument("--seed", type=int, default=0)

    opt = parser.add_argument_group("optimisation")
    opt.add_argument("--lr", type=float, default=4e-4, help="peak learning rate")
    opt.add_argument("--min-lr-ratio", type=float, default=0.01, help="final LR as a fraction of the peak")
    opt.add_argument("--schedule", choices=SCHEDULES, default="cosine")
    opt.add_argument("--warmup-steps", type=int, default=0)
    opt.add_argument("--decay-fraction", type=float, default=0.2, help="wsd / 1-sqrt: share of steps spent cooling down")
    opt.add_argument("--weight-decay", type=float, default=0.05, help="on 2-D backbone weights only")
    opt.add_argument("--routing-lr-multiplier", type=float, default=1.0, help="LR factor of the routing parameters")
    opt.add_argument("--adam-betas", type=float, nargs=2, default=(0.9, 0.95))
    opt.add_argument("--adam-eps", type=float, default=1e-8)
    opt.add_argument("--clip", type=float, default=1.0, help="gradient-norm clipping (0: off)")
    opt.add_argument("--z-loss", type=float, default=0.0, help="weight of mean(logsumexp(logits)^2); the paper: 1e-4")
    opt.add_argument("--ema-decay", type=float, default=0.0, help="weight EMA decay (0: off; the paper: 0.999); the saved model is the EMA")
    opt.add_argument("--mixed-precision", choices=("no", "bf16", "fp16"),
                     help="default: what `accelerate launch` / its config says")
    opt.add_argument("--gradient-checkpointing", action="store_true", help="recompute each decoder layer in backward")
    opt.add_argument("--train-only-routing", action="store_true", help="freeze the backbone; train routing parameters only")
    opt.add_argument("--lora-rank", type=int, default=0, help="LoRA on the backbone (routing parameters stay fully trainable)")
    opt.add_argument("--lora-alpha", type=float, default=16.0)
    opt.add_argument("--lora-targets", default=LORA_TARGETS, help="comma-separated module names")
    opt.add_argument("--merge-lora", action="store_true", help="save a merged full model instead of the adapter")

    saved = parser.add_argument_group("saved model")
    saved.add_argument("--save-dtype", choices=("source", "float32", "bfloat16", "float16"), default="source",
                          help="dtype of the saved model: `source` keeps the --model folder's (its config's dtype)")

    log = parser.add_argument_group("checkpoints and logging")
    log.add_argument("--save-every", type=int, default=500, help="checkpoint every N steps (and at the end)")
    log.add_argument("--keep-last", type=int, default=2, help="checkpoints to keep")
    log.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --output (if any)")
    log.add_argument("--eval-every", type=int, default=200, help="validation loss every N steps (and at the end)")
    log.add_argument("--log-every", type=int, default=1)
    log.add_argument("--report-to", choices=("tensorboard", "none"), default="tensorboard")
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m mhar_hf.train", description="Mid-train an MHAR model",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    return add_arguments(parser)


def check_arguments(args: argparse.Namespace) -> None:
    """Errors that need nothing loaded: numbers in range, exclusive options, the model folder."""
    positive = ("seq_length", "batch_size", "grad_accum", "max_steps", "save_every", "eval_every", "log_every")
    for key in positive:
        if getattr(args, key) < 1:
            raise ValueError(f"--{key.replace('_', '-')} must be at least 1, got {getattr(args, key)}")
    for key in ("val_sequences", "warmup_steps", "keep_last", "clip", "z_loss", "weight_decay", "lora_rank", "shuffle_buffer"):
        if getattr(args, key) < 0:
            raise ValueError(f"--{key.replace('_', '-')} must not be negative, got {getattr(args, key)}")
    if args.warmup_steps >= args.max_steps and args.max_steps > 1:
        raise ValueError(f"--warmup-steps {args.warmup_steps} must be below --max-steps {args.max_steps}")
    if not 0.0 <= args.min_lr_ratio <= 1.0 or not 0.0 < args.decay_fraction <= 1.0:
        raise ValueError("--min-lr-ratio must be in [0, 1] and --decay-fraction in (0, 1]")
    if args.ema_decay and not 0.0 < args.ema_decay < 1.0:
        raise ValueError(f"--ema-decay must be in (0, 1) (or 0 for off), got {args.ema_decay}")
    if args.lora_rank and args.train_only_routing:
        raise ValueError("--lora-rank and --train-only-routing exclude each other: LoRA trains the backbone")
    if args.merge_lora and not args.lora_rank:
        raise ValueError("--merge-lora needs --lora-rank")
    if args.lora_rank and args.ema_decay:
        raise ValueError("--ema-decay is not supported with --lora-rank")
    if not (args.model / "config.json").is_file():
        raise FileNotFoundError(f"--model {args.model}: no config.json there; pass a folder written by save_pretrained")
    tokenizer = args.tokenizer or args.model
    if not tokenizer.is_dir():
        raise FileNotFoundError(f"--tokenizer {tokenizer}: no such folder")
