"""The fused Triton routing kernels against the specification `route_reference` evaluated in fp64.

On CPU the kernels run under the Triton interpreter (conftest sets TRITON_INTERPRET=1); with
MHAR_TEST_GPU=1 on a CUDA machine the same tests run compiled, plus bf16/fp16 variants.
"""

import contextlib
import copy
import gc
import os
import subprocess
import sys
import textwrap
import weakref

import pytest
import torch
import triton
import triton.language as tl
from conftest import HANG_GUARD_S

from mhar_hf.ops.routing import (fused_route, fused_route_and_start, kernels, launch, launch_config, outputs, reads,
                                 tables, track)
from mhar_hf.routing import Read, route, route_group, route_reference
from mhar_hf.tiny import tiny_config

EPS = 1e-6
GPU = os.environ.get("MHAR_TEST_GPU") == "1" and torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
# relative RMS error against fp64 allowed per source dtype (bf16: one rounding of the output)
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
DTYPES = [torch.float32, torch.bfloat16, torch.float16] if GPU else [torch.float32]


@pytest.fixture(autouse=True)
def poisoned_outputs():
    """Every tensor the kernels write starts as NaN, so an element they skip fails the test."""
    with outputs.allocating(lambda *a, **k: torch.full(*a, float("nan"), **k)):
        yield


@pytest.fixture
def configured():
    """`configured(field=value, ...)` runs the rest of the test under those LaunchConfig fields."""
    with contextlib.ExitStack() as stack:
        yield lambda **changes: stack.enter_context(launch_config(**changes))


def rel_rms(actual, expected):
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def routing_inputs(n, width, tokens, batch=1, dtype=torch.float32, null=False):
    """Sources of varied scale, a nonzero query (zero would make every weight uniform) and norm weight."""
    g = torch.Generator().manual_seed(n * 1000 + width + tokens)
    sources = [(torch.randn(batch, tokens, width, generator=g) * (0.5 + i)).to(DEVICE, dtype) for i in range(n)]
    query = (torch.randn(width, generator=g) * 4 / width**0.5).to(DEVICE, dtype)
    norm_weight = (1 + 0.3 * torch.randn(width, generator=g)).to(DEVICE, dtype)
    null_source = torch.randn(width, generator=g).to(DEVICE, dtype) if null else None
    return sources, query, norm_weight, null_source


def forward_and_grads(fn, sources, query, norm_weight, null_source, heads, grad_out):
    inputs = [t.detach().clone().requires_grad_() for t in (*sources, query, norm_weight)]
    null = null_source.detach().clone().requires_grad_() if null_source is not None else None
    out = fn(inputs[: len(sources)], inputs[-2], inputs[-1], heads, EPS, null)
    wrt = inputs + ([null] if null is not None else [])
    return out, torch.autograd.grad(out, wrt, grad_out.to(out.dtype), allow_unused=True)


def fp64(t):
    return t.double() if t is not None else None


SHAPES = [  # (sources, width, heads, tokens, batch, null source)
    pytest.param(5, 64, 4, 37, 1, False, id="tokens-not-a-block-multiple"),
    pytest.param(3, 320, 2, 9, 2, True, id="head-width-160"),
    pytest.param(2, 200, 2, 7, 1, False, id="head-width-100"),  # 64 + 36 columns: a masked high tile
    pytest.param(4, 36, 12, 13, 1, True, id="H=12"),  # head width 3 = 2 + 1
    pytest.param(3, 64, 1, 21, 1, False, id="H=1"),
    pytest.param(1, 32, 4, 19, 1, True, id="one-source-plus-null"),
]


@pytest.fixture(params=[1, 10**9], ids=["S-from-output", "S-in-the-loop"])
def total_from_out(request, configured) -> bool:
    """Both ways an ungated read's site kernel gets S (LaunchConfig.total_from_out_min_sources):
    True when from the read's output."""
    configured(total_from_out_min_sources=request.param)
    return request.param == 1


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n, width, heads, tokens, batch, null", SHAPES)
def test_forward_and_every_gradient_match_fp64_reference(total_from_out, n, width, heads, tokens, batch, null,
                                                         dtype):
    sources, query, norm_weight, null_source = routing_inputs(n, width, tokens, batch, dtype, null)
    grad_out = torch.randn(batch, tokens, width, device=DEVICE)
    out, grads = forward_and_grads(fused_route, sources, query, norm_weight, null_source, heads, grad_out)
    ref, ref_grads = forward_and_grads(
        route_reference, [fp64(s) for s in sources], fp64(query), fp64(norm_weight), fp64(null_source), heads, grad_out
    )
    assert out.dtype == dtype and out.shape == ref.shape
    assert rel_rms(out, ref) < TOLERANCE[dtype]
    names = [f"source {i}" for i in range(n)] + ["query", "key norm weight"] + (["null source"] if null else [])
    for name, grad, expected in zip(names, grads, ref_grads, strict=True):
        assert grad.dtype == dtype, name
        assert torch.isfinite(grad).all(), f"{name}: unwritten (NaN) gradient elements"
        assert rel_rms(grad, expected) < TOLERANCE[dtype], name


@pytest.mark.parametrize("heads_axis", [1, 2], ids=["heads-before-blocks", "blocks-before-heads"])
@pytest.mark.parametrize("split", [1, 4])
def test_low_tile_in_one_or_four_blocks_matches_fp64_reference(monkeypatch, split, heads_axis, width=320, heads=2,
                                                                tokens=9):
    """The interpreter holds the low tile as a GPU launch does, in two column blocks in the
    launches that take them (LaunchConfig.column_block_kinds) and in one elsewhere; a GPU launch may take
    four (launch.column_blocks): one and four blocks in every kernel here, on a read (head width 160:
    128 + 32) and on a group of gated reads, every gradient against fp64; in both axis orders
    (kernels.HEADS_AXIS, by Triton version; a compiled kernel's globals must not change, so a GPU
    runs only its own)."""
    if GPU and heads_axis != kernels.HEADS_AXIS:
        pytest.skip("compiled kernels keep the axis order of the installed Triton")
    monkeypatch.setattr(kernels, "HEADS_AXIS", tl.constexpr(heads_axis))
    kernel_args = launch.kernel_args
    monkeypatch.setattr(launch, "kernel_args", lambda *args: dict(kernel_args(*args), SPLIT=split))
    sources, query, norm_weight, null_source = routing_inputs(3, width, tokens, 2, null=True)
    grad_out = torch.randn(2, tokens, width, device=DEVICE)
    out, grads = forward_and_grads(fused_route, sources, query, norm_weight, null_source, heads, grad_out)
    ref, ref_grads = forward_and_grads(
        route_reference, [fp64(s) for s in sources], fp64(query), fp64(norm_weight), fp64(null_source), heads, grad_out
    )
    sources, params = group_inputs(3, width, tokens, 2, 3, True, torch.float32)
    grad_outs = [torch.randn(2, tokens, width, device=DEVICE) for _ in params]
    outs, group_grads = group_reads_and_grads(sources, params, heads, grad_outs, "fused")
    expected, expected_grads = group_reads_and_grads([fp64(s) for s in sources],
                                                     [[fp64(t) for t in read] for read in params], heads, grad_outs,
                                                     "reference")
    for actual, reference in zip([out, *grads, *outs, *group_grads], [ref, *ref_grads, *expected, *expected_grads],
                                 strict=True):
        assert rel_rms(actual, reference) < TOLERANCE[torch.float32]


@pytest.mark.skipif(not GPU, reason="autotuned launches (large token counts) run on the GPU only")
@pytest.mark.parametrize("heads", [8, 1])
@pytest.mark.parametrize("n", [6, launch.LaunchConfig().few_sources + 4])  # the launch shapes of few and of many sources
def test_tuned_launch_at_training_size(heads, n):
    sources, query, norm_weight, null_source = routing_inputs(n, 1280, 2048, dtype=torch.bfloat16, null=True)
    # the gradient the kernels get, bf16, is the reference's too: P - S cancels, which magnifies a difference
    grad_out = torch.randn(1, 2048, 1280, device=DEVICE).bfloat16()
    out, grads = forward_and_grads(fused_route, sources, query, norm_weight, null_source, heads, grad_out)
    ref, ref_grads = forward_and_grads(
        route_reference, [fp64(s) for s in sources], fp64(query), fp64(norm_weight), fp64(null_source), heads, grad_out
    )
    assert rel_rms(out, ref) < TOLERANCE[torch.bfloat16]
    for grad, expected in zip(grads, ref_grads, strict=True):
        assert rel_rms(grad, expected) < TOLERANCE[torch.bfloat16]


