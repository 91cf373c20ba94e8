"""Demo steps: a tiny "pretrained" Llama, its conversion to an MHAR delta model, and the identity check."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .pipeline import DemoContext

LLAMA_STEPS = 40
SOURCE_SHARD_SIZE = "300KB"  # small, so the tiny source is saved in several shards like a real one


def step_train_llama(ctx: DemoContext, steps: int = LLAMA_STEPS) -> str:
    """Train a plain `LlamaForCausalLM` briefly on the embedded text: the stand-in for a pretrained checkpoint."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from .pipeline import train_briefly

    tokenizer = ctx.artifacts["tokenizer"]
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(ctx.seed)
    model = LlamaForCausalLM(config)
    losses = train_briefly(model, ctx, steps, seed=ctx.seed + 1)
    path = ctx.workdir / "llama"
    model.save_pretrained(path, max_shard_size=SOURCE_SHARD_SIZE)
    tokenizer.save_pretrained(path)
    ctx.artifacts["llama_path"] = path
    shards = len(list(path.glob("*.safetensors")))
    return (f"LlamaForCausalLM ({model.num_parameters():,} parameters): loss {losses[0]:.2f} -> {losses[-1]:.2f} "
            f"in {steps} steps; saved to {path} in {shards} shards")


def step_convert(ctx: DemoContext) -> str:
    """Convert the Llama checkpoint into an MHAR delta model (H=4, 2 blocks)."""
    from ..convert import convert_checkpoint
    from ..folder import ConversionRecord

    path = convert_checkpoint(ctx.artifacts["llama_path"], ctx.workdir / "converted", heads=4, num_blocks=2,
                              log=lambda line: None)
    ctx.artifacts["converted_path"] = path
    provenance = ConversionRecord.read(path)
    return (f"{path}: {len(provenance.shards)} shard(s), {provenance.routing_tensors} routing tensors added "
            f"(zero gates), tokenizer and remote code copied")


def step_verify_identity(ctx: DemoContext) -> str:
    """The converted model must compute exactly what the Llama computes, in fp32 and bf16."""
    from ..verify import verify_identity

    report = verify_identity(ctx.artifacts["llama_path"], ctx.artifacts["converted_path"], max_new_tokens=8)
    if not report.ok:
        raise RuntimeError(f"the converted model differs from its source:\n{report.summary()}")
    dtypes = ", ".join(r.dtype for r in report.results)
    return (f"logits bit-equal and greedy generations identical in {dtypes} on {report.prompts} prompts "
            f"(max |diff| {max(r.max_abs_logit_diff for r in report.results):g})")
