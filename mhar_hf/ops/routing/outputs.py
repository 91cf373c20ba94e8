"""Where the fused path allocates what its kernels write, and the dtype a read returns.

Every kernel output comes from `empty`, so tests can poison outputs with NaN before a kernel
writes them and benchmarks can stand zeros in for skipped launches (`allocating`)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import torch

from mhar_hf.routing import gated_dtype

from . import launch

_allocate: Callable[..., torch.Tensor] = torch.empty


def empty(*args, **kwargs) -> torch.Tensor:
    """`torch.empty`, or what `allocating` put in its place."""
    return _allocate(*args, **kwargs)


@contextlib.contextmanager
def allocating(allocate: Callable[..., torch.Tensor]) -> Iterator[None]:
    """Allocate every kernel output with `allocate` (torch.empty's signature) inside the block,
    e.g. `lambda *a, **k: torch.full(*a, float("nan"), **k)`."""
    global _allocate
    previous, _allocate = _allocate, allocate
    try:
        yield
    finally:
        _allocate = previous


def output_dtype(first, null_source, gate, residual=None) -> torch.dtype:
    """A read's output dtype, as route_reference gives it: the mix has the dtype of its source 0
    (the null source where there is one), promoted with the gate's and the residual's."""
    dtype = first.dtype if null_source is None else null_source.dtype
    return dtype if gate is None else gated_dtype(gate, residual, dtype)


def per_read(count: int, shape: tuple[int, ...], device) -> torch.Tensor:
    """fp32 [count, *shape], one block per read of a group, each 16-byte aligned (the source
    kernel reaches a read's blocks through its table; kernels._read_stride steps by the same)."""
    numel = math.prod(shape)
    if count == 1 or numel % 4 == 0:  # the blocks need no padding: no views to cut them out
        return empty((count, *shape), dtype=torch.float32, device=device)
    stride = launch.cdiv(numel, 4) * 4
    return empty((count, stride), dtype=torch.float32, device=device)[:, :numel].view(count, *shape)