@pytest.mark.skipif(not GPU, reason="only compiled kernels have registers to count")
def test_site_launch_counts_the_programs_of_the_variant_it_runs():
    """The site launch's programs per multiprocessor come from the variant it runs: the warmup
    that counts them compiles that variant (one compiled site kernel after a read's backward, not
    a second one for the launch), and the count is what its registers, warps and shared memory
    allow."""
    device = torch.device(DEVICE)
    cache = kernels.route_site_bwd_kernel.device_caches[torch.cuda.current_device()][0]
    cache.clear()
    sources, query, norm_weight, null_source = routing_inputs(6, 1280, 2048, dtype=torch.bfloat16, null=True)
    grad_out = torch.randn(1, 2048, 1280, device=DEVICE).bfloat16()
    with launch_config():  # from cleared launch caches
        forward_and_grads(fused_route, sources, query, norm_weight, null_source, 8, grad_out)
        (compiled,) = cache.values()
        counted = launch.fitting_programs(compiled.n_regs, compiled.metadata.num_warps, compiled.metadata.shared, device)
        assert launch.resident_counts() == [counted]


@triton.jit
def _converted(src_ptr, dst_ptr, N: tl.constexpr):
    """The rows of a bf16 tile as the kernels convert them with PTX (kernels._bf16_pairs_to_fp32)."""
    offs = tl.arange(0, N)[None, None, None, :]
    tl.store(dst_ptr + offs, kernels._load_tile(src_ptr, offs, offs < N, PTX=True))


@pytest.mark.skipif(not GPU, reason="NVIDIA assembly runs in compiled kernels only")
def test_bf16_rows_convert_bit_for_bit():
    """Two bf16 per 32-bit word, shifted and masked: each fp32 equals torch's conversion bit for
    bit, in order, subnormals, infinities and NaN included."""
    special = torch.tensor([0.0, -0.0, 1e-40, -1e-40, float("inf"), float("-inf"), float("nan"), 3.0])
    values = torch.cat([special, torch.randn(248)]).to(DEVICE, torch.bfloat16)
    out = torch.full((256,), float("nan"), device=DEVICE)
    _converted[(1,)](values, out, N=256)
    assert torch.equal(out.view(torch.int32), values.float().view(torch.int32))


@pytest.mark.skipif(GPU, reason="the GPU run covers 16-bit sources in every shape above")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_16_bit_sources_under_the_interpreter(dtype):
    """Loads and stores of 16-bit types are exact in the interpreter; the math runs in fp32."""
    sources, query, norm_weight, null_source = routing_inputs(3, 320, 9, dtype=dtype, null=True)
    grad_out = torch.randn(1, 9, 320)
    out, grads = forward_and_grads(fused_route, sources, query, norm_weight, null_source, 2, grad_out)
    ref, ref_grads = forward_and_grads(
        route_reference, [fp64(s) for s in sources], fp64(query), fp64(norm_weight), fp64(null_source), 2, grad_out
    )
    assert out.dtype == dtype and rel_rms(out, ref) < TOLERANCE[dtype]
    for grad, expected in zip(grads, ref_grads, strict=True):
        assert grad.dtype == dtype and rel_rms(grad, expected) < TOLERANCE[dtype]


@pytest.mark.skipif(not GPU, reason="address tables pass through pinned host memory on CUDA only")
def test_reads_under_a_cuda_default_device():
    """A model used under `with torch.device("cuda")`: its reads' host-side tables stay on the host."""
    tables.clear()
    sources, query, norm_weight, null_source = routing_inputs(3, 64, 9, null=True)
    grad_out = torch.randn(1, 9, 64, device=DEVICE)
    with torch.device("cuda"):
        out, grads = forward_and_grads(fused_route, sources, query, norm_weight, null_source, 4, grad_out)
    ref, ref_grads = forward_and_grads(
        route_reference, [fp64(s) for s in sources], fp64(query), fp64(norm_weight), fp64(null_source), 4, grad_out
    )
    assert rel_rms(out, ref) < TOLERANCE[torch.float32]
    for grad, expected in zip(grads, ref_grads, strict=True):
        assert rel_rms(grad, expected) < TOLERANCE[torch.float32]


def test_single_source_is_returned_unchanged():
    (source,), query, norm_weight, _ = routing_inputs(1, 32, 5)
    assert fused_route([source], query, norm_weight, 4, EPS) is source


def test_inference_forward_matches_the_training_forward():
    sources, query, norm_weight, null_source = routing_inputs(4, 64, 11, null=True)
    with torch.no_grad():
        inference = fused_route(sources, query, norm_weight, 8, EPS, null_source)
    training = fused_route(sources, query.requires_grad_(), norm_weight, 8, EPS, null_source)
    assert torch.equal(inference, training.detach())


@pytest.mark.parametrize("dtype", DTYPES[-1:] if GPU else [torch.float32], ids=str)
def test_repeated_backward_is_bitwise_identical(dtype):
    sources, query, norm_weight, null_source = routing_inputs(4, 64, 45, batch=2, dtype=dtype, null=True)
    grad_out = torch.randn(2, 45, 64, device=DEVICE)
    first = forward_and_grads(fused_route, sources, query, norm_weight, null_source, 4, grad_out)[1]
    second = forward_and_grads(fused_route, sources, query, norm_weight, null_source, 4, grad_out)[1]
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def test_gated_router_gradients_match_fp64_reference():
    """The gate (and everything else) of a delta-mode site: the fused router against an fp64 twin."""
    from mhar_hf.modeling_mhar import MHARRouter

    config = tiny_config(residual_mode="delta", routing_implementation="fused")
    router = MHARRouter(config, gated=True).to(DEVICE)
    with torch.no_grad():
        for p in router.parameters():
            p.copy_(torch.randn_like(p))
    twin = copy.deepcopy(router).double()
    twin.implementation = "reference"
    sources = [torch.randn(2, 7, 64, device=DEVICE, requires_grad=True) for _ in range(3)]
    twin_sources = [s.detach().double().requires_grad_() for s in sources]
    grad_out = torch.randn(2, 7, 64, device=DEVICE)
    stream = torch.randn(2, 7, 64, device=DEVICE, requires_grad=True)
    twin_stream = stream.detach().double().requires_grad_()
    out, expected = router(tuple(sources), residual=stream), twin(tuple(twin_sources), residual=twin_stream)
    out.backward(grad_out)
    expected.backward(grad_out.double())
    assert rel_rms(out, expected) < 1e-5
    for (name, p), (_, q) in zip(router.named_parameters(), twin.named_parameters(), strict=True):
        assert rel_rms(p.grad, q.grad) < 1e-5, name
    for s, t in zip([*sources, stream], [*twin_sources, twin_stream], strict=True):
        assert rel_rms(s.grad, t.grad) < 1e-5


GATED_SHAPES = [  # (sources, width, heads, tokens, batch)
    pytest.param(3, 320, 2, 9, 2, id="head-width-160"),
    pytest.param(4, 36, 12, 13, 1, id="H=12"),
    pytest.param(1, 64, 1, 37, 1, id="one-source-plus-null-H=1"),
]


def gated_inputs(n, width, tokens, batch, dtype):
    sources, query, norm_weight, null_source = routing_inputs(n, width, tokens, batch, dtype, null=True)
    g = torch.Generator().manual_seed(7 * n + width)
    gate = torch.randn(1, generator=g).to(DEVICE, dtype)
    residual = (3 * torch.randn(batch, tokens, width, generator=g)).to(DEVICE, dtype)
    return [*sources, query, norm_weight, null_source, gate, residual]


