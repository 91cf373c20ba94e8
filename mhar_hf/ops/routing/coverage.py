"""What the kernels cover: why a call cannot run fused (a sentence), or None when it can."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mhar_hf.routing import Read

from . import launch

SOURCE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_TILE = 16384  # padded elements per token row a program holds in registers


def unsupported_reason(sources: Sequence[torch.Tensor], query: torch.Tensor, num_heads: int, null_source=None,
                       residual=None, next_query=None):
    """Why the kernels cannot run this call (a sentence), or None when they can; `next_query`: the
    query of a read begun in the same pass (`route_and_start`), checked like `query`."""
    return _reason(sources, num_heads, (query, null_source, next_query), residual)


def group_unsupported_reason(sources: Sequence[torch.Tensor], reads: Sequence[Read], num_heads: int):
    """`unsupported_reason` for a group of reads (`fused_route_group`), or None when it runs."""
    kinds = {(r.null_source is not None, r.gate is not None) for r in reads}
    if len(kinds) > 1:
        return "fused routing groups reads that all have, or all lack, a null source and a gate"
    dtypes = {tuple(t.dtype for t in r if t is not None) for r in reads}
    if len(dtypes) > 1:
        return "fused routing groups reads whose parameters share their dtypes"
    return _reason(sources, num_heads, [t for r in reads for t in (r.query, r.null_source)])


def _reason(sources, num_heads: int, vectors, residual=None):
    """`unsupported_reason` of sources read with these routing vectors (None: absent), each
    source checked once however many reads take it."""
    if not sources:
        return None
    first = sources[0]
    shape, dtype, device = first.shape, first.dtype, first.device
    if not (first.is_cuda or launch.interpreted()):
        return f"fused routing runs on CUDA tensors (or under TRITON_INTERPRET=1), got device {device}"
    if dtype not in SOURCE_DTYPES or any(s.dtype != dtype or s.shape != shape or s.device != device for s in sources):
        return f"fused routing needs all sources of one shape, device and dtype out of {SOURCE_DTYPES}"
    if residual is not None and (residual.shape != shape or residual.device != device or residual.dtype not in SOURCE_DTYPES):
        return f"fused routing needs the residual shaped like the sources ({tuple(shape)}) on {device}"
    width = shape[-1]
    if any(t is not None and (t.numel() != width or t.device != device) for t in vectors) or width % num_heads:
        return f"fused routing needs [{width}] routing vectors on {device} and heads dividing {width}"
    # traced (torch.compile), the tile is computed outside its cache, which Dynamo would warn of
    tile = launch.tile.__wrapped__ if torch.compiler.is_compiling() else launch.tile
    if launch.padded_width(tile(width, num_heads)) > MAX_TILE:
        return f"fused routing covers widths up to {MAX_TILE} (padded per head); got d={width}, H={num_heads}"
    return None
