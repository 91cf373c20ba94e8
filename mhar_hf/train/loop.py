"""The mid-training run: check inputs, build everything, train, checkpoint, save the final model.

Every check that can fail on bad input runs before the first training step. The same code
runs on one CPU, one GPU, several GPUs with DDP or FSDP2, and several hosts: `accelerate
launch` decides which.
"""

from __future__ import annotations

import json
import math
import os
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from ..folder import TrainingRecord, built_in_place, is_router_module, is_routing_parameter
from .checkpoint import (
    TrainerState,
    latest_checkpoint,
    leave_frozen_weights_out,
    load_checkpoint,
    remove_partial_checkpoints,
    save_checkpoint,
)
from .compile import compile_regions
from .data import build_corpus, check_sources
from .optim import WeightEMA, build_optimizer, build_scheduler, fused_loss_head, model_loss
from .options import check_options
from .run_folder import check_output, run_folder, stop_with_launcher


def check_model_and_tokenizer(config, tokenizer, seq_length: int) -> None:
    if len(tokenizer) > config.vocab_size:
        raise ValueError(
            f"the tokenizer has {len(tokenizer)} tokens but the model's vocabulary has {config.vocab_size}: "
            "token ids past the embedding would crash training; use the model's own tokenizer (--tokenizer)"
        )
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and seq_length > limit:
        raise ValueError(f"--seq-length {seq_length} exceeds the model's max_position_embeddings={limit}: lower --seq-length")
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos token to separate documents; set one in its tokenizer_config.json")


def configure_trainable(model, args):
    """Freeze the backbone (routing only), or wrap it in LoRA with the routers fully trainable."""
    if args.train_only_routing:
        routing = [p for name, p in model.named_parameters() if is_routing_parameter(name)]
        if not routing:
            raise ValueError("--train-only-routing: the model has no routing parameters (is it an MHAR model in standard mode?)")
        for name, param in model.named_parameters():
            param.requires_grad_(is_routing_parameter(name))
        return model
    if args.lora_rank:
        from peft import LoraConfig, get_peft_model

        routers = sorted({name.rsplit(".", 1)[-1] for name, _ in model.named_modules() if is_router_module(name)})
        lora = LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=0.0,
                          target_modules=args.lora_targets.split(","), modules_to_save=routers or None)
        return get_peft_model(model, lora)
    return model


def gate_tensors(model) -> list[torch.Tensor]:
    return [p for name, p in model.named_parameters() if p.requires_grad and is_routing_parameter(name) and name.endswith(".gate")]


@torch.no_grad()
def gate_magnitudes(gates: list[torch.Tensor]) -> dict[str, float]:
    """Mean and largest |gate| over the delta sites (every process must call: FSDP2 gathers shards)."""
    if not gates:
        return {}
    values = torch.cat([(g.full_tensor() if hasattr(g, "full_tensor") else g).detach().float().reshape(-1) for g in gates]).abs()
    return {"gate_abs_mean": values.mean().item(), "gate_abs_max": values.max().item()}


def loss_head(model, choice: str, log=print):
    """The output layer `model_loss` computes the fused loss in (`--loss fused-linear`), or None:
    the loss on the logits (`--loss chunked`, or a model the fused loss does not cover, said
    through `log`)."""
    if choice == "chunked":
        return None
    head, reason = fused_loss_head(model)
    if head is None:
        log(f"--loss {choice}: {reason}; computing the loss from the logits (--loss chunked) instead")
    return head


@torch.no_grad()
def validation_loss(model, val: torch.Tensor, batch_size: int, accelerator, head=None) -> float | None:
    """Mean next-token loss over the held-out sequences, split across processes. Every process
    runs the same number of forwards (FSDP2 gathers in each); padding batches weigh zero.
    `head`: as `model_loss` takes it."""
    if len(val) == 0:
        return None
    world, rank = accelerator.num_processes, accelerator.process_index
    mine = val[rank::world]
    batches = math.ceil(math.ceil(len(val) / world) / batch_size)
    totals = torch.zeros(2, device=accelerator.device, dtype=torch.float64)
    model.eval()
    for b in range(batches):
        chunk = mine[b * batch_size : (b + 1) * batch_size]
        weight = len(chunk)
        if weight == 0:
            chunk = val[:1]
        chunk = chunk.to(accelerator.device)
        loss, _ = model_loss(model, chunk, head)
        totals += torch.tensor([loss.item() * weight, weight], device=accelerator.device, dtype=torch.float64)
    model.train()
    totals = accelerator.reduce(totals, reduction="sum")
    return (totals[0] / totals[1]).item()


