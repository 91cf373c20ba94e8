"""`mhar demo`: the whole path on a tiny model built from the embedded text, step by step.

Each step takes the shared `DemoContext`, does one job, and returns a one-line report.
Steps run in order; later ones use what earlier ones left in `ctx.artifacts`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .steps_convert import step_convert, step_train_llama, step_verify_identity
from .steps_probe import step_probe
from .steps_train import step_midtrain
from .steps_eval import step_card, step_evaluate


@dataclass
class DemoContext:
    workdir: Path
    seed: int = 0
    artifacts: dict = field(default_factory=dict)


def step_tokenizer(ctx: DemoContext) -> str:
    from ..tiny import demo_corpus, train_tokenizer

    text = demo_corpus()
    tokenizer = train_tokenizer([text], vocab_size=384)
    ctx.artifacts.update(text=text, tokenizer=tokenizer)
    ids = tokenizer(text)["input_ids"]
    return f"byte-level BPE with {len(tokenizer)} tokens; the embedded text is {len(ids):,} tokens"


def token_batches(ids: torch.Tensor, seq_len: int, batch_size: int, steps: int, seed: int):
    """Random windows of the token stream, reproducible from `seed`."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - seq_len, (batch_size,), generator=generator)
        yield torch.stack([ids[s : s + seq_len] for s in starts])


def train_briefly(model, ctx: DemoContext, steps: int, seed: int) -> list[float]:
    """A few AdamW steps on random windows of the embedded text; the loss of every step."""
    ids = torch.tensor(ctx.artifacts["tokenizer"](ctx.artifacts["text"])["input_ids"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    losses = []
    for batch in token_batches(ids, seq_len=64, batch_size=8, steps=steps, seed=seed):
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def step_train_from_scratch(ctx: DemoContext, steps: int = 60) -> str:
    from transformers import AutoModelForCausalLM

    from ..tiny import tiny_config

    torch.manual_seed(ctx.seed)
    tokenizer = ctx.artifacts["tokenizer"]
    config = tiny_config(vocab_size=len(tokenizer), residual_mode="full", residual_heads=4)
    model = AutoModelForCausalLM.from_config(config)
    losses = train_briefly(model, ctx, steps, seed=ctx.seed)
    ctx.artifacts["scratch_model"] = model
    return f"full-mode MHAR (H=4, {model.num_parameters():,} parameters): loss {losses[0]:.2f} -> {losses[-1]:.2f} in {steps} steps"


def step_save_reload(ctx: DemoContext) -> str:
    from transformers import AutoModelForCausalLM

    from ..remote_code import save_remote_code

    path = ctx.workdir / "scratch"
    model = ctx.artifacts["scratch_model"]
    model.save_pretrained(path)
    ctx.artifacts["tokenizer"].save_pretrained(path)
    save_remote_code(path)
    reloaded = AutoModelForCausalLM.from_pretrained(path)
    probe = torch.arange(16).unsqueeze(0)
    with torch.no_grad():
        same = torch.equal(model.eval()(probe).logits, reloaded(probe).logits)
    if not same:
        raise RuntimeError("the reloaded model's logits differ from the trained model's")
    ctx.artifacts["scratch_path"] = path
    ctx.artifacts["scratch_model"] = reloaded
    return f"saved to {path} (safetensors + remote-code bundle); reloaded through AutoModelForCausalLM, logits identical"


def step_generate(ctx: DemoContext) -> str:
    tokenizer, model = ctx.artifacts["tokenizer"], ctx.artifacts["scratch_model"]
    prompt = "Question: Ada has 3 apples"
    inputs = tokenizer(prompt, return_tensors="pt")
    output = model.generate(**inputs, max_new_tokens=20, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    text = tokenizer.decode(output[0], skip_special_tokens=True)
    return f"greedy continuation: {text!r}"


STEPS: list[tuple[str, Callable[[DemoContext], str]]] = [
    ("tokenizer", step_tokenizer),
    ("train from scratch", step_train_from_scratch),
    ("save and reload", step_save_reload),
    ("generate", step_generate),
    ("train a tiny Llama", step_train_llama),
    ("convert to MHAR", step_convert),
    ("verify identity", step_verify_identity),
    ("mid-train", step_midtrain),
    ("probe", step_probe),
    ("evaluate", step_evaluate),
    ("model card", step_card),
]


def run_demo(workdir: Path, seed: int = 0, report: Callable[[str], None] = print) -> DemoContext:
    ctx = DemoContext(workdir=Path(workdir), seed=seed)
    ctx.workdir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    for index, (name, step) in enumerate(STEPS, 1):
        t0 = time.perf_counter()
        summary = step(ctx)
        report(f"[{index}/{len(STEPS)}] {name} ({time.perf_counter() - t0:.1f}s): {summary}")
    report(f"demo finished in {time.perf_counter() - started:.1f}s")
    return ctx
