"""`torch.compile(model)` on the whole model with the fused routing kernels (issue 42 item 1):
the reads are custom ops (`mhar_hf/ops/routing/traced.py`), so Dynamo traces every layer into
one graph (fullgraph=True: a graph break raises), compiles it once per grad mode and shape, and
the kernels run inside it (launches counted, none falling back to the reference op) with the
reference op's loss and gradients. On a CPU the kernels run under the Triton interpreter and
inductor compiles its C++ code; with MHAR_TEST_GPU=1 the same tests run on the GPU.
"""

import os
import warnings

import pytest
import torch
from torch._dynamo.utils import counters

from mhar_hf import MHARForCausalLM, routing
from mhar_hf.ops.routing import fused_route, fused_route_group, kernels, launch, launch_config, outputs, traced
from mhar_hf.routing import Read, route_reference
from mhar_hf.tiny import tiny_config

GPU = os.environ.get("MHAR_TEST_GPU") == "1" and torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
EPS = 1e-6
MODES = ["full", "block", "delta"]
# forward launches of the 4-layer, 2-block tiny model: full and block mode 8 reads, one launch each
# (no split pairs when traced); delta mode 7 reads in two groups, one launch each
FORWARD_LAUNCHES = {"full": 8, "block": 8, "delta": 2}


def _inductor_compiles() -> bool:
    if GPU:
        return True
    try:
        from torch._inductor import cpp_builder

        cpp_builder.get_cpp_compiler()
        return True
    except Exception:
        return False


BACKENDS = ["eager", "aot_eager",
            pytest.param("inductor", marks=pytest.mark.skipif(not _inductor_compiles(), reason="no C++ compiler"))]


class Launches:
    """Counts each kernel's launches, by name, and the flags (constexprs set True) of each."""

    def __init__(self, monkeypatch):
        self.flags = {}
        for name in kernels.ENTRY_POINTS:
            self.flags[name] = []
            monkeypatch.setattr(kernels, name, self._spy(name, getattr(kernels, name)))

    def _spy(self, name, kernel):
        flags = self.flags[name]

        class Spy:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    flags.append({k for k, v in kwargs.items() if v is True})
                    return kernel[grid](*args, **kwargs)

                return launch

            def __getattr__(self, attribute):  # the site launch's warmup
                return getattr(kernel, attribute)

        return Spy()

    def count(self, name: str, flag: str | None = None) -> int:
        return sum(flag is None or flag in flags for flags in self.flags[name])

    def clear(self):
        for flags in self.flags.values():
            flags.clear()


@pytest.fixture
def launches(monkeypatch):
    return Launches(monkeypatch)


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    """NaN in every tensor the kernels write (an element they skip fails the test), a fresh
    Dynamo, and a fallback to the reference op raised (its one-time warning made new here)."""
    monkeypatch.setattr(routing, "_warned", set())
    torch._dynamo.reset()
    counters.clear()
    with outputs.allocating(lambda *a, **k: torch.full(*a, float("nan"), **k)), warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*reference routing op")
        yield
    torch._dynamo.reset()