class MetricsLog:
    """`metrics.jsonl` (main process): one JSON object per logged step. On resume, entries after
    the checkpoint's step are dropped, so the file reads as if the run had never stopped."""

    def __init__(self, path: Path, resumed_step: int | None, enabled: bool):
        self.path, self.enabled = path, enabled
        if enabled and resumed_step is not None and path.exists():
            kept = [line for line in path.read_text().splitlines() if self._step(line) <= resumed_step]
            path.write_text("".join(line + "\n" for line in kept))

    @staticmethod
    def _step(line: str) -> float:
        try:  # a line cut short by a kill does not parse: drop it
            return json.loads(line)["step"]
        except (ValueError, KeyError):
            return float("inf")

    def write(self, record: dict) -> None:
        if self.enabled:
            with self.path.open("a") as handle:
                handle.write(json.dumps(record) + "\n")


def _tracker_config(args) -> dict:
    return {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in vars(args).items() if k != "run"}


def train(args) -> Path:
    """Run mid-training as `args` says (a `TrainOptions`, or the command line's namespace of the
    same fields); returns the final model folder."""
    from transformers import AutoConfig, AutoTokenizer

    stop_with_launcher()
    check_options(args)
    check_sources(args.data)
    if args.val_data:
        check_sources(args.val_data)
    output = Path(args.output)
    check_output(output, args.resume)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
    source_config = AutoConfig.from_pretrained(args.model)
    check_model_and_tokenizer(source_config, tokenizer, args.seq_length)
    save_dtype = saved_dtype(args.save_dtype, source_config)
    with run_folder(output, is_main=int(os.environ.get("RANK", "0")) == 0):
        return _train(args, output, tokenizer, save_dtype)


def saved_dtype(choice: str, source_config) -> torch.dtype:
    """The dtype of the saved model: the source's (as its config records it) unless asked."""
    if choice != "source":
        return getattr(torch, choice)
    recorded = getattr(source_config, "dtype", None)
    if isinstance(recorded, str):
        recorded = getattr(torch, recorded, None)
    return recorded if isinstance(recorded, torch.dtype) else torch.float32


def describe(config) -> str:
    """What is being trained, in a line: an MHAR model's residual mode, or a plain model."""
    mode = getattr(config, "residual_mode", "standard") if config.model_type == "mhar" else None
    if mode in (None, "standard"):
        return (f"training a plain {config.model_type} model (no routing parameters): a control run; "
                "`mhar convert` makes an MHAR delta model of it")
    blocks = "" if mode == "full" else f", {config.layers_per_block} layers a block"
    return f"training an MHAR model: {mode} mode, H={config.residual_heads}{blocks}"


