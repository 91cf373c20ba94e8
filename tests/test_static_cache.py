"""`generate` with a static cache, eager and with transformers' compiled decoding, gives the same
greedy tokens as the dynamic cache in every mode; compiled decoding traces one graph, compiled
once, that every decoding step replays (no graph break, no recompilation)."""

from types import SimpleNamespace

import pytest
import torch
from test_modeling import MODES, build, randomise_routing
from torch._dynamo.backends.registry import lookup_backend
from transformers import CompileConfig

from mhar_hf import routing

NEW_TOKENS = 8
SETTINGS = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=1,
                eos_token_id=None)

# what the counting backend saw: graphs compiled, and calls of compiled graphs
SEEN = {"compiled": 0, "calls": 0}


def counting_backend(graph_module, example_inputs):
    """aot_eager, counting each graph it compiles and each call of a compiled graph. Module-level:
    CompileConfig deep-copies its fields, so a counter held by the backend would be a copy's."""
    SEEN["compiled"] += 1
    compiled = lookup_backend("aot_eager")(graph_module, example_inputs)

    def call(*args):
        SEEN["calls"] += 1
        return compiled(*args)

    return call


def compile_config(backend="aot_eager", fullgraph=False) -> CompileConfig:
    """transformers' compiled decoding, on the CPU (which it skips unless told)."""
    config = CompileConfig(backend=backend, mode=None, fullgraph=fullgraph)
    config._compile_all_devices = True
    return config


def sharp_model(mode: str, **overrides):
    """A tiny model with open routing and a sharpened output layer: greedy picks are no near-ties,
    so equal tokens mean equal computations."""
    model = randomise_routing(build(mode, attn="sdpa", **overrides), scale=3.0)
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    return model


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    SEEN.update(compiled=0, calls=0)
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("mode", MODES)
def test_static_cache_greedy_equals_dynamic_cache_greedy(mode):
    model = sharp_model(mode)
    prompt = torch.randint(2, 384, (2, 9))
    dynamic = model.generate(prompt, **SETTINGS)
    static = model.generate(prompt, cache_implementation="static", **SETTINGS)
    assert dynamic.shape == (2, 9 + NEW_TOKENS)
    assert torch.equal(static, dynamic)


@pytest.mark.parametrize("mode", MODES)
def test_compiled_static_decoding_equals_eager_in_one_graph_compiled_once(mode):
    """fullgraph=True: a graph break would raise. The counting backend then shows the one graph
    compiled once and called once per decoding step (the first token comes from the prefill, which
    runs eagerly), and a second generate of the same shapes compiling nothing."""
    model = sharp_model(mode)
    prompt = torch.randint(2, 384, (2, 9))
    eager = model.generate(prompt, **SETTINGS)
    config = compile_config(counting_backend, fullgraph=True)
    compiled = model.generate(prompt, cache_implementation="static", compile_config=config, **SETTINGS)
    assert torch.equal(compiled, eager)
    assert SEEN == {"compiled": 1, "calls": NEW_TOKENS - 1}
    again = model.generate(prompt, cache_implementation="static", compile_config=config, **SETTINGS)
    assert torch.equal(again, eager)
    assert SEEN == {"compiled": 1, "calls": 2 * (NEW_TOKENS - 1)}


def test_compiled_static_decoding_in_bf16_with_inductor_matches_aot_eager():
    """The backend of compiled decoding on a GPU (inductor; on this CPU its C++ code) fuses the
    reference routing op into the step's graph: the same tokens as the unfused aot_eager graph."""
    pytest.importorskip("torch._inductor")
    from torch._inductor import cpp_builder

    try:
        cpp_builder.get_cpp_compiler()
    except Exception:
        pytest.skip("no C++ compiler for inductor's CPU code")
    model = sharp_model("delta", dtype=torch.bfloat16)
    prompt = torch.randint(2, 384, (1, 9))
    plain = model.generate(prompt, cache_implementation="static", compile_config=compile_config(), **SETTINGS)
    torch._dynamo.reset()
    fused = model.generate(prompt, cache_implementation="static", compile_config=compile_config("inductor", True),
                           **SETTINGS)
    assert torch.equal(fused, plain)


def test_fused_routing_under_compiled_decoding_runs_the_kernels_inside_one_graph():
    """routing_implementation='fused' keeps the Triton kernels (here under TRITON_INTERPRET), traced
    as custom ops (ops/routing/traced.py): the same tokens, and every decoding step one graph,
    compiled once (fullgraph=True: a break would raise). `auto` traces the reference op instead."""
    model = sharp_model("delta", routing_implementation="fused")
    prompt = torch.randint(2, 384, (1, 5))
    settings = dict(SETTINGS, max_new_tokens=3, min_new_tokens=3)
    eager = model.generate(prompt, **settings)
    compiled = model.generate(prompt, cache_implementation="static",
                              compile_config=compile_config(counting_backend, fullgraph=True), **settings)
    assert torch.equal(compiled, eager)
    assert SEEN == {"compiled": 1, "calls": 2}  # the first token comes from the eager prefill


def test_auto_routing_leaves_the_kernels_out_only_when_compiling_without_autograd(monkeypatch):
    """The dispatch rule behind the one-graph decoding step, for a CUDA tensor (stood in for here)."""
    cuda_tensor = SimpleNamespace(is_cuda=True)
    kernels = routing._fused_kernels(required=True)
    monkeypatch.delenv(routing.ENV_VAR, raising=False)
    assert routing._kernels_for("auto", cuda_tensor) is kernels  # eager: the fused kernels
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with torch.no_grad():
        assert routing._kernels_for("auto", cuda_tensor) is None  # traced: the reference op
        assert routing._kernels_for("fused", cuda_tensor) is kernels  # asked for: kept
    assert routing._kernels_for("auto", cuda_tensor) is kernels  # training under compile: kept
