"""Identity check: does a converted MHAR model compute exactly what its source model computes?

Both models are loaded (one at a time, so peak memory is one model), run on a fixed set of
prompts, each alone and all in one left-padded batch (a batch runs other kernels than one
sequence does), and compared: the maximum absolute logit difference over every prompt position,
whether the logits are bit-for-bit equal, and whether greedy generations match token for token.
A delta conversion must pass in fp32 and in bf16.
"""

from __future__ import annotations

import dataclasses
import gc
import os
from pathlib import Path

import torch

DEFAULT_DTYPES = ("float32", "bfloat16")
PROMPTS = (
    "The capital of France is",
    "Question: Ada has 3 apples and buys 4 more. How many apples does she have?\nAnswer:",
    "def fibonacci(n):\n    ",
    "1, 1, 2, 3, 5, 8, 13,",
)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


class IdentityMismatchError(ValueError):
    """A converted model whose outputs differ from its source's."""


@dataclasses.dataclass
class DtypeResult:
    dtype: str
    max_abs_logit_diff: float
    logits_equal: bool
    generations_match: bool

    @property
    def ok(self) -> bool:
        return self.logits_equal and self.generations_match


@dataclasses.dataclass
class IdentityReport:
    results: list[DtypeResult]
    prompts: int
    prompt_tokens: int
    new_tokens: int
    prompt_source: str  # "tokenizer" or "fixed token ids"

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "ok": self.ok}

    def summary(self) -> str:
        lines = [f"identity check on {self.prompts} prompts ({self.prompt_tokens} tokens from the {self.prompt_source}), "
                 f"each alone and all in one batch, {self.new_tokens} greedy tokens each:"]
        for r in self.results:
            lines.append(f"  {r.dtype:<9} max |logit diff| {r.max_abs_logit_diff:.3g}  logits bit-equal: "
                         f"{'yes' if r.logits_equal else 'NO'}  greedy generations match: {'yes' if r.generations_match else 'NO'}")
        lines.append("IDENTICAL" if self.ok else "MISMATCH")
        return "\n".join(lines)


def prompt_ids(src: str | os.PathLike, vocab_size: int, prompts=PROMPTS) -> tuple[list[torch.Tensor], str]:
    """The prompts as token ids: through the source's tokenizer when it has one, else fixed
    pseudo-random ids (the check is about the model, not the text)."""
    folder = Path(src)
    if any((folder / name).is_file() for name in _TOKENIZER_FILES):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(folder)
        return [tokenizer(p, return_tensors="pt")["input_ids"] for p in prompts], "tokenizer"
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab_size, (1, 8 + 4 * i), generator=generator) for i in range(len(prompts))], "fixed token ids"


@torch.inference_mode()
def model_outputs(path, dtype: str, prompts: list[torch.Tensor], max_new_tokens: int, device: str = "cpu",
                  attn_implementation: str = "eager") -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Logits over each prompt and its greedy continuation, from the model saved at `path`: each
    prompt alone, then all of them in one batch, left-padded (the logits of real tokens only)."""
    from transformers import AutoModelForCausalLM

    from . import MHARConfig  # noqa: F401  (registers the mhar model type)

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), attn_implementation=attn_implementation)
    model.to(device).eval()
    pad = model.generation_config.pad_token_id or 0
    batch, mask = left_padded(prompts, pad)
    logits, generations = [], []
    for ids, attention_mask in [(p, torch.ones_like(p)) for p in prompts] + [(batch, mask)]:
        ids, attention_mask = ids.to(device), attention_mask.to(device)
        out = model(input_ids=ids, attention_mask=attention_mask).logits
        logits.append(out[attention_mask.bool()].cpu())
        out = model.generate(input_ids=ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=pad)
        generations.append(out[:, ids.shape[1]:].cpu())
    del model
    gc.collect()
    return logits, generations


def left_padded(prompts: list[torch.Tensor], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts (each [1, n]) as one batch padded on the left with `pad`, and its attention mask."""
    length = max(p.shape[1] for p in prompts)
    batch = torch.full((len(prompts), length), pad, dtype=prompts[0].dtype)
    mask = torch.zeros((len(prompts), length), dtype=torch.long)
    for row, p in enumerate(prompts):
        batch[row, length - p.shape[1]:], mask[row, length - p.shape[1]:] = p[0], 1
    return batch, mask


def verify_identity(src: str | os.PathLike, dst: str | os.PathLike, dtypes=DEFAULT_DTYPES, max_new_tokens: int = 16,
                    device: str = "cpu", attn_implementation: str = "eager") -> IdentityReport:
    """Compare the source checkpoint `src` with the converted model `dst` in each of `dtypes`."""
    from transformers import AutoConfig

    for dtype in dtypes:
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ValueError(f"{dtype!r} is not a torch dtype name such as float32 or bfloat16")
    for path in (src, dst):
        if not (Path(path) / "config.json").is_file():
            raise FileNotFoundError(f"{Path(path) / 'config.json'} not found: give two saved model folders")
    prompts, prompt_source = prompt_ids(src, AutoConfig.from_pretrained(src).vocab_size)
    results = []
    for dtype in dtypes:
        src_logits, src_gen = model_outputs(src, dtype, prompts, max_new_tokens, device, attn_implementation)
        dst_logits, dst_gen = model_outputs(dst, dtype, prompts, max_new_tokens, device, attn_implementation)
        diff = torch.stack([(a.float() - b.float()).abs().max() for a, b in zip(src_logits, dst_logits)]).max()
        results.append(DtypeResult(
            dtype=dtype,
            max_abs_logit_diff=diff.item(),  # NaN propagates: a NaN anywhere shows as nan
            logits_equal=all(torch.equal(a, b) for a, b in zip(src_logits, dst_logits)),
            generations_match=all(torch.equal(a, b) for a, b in zip(src_gen, dst_gen)),
        ))
    return IdentityReport(results, len(prompts), sum(p.shape[1] for p in prompts), max_new_tokens, prompt_source)


__all__ = ["IdentityMismatchError", "IdentityReport", "verify_identity"]