def _train(args, output: Path, tokenizer, save_dtype: torch.dtype) -> Path:
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, ProjectConfiguration, set_seed
    from transformers import AutoModelForCausalLM

    accelerator = Accelerator(
        mixed_precision=args.mixed_precision,
        log_with="tensorboard" if args.report_to == "tensorboard" else None,
        project_config=ProjectConfiguration(project_dir=str(output), logging_dir=str(output / "logs")),
    )
    if args.lora_rank and accelerator.distributed_type == DistributedType.FSDP:
        raise ValueError("--lora-rank runs with DDP or on one device, not with FSDP: a LoRA model's frozen backbone fits one GPU")
    set_seed(args.seed)

    with accelerator.main_process_first():
        corpus = build_corpus(
            args.data, tokenizer, args.seq_length, args.val_sequences, args.seed, text_field=args.text_field,
            streaming=args.streaming, shuffle_buffer=args.shuffle_buffer, split=args.data_split,
            name=args.data_name, min_train_sequences=accelerator.num_processes * args.batch_size,
            val_specs=args.val_data,
        )

    # fp32 master weights, loaded straight onto this process's device where it holds the whole model
    # (one device, DDP): no host-memory fp32 copy (32 GB at 8B) to build and then move, and the
    # cast from the stored bf16 runs on the device. FSDP2 shards from the host copy.
    placement = {} if accelerator.distributed_type == DistributedType.FSDP else {"device_map": accelerator.device}
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, **placement)
    accelerator.print(describe(model.config))
    model.config.use_cache = False
    if args.gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model = configure_trainable(model, args)
    if args.compile:
        compile_regions(model, backend=args.compile)
    optimizer = build_optimizer(model, args.lr, args.weight_decay, args.routing_lr_multiplier,
                                tuple(args.adam_betas), args.adam_eps)
    scheduler = build_scheduler(optimizer, args.max_steps, args.warmup_steps, args.schedule,
                                args.min_lr_ratio, args.decay_fraction)
    model, optimizer = accelerator.prepare(model, optimizer)
    leave_frozen_weights_out(accelerator, model)
    state = TrainerState()
    # Registered rather than prepared: a prepared scheduler steps once per process.
    accelerator.register_for_checkpointing(scheduler, state)
    ema = WeightEMA(model, args.ema_decay) if args.ema_decay else None

    if args.resume:
        if accelerator.is_main_process:
            remove_partial_checkpoints(output)
        accelerator.wait_for_everyone()
        resumed_from = latest_checkpoint(output)
        if resumed_from is not None:
            load_checkpoint(accelerator, resumed_from, ema)
            accelerator.print(f"resumed from {resumed_from} at step {state.step}")
        if state.step >= args.max_steps and (output / "model").is_dir():
            accelerator.print(f"{output} already holds the finished run ({state.step} steps); nothing to do")
            return output / "model"
    if args.report_to == "tensorboard":
        accelerator.init_trackers("mhar-train", config=_tracker_config(args))

    last = run_steps(args, accelerator, model, optimizer, scheduler, ema, corpus, state, output)
    metadata = training_metadata(args, accelerator, state, last, save_dtype)
    final = save_final_model(accelerator, model, tokenizer, ema, output, args, metadata, save_dtype)
    accelerator.end_training()
    return final


def run_steps(args, accelerator, model, optimizer, scheduler, ema, corpus, state: TrainerState, output: Path) -> dict:
    """Optimizer steps from `state.step` to `--max-steps`, logging and checkpointing on the way;
    returns the last logged record."""
    from tqdm.auto import tqdm

    world, rank = accelerator.num_processes, accelerator.process_index
    sequences_per_step = world * args.batch_size * args.grad_accum
    metrics = MetricsLog(output / "metrics.jsonl", state.step if args.resume else None, accelerator.is_main_process)
    parameters = list(model.parameters())  # all of them: accelerate's FSDP2 clipping path expects exactly these
    gates = gate_tensors(model)
    head = loss_head(accelerator.unwrap_model(model), args.loss, accelerator.print)
    batches = corpus.micro_batches(state.position, args.batch_size, rank, world)
    progress = tqdm(total=args.max_steps, initial=state.step, disable=not accelerator.is_main_process,
                    desc="train", unit="step", dynamic_ncols=True)
    last: dict = {}
    window_start, window_tokens = time.perf_counter(), 0
    model.train()
    while state.step < args.max_steps:
        loss_sum = torch.zeros((), device=accelerator.device)
        z_sum = torch.zeros((), device=accelerator.device)
        for micro in range(args.grad_accum):
            batch = next(batches).to(accelerator.device)
            sync = nullcontext() if micro == args.grad_accum - 1 else accelerator.no_sync(model)
            with sync:
                cross_entropy, z_loss = model_loss(model, batch, head)
                accelerator.backward((cross_entropy + args.z_loss * z_loss) / args.grad_accum)
            loss_sum += cross_entropy.detach()
            z_sum += z_loss.detach()
        grad_norm = accelerator.clip_grad_norm_(parameters, args.clip if args.clip > 0 else float("inf"))
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if ema is not None:
            ema.update()
        state.step += 1
        state.position += sequences_per_step
        state.tokens += sequences_per_step * args.seq_length
        window_tokens += sequences_per_step * args.seq_length

        last_step = state.step == args.max_steps
        if state.step % args.log_every == 0 or last_step:
            losses = accelerator.reduce(torch.stack([loss_sum, z_sum]) / args.grad_accum, reduction="mean")
            record = {"step": state.step, "loss": losses[0].item(), "z_loss": losses[1].item(), "lr": lr,
                      "grad_norm": float(grad_norm), "tokens": state.tokens,
                      "tokens_per_s": window_tokens / (time.perf_counter() - window_start), **gate_magnitudes(gates)}
            if torch.cuda.is_available():
                record["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
            if state.step % args.eval_every == 0 or last_step:
                record["val_loss"] = validation_loss(model, corpus.val, args.batch_size, accelerator, head)
            metrics.write(record)
            accelerator.log({k: v for k, v in record.items() if k != "step" and v is not None}, step=state.step)
            progress.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:,.0f}")
            last = {**last, **record}
            window_start, window_tokens = time.perf_counter(), 0
        progress.update(1)
        if state.step % args.save_every == 0 or last_step:
            save_checkpoint(accelerator, output, state, ema, keep=args.keep_last)
    progress.close()
    return last