def rel_rms(actual, expected) -> float:
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def models(mode: str, **config):
    """A tiny fused model with random routing (open gates, so every routing gradient is nonzero)
    and its twin on the reference op in fp64."""
    torch.manual_seed(0)
    model = MHARForCausalLM(tiny_config(residual_mode=mode, routing_implementation="fused", **config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "router" in name:
                p.add_(0.5 * torch.randn_like(p))
    reference = MHARForCausalLM(tiny_config(residual_mode=mode, routing_implementation="reference", **config))
    reference.load_state_dict(model.state_dict())
    return model.to(DEVICE).train(), reference.to(DEVICE).double().train()


def ids(batch=2, length=7, seed=0):
    return torch.randint(2, 384, (batch, length), generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def train_step(model, tokens):
    model.zero_grad(set_to_none=True)
    loss = model(tokens, labels=tokens, use_cache=False).loss
    loss.backward()
    return loss.detach()


def assert_same_gradients(model, reference, tolerance=1e-4):
    expected = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        if expected[name].grad is None:
            assert p.grad is None, name
            continue
        assert p.grad is not None and torch.isfinite(p.grad).all(), f"{name}: missing or unwritten gradient"
        assert rel_rms(p.grad, expected[name].grad) < tolerance, name


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", MODES)
def test_whole_model_compile_trains_with_the_kernels_like_the_reference(launches, mode, backend):
    model, reference = models(mode)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    tokens = ids()
    loss = train_step(compiled, tokens)
    expected = train_step(reference, tokens)
    assert abs(loss.item() - expected.item()) < 1e-5 * abs(expected.item())
    assert_same_gradients(model, reference)
    reads = FORWARD_LAUNCHES[mode]
    assert launches.count("route_fwd_kernel") == reads  # every read fused, none on the reference op
    assert launches.count("route_site_bwd_kernel") == reads
    assert launches.count("route_fwd_kernel", "GROUPED") == (reads if mode == "delta" else 0)
    assert launches.count("route_fwd_kernel", "HAS_SECOND") == 0  # no split pairs when traced
    assert launches.count("route_source_bwd_kernel") > 0
    assert not counters["graph_break"]


@pytest.mark.parametrize("mode", MODES)
def test_no_grad_compiled_forward_runs_the_kernels(launches, mode):
    """routing_implementation='fused' keeps the kernels in a graph traced without autograd too
    (`auto` traces the reference op there: compiled decoding)."""
    model, reference = models(mode)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    tokens = ids()
    with torch.no_grad():
        logits = compiled(tokens, use_cache=False).logits
        expected = reference(tokens, use_cache=False).logits
    assert rel_rms(logits, expected) < 1e-5
    assert launches.count("route_fwd_kernel") == FORWARD_LAUNCHES[mode]
    assert launches.count("route_site_bwd_kernel") == launches.count("route_source_bwd_kernel") == 0


class NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


@pytest.fixture
def skipped_kernels(monkeypatch):
    """The kernels skipped (zeros written), for tests of what is compiled, which does not depend on
    what they compute: compiling is most of these tests' time, and the interpreter the rest."""
    for name in kernels.ENTRY_POINTS:
        monkeypatch.setattr(kernels, name, NoLaunch())
    # a skipped kernel has no binary to size the site launch's grid from (on a GPU)
    monkeypatch.setattr(launch, "resident_programs", lambda *args: 1)
    with outputs.allocating(torch.zeros):
        yield


@pytest.mark.parametrize("mode", MODES)
def test_one_compile_per_grad_mode_and_shape_and_none_after(skipped_kernels, mode):
    """One graph for training and one without autograd, no graph break; a second sequence length
    compiles the training graph once more, with dynamic shapes; after that new batches, of those
    lengths and of a third, compile nothing (error_on_recompile)."""
    model, _ = models(mode)
    compiled = torch.compile(model, backend="aot_eager")
    train_step(compiled, ids(seed=0))
    with torch.no_grad():
        compiled(ids(seed=0), use_cache=False)
    assert counters["stats"]["unique_graphs"] == 2 and not counters["graph_break"]
    train_step(compiled, ids(length=9, seed=1))
    assert counters["stats"]["unique_graphs"] == 3
    with torch._dynamo.config.patch(error_on_recompile=True):
        for length, seed in ((7, 2), (9, 3), (11, 4)):
            train_step(compiled, ids(length=length, seed=seed))
        with torch.no_grad():
            compiled(ids(seed=5), use_cache=False)
    assert counters["stats"]["unique_graphs"] == 3 and not counters["graph_break"]


def test_ten_full_mode_layers_compile_to_one_graph(skipped_kernels):
    """Past torch's default recompile_limit of 8, which graph breaks at each read hit in full mode
    (the code after a read compiled again for each layer's number of sources): one graph, once."""
    model, _ = models("full", num_hidden_layers=10, residual_num_blocks=5)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    train_step(compiled, ids(seed=0))
    with torch._dynamo.config.patch(error_on_recompile=True):
        train_step(compiled, ids(seed=1))
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("mode", MODES)
def test_activation_checkpointing_under_whole_model_compile(mode, reentrant):
    """A checkpointed layer's reads run again in the backward: each traced read is the same call
    again (nothing kept between reads), so the gradients are the reference's."""
    model, reference = models(mode)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    tokens = ids()
    train_step(compiled, tokens)
    train_step(reference, tokens)
    assert_same_gradients(model, reference)


def test_sources_without_gradient_get_none(launches):
    """A frozen embedding (LoRA, routing-only training): the first source needs no gradient, so
    no read launches a source kernel for it, and every other gradient is the reference's."""
    model, reference = models("full")
    for m in (model, reference):
        m.model.embed_tokens.requires_grad_(False)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    tokens = ids()
    train_step(compiled, tokens)
    train_step(reference, tokens)
    assert_same_gradients(model, reference)
    # full mode's reads take 1, 3, 5, 7 (attention) and 2, 4, 6, 8, 9 (MLP, final) sources: one
    # source kernel per source a read takes, less the embedding, which each of the 8 reads takes
    assert launches.count("route_source_bwd_kernel") == 1 + 3 + 5 + 7 + 2 + 4 + 6 + 8 + 9 - 8 - 1


# the ops themselves, called eagerly, against the specification in fp64 ---------------------

def tensors(count, shape, generator, scale=1.0):
    return [(torch.randn(*shape, generator=generator) * scale * (0.5 + i)).to(DEVICE).requires_grad_()
            for i in range(count)]


def vectors(width, generator):
    """A read's query, key-norm weight, null source and gate."""
    query = torch.randn(width, generator=generator) * 4 / width**0.5
    norm_weight = 1 + 0.3 * torch.randn(width, generator=generator)
    null = torch.randn(width, generator=generator)
    gate = torch.tensor([0.7])
    return [t.to(DEVICE).requires_grad_() for t in (query, norm_weight, null, gate)]


def gradients(outs, inputs, grad_outs):
    return torch.autograd.grad(outs, inputs, grad_outs, allow_unused=True)


@pytest.mark.parametrize("from_out", [1, 10**9], ids=["S-from-output", "S-in-the-loop"])
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "null-gate-residual"])
def test_traced_read_and_every_gradient_match_fp64_reference(from_out, gated, count=5, shape=(2, 9, 64), heads=4):
    g = torch.Generator().manual_seed(1)
    sources = tensors(count, shape, g)
    query, norm_weight, null, gate = vectors(shape[-1], g)
    residual = tensors(1, shape, g)[0]
    extra = dict(null_source=null, gate=gate, residual=residual) if gated else {}
    grad_out = torch.randn(*shape, generator=g).to(DEVICE)
    inputs = [*sources, query, norm_weight, *((null, gate, residual) if gated else ())]
    with launch_config(total_from_out_min_sources=from_out):
        out = traced.traced_route(sources, query, norm_weight, heads, EPS, **extra)
        grads = gradients(out, inputs, grad_out)
    wide = [t.detach().double().requires_grad_() for t in inputs]
    wide_extra = dict(zip(("null_source", "gate", "residual"), wide[count + 2:]))
    expected = route_reference(wide[:count], wide[count], wide[count + 1], heads, EPS, **wide_extra)
    assert rel_rms(out, expected) < 1e-5
    for got, want in zip(grads, gradients(expected, wide, grad_out.double()), strict=True):
        assert rel_rms(got, want) < 1e-5


def test_traced_group_and_every_gradient_match_fp64_reference(count=3, shape=(1, 13, 64), heads=4, reads=3):
    g = torch.Generator().manual_seed(2)
    sources = tensors(count, shape, g)
    params = [vectors(shape[-1], g) for _ in range(reads)]
    grad_outs = [torch.randn(*shape, generator=g).to(DEVICE) for _ in range(reads)]
    inputs = [*sources, *(t for read in params for t in read)]
    outs = traced.traced_route_group(sources, [Read(*read) for read in params], heads, EPS)
    grads = gradients(outs, inputs, grad_outs)
    wide = [t.detach().double().requires_grad_() for t in inputs]
    wide_params = [wide[count + 4 * r:count + 4 * (r + 1)] for r in range(reads)]
    expected = [route_reference(wide[:count], q, w, heads, EPS, null, gate) for q, w, null, gate in wide_params]
    for got, want in zip(outs, expected, strict=True):
        assert rel_rms(got, want) < 1e-5
    for got, want in zip(grads, gradients(expected, wide, [d.double() for d in grad_outs]), strict=True):
        assert rel_rms(got, want) < 1e-5


def test_traced_reads_without_gradient_take_no_rstd_and_match_the_eager_kernels(monkeypatch, count=5,
                                                                                 shape=(2, 9, 64), heads=4):
    """Without autograd (compiled decoding) a traced read's kernel sums its sources' rstd itself, as
    an eager read's does, so the graph computes none for it (nothing there shares one between
    reads): same outputs, bit for bit, as the eager kernels."""
    g = torch.Generator().manual_seed(4)
    sources = [t.detach() for t in tensors(count, shape, g)]
    params = [[t.detach() for t in vectors(shape[-1], g)] for _ in range(3)]
    computed = []
    monkeypatch.setattr(traced, "source_rstd", lambda source, eps: computed.append(source) or torch.ones(1))
    with torch.no_grad():
        read = traced.traced_route(sources, *params[0][:2], heads, EPS)
        group = traced.traced_route_group(sources, [Read(*p) for p in params], heads, EPS)
        eager_read = fused_route(sources, *params[0][:2], heads, EPS)
        eager_group = fused_route_group(sources, [Read(*p) for p in params], heads, EPS)
    assert computed == []
    assert torch.equal(read, eager_read)
    for got, want in zip(group, eager_group, strict=True):
        assert torch.equal(got, want)
    wide = [s.double() for s in sources]
    assert rel_rms(read, route_reference(wide, *[t.double() for t in params[0][:2]], heads, EPS)) < 1e-5
    assert rel_rms(group[2], route_reference(wide, *[t.double() for t in params[2][:2]], heads, EPS,
                                             *[t.double() for t in params[2][2:]])) < 1e-5


def test_custom_ops_pass_opcheck():
    """Schema, fake (meta) implementations, autograd registration, and AOT dispatch with dynamic
    shapes, as torch.library checks them."""
    g = torch.Generator().manual_seed(3)
    shape = (2, 5, 64)
    sources = tensors(3, shape, g)
    rstd = [traced.source_rstd(s, EPS) for s in sources]
    query, norm_weight, null, gate = vectors(shape[-1], g)
    residual = tensors(1, shape, g)[0]
    for args in [(sources, rstd, query, norm_weight, None, None, None, 4, EPS),
                 (sources, rstd, query, norm_weight, null, gate, residual, 4, EPS)]:
        torch.library.opcheck(torch.ops.mhar.route_read.default, args)
    params = [*vectors(shape[-1], g), *vectors(shape[-1], g)]
    torch.library.opcheck(torch.ops.mhar.route_group.default, (sources, rstd, params, True, True, 4, EPS))
    # no rstd: what a graph without autograd calls (the kernel sums it), with no input needing a gradient
    free = [[t.detach() for t in tensors] for tensors in (sources, params, [query, norm_weight])]
    torch.library.opcheck(torch.ops.mhar.route_group.default, (free[0], [], free[1], True, True, 4, EPS))
    torch.library.opcheck(torch.ops.mhar.route_read.default, (free[0], [], *free[2], None, None, None, 4, EPS))
