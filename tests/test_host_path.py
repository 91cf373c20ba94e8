"""The shortcuts that keep the fused path's host time per read low (benchmarks/host_overhead.py)
take only the calls they are right for: every other call goes the general way."""

import pytest
import torch
import triton

from mhar_hf.ops.routing import coverage, depth_sources, fused_route, launch, outputs, tables, track
from mhar_hf.routing import Read, route_reference

EPS = 1e-6


def chain_of(sources):
    """The sources marked in order, each after the one before (as the model marks them)."""
    marked = []
    for s in sources:
        marked.append(track(s, after=marked[-1] if marked else None))
    return marked


def inputs(n, width=64, tokens=9):
    g = torch.Generator().manual_seed(n)
    sources = [torch.randn(1, tokens, width, generator=g) * (1 + i) for i in range(n)]
    return sources, torch.randn(width, generator=g) * 0.5, 1 + 0.3 * torch.randn(width, generator=g)


def test_a_chain_from_its_first_mark_comes_back_as_it_is():
    leaves = [s.requires_grad_() for s in inputs(4)[0]]
    marked = chain_of(leaves)
    sources, marks, newest = depth_sources.on_one_chain(tuple(marked))
    assert sources == tuple(marked) and newest is marked[-1]
    assert marks == [(s.grad_fn, i) for i, s in enumerate(marked)]
    reordered = (marked[0], marked[2], marked[1], marked[3])  # still one chain: nothing to mark
    sources, marks, _ = depth_sources.on_one_chain(reordered)
    assert sources == reordered and [i for _, i in marks] == [0, 1, 2, 3]


def test_a_source_in_place_of_a_chains_first_mark_is_marked():
    """The newest source's position and the sources' count match a chain from its first mark,
    but the first source is not that mark: the shortcut must not take it (its gradient would be lost)."""
    sources, query, norm_weight = inputs(4)
    leaves = [s.clone().requires_grad_() for s in sources]
    marked = chain_of(leaves)
    stranger = sources[0].clone().requires_grad_()
    read = (stranger, *marked[1:])
    out, marks, _ = depth_sources.on_one_chain(read)
    assert out[0] is not stranger and isinstance(out[0].grad_fn, depth_sources._DEPTH_NODE)
    assert [i for _, i in marks] == [0, 1, 2, 3]
    fused_route(read, query, norm_weight, 4, EPS).sum().backward()
    twins = [s.double().requires_grad_() for s in sources]
    route_reference(twins, query.double(), norm_weight.double(), 4, EPS).sum().backward()
    for got, twin in zip((stranger, *leaves[1:]), twins, strict=True):
        assert got.grad is not None and (got.grad - twin.grad).norm() / twin.grad.norm() < 1e-5


def test_one_coverage_check_still_checks_every_routing_vector():
    sources, query, _ = inputs(3)
    narrow = torch.zeros(32)
    assert coverage.unsupported_reason(sources, query, 4, next_query=query) is None
    assert "routing vectors" in coverage.unsupported_reason(sources, query, 4, next_query=narrow)
    reads = [Read(query, query, query), Read(query, query, narrow)]  # the second read's null source
    assert "routing vectors" in coverage.group_unsupported_reason(sources, reads, 4)
    assert coverage.group_unsupported_reason(sources, reads[:1], 4) is None
    assert "one shape" in coverage.unsupported_reason([*sources, narrow], query, 4)


@pytest.mark.parametrize("count, shape", [(1, (5,)), (3, (5,)), (3, (4, 2)), (2, (3, 3))])
def test_per_read_blocks_stay_where_the_kernels_look(count, shape):
    """A group's blocks are kernels._read_stride apart and 16-byte aligned, with or without padding."""
    blocks = outputs.per_read(count, shape, torch.device("cpu"))
    assert blocks.shape == (count, *shape)
    numel = blocks[0].numel()
    for r in range(count):
        assert blocks[r].data_ptr() % 16 == 0 and blocks[r].is_contiguous()
        assert blocks[r].data_ptr() - blocks[0].data_ptr() == r * 4 * ((numel + 3) // 4 * 4)


def test_a_table_holds_only_aligned_contiguous_sources():
    tables.clear()
    aligned = torch.randn(1, 9, 64)
    strided = torch.randn(1, 64, 9).transpose(1, 2)  # same shape, not contiguous
    storage = torch.randn(9 * 64 + 1)
    shifted = storage[1:].view(1, 9, 64)  # 4 bytes past an aligned start
    for odd in (strided, shifted):
        sources, table = tables.with_table([aligned, odd])
        assert sources[0] is aligned and sources[1] is not odd and torch.equal(sources[1], odd)
        assert table.tolist() == [aligned.data_ptr()] * 2 + [sources[1].data_ptr()] * 2
    sources, table = tables.with_table((aligned, aligned.clone()))
    assert all(s.data_ptr() == a for s, a in zip(sources, table.tolist()[::2], strict=True))


def test_host_cdiv_is_tritons():
    assert all(launch.cdiv(a, b) == triton.cdiv(a, b) for a in range(0, 70) for b in (1, 4, 16, 64))
