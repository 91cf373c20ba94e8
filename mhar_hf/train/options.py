"""The options of a mid-training run: one dataclass, from which both command lines
(`mhar train`, `python -m mhar_hf.train`) are generated, and whose fields a `--config` YAML file
may set (command-line options win over the file, the file over the defaults).
`training/recipes/` holds such files."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from .optim import LOSSES, SCHEDULES

LORA_TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


def option(default, group: str, help: str, **argparse_kwargs):
    """A field that is also a command-line option of `group`, explained by `help`."""
    return field(default=default, metadata={"group": group, "help": help, **argparse_kwargs})


IO, BATCH, OPT, SAVED, LOG = ("model, data and output", "batch and length", "optimisation", "saved model",
                              "checkpoints and logging")


@dataclass
class TrainOptions:
    model: Path | None = option(None, IO, "a saved model folder (e.g. a converted delta MHAR model)", type=Path,
                                required=True)
    tokenizer: Path | None = option(None, IO, "tokenizer folder (default: --model)", type=Path)
    data: list[str] | None = option(None, IO, ".jsonl/.json/.parquet/.txt files, save_to_disk folders or datasets "
                                    "names", nargs="+", metavar="PATH", required=True)
    data_name: str | None = option(None, IO, "datasets config name (for a datasets name in --data)")
    data_split: str = option("train", IO, "the split of a datasets name")
    text_field: str = option("text", IO, "column that holds the documents")
    streaming: bool = option(False, IO, "read the data as a stream (corpora larger than the disk cache)")
    shuffle_buffer: int = option(10_000, IO, "streaming: seeded shuffle buffer (0: file order)", type=int)
    val_sequences: int = option(64, IO, "packed sequences held out for validation", type=int)
    val_data: list[str] | None = option(None, IO, "take the validation sequences from these sources (same kinds as "
                                        "--data) instead of holding them out of --data", nargs="+", metavar="PATH")
    output: Path | None = option(None, IO, "run folder: checkpoints/, logs/, metrics.jsonl, model/", type=Path,
                                 required=True)

    seq_length: int = option(4096, BATCH, "tokens per packed sequence", type=int)
    batch_size: int = option(1, BATCH, "sequences per process per micro-batch", type=int)
    grad_accum: int = option(1, BATCH, "micro-batches per optimizer step", type=int)
    max_steps: int | None = option(None, BATCH, "optimizer steps", type=int, required=True)
    seed: int = option(0, BATCH, "seed of the initialisation RNGs and the data order", type=int)

    lr: float = option(4e-4, OPT, "peak learning rate", type=float)
    min_lr_ratio: float = option(0.01, OPT, "final LR as a fraction of the peak", type=float)
    schedule: str = option("cosine", OPT, "LR schedule after the warm-up", choices=SCHEDULES)
    warmup_steps: int = option(0, OPT, "linear warm-up steps", type=int)
    decay_fraction: float = option(0.2, OPT, "wsd / 1-sqrt: share of steps spent cooling down", type=float)
    weight_decay: float = option(0.05, OPT, "on 2-D backbone weights only", type=float)
    routing_lr_multiplier: float = option(1.0, OPT, "LR factor of the routing parameters", type=float)
    adam_betas: tuple[float, float] = option((0.9, 0.95), OPT, "AdamW's beta1 and beta2", type=float, nargs=2)
    adam_eps: float = option(1e-8, OPT, "AdamW's epsilon", type=float)
    clip: float = option(1.0, OPT, "gradient-norm clipping (0: off)", type=float)
    z_loss: float = option(0.0, OPT, "weight of mean(logsumexp(logits)^2); the paper: 1e-4", type=float)
    loss: str = option(LOSSES[0], OPT, "fused-linear: cross-entropy and z-loss computed from the final hidden states "
                       "and the output layer's weight a chunk of positions at a time, the logits never made whole; "
                       "chunked: from the model's logits (a model fused-linear does not cover falls back to it)",
                       choices=LOSSES)
    ema_decay: float = option(0.0, OPT, "weight EMA decay (0: off; the paper: 0.999); the saved model is the EMA",
                              type=float)
    mixed_precision: str | None = option(None, OPT, "default: what `accelerate launch` / its config says",
                                         choices=("no", "bf16", "fp16"))
    gradient_checkpointing: bool = option(False, OPT, "recompute each decoder layer in backward")
    compile: str | None = option(None, OPT, "torch.compile each decoder layer with this backend (default inductor): "
                                 "an MHAR layer's attention and MLP sublayers, any other model's whole layer",
                                 nargs="?", const="inductor", metavar="BACKEND")
    train_only_routing: bool = option(False, OPT, "freeze the backbone; train routing parameters only")
    lora_rank: int = option(0, OPT, "LoRA on the backbone (routing parameters stay fully trainable)", type=int)
    lora_alpha: float = option(16.0, OPT, "LoRA's alpha", type=float)
    lora_targets: str = option(LORA_TARGETS, OPT, "comma-separated module names")
    merge_lora: bool = option(False, OPT, "save a merged full model instead of the adapter")

    save_dtype: str = option("source", SAVED, "dtype of the saved model: `source` keeps the --model folder's (its "
                             "config's dtype)", choices=("source", "float32", "bfloat16", "float16"))

    save_every: int = option(500, LOG, "checkpoint every N steps (and at the end)", type=int)
    keep_last: int = option(2, LOG, "checkpoints to keep", type=int)
    resume: bool = option(False, LOG, "continue from the newest checkpoint in --output (if any)")
    eval_every: int = option(200, LOG, "validation loss every N steps (and at the end)", type=int)
    log_every: int = option(1, LOG, "log every N steps", type=int)
    report_to: str = option("tensorboard", LOG, "where metrics go besides metrics.jsonl", choices=("tensorboard", "none"))


OPTIONS = {f.name: f for f in dataclasses.fields(TrainOptions)}


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Every field of `TrainOptions` as an option (`seq_length` as `--seq-length`), and `--config`."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for name, spec in OPTIONS.items():
        kwargs = {k: v for k, v in spec.metadata.items() if k not in ("group", "required")}
        group = groups.setdefault(spec.metadata["group"], parser.add_argument_group(spec.metadata["group"]))
        if spec.default is False:
            kwargs["action"] = "store_true"
        group.add_argument(f"--{name.replace('_', '-')}", default=spec.default, **kwargs)
    parser.add_argument("--config", type=Path, metavar="FILE",
                        help="a YAML file of options (keys as the option names, e.g. seq_length or seq-length); "
                             "options given here win over it (training/recipes/)")
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m mhar_hf.train", description="Mid-train an MHAR model",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    return add_arguments(parser)


def load_config(path: Path) -> dict:
    """The options a YAML file sets, by field name; a clear error for anything else."""
    import yaml

    if not path.is_file():
        raise FileNotFoundError(f"--config {path}: no such file")
    values = yaml.safe_load(path.read_text()) or {}
    if not isinstance(values, dict):
        raise ValueError(f"--config {path}: expected a mapping of option names to values")
    options = {}
    for key, value in values.items():
        name = str(key).replace("-", "_")
        if name not in OPTIONS:
            raise ValueError(f"--config {path}: unknown option {key!r}; the options are {', '.join(OPTIONS)}")
        kind = OPTIONS[name].metadata.get("type")
        options[name] = value if value is None or kind is None else (
            [kind(v) for v in value] if isinstance(value, list) else kind(value))
    return options


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """The options from `argv`, with `--config`'s file under them; errors through `parser`."""
    config = _config_path(argv)
    if config is not None:
        try:
            parser.set_defaults(**load_config(config))
        except (ValueError, FileNotFoundError) as error:
            parser.error(str(error))
    args = parser.parse_args(argv)
    missing = [f"--{name.replace('_', '-')}" for name, spec in OPTIONS.items()
               if spec.metadata.get("required") and getattr(args, name) is None]
    if missing:
        parser.error(f"the following options are required (on the command line or in --config): {', '.join(missing)}")
    return args


def _config_path(argv: list[str]) -> Path | None:
    finder = argparse.ArgumentParser(add_help=False)
    finder.add_argument("--config", type=Path)
    return finder.parse_known_args(argv)[0].config


def check_options(args) -> None:
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
