"""The benchmarks' stand-ins for a training step launch what the model launches."""

import sys
from pathlib import Path

import pytest
import torch

from mhar_hf import MHARForCausalLM
from mhar_hf.ops.routing import fused
from mhar_hf.tiny import tiny_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_train import record_routing_sites, step_reads  # noqa: E402


@pytest.fixture
def source_launches(monkeypatch):
    """Per source-kernel launch: (reads summed, starts from a partial, sums a partner's terms)."""
    launches = []
    launch = fused._source_grad

    def spy(source, records, grad_in, partial, partner):
        launches.append((len(records), partial is not None, partner is not None))
        return launch(source, records, grad_in, partial, partner)

    monkeypatch.setattr(fused, "_source_grad", spy)
    return launches


def model_step(mode: str, source_launches) -> tuple:
    """A 5-layer tiny model's config, its routing sites and source launches in one step."""
    config = tiny_config(residual_mode=mode, routing_implementation="fused", num_hidden_layers=5)
    model = MHARForCausalLM(config)
    sites = record_routing_sites(model)
    model(torch.randint(0, 384, (1, 6))).logits.sum().backward()
    by_model = list(source_launches)
    source_launches.clear()
    return config, sites, by_model


def test_step_reads_pair_sources_as_the_model_does(source_launches):
    config, sites, by_model = model_step("full", source_launches)
    width = config.hidden_size
    sources = [torch.randn(6, width, requires_grad=True) for _ in range(max(n for n, _ in sites))]
    first, second = [tuple(torch.randn(width, requires_grad=True) for _ in range(2)) for _ in range(2)]
    outs = step_reads(sites, sources, first, second, config.residual_heads)
    torch.autograd.grad(outs, sources + [*first, *second], [torch.randn_like(o) for o in outs])

    assert any(partner for _, _, partner in by_model)  # the comparison means something only with pairs
    assert source_launches == by_model


def test_step_reads_group_reads_as_the_model_does(source_launches):
    """Delta mode: the same grouped reads (one forward launch per group) and the same number of
    reads summed by each source launch."""
    config, sites, by_model = model_step("delta", source_launches)

    width = config.hidden_size
    sources = [torch.randn(6, width, requires_grad=True) for _ in range(max(n for n, _ in sites) - 1)]
    first, second = [tuple(torch.randn(width, requires_grad=True) for _ in range(2)) for _ in range(2)]
    null, gate = torch.randn(width, requires_grad=True), torch.randn(1, requires_grad=True)
    outs = step_reads(sites, sources, first, second, config.residual_heads, null, gate)
    torch.autograd.grad(outs, sources + [*first, null, gate], [torch.randn_like(o) for o in outs])

    roles = [role for _, role in sites]
    # blocks of 3 layers: layer 0's MLP read to layer 3's attention read, then layer 3's MLP read on
    assert roles.count("group") == 2 and roles.count("ahead") == 7
    assert len(outs) == len(sites) and source_launches == by_model


def test_sweep_constant_times_each_value_and_restores_the_default(monkeypatch, capsys):
    import sweep_launch

    seen = []
    monkeypatch.setattr(sweep_launch, "model_sites", lambda preset, mode: [(3, "group"), (3, "ahead")])
    monkeypatch.setattr(sweep_launch, "time_routing", lambda *args: seen.append(fused.PARTIALS_TILE) or
                        {"fwd_bwd_kernels_ms": {"route_partials_kernel": float(len(seen))}})
    default = fused.PARTIALS_TILE
    sweep_launch.sweep_constant(["100M"], "delta", "PARTIALS_TILE", "{'read': (8, 8), 'group': (4, 4)}",
                                "{'read': (2, 2), 'group': (1, 1)}", bandwidth=1.0)
    assert seen == [{"read": (8, 8), "group": (4, 4)}, {"read": (2, 2), "group": (1, 1)}]
    assert fused.PARTIALS_TILE is default
    assert capsys.readouterr().out.count("100M PARTIALS_TILE=") == 2


def test_sweep_constant_rejects_bad_input_before_any_gpu_work():
    from sweep_launch import constant_error

    assert "not a constant" in constant_error("NOPE", "1")
    assert "not a constant" in constant_error("_tile", "1")  # functions and private names are not constants
    assert "give the values" in constant_error("PARTIALS_TILE")
    assert "not a Python literal" in constant_error("PARTIALS_TILE", "{'read': (8, 8)}", "{bad")
    assert constant_error("GROUP_FORWARD_PROGRAMS_PER_SM", "8", "32") is None
