"""A converted delta model on the fused routing path computes exactly what its source Llama
computes, in bf16, at a batch of many sequences: every module the two share by name (Llama's
names are kept) gives bit-equal outputs, in prefill and in greedy decoding. On CPU the kernels run
under the Triton interpreter at a tiny size; on a GPU (MHAR_TEST_GPU=1) at a size where cuBLAS and
SDPA choose among several kernels, so a different op, shape or layout on MHAR's side shows.

A failure names the first module, in the order the source model runs them, whose output differs
(or, if the source's own outputs change from one run to the next, says so)."""

import os

import pytest
import torch
from test_convert import save_source
from transformers import AutoModelForCausalLM

from mhar_hf.convert import convert_checkpoint

GPU = os.environ.get("MHAR_TEST_GPU") == "1" and torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
# the GPU size: Llama-3.1-8B's layer at a quarter of its width, four layers, a batch of 32
SIZES = dict(hidden_size=1024, intermediate_size=3584, num_hidden_layers=4, vocab_size=4096) if GPU else {}
BATCH, PROMPT, NEW = (32, 128, 24) if GPU else (8, 16, 12)


def module_outputs(model, ids) -> dict[str, list[torch.Tensor]]:
    """The outputs (their first tensor) of every named module inside a decoder layer and after the
    last, in one forward, in call order. The layers themselves are left out: MHAR's carry its
    residual state, not Llama's hidden states."""
    seen: dict[str, list[torch.Tensor]] = {}

    def keep(name):
        def hook(module, args, output):
            first = output[0] if isinstance(output, tuple) else output
            if isinstance(first, torch.Tensor):
                seen.setdefault(name, []).append(first.detach().clone())
        return hook

    handles = [m.register_forward_hook(keep(name)) for name, m in model.named_modules()
               if name not in ("", "model") and not type(m).__name__.endswith("DecoderLayer")]
    try:
        model(input_ids=ids, attention_mask=torch.ones_like(ids))
    finally:
        for handle in handles:
            handle.remove()
    return seen


def first_difference(source: dict, converted: dict) -> str | None:
    for name, outputs in source.items():  # the source's call order
        if name not in converted:
            continue
        for a, b in zip(outputs, converted[name]):
            if a.shape != b.shape or not torch.equal(a, b):
                diff = (a.float() - b.float()).abs().max().item() if a.shape == b.shape else "shape"
                return f"{name}: max |difference| {diff}"
    return None


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("identity")
    src = save_source(folder / "src", "Llama-3.1-8B", **SIZES)
    dst = convert_checkpoint(src, folder / "dst", heads=8 if GPU else 4, num_blocks=2, log=lambda s: None)
    loaded = []
    for path in (src, dst):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa")
        loaded.append(model.to(DEVICE).eval())
    assert loaded[1].config.routing_implementation == "auto"
    return loaded


def prompts(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (BATCH, PROMPT), generator=torch.Generator().manual_seed(0)).to(DEVICE)


def test_every_shared_module_is_bit_equal_in_a_batched_prefill(models, monkeypatch):
    monkeypatch.setenv("MHAR_ROUTING", "fused")  # on CPU too, through the interpreter
    source, converted = models
    ids = prompts(source.config.vocab_size)
    with torch.inference_mode():
        expected, again, got = module_outputs(source, ids), module_outputs(source, ids), module_outputs(converted, ids)
    # the control: a source that differs from itself would make any difference below meaningless
    unstable = first_difference(expected, again)
    assert unstable is None, f"the source, run twice: {unstable}"
    shared = set(expected) & set(got)
    assert {"model.layers.0.self_attn", "model.layers.3.mlp" if GPU else "model.layers.2.mlp", "lm_head"} <= shared
    difference = first_difference(expected, got)
    assert difference is None, difference


def test_batched_greedy_decoding_gives_the_source_tokens(models, monkeypatch):
    monkeypatch.setenv("MHAR_ROUTING", "fused")
    source, converted = models
    ids = prompts(source.config.vocab_size)
    settings = dict(attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                    pad_token_id=0)
    with torch.inference_mode():
        expected = source.generate(input_ids=ids, **settings)[:, PROMPT:]
        got = converted.generate(input_ids=ids, **settings)[:, PROMPT:]
    same = (expected == got).all(dim=1)
    assert same.all(), f"sequences {same.logical_not().nonzero().flatten().tolist()} part from the source's tokens"
