"""A converted delta model on the fused routing path computes exactly what its source Llama
computes, in bf16, at a batch of many sequences: every module the two share by name (Llama's
names are kept) gives bit-equal outputs, in prefill and in greedy decoding. On CPU the kernels run
under the Triton interpreter at a tiny size; on a GPU (MHAR_TEST_GPU=1) at sizes where cuBLAS and
SDPA choose among several kernels, so a different op, shape or layout on MHAR's side shows: four
of Llama-3.1-8B's layers at a quarter of its width, and two at its full width (its GEMM shapes).

A failure names the first module, in the order the source model runs them, whose output differs,
with the layout of each model's inputs to it (or, if the source's own outputs change from one
run to the next, says so)."""

import os
from typing import NamedTuple

import pytest
import torch
from test_convert import save_source
from transformers import AutoModelForCausalLM

from mhar_hf.convert import convert_checkpoint
from mhar_hf.ops.routing import launch

GPU = os.environ.get("MHAR_TEST_GPU") == "1" and torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
SIZES = {  # on the GPU, Llama-3.1-8B's layers at a batch of 32
    "quarter-width": dict(hidden_size=1024, intermediate_size=3584, num_hidden_layers=4, vocab_size=4096),
    "full-width": dict(num_hidden_layers=2, vocab_size=4096),
} if GPU else {"tiny": {}}
BATCH, PROMPT, NEW = (32, 128, 24) if GPU else (8, 16, 12)


def layout(tensor: torch.Tensor) -> str:
    """What a kernel's choice can depend on besides the values: shape, strides, dtype, alignment."""
    return (f"{tuple(tensor.shape)} strides {tensor.stride()} {tensor.dtype} "
            f"offset {tensor.storage_offset()}, address mod 256 {tensor.data_ptr() % 256}")


class Call(NamedTuple):
    output: torch.Tensor  # the first tensor of the output
    inputs: str  # the layouts of the tensor arguments


def module_outputs(model, run) -> dict[str, list[Call]]:
    """The outputs (their first tensor) and input layouts of every named module inside a decoder
    layer and after the last, each call's, while `run(model)` runs (a forward, or every step of a
    generation). The layers themselves are left out: MHAR's carry its residual state, not Llama's
    hidden states."""
    seen: dict[str, list[Call]] = {}

    def keep(name):
        def hook(module, args, kwargs, output):
            first = output[0] if isinstance(output, tuple) else output
            if isinstance(first, torch.Tensor):
                tensors = [*args, *kwargs.values()]
                inputs = "; ".join(layout(t) for t in tensors if isinstance(t, torch.Tensor))
                seen.setdefault(name, []).append(Call(first.detach().clone(), inputs))
        return hook

    handles = [m.register_forward_hook(keep(name), with_kwargs=True) for name, m in model.named_modules()
               if name not in ("", "model") and not type(m).__name__.endswith("DecoderLayer")]
    try:
        with torch.inference_mode():
            run(model)
    finally:
        for handle in handles:
            handle.remove()
    return seen


def first_difference(source: dict, converted: dict) -> str | None:
    """The first module output that differs, by call (a generation's step) and then in the
    source's call order within it; None if none does."""
    calls = max(len(outputs) for outputs in source.values())
    for call in range(calls):
        for name, outputs in source.items():
            if name not in converted or call >= len(outputs):
                continue
            if call >= len(converted[name]):
                return f"{name}: called {len(converted[name])} times, the source's {len(outputs)}"
            a, b = outputs[call], converted[name][call]
            if a.output.shape != b.output.shape or not torch.equal(a.output, b.output):
                same = a.output.shape == b.output.shape
                diff = (a.output.float() - b.output.float()).abs().max().item() if same else "shape"
                return (f"{name}, call {call}: max |difference| {diff}; inputs of the source: {a.inputs}; "
                        f"of the converted model: {b.inputs}")
    return None


@pytest.fixture(scope="module", params=list(SIZES))
def models(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("identity")
    src = save_source(folder / "src", "Llama-3.1-8B", **SIZES[request.param])
    dst = convert_checkpoint(src, folder / "dst", heads=8 if GPU else 4, num_blocks=2, log=lambda s: None)
    loaded = []
    for path in (src, dst):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa")
        loaded.append(model.to(DEVICE).eval())
    assert loaded[1].config.routing_implementation == "auto"
    return loaded


def prompts(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (BATCH, PROMPT), generator=torch.Generator().manual_seed(0)).to(DEVICE)


def assert_same_module_outputs(models, run):
    """Runs `run` on the source twice (the control: a source that differs from itself would make
    any difference meaningless) and on the converted model, and compares every shared module."""
    source, converted = models
    expected, again, got = (module_outputs(model, run) for model in (source, source, converted))
    unstable = first_difference(expected, again)
    assert unstable is None, f"the source, run twice: {unstable}"
    assert {"model.layers.0.self_attn", f"model.layers.{source.config.num_hidden_layers - 1}.mlp",
            "lm_head"} <= set(expected) & set(got)
    difference = first_difference(expected, got)
    assert difference is None, difference


@pytest.fixture(params=["own", "H100"] if not GPU else ["own"])
def fused(request, monkeypatch):
    """The fused path (on CPU too, through the interpreter), its launches sized for the machine's
    own multiprocessors or, on a CPU, as for an H100's 132: the grids and the token blocks each
    program loops over are then a GPU's."""
    monkeypatch.setenv("MHAR_ROUTING", "fused")
    if request.param == "H100":
        monkeypatch.setattr(launch, "multiprocessors", lambda device: 132)


def test_every_shared_module_is_bit_equal_in_a_batched_prefill(models, fused):
    ids = prompts(models[0].config.vocab_size)
    assert_same_module_outputs(models, lambda model: model(input_ids=ids, attention_mask=torch.ones_like(ids)))


def test_batched_greedy_decoding_is_bit_equal_at_every_step(models, fused):
    """Every decoding step's module outputs, and so the tokens: a difference that greedy choice
    hides for a few steps still names its module and step."""
    ids = prompts(models[0].config.vocab_size)
    settings = dict(attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                    pad_token_id=0)
    assert_same_module_outputs(models, lambda model: model.generate(input_ids=ids, **settings))