def _resolved(path) -> str:
    """A path as an absolute one (records stay valid when read from elsewhere); a name of a
    `datasets` dataset, which is no local path, as given."""
    return str(Path(path).resolve()) if Path(path).exists() else str(path)


def training_metadata(args, accelerator, state: TrainerState, last: dict, save_dtype: torch.dtype) -> TrainingRecord:
    """What `mhar_training.json` records about the run."""
    import mhar_hf

    return TrainingRecord(
        source_model=_resolved(args.model), steps=state.step, tokens=state.tokens,
        data=[_resolved(d) for d in args.data], val_data=[_resolved(d) for d in args.val_data or []],
        seq_length=args.seq_length,
        global_batch_sequences=accelerator.num_processes * args.batch_size * args.grad_accum,
        processes=accelerator.num_processes, distributed_type=str(accelerator.distributed_type.value),
        lr_schedule={"schedule": args.schedule, "peak_lr": args.lr, "min_lr_ratio": args.min_lr_ratio,
                     "warmup_steps": args.warmup_steps, "decay_fraction": args.decay_fraction,
                     "routing_lr_multiplier": args.routing_lr_multiplier},
        weight_decay=args.weight_decay, z_loss=args.z_loss, ema_decay=args.ema_decay or None,
        trainable="routing" if args.train_only_routing else (f"lora-r{args.lora_rank}" if args.lora_rank else "all"),
        lora_merged=bool(args.merge_lora) if args.lora_rank else None,
        final_train_loss=last.get("loss"), final_val_loss=last.get("val_loss"),
        mixed_precision=accelerator.mixed_precision, saved_dtype=str(save_dtype).removeprefix("torch."),
        mhar_hf_version=mhar_hf.__version__,
    )


def save_final_model(accelerator, model, tokenizer, ema, output: Path, args, metadata: TrainingRecord,
                     save_dtype: torch.dtype) -> Path:
    """`OUT/model`: from_pretrained weights in `save_dtype` (the EMA when on; LoRA merged, or as
    an adapter), tokenizer, remote-code bundle and `mhar_training.json`, built in a staging
    folder beside it and renamed into place (`built_in_place`)."""
    from transformers import AutoConfig

    from ..remote_code import save_remote_code

    final = output / "model"
    accelerator.wait_for_everyone()
    if ema is not None:
        ema.swap()
    unwrapped = accelerator.unwrap_model(model)
    adapter = args.lora_rank and not args.merge_lora
    if args.lora_rank and args.merge_lora:
        unwrapped = unwrapped.merge_and_unload()
    state_dict = accelerator.get_state_dict(model) if not args.lora_rank else None
    if accelerator.is_main_process:
        with built_in_place(final, "saving", accelerator.print) as tmp:
            if adapter:
                unwrapped.save_pretrained(tmp)
            else:
                weights = state_dict if state_dict is not None else unwrapped.state_dict()
                # cast on the way to host memory, a tensor at a time: a copy of the whole model in
                # the save dtype beside the fp32 weights would not fit a GPU that trained near full
                weights = {name: t.to("cpu", save_dtype if t.is_floating_point() else t.dtype)
                           for name, t in weights.items()}
                unwrapped.save_pretrained(tmp, state_dict=weights)
                config = AutoConfig.from_pretrained(tmp)  # save_pretrained records the model's own dtype
                config.dtype = save_dtype
                config.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            if getattr(unwrapped.config, "model_type", None) == "mhar" and not adapter:
                save_remote_code(tmp)
            metadata.write(tmp)
    accelerator.wait_for_everyone()
    if ema is not None:
        ema.swap()
    return final