def gated_read_and_grads(fn, tensors, heads, grad_out):
    tensors = [t.detach().clone().requires_grad_() for t in tensors]
    *sources, query, norm_weight, null, gate, residual = tensors
    out = fn(sources, query, norm_weight, heads, EPS, null, gate, residual)
    return out, torch.autograd.grad(out, tensors, grad_out.to(out.dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n, width, heads, tokens, batch", GATED_SHAPES)
def test_gated_read_and_every_gradient_match_fp64_reference(n, width, heads, tokens, batch, dtype):
    """A delta-mode read, `residual + gate * mix` in one kernel: output and the gradients of the
    sources, query, key-norm weight, null source, gate and residual against fp64."""
    tensors = gated_inputs(n, width, tokens, batch, dtype)
    grad_out = torch.randn(batch, tokens, width, device=DEVICE)
    out, grads = gated_read_and_grads(fused_route, tensors, heads, grad_out)
    ref, ref_grads = gated_read_and_grads(route_reference, [fp64(t) for t in tensors], heads, grad_out)
    assert out.dtype == dtype and rel_rms(out, ref) < TOLERANCE[dtype]
    names = [f"source {i}" for i in range(n)] + ["query", "key norm weight", "null source", "gate", "residual"]
    for name, grad, expected in zip(names, grads, ref_grads, strict=True):
        assert grad.dtype == dtype and grad.shape == expected.shape, name
        assert torch.isfinite(grad).all(), f"{name}: unwritten (NaN) gradient elements"
        assert rel_rms(grad, expected) < TOLERANCE[dtype], name


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_closed_gate_returns_the_residual_bit_for_bit(dtype):
    """Gate 0 (a freshly converted model): the fused read is its residual exactly, and only the
    gate gets a gradient, equal to the reference's."""
    tensors = gated_inputs(3, 64, 11, 2, dtype)
    tensors[-2] = torch.zeros_like(tensors[-2])
    grad_out = torch.randn(2, 11, 64, device=DEVICE)
    out, grads = gated_read_and_grads(fused_route, tensors, 4, grad_out)
    ref, ref_grads = gated_read_and_grads(route_reference, [fp64(t) for t in tensors], 4, grad_out)
    assert torch.equal(out, tensors[-1])
    *routing, dgate, dresidual = grads
    assert all(torch.count_nonzero(g) == 0 for g in routing)
    assert torch.equal(dresidual, grad_out.to(dtype))
    assert rel_rms(dgate, ref_grads[-2]) < TOLERANCE[dtype]


def test_a_residual_needs_a_gate():
    sources, query, norm_weight, null = routing_inputs(2, 64, 5, null=True)
    with pytest.raises(ValueError, match="pass the read's `gate`"):
        fused_route(sources, query, norm_weight, 4, EPS, null, residual=sources[0])
    with pytest.raises(ValueError, match="shape \\(1,\\)"):
        route_reference(sources, query, norm_weight, 4, EPS, null, torch.ones(2), sources[0])


GROUP_SHAPES = [  # (sources, width, heads, tokens, batch, reads, gated); a program loops over token blocks
    pytest.param(3, 320, 2, 9, 2, 3, True, id="gated-head-width-160"),
    pytest.param(4, 36, 12, 13, 3, 5, True, id="gated-H=12"),
    pytest.param(1, 64, 1, 37, 1, 2, True, id="gated-one-source-plus-null-H=1"),
    pytest.param(2, 64, 4, 21, 1, 1, True, id="gated-one-read"),
    pytest.param(5, 200, 2, 7, 1, 3, False, id="ungated-head-width-100"),
]


def group_inputs(n, width, tokens, batch, reads, gated, dtype):
    """Sources and, per read, its own query, key-norm weight (and null source and gate)."""
    sources, *_ = routing_inputs(n, width, tokens, batch, dtype)
    params = []
    for r in range(reads):
        _, query, norm_weight, null = routing_inputs(r + 2, width, tokens, batch, dtype, null=gated)
        gate = (torch.randn(1, generator=torch.Generator().manual_seed(r)) + 0.5).to(DEVICE, dtype)
        params.append((query, norm_weight, null, gate) if gated else (query, norm_weight))
    return sources, params


def group_reads_and_grads(sources, params, heads, grad_outs, implementation):
    sources = [s.detach().clone().requires_grad_() for s in sources]
    params = [[t.detach().clone().requires_grad_() for t in read] for read in params]
    outs = route_group(sources, [Read(*read) for read in params], heads, EPS, implementation)
    loss = sum((out * g.to(out.dtype)).sum() for out, g in zip(outs, grad_outs, strict=True))
    wrt = [*sources, *(t for read in params for t in read)]
    return outs, torch.autograd.grad(loss, wrt)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n, width, heads, tokens, batch, reads, gated", GROUP_SHAPES)
def test_grouped_reads_and_every_gradient_match_fp64_reference(spies, n, width, heads, tokens, batch, reads, gated,
                                                               dtype):
    """Reads of the same sources in one launch (delta mode's reads between block boundaries,
    each `gate * mix`): every output and the gradients of the sources and of every read's
    query, key-norm weight, null source and gate against fp64 reads one at a time."""
    sources, params = group_inputs(n, width, tokens, batch, reads, gated, dtype)
    grad_outs = [torch.randn(batch, tokens, width, device=DEVICE, dtype=dtype) for _ in range(reads)]  # exact in fp64
    outs, grads = group_reads_and_grads(sources, params, heads, grad_outs, "fused")
    expected, expected_grads = group_reads_and_grads([fp64(s) for s in sources],
                                                     [[fp64(t) for t in read] for read in params], heads, grad_outs,
                                                     "reference")
    for r, (out, ref) in enumerate(zip(outs, expected, strict=True)):
        assert out.dtype == dtype and torch.isfinite(out).all() and rel_rms(out, ref) < TOLERANCE[dtype], f"read {r}"
    leaves = ("query", "key norm weight", "null source", "gate")[: len(params[0])]
    names = [f"source {i}" for i in range(n)] + [f"read {r} {leaf}" for r in range(reads) for leaf in leaves]
    for name, grad, ref in zip(names, grads, expected_grads, strict=True):
        assert grad.dtype == dtype and grad.shape == ref.shape, name
        assert torch.isfinite(grad).all(), f"{name}: unwritten (NaN) gradient elements"
        assert rel_rms(grad, ref) < TOLERANCE[dtype], name
    forward, site, _, _ = spies
    launches = int(n + gated > 1)  # one source and no null source: nothing to mix, no kernel
    assert (forward.count("GROUPED"), site.count("GROUPED")) == (launches, launches)  # each serves every read


def chained(mark):
    """Marks each source after the one before it, as the model does."""

    def mark_all(sources):
        marked = []
        for s in sources:
            marked.append(mark(s, after=marked[-1] if marked else None))
        return marked

    return mark_all


@pytest.mark.parametrize("keep", [True, False], ids=["kept", "summed-by-every-read"])
def test_each_source_rstd_is_computed_once_by_its_first_read(monkeypatch, configured, keep, heads=4):
    """A training read computes the rstd of the sources no read has taken before, and keeps it
    with their marks; later reads load it (their forward sums only the newest): `kept` counts the
    leading sources whose rstd the forward loads. A read with another eps sums its own. With
    LaunchConfig.keep_rstd off, every read sums every rstd."""
    configured(keep_rstd=keep)
    kept, forward = [], reads.read_forward
    monkeypatch.setattr(reads, "read_forward", lambda *args, **kwargs: kept.append(kwargs["kept"]) or forward(*args,
                                                                                                              **kwargs))
    sources, query, norm_weight, _ = routing_inputs(4, 64, 11)
    leaves = [s.detach().clone().requires_grad_() for s in sources]
    marked = chained(track)(leaves)
    outs = [fused_route(marked[:n], query, norm_weight, heads, EPS) for n in (2, 3, 4)]
    assert kept == ([0, 2, 3] if keep else [0, 0, 0])
    sum(o.sum() for o in outs).backward()
    twins = [s.detach().double().requires_grad_() for s in sources]
    sum(route_reference(twins[:n], fp64(query), fp64(norm_weight), heads, EPS).sum() for n in (2, 3, 4)).backward()
    for leaf, twin in zip(leaves, twins, strict=True):
        assert rel_rms(leaf.grad, twin.grad) < 1e-5
    other_eps = fused_route(marked, query, norm_weight, heads, 0.5)  # forward only: a source's reads share one eps
    assert kept[-1] == 0
    assert rel_rms(other_eps, route_reference([fp64(s) for s in sources], fp64(query), fp64(norm_weight), heads,
                                              0.5)) < 1e-5


@pytest.mark.parametrize("marking", ["chained", "separately"])
def test_tracked_sources_sum_every_read_and_other_uses(spies, marking, heads=4):
    """Sources read by several sites with different queries, and used elsewhere too, match the
    fp64 reference. Marked in a chain, each gets its whole gradient from one source-kernel
    launch and a read takes one autograd input for all its sources; marked separately (not in
    the order autograd needs), each read marks its sources again: more launches, same result."""
    from mhar_hf.ops.routing import track

    _, _, source_kernel, _ = spies

    def model(route_fn, sources, params, mark_all):
        sources = mark_all(sources)
        reads = [route_fn(sources[:n], q, g, heads, EPS, null) for n, (q, g, null) in zip((2, 3, 4), params)]
        return reads, reads[0] * reads[1] + reads[2] + sources[1] * 3  # the last term: a use that is not a read

    sources, _, _, _ = routing_inputs(4, 64, 11, batch=2)
    params = [routing_inputs(4, 64, 11, null=i == 1)[1:] for i in range(3)]
    leaves = [s.detach().clone().requires_grad_() for s in sources]
    twins = [s.detach().double().requires_grad_() for s in sources]
    mark_all = chained(track) if marking == "chained" else (lambda ss: [track(s) for s in ss])
    reads, fused_out = model(fused_route, leaves, params, mark_all)
    _, reference_out = model(route_reference, twins, [[fp64(t) for t in p] for p in params], lambda ss: ss)
    grad_out = torch.randn_like(reference_out)
    fused_out.backward(grad_out.float())
    reference_out.backward(grad_out)
    for i, (leaf, twin) in enumerate(zip(leaves, twins, strict=True)):
        assert rel_rms(leaf.grad, twin.grad) < 1e-5, f"source {i}"
    if marking == "chained":
        assert source_kernel.launches == 4
        # query, key-norm weight, null source where there is one, and the newest source
        assert [len(r.grad_fn.next_functions) for r in reads] == [3, 4, 3]
    else:
        assert source_kernel.launches == 2 + 3 + 4


SPLIT_SHAPES = [  # (sources both reads take, sources only the second takes, width, heads, tokens)
    pytest.param(3, 1, 64, 4, 37, id="tokens-not-a-block-multiple"),
    pytest.param(2, 2, 320, 2, 9, id="head-width-160-two-more"),
    pytest.param(4, 1, 36, 12, 13, id="H=12"),
    pytest.param(2, 1, 64, 1, 21, id="H=1"),
]


def split_pair(sources, params, shared, heads, fused):
    """The two reads of a split pair (fused) or the same two reads whole (reference)."""
    (q1, g1), (q2, g2) = params
    if not fused:
        return route_reference(sources[:shared], q1, g1, heads, EPS), route_reference(sources, q2, g2, heads, EPS)
    first, prefix = fused_route_and_start(sources[:shared], q1, g1, q2, g2, heads, EPS)
    return first, fused_route(sources, q2, g2, heads, EPS, prefix=prefix)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("loss_of", ["both", "first", "second"])
@pytest.mark.parametrize("shared, more, width, heads, tokens", SPLIT_SHAPES)
def test_split_reads_and_every_gradient_match_fp64_reference(total_from_out, shared, more, width, heads, tokens,
                                                             loss_of, dtype):
    """A read begun with the one before it (one forward pass, one site pass for both) gives both
    reads' outputs and every gradient of the two reads computed whole; also when only one of
    them reaches the loss."""
    sources = routing_inputs(shared + more, width, tokens, 2, dtype)[0]
    params = [routing_inputs(1, width, tokens + i, dtype=dtype)[1:3] for i in range(2)]
    weights = [torch.randn(2, tokens, width, device=DEVICE) for _ in range(2)]
    used = [loss_of in ("both", "first"), loss_of in ("both", "second")]

    def run(fused):
        cast = (lambda t: t) if fused else fp64
        leaves = [cast(t).detach().clone().requires_grad_() for t in (*sources, *params[0], *params[1])]
        n = len(sources)
        marked = chained(track)(leaves[:n]) if fused else leaves[:n]
        outs = split_pair(marked, [leaves[n : n + 2], leaves[n + 2 :]], shared, heads, fused)
        sum((o.double() * w.double()).sum() for o, w, u in zip(outs, weights, used) if u).backward()
        return outs, [leaf.grad for leaf in leaves]

    (outs, grads), (ref_outs, ref_grads) = run(fused=True), run(fused=False)
    for out, ref in zip(outs, ref_outs):
        assert out.dtype == dtype and rel_rms(out, ref) < TOLERANCE[dtype]
    names = [f"source {i}" for i in range(len(sources))] + ["query 1", "key norm 1", "query 2", "key norm 2"]
    for name, grad, expected in zip(names, grads, ref_grads, strict=True):
        if expected is None:  # not on the loss's path: no gradient, or zeros
            assert grad is None or not grad.any(), name
            continue
        assert torch.isfinite(grad).all(), f"{name}: unwritten (NaN) gradient elements"
        assert rel_rms(grad, expected) < TOLERANCE[dtype], name


@pytest.mark.parametrize("marking", ["none", "added-after-unmarked"])
def test_split_reads_of_sources_not_marked_in_a_chain(marking, shared=3, width=64, heads=4, tokens=37):
    """Sources not marked where they were made (a layer recomputed by reentrant checkpointing
    receives its sources as fresh leaves) are marked by the reads: the second read's must still
    follow the first's marks, whose backward writes terms they use."""
    sources, *_ = routing_inputs(shared + 1, width, tokens, 2)
    params = [routing_inputs(1, width, tokens + i)[1:3] for i in range(2)]
    weights = [torch.randn(2, tokens, width, device=DEVICE) for _ in range(2)]

    def run(fused):
        cast = (lambda t: t) if fused else fp64
        leaves = [cast(t).detach().clone().requires_grad_() for t in (*sources, *params[0], *params[1])]
        given = list(leaves[: shared + 1])
        if fused and marking == "added-after-unmarked":
            given[-1] = track(given[-1], after=given[-2])
        outs = split_pair(given, [leaves[shared + 1 : shared + 3], leaves[shared + 3 :]], shared, heads, fused)
        sum((o.double() * w.double()).sum() for o, w in zip(outs, weights)).backward()
        return [leaf.grad for leaf in leaves]

    for i, (grad, expected) in enumerate(zip(run(fused=True), run(fused=False), strict=True)):
        assert torch.isfinite(grad).all(), f"input {i}: unwritten (NaN) gradient elements"
        assert rel_rms(grad, expected) < 1e-5, f"input {i}"


def test_split_reads_without_gradients_match_the_training_forward():
    sources = routing_inputs(4, 64, 11)[0]
    params = [routing_inputs(1, 64, 11 + i)[1:3] for i in range(2)]
    with torch.no_grad():
        inference = split_pair(sources, params, 3, 4, fused=True)
    params[1][0].requires_grad_()
    training = split_pair(sources, params, 3, 4, fused=True)
    assert all(torch.equal(a, b.detach()) for a, b in zip(inference, training, strict=True))


def test_split_reads_leave_no_reference_cycle():
    """The second read's new source is usually made from the first read's output (the attention
    sublayer's): nothing the pair keeps may hold that source's autograd graph, or the whole
    step's graph and activations would never be freed."""
    sources = [s.requires_grad_() for s in routing_inputs(4, 64, 11)[0]]
    (q1, g1), (q2, g2) = [routing_inputs(1, 64, 11 + i)[1:3] for i in range(2)]
    marked = chained(track)(sources[:3])
    first, prefix = fused_route_and_start(marked, q1, g1, q2, g2, 4, EPS)
    new = track(first * 2 + sources[3], after=marked[-1])
    second = fused_route((*marked, new), q2, g2, 4, EPS, prefix=prefix)
    probe = weakref.ref(new)
    del marked, first, prefix, new, second
    gc.collect()
    assert probe() is None


def test_a_begun_read_ends_once_with_its_sources_and_query():
    sources = routing_inputs(4, 64, 11)[0]
    (q1, g1), (q2, g2) = [routing_inputs(1, 64, 11 + i)[1:3] for i in range(2)]
    _, prefix = fused_route_and_start(sources[:3], q1, g1, q2, g2, 4, EPS)
    with pytest.raises(ValueError, match="starts with|start with"):
        fused_route(sources[1:], q2, g2, 4, EPS, prefix=prefix)
    with pytest.raises(ValueError, match="at least one more"):
        fused_route(sources[:3], q2, g2, 4, EPS, prefix=prefix)
    with pytest.raises(ValueError, match="query"):
        fused_route(sources, q1, g1, 4, EPS, prefix=prefix)
    fused_route(sources, q2, g2, 4, EPS, prefix=prefix)
    with pytest.raises(ValueError, match="ends once"):
        fused_route(sources, q2, g2, 4, EPS, prefix=prefix)
    with torch.no_grad():
        _, prefix = fused_route_and_start(sources[:3], q1, g1, q2, g2, 4, EPS)
    with pytest.raises(ValueError, match="same grad mode"):
        fused_route(sources, q2.requires_grad_(), g2, 4, EPS, prefix=prefix)


@pytest.fixture
def launch_kinds(monkeypatch) -> list[str]:
    """The launch shape (LaunchConfig.shapes kind) each kernel launch asks for, in order."""
    kinds, kernel_args = [], launch.kernel_args
    monkeypatch.setattr(launch, "kernel_args", lambda kind, *args: kinds.append(kind) or kernel_args(kind, *args))
    return kinds


@pytest.mark.parametrize("own_read", [True, False], ids=["partner-has-its-own-read", "partner-has-no-other-read"])
def test_paired_sources_match_fp64_reference(spies, configured, launch_kinds, own_read, heads=4):
    """Sources made and read in the model's order: the newest source's launch also sums, for the
    source made before it, the terms of the reads they share, and that source's launch adds the
    rest (its other reads, its other uses)."""
    configured(partner_min_reads=3)
    _, _, source_kernel, _ = spies
    sources = routing_inputs(3, 64, 11, batch=2)[0]
    params = [routing_inputs(1, 64, 11 + i)[1:3] for i in range(4)]

    def model(route_fn, sources, params, mark):
        x0 = mark(sources[0], None)
        x1 = mark(sources[1], x0)
        own = route_fn([x0, x1], *params[0], heads, EPS) if own_read else 0
        x2 = mark(sources[2], x1)
        r1, r2, r3 = (route_fn([x0, x1, x2], *p, heads, EPS) for p in params[1:])
        return own * 2 + r1 + r2 * r3 + x1  # x1 is also used outside the reads

    leaves = [s.detach().clone().requires_grad_() for s in sources]
    twins = [s.detach().double().requires_grad_() for s in sources]
    fused_out = model(fused_route, leaves, params, lambda s, after: track(s, after=after))
    reference_out = model(route_reference, twins, [[fp64(t) for t in p] for p in params], lambda s, after: s)
    grad_out = torch.randn_like(reference_out)
    fused_out.backward(grad_out.float())
    reference_out.backward(grad_out)
    for i, (leaf, twin) in enumerate(zip(leaves, twins, strict=True)):
        assert torch.isfinite(leaf.grad).all() and rel_rms(leaf.grad, twin.grad) < 1e-5, f"source {i}"
    assert source_kernel.launches == 3
    assert (source_kernel.count("HAS_PARTNER"), source_kernel.count("HAS_INIT")) == (1, 1)
    assert sorted(kind for kind in launch_kinds if kind.startswith("source")) == ["source", "source", "source_paired"]


def test_site_shapes_of_few_source_reads(launch_kinds, heads=4):
    """Few sources: an ungated read alone takes the `site_few` launch shape, a split pair's one
    site launch keeps `site` (faster for pairs: LaunchConfig.shapes' notes)."""
    sources, q, g = routing_inputs(3, 64, 11)[:3]
    params = [routing_inputs(1, 64, 11 + i)[1:3] for i in range(2)]
    leaves = [s.detach().clone().requires_grad_() for s in sources]
    fused_route(leaves, q, g, heads, EPS).sum().backward()
    assert [kind for kind in launch_kinds if kind.startswith("site")] == ["site_few"]
    launch_kinds.clear()
    sum(out.sum() for out in split_pair(leaves, params, 2, heads, fused=True)).backward()
    assert [kind for kind in launch_kinds if kind.startswith("site")] == ["site"]


def test_reads_with_outputs_of_two_dtypes():
    """A 16-bit source read by a site whose fp32 null source makes its output fp32 (fp32 routing
    parameters over 16-bit activations) and by a site without one: both reads reach the source."""
    from mhar_hf.ops.routing import track

    sources, query, norm_weight, null = routing_inputs(2, 64, 7, dtype=torch.bfloat16, null=True)
    leaves = [s.detach().clone().requires_grad_() for s in sources]
    twins = [s.detach().double().requires_grad_() for s in sources]
    null = null.float()

    def reads(route_fn, sources, mark, cast):
        sources = [mark(s) for s in sources]
        return route_fn(sources, query, norm_weight, 4, EPS, cast(null)), route_fn(sources, query, norm_weight, 4, EPS)

    gated, plain = reads(fused_route, leaves, track, lambda t: t)
    assert gated.dtype == torch.float32 and plain.dtype == torch.bfloat16
    (gated.sum() + plain.float().sum()).backward()
    gated, plain = reads(route_reference, twins, lambda s: s, fp64)
    (gated.sum() + plain.sum()).backward()
    for leaf, twin in zip(leaves, twins, strict=True):
        assert rel_rms(leaf.grad, twin.grad) < TOLERANCE[torch.bfloat16]


def test_sources_at_unaligned_addresses(monkeypatch, dtype=DTYPES[-1]):
    """The kernels load table-addressed tensors 16 bytes at a time: a source that starts off a
    16-byte boundary is copied first, so no table holds such an address, and results stay exact."""
    tabled = []
    upload = tables.upload
    monkeypatch.setattr(tables, "upload", lambda addresses, device: tabled.extend(addresses) or upload(addresses, device))
    tables.clear()
    sources, query, norm_weight, _ = routing_inputs(3, 64, 9, dtype=dtype)
    storage = torch.empty(sources[1].numel() + 1, device=DEVICE, dtype=dtype)
    storage[1:].copy_(sources[1].flatten())
    leaves = [s.clone().requires_grad_() for s in sources]
    storage.requires_grad_()
    leaves[1] = storage[1:].view_as(sources[1])  # one element past an aligned start
    assert leaves[1].is_contiguous() and leaves[1].data_ptr() % 16
    grad_out = torch.randn(1, 9, 64, device=DEVICE)
    out = fused_route(leaves, query, norm_weight, 4, EPS)
    grads = torch.autograd.grad(out, leaves, grad_out.to(dtype))
    twins = [fp64(s).requires_grad_() for s in sources]
    ref = route_reference(twins, fp64(query), fp64(norm_weight), 4, EPS)
    ref_grads = torch.autograd.grad(ref, twins, grad_out.double())
    assert tabled and all(address % 16 == 0 for address in tabled)
    assert rel_rms(out, ref) < TOLERANCE[dtype]
    for grad, expected in zip(grads, ref_grads, strict=True):
        assert rel_rms(grad, expected) < TOLERANCE[dtype]


def test_a_groups_copies_of_misaligned_parameters_live_until_its_launches(monkeypatch, dtype=DTYPES[-1]):
    """A read's parameter off a 16-byte boundary (a view into a larger buffer, as flat-parameter
    wrappers make) is copied for the group's read table, and nothing else holds the copy: it must
    live until the forward and site launches have read it. The reads stay exact."""
    copies, alive = [], []
    aligned = tables.aligned

    def record_copies(tensors):
        out = aligned(tensors)
        copies.extend(weakref.ref(c) for c, t in zip(out, tensors, strict=True) if c is not t)
        return out

    class CheckingCopies(LaunchSpy):
        def __getitem__(self, grid):
            launch = super().__getitem__(grid)

            def checked(*args, **kwargs):
                alive.append(bool(copies) and all(ref() is not None for ref in copies))
                copies.clear()
                return launch(*args, **kwargs)

            return checked

    monkeypatch.setattr(tables, "aligned", record_copies)
    for name in ("route_fwd_kernel", "route_site_bwd_kernel"):
        monkeypatch.setattr(kernels, name, CheckingCopies(getattr(kernels, name)))
    sources, params = group_inputs(3, 64, 9, 1, 2, True, dtype)
    buffer = torch.zeros(65, device=DEVICE, dtype=dtype)
    buffer[1:].copy_(params[1][0])
    buffer.requires_grad_()
    leaves = [s.detach().clone().requires_grad_() for s in sources]
    query = buffer[1:]  # one element past an aligned start
    assert query.data_ptr() % 16
    reads = [Read(*params[0]), Read(query, *params[1][1:])]
    outs = route_group(leaves, reads, 4, EPS, "fused")
    grad_outs = [torch.randn_like(out) for out in outs]
    torch.autograd.backward(outs, grad_outs)
    assert alive == [True, True]  # the forward launch, then the site launch
    twins = [fp64(s).requires_grad_() for s in sources]
    twin_query = fp64(params[1][0]).requires_grad_()
    expected = route_group(twins, [Read(*map(fp64, params[0])), Read(twin_query, *map(fp64, params[1][1:]))], 4, EPS,
                           "reference")
    torch.autograd.backward(expected, [fp64(g) for g in grad_outs])
    for out, ref in zip(outs, expected, strict=True):
        assert rel_rms(out, ref) < TOLERANCE[dtype]
    assert rel_rms(buffer.grad[1:], twin_query.grad) < TOLERANCE[dtype]
    for leaf, twin in zip(leaves, twins, strict=True):
        assert rel_rms(leaf.grad, twin.grad) < TOLERANCE[dtype]


def test_a_partial_backward_leaves_nothing_behind():
    """autograd.grad on the query alone runs the reads' backward but not the sources': a later
    full backward must not count the records that pass left."""
    sources, query, norm_weight, _ = routing_inputs(3, 64, 9)
    leaves = [s.detach().clone().requires_grad_() for s in sources]
    query.requires_grad_()
    out = fused_route(leaves, query, norm_weight, 4, EPS)
    torch.autograd.grad(out.sum(), [query], retain_graph=True)
    out.sum().backward()
    twins = [s.double().requires_grad_() for s in sources]
    route_reference(twins, fp64(query), fp64(norm_weight), 4, EPS).sum().backward()
    for leaf, twin in zip(leaves, twins, strict=True):
        assert rel_rms(leaf.grad, twin.grad) < 1e-5


class LaunchSpy:
    """Wraps a kernel: records each launch's flags (the constexprs it sets True), then launches it."""

    def __init__(self, kernel):
        self.kernel, self.flags = kernel, []

    @property
    def launches(self) -> int:
        return len(self.flags)

    def count(self, flag: str) -> int:
        return sum(flag in flags for flags in self.flags)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.flags.append({k for k, v in kwargs.items() if v is True})
            return self.kernel[grid](*args, **kwargs)

        return launch

    def __getattr__(self, name):  # the rest (the site launch's warmup) is the kernel's
        return getattr(self.kernel, name)


SPIED = ("route_fwd_kernel", "route_site_bwd_kernel", "route_source_bwd_kernel", "route_total_kernel")


@pytest.fixture
def spies(monkeypatch):
    """Launch records of the forward, per-read backward, per-source backward and S-from-output kernels."""
    counters = {}
    for name in SPIED:
        counters[name] = LaunchSpy(getattr(kernels, name))
        monkeypatch.setattr(kernels, name, counters[name])
    return counters.values()


def test_dispatch_runs_the_kernels(spies, monkeypatch):
    forward, site, source, _ = spies
    sources, query, norm_weight, _ = routing_inputs(3, 64, 9)
    query.requires_grad_()
    route(sources, query, norm_weight, 4, EPS, implementation="auto" if GPU else "fused").sum().backward()
    assert (forward.launches, site.launches, source.launches) == (1, 1, 0)  # no source needs a gradient
    monkeypatch.setenv("MHAR_ROUTING", "reference")  # the environment variable wins over the argument
    route(sources, query, norm_weight, 4, EPS, implementation="fused")
    assert forward.launches == 1


# (mode, forward launches, sources, split pairs, source pairs, grouped launches, two-phase ends)
# of the 4-layer, 2-block tiny model. full: every attention router but layer 0's, every MLP router
# and the final one read; the embedding and every sublayer output are sources; layers 1-3 pair
# their attention and MLP reads. block: the same reads, the embedding and the running sum after
# every sublayer; each block's reads begun in one grouped launch over its finished blocks (layer 0:
# the embedding, for its MLP read and layer 1's reads; layer 2: the embedding and the first
# block, for its own reads and layer 3's), each read but layer 2's attention read (which takes
# the blocks alone) then ended by a launch that folds in its running sum; the final read whole.
# delta: no final read; the two block deltas; its 7 reads in two groups, one per block (layer 0's
# MLP read to layer 2's attention read, layer 2's MLP read to the end), a launch each way each.
# Source pairs (a source's launch also sums the terms of the source made before it, from the
# reads they share when those are all that source has had so far, LaunchConfig.partner_min_reads or
# more): full mode, the attention outputs of layers 2, 1 and 0 with the MLP output of the layer
# before (the embedding for layer 0), sharing 4, 6 and 8 reads; in delta mode the two deltas
# share 3 reads, too few.
MODEL_READS = [("full", 8, 9, 3, 3, 0, 0), ("block", 9, 9, 0, 0, 2, 6), ("delta", 2, 2, 0, 0, 2, 0)]


@pytest.mark.parametrize("mode, reads, sources, pairs, source_pairs, groups, ends", MODEL_READS)
def test_model_routes_every_multi_source_site_through_the_kernels(spies, total_from_out, mode, reads, sources, pairs,
                                                                  source_pairs, groups, ends):
    from mhar_hf import MHARForCausalLM

    forward, site, source, totals = spies
    model = MHARForCausalLM(tiny_config(residual_mode=mode, routing_implementation="fused")).to(DEVICE)
    model(torch.randint(0, 384, (1, 6), device=DEVICE)).logits.sum().backward()
    # each source gets its gradient from one launch, for all its reads: none was marked again
    assert (forward.launches, source.launches) == (reads, sources)
    # a pair: one forward pass begins the second read, one more ends it; one site pass serves both
    assert (forward.count("HAS_SECOND"), forward.count("HAS_INIT")) == (pairs, pairs + ends)
    assert (site.launches, site.count("HAS_SECOND"), totals.launches) == (reads - pairs, pairs, pairs)
    assert (source.count("HAS_PARTNER"), source.count("HAS_INIT")) == (source_pairs, source_pairs)
    assert (forward.count("GROUPED"), site.count("GROUPED")) == (groups, groups)
    assert site.count("HAS_LSE_GRAD") == (groups if mode == "block" else 0)  # two-phase reads' first phase
    # an ungated read's site pass takes S from its output (the mix); a gated read's output is not;
    # a two-phase read's end always does (its pass sees only the sources it adds)
    whole = reads - pairs - groups - ends
    assert site.count("TOTAL_FROM_OUT") == ends + (whole if total_from_out and mode != "delta" else 0)


@pytest.mark.parametrize("keep_rstd", [True, False], ids=["rstd-kept", "rstd-summed"])
@pytest.mark.parametrize("mode", ["full", "block", "delta"])
def test_model_gradients_match_the_fp64_reference_model(configured, total_from_out, keep_rstd, mode):
    """Every parameter's gradient through a whole model with the kernels (split pairs, source
    pairs, the terms each read leaves for the source kernel, some written by a split pair's
    second read before the pair's site kernel writes the rest) against the same model in fp64
    with the reference op, with each source's rstd kept from its first read or summed by every
    read (LaunchConfig.keep_rstd)."""
    from mhar_hf import MHARForCausalLM

    configured(keep_rstd=keep_rstd)

    config = tiny_config(residual_mode=mode, routing_implementation="fused")
    model = MHARForCausalLM(config).to(DEVICE)
    reference = MHARForCausalLM(tiny_config(residual_mode=mode, routing_implementation="reference")).to(DEVICE)
    reference.load_state_dict(model.state_dict())
    reference.double()
    ids = torch.randint(0, config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    for m in (model, reference):
        m(ids, labels=ids).loss.backward()
    expected = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        assert torch.isfinite(p.grad).all(), f"{name}: unwritten (NaN) gradient elements"
        assert rel_rms(p.grad, expected[name].grad) < 1e-4, name


@pytest.mark.parametrize("mode", ["full", "block", "delta"])
def test_a_dropped_step_frees_every_depth_source(mode):
    """Nothing the fused reads keep (tables, split pairs, marks) may hold a step's autograd graph
    in a reference cycle: once the loss is dropped, with or without its backward, every layer's
    output is freed."""
    from mhar_hf import MHARForCausalLM

    model = MHARForCausalLM(tiny_config(residual_mode=mode, routing_implementation="fused")).to(DEVICE)
    probes = []
    for layer in model.model.layers:
        layer.register_forward_hook(lambda module, args, out: probes.extend(
            weakref.ref(t) for t in torch.utils._pytree.tree_leaves(out) if torch.is_tensor(t)))
    for backward in (False, True):
        loss = model(torch.randint(0, 384, (1, 6), device=DEVICE)).logits.sum()
        if backward:
            loss.backward()
        del loss
        gc.collect()
        assert probes and all(p() is None for p in probes)
        probes.clear()


def test_a_group_of_unlike_reads_falls_back_with_one_warning(spies, recwarn):
    """One launch serves a group only when its reads agree on having a null source and a gate."""
    forward, *_ = spies
    sources, params = group_inputs(3, 64, 5, 1, 2, True, torch.float32)
    reads = [Read(*params[0]), Read(*params[1][:2], gate=params[1][3])]  # the second has no null source
    for _ in range(2):
        outs = route_group(sources, reads, 4, EPS, implementation="fused")
    assert forward.launches == 0 and "null source and a gate" in str(recwarn[0].message)
    assert len([w for w in recwarn if "reference routing op" in str(w.message)]) == 1
    for out, read in zip(outs, reads, strict=True):
        assert torch.equal(out, route_reference(sources, read.query, read.key_norm_weight, 4, EPS, read.null_source,
                                                read.gate))


def test_uncovered_call_falls_back_with_one_warning(spies, recwarn):
    forward, *_ = spies
    sources, query, norm_weight, _ = routing_inputs(3, 64, 5)
    mixed = [sources[0].half(), *sources[1:]]
    for _ in range(2):
        out = route(mixed, query, norm_weight, 4, EPS, implementation="fused")
    assert forward.launches == 0
    assert torch.equal(out, route_reference(mixed, query, norm_weight, 4, EPS))
    assert len([w for w in recwarn if "reference routing op" in str(w.message)]) == 1


@pytest.mark.parametrize("width, heads, held", [(1024, 8, 1024), (1280, 8, 1280), (1020, 12, 16 * (64 + 32))])
def test_launch_counts_only_the_columns_a_program_holds(width, heads, held):
    """A power-of-two d/H leaves the high tile empty: counting it gave d = 1024, H = 8 (350M) 1032
    elements per row, which rounded its programs up to twice the warps."""
    assert launch.padded_width(launch.tile(width, heads)) == held


@pytest.mark.parametrize("width, heads", [(320, 2), (36, 12), (200, 2), (1280, 8), (4096, 8)])
def test_every_launch_takes_a_power_of_two_of_rows(monkeypatch, width, heads):
    """Token rows are a tile dimension (tl.arange): the grouped forward's rows-that-fit-a-warp
    gave 6 at d = 320, H = 2, which the GPU compiler rejects (the interpreter does not check)."""
    monkeypatch.setattr(launch, "interpreted", lambda: False)
    with launch_config():  # launch caches cleared before and after
        for kind in launch.current().shapes:
            rows = launch.kernel_args(kind, width, heads)["BLOCK_T"]
            assert rows >= 1 and rows & (rows - 1) == 0, (kind, rows)


def test_site_programs_fill_each_multiprocessor_within_their_bounds(monkeypatch, configured, sms=132, resident=6):
    """A read's site launch on a GPU of `sms` multiprocessors, each holding `resident` of its
    programs at once: one token block per program up to that many per multiprocessor, past which
    programs loop over blocks; a group of reads shares the site_programs_per_sm floor among its
    reads, but each read keeps the programs whose partials stay under 1 / SITE_PARTIALS_SHARE of
    its sources' bytes. site_programs_max_per_sm, where set, stands in for `resident`."""
    monkeypatch.setattr(launch, "multiprocessors", lambda device: sms)
    low, high = launch.current().site_programs_per_sm * sms, resident * sms
    row = 4 * 1024 * 4  # four fp32 partial rows of d = 1024 per program
    cpu = torch.device("cpu")
    assert launch.site_programs(100, 10**12, row, cpu, resident) == 100
    assert launch.site_programs(100_000, 10**12, row, cpu, resident) == high
    assert launch.site_programs(100_000, 0, row, cpu, resident) == min(low, high)
    reads = 10
    assert launch.site_programs(100_000, 0, row, cpu, resident, reads) == min(-(-low // reads), high)
    enough = 300 * launch.current().site_partials_share * row  # partials bound: 300 programs
    assert launch.site_programs(100_000, enough, row, cpu, resident, reads) == min(max(300, -(-low // reads)), high)
    configured(site_programs_max_per_sm=2)
    assert launch.site_programs(100_000, 10**12, row, cpu, resident) == 2 * sms


def test_resident_counts_are_kept_per_variant_triton_compiles():
    """The resident-program counts are keyed as Triton tells its variants apart: by a tensor's
    dtype and 16-byte alignment, and by an integer's being 1 or a multiple of 16."""
    rows = torch.zeros(8, dtype=torch.bfloat16)
    assert launch.specialized(rows) == launch.specialized(torch.ones(4, dtype=torch.bfloat16))
    assert launch.specialized(rows) != launch.specialized(rows.float())
    assert launch.specialized(rows) != launch.specialized(rows[1:])  # 2 bytes past an aligned start
    assert len({launch.specialized(n) for n in (1, 16, 32, 17, 3)}) == 3
    assert launch.specialized(1e-6) == launch.specialized(0.5)


@pytest.mark.parametrize("registers, warps, shared, fitting", [
    (168, 2, 0, 6),  # 168 x 32 = 21 blocks of 256 per warp: 65536 // (2 x 5376) = 6
    (222, 2, 0, 4),  # 222 x 32 = 7104, 28 blocks (7168) a warp: 65536 // 14336 = 4
    (255, 1, 0, 8),  # 255 x 32 = 8160, 32 blocks (8192): 8
    (32, 1, 0, 32),  # registers for 64 programs: at most 32 programs a multiprocessor
    (32, 8, 0, 8),  # 2048 threads // 256 a program
    (64, 1, 40 * 1024, 5),  # shared memory: 233472 // (40960 + 1024) = 5
])
def test_fitting_programs_follow_the_multiprocessor_limits(monkeypatch, registers, warps, shared, fitting):
    """Programs one multiprocessor runs at once, by registers (in blocks of 256 a warp), threads,
    the 32-program limit and shared memory (1 KiB more a program), with an H100's limits."""
    monkeypatch.setattr(launch, "_multiprocessor_limits",
                        lambda device: dict(registers=65536, threads=2048, shared=233472))
    assert launch.fitting_programs(registers, warps, shared, torch.device("cuda")) == fitting


def run_without_interpreter(script: str) -> subprocess.CompletedProcess:
    """A Python script run in a fresh process with TRITON_INTERPRET unset (this process set it)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)


def test_kernels_compile_for_sm90():
    """The interpreter accepts code the GPU compiler rejects: compile every kernel for Hopper."""
    script = textwrap.dedent("""
        import itertools
        from mhar_hf.ops.routing import kernels, launch
        from mhar_hf.ops.routing.ahead import compile_kernel

        gated = dict(HAS_NULL=True, HAS_GATE=True, STORE_STATS=True, HAS_GRAD_IN=True, HAS_SECOND=False,
                     HAS_INIT=False, HAS_PARTNER=False, GROUPED=False, TOTAL_FROM_OUT=False)
        split = dict(HAS_NULL=False, HAS_GATE=False, STORE_STATS=True, HAS_GRAD_IN=False, HAS_SECOND=True,
                     HAS_INIT=True, HAS_PARTNER=True, GROUPED=False, TOTAL_FROM_OUT=True)
        grouped = dict(gated, GROUPED=True)
        begun = dict(grouped, HAS_NULL=False, HAS_GATE=False, HAS_LSE_GRAD=True)  # two-phase reads' first phase
        shapes = ((1280, 8, 1, 1), (512, 1, 4, 8), (1536, 12, 2, 2), (36, 12, 1, 4))  # the last: d/H = 3
        every_kernel = (kernels.route_fwd_kernel, kernels.route_site_bwd_kernel, kernels.route_source_bwd_kernel,
                        kernels.route_total_kernel, kernels.route_partials_kernel, kernels.route_begun_grad_kernel)
        for (width, heads, rows, warps), flags, kernel in itertools.product(shapes, (gated, split, grouped, begun),
                                                                            every_kernel):
            kind = {kernels.route_site_bwd_kernel: "site", kernels.route_total_kernel: "total",
                    kernels.route_begun_grad_kernel: "total"}.get(kernel, "forward")
            blocks = launch.column_blocks(kind, launch.tile(width, heads), warps)
            compile_kernel(kernel, flags, width, heads, rows, warps, split=blocks)
        print("compiled")
    """)
    result = run_without_interpreter(script)
    assert result.returncode == 0 and "compiled" in result.stdout, result.stderr[-3000:]


def test_low_tile_in_blocks_keeps_each_head_on_few_lanes_of_one_warp():
    """The low tile in column blocks (launch.column_blocks): at the presets' site launches (H = 8) the
    compiled layout puts no head across warps (a sum across warps goes through shared memory) and
    each head on as few lanes as the warp allows, 32 * warps / H. In one block, a head of 128
    columns spanned 16 lanes, and each per-head sum a shuffle more. With the heads' axis of the
    other Triton versions (kernels.HEADS_AXIS) it fails: the lanes go to the blocks."""
    script = textwrap.dedent(r"""
        import re
        from mhar_hf import MHARConfig
        from mhar_hf.ops.routing import kernels, launch
        from mhar_hf.ops.routing.ahead import compile_kernel

        flags = dict(HAS_NULL=False, HAS_GATE=False, STORE_STATS=True, HAS_SECOND=False, HAS_INIT=False,
                     GROUPED=False, TOTAL_FROM_OUT=True)
        layout = re.compile(r"sizePerThread = \[1, 1, 1, 8\], threadsPerWarp = \[(\d+), (\d+), (\d+), (\d+)\], "
                            r"warpsPerCTA = \[(\d+), (\d+), (\d+), (\d+)\]")
        for preset in ("100M", "350M", "1B"):
            width = MHARConfig.from_preset(preset).hidden_size
            setup = launch.kernel_args("site", width, 8)
            ttgir = compile_kernel(kernels.route_site_bwd_kernel, flags, width, 8, setup["BLOCK_T"],
                                   setup["num_warps"], split=setup["SPLIT"]).asm["ttgir"]
            lanes = [int(n) for n in layout.search(ttgir).groups()]
            blocks = 3 - kernels.HEADS_AXIS  # the axis of column blocks
            print("tile", preset, setup["num_warps"], lanes[blocks] * lanes[3], lanes[4 + blocks] * lanes[7])
    """)
    result = run_without_interpreter(script)
    assert result.returncode == 0, result.stderr[-3000:]
    tiles = [line.split()[1:] for line in result.stdout.splitlines() if line.startswith("tile")]
    assert len(tiles) == 3, result.stdout
    for preset, warps, lanes_per_head, warps_per_head in tiles:
        assert int(lanes_per_head) == 32 * int(warps) // 8 and warps_per_head == "1", (preset, result.stdout)


def test_site_kernel_stores_its_per_source_sums_without_a_layout_change():
    """Per source, the site kernel stores the read's dots and P (per-head sums). Through tl.store
    each went to shared memory and back behind a barrier (a layout change the compiler adds for the
    store); IN_PLACE stores them from the threads that hold them (the GPU's form; measured in
    launch.stores_in_place). Nor does it sum over heads per source, a grouped read's or a split
    pair's (rstd comes from the forward's table). And where S comes from the read's output
    (TOTAL_FROM_OUT) the loop carries one row-wide sum instead of two. Read from the Hopper build
    at d = 1024, H = 8 (the 350M shape)."""
    script = textwrap.dedent("""
        from mhar_hf.ops.routing import kernels
        from mhar_hf.ops.routing.ahead import compile_kernel
        from mhar_hf.ops.routing.launch import column_blocks, tile

        split = column_blocks("site", tile(1024, 8), 2)  # the low tile's column blocks per head at two warps
        low = f"1x8x{split}" if kernels.HEADS_AXIS == 1 else f"1x{split}x8"  # its shape, by the heads' axis
        grouped = dict(HAS_NULL=True, HAS_GATE=True, HAS_SECOND=False, GROUPED=True, TOTAL_FROM_OUT=False)
        pair = dict(HAS_NULL=False, HAS_GATE=False, HAS_SECOND=True, GROUPED=False, TOTAL_FROM_OUT=True)
        single = dict(pair, HAS_SECOND=False)

        def source_loop(flags, in_place=True):
            ttgir = compile_kernel(kernels.route_site_bwd_kernel, dict(flags, IN_PLACE=in_place), 1024, 8, 1, 2,
                                   split=split).asm["ttgir"]
            loop = ttgir[ttgir.index("to %num_"):]
            return loop[:loop.index("scf.yield")]

        def sums_over_heads(loop):  # reductions of per-head sums ([1, 8]), as rstd's
            lines = loop.splitlines()
            ends = [next(end for end in lines[i:] if end.lstrip().startswith("})"))
                    for i, line in enumerate(lines) if '"tt.reduce"' in line]
            return sum("(tensor<1x8xf32" in end for end in ends)

        def row_sums(loop):  # what the loop carries that is as wide as a row (d/H = 128: one tile)
            return loop.splitlines()[0].split("->")[1].count(f"tensor<{low}x{128 // split}xf32")

        in_place, through_store = source_loop(grouped), source_loop(grouped, False)
        print("split", split)
        print("changes", in_place.count("ttg.convert_layout"), through_store.count("ttg.convert_layout"))
        print("sums over heads", sums_over_heads(in_place), sums_over_heads(source_loop(pair)))
        print("row sums", row_sums(in_place), row_sums(source_loop(single)), row_sums(source_loop(pair)))
    """)
    result = run_without_interpreter(script)
    assert result.returncode == 0, result.stderr[-3000:]
    assert int(result.stdout.split("split")[1].split()[0]) == 2, result.stdout  # the tile these counts are of
    in_place, through_store = (int(n) for n in result.stdout.split("changes")[1].split()[:2])
    assert in_place == 0 and through_store >= 2, result.stdout
    grouped, pair = (int(n) for n in result.stdout.split("sums over heads")[1].split()[:2])
    assert grouped == 0 and pair == 0, result.stdout  # rstd from the forward's table
    grouped, single, pair = (int(n) for n in result.stdout.split("row sums")[1].split())
    assert grouped == 2 and single == 1 and pair == 1, result.stdout  # S from the output: one


@pytest.mark.parametrize("interpreted, hip, warps, second, in_place", [
    (False, None, 2, True, True), (False, None, 1, False, True), (False, None, 1, True, False),
    (True, None, 2, False, False), (False, "6.2", 2, False, False)])
def test_which_site_launches_store_in_place(monkeypatch, interpreted, hip, warps, second, in_place):
    """The in-place store is NVIDIA assembly (not under the interpreter, nor on ROCm), and a
    one-warp launch with a second read keeps tl.store."""
    monkeypatch.setattr(launch, "interpreted", lambda: interpreted)
    monkeypatch.setattr(torch.version, "hip", hip)
    assert launch.stores_in_place({"num_warps": warps}, second) is in_place
