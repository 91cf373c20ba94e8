"""The routing op's specification (`route_reference`) against plain implementations written here."""

import math

import pytest
import torch

from mhar_hf.routing import resolve_implementation, route, route_reference, routing_weights

EPS = 1e-6


def single_query_route(sources, query, norm_weight, eps=EPS):
    """Kimi's Attention Residuals, token by token in fp64: one softmax over depth for the whole width."""
    n, (batch, tokens, width) = len(sources), sources[0].shape
    out = torch.empty(batch, tokens, width, dtype=torch.float64)
    for b in range(batch):
        for t in range(tokens):
            vectors = [s[b, t].double() for s in sources]
            logits = []
            for v in vectors:
                rms = math.sqrt(float((v * v).sum()) / width + eps)
                logits.append(float((query.double() * (v / rms) * norm_weight.double()).sum()))
            top = max(logits)
            exps = [math.exp(x - top) for x in logits]
            weights = [e / sum(exps) for e in exps]
            out[b, t] = sum(w * v for w, v in zip(weights, vectors))
    return out


def per_head_route(sources, query, norm_weight, heads, eps=EPS):
    """MHAR in fp64 with explicit head loops; the RMS statistic spans the full width."""
    stacked = torch.stack(sources).double()
    width = stacked.shape[-1]
    rms = stacked.pow(2).mean(-1, keepdim=True).add(eps).sqrt()
    keys = stacked / rms * norm_weight.double()
    out = torch.empty_like(stacked[0])
    size = width // heads
    for h in range(heads):
        cols = slice(h * size, (h + 1) * size)
        logits = (keys[..., cols] * query.double()[cols]).sum(-1)
        weights = torch.softmax(logits, dim=0)
        out[..., cols] = (weights.unsqueeze(-1) * stacked[..., cols]).sum(0)
    return out


def make(n=5, width=48, batch=2, tokens=3, dtype=torch.float32):
    sources = [torch.randn(batch, tokens, width, dtype=dtype) * (i + 1) for i in range(n)]
    return sources, torch.randn(width), 1 + 0.3 * torch.randn(width)


def test_zero_query_gives_uniform_weights_and_the_mean():
    sources, _, norm_weight = make()
    query = torch.zeros(48)
    weights = routing_weights(sources, query, norm_weight, 4, EPS)
    torch.testing.assert_close(weights, torch.full_like(weights, 1 / 5))
    torch.testing.assert_close(route_reference(sources, query, norm_weight, 4, EPS), torch.stack(sources).mean(0))


def test_one_head_equals_a_single_query_implementation():
    sources, query, norm_weight = make()
    expected = single_query_route(sources, query, norm_weight)
    got = route_reference([s.double() for s in sources], query.double(), norm_weight.double(), 1, EPS)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("heads", [2, 8, 12, 48])
def test_heads_equal_an_explicit_per_head_implementation(heads):
    sources, query, norm_weight = make()
    expected = per_head_route(sources, query, norm_weight, heads)
    got = route_reference([s.double() for s in sources], query.double(), norm_weight.double(), heads, EPS)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_eight_heads_differ_from_one_once_queries_are_nonzero():
    sources, query, norm_weight = make()
    one = route_reference(sources, query, norm_weight, 1, EPS)
    eight = route_reference(sources, query, norm_weight, 8, EPS)
    assert (one - eight).abs().max() > 1e-2
    weights = routing_weights(sources, query, norm_weight, 8, EPS)
    assert weights.shape == (5, 2, 3, 8)
    torch.testing.assert_close(weights.sum(0), torch.ones(2, 3, 8))
    assert (weights.std(-1) > 1e-3).any()  # the heads chose different distributions


def test_statistics_run_in_fp32_and_output_keeps_the_source_dtype():
    sources, query, norm_weight = make(dtype=torch.bfloat16)
    got = route_reference(sources, query, norm_weight, 4, EPS)
    assert got.dtype == torch.bfloat16
    expected = per_head_route([s.double() for s in sources], query, norm_weight, 4)
    torch.testing.assert_close(got.double(), expected, rtol=1e-2, atol=1e-2)
    # fp32 math then one rounding: the bf16 result is the rounded fp32 result
    fp32 = route_reference([s.float() for s in sources], query, norm_weight, 4, EPS)
    torch.testing.assert_close(got, fp32.bfloat16(), rtol=0, atol=0)


def test_one_source_is_returned_unchanged():
    source = torch.randn(2, 3, 8)
    assert route_reference([source], torch.randn(8), torch.ones(8), 2, EPS) is source


def test_null_source_is_source_zero():
    sources, query, norm_weight = make(n=3)
    null = torch.randn(48)
    with_null = route_reference(sources, query, norm_weight, 4, EPS, null_source=null)
    explicit = route_reference([null.expand(2, 3, 48), *sources], query, norm_weight, 4, EPS)
    torch.testing.assert_close(with_null, explicit, rtol=0, atol=0)


def test_dispatch_reference_on_cpu_and_environment_override(monkeypatch):
    sources, query, norm_weight = make()
    expected = route_reference(sources, query, norm_weight, 4, EPS)
    torch.testing.assert_close(route(sources, query, norm_weight, 4, EPS), expected, rtol=0, atol=0)
    monkeypatch.setenv("MHAR_ROUTING", "reference")
    assert resolve_implementation("fused") == "reference"
    monkeypatch.setenv("MHAR_ROUTING", "triton")
    with pytest.raises(ValueError, match="MHAR_ROUTING"):
        resolve_implementation("auto")
