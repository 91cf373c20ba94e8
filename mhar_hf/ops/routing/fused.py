"""The fused routing op: launch configuration, coverage check and the autograd function."""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Sequence

import torch
import triton

from . import kernels

SOURCE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_TILE = 16384  # padded elements per token row a program holds in registers
_empty = torch.empty  # every output the kernels write is allocated here (tests poison it with NaN)


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _tile(width: int, num_heads: int) -> dict:
    head_width = width // num_heads
    h_pad, dh_pad = triton.next_power_of_2(num_heads), triton.next_power_of_2(head_width)
    return dict(D=width, H=num_heads, DH=head_width, H_PAD=h_pad, DH_PAD=dh_pad)


TUNED_FROM_TOKENS = 1024  # calls this large (training, prefill) use autotuned launch configs


def _drop_oversized(configs, named_args, **kwargs):
    """Keep configs that give each thread at most 64 fp32 values of a tile (more spill registers)."""
    tile = kwargs["H_PAD"] * kwargs["DH_PAD"]
    kept = [c for c in configs if c.kwargs["BLOCK_T"] * tile <= 64 * 32 * c.num_warps]
    return kept or configs[-1:]


def _quick_bench(fn, quantiles=None, **_):
    return triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles)


def _launchers(kernel) -> dict:
    """{tuned?: launcher}. Token rows per program and warps: one fixed config for small calls
    (decoding) and under the interpreter (where autotuning fails), autotuned otherwise."""
    keys = ["D", "H", "HAS_NULL"]
    if _interpreted():
        fixed = triton.autotune([triton.Config({"BLOCK_T": 16}, num_warps=4)], key=keys)(kernel)
        return {False: fixed, True: fixed}
    tuned = triton.autotune(
        [triton.Config({"BLOCK_T": t}, num_warps=w) for t, w in ((1, 1), (1, 2), (2, 2), (2, 4))],
        key=keys, prune_configs_by={"early_config_prune": _drop_oversized}, do_bench=_quick_bench,
    )(kernel)
    return {False: triton.autotune([triton.Config({"BLOCK_T": 1}, num_warps=2)], key=keys)(kernel), True: tuned}


route_fwd = _launchers(kernels.route_fwd_kernel)
route_bwd = _launchers(kernels.route_bwd_kernel)


def unsupported_reason(sources: Sequence[torch.Tensor], query: torch.Tensor, num_heads: int, null_source=None):
    """Why the kernels cannot run this call (a sentence), or None when they can."""
    if not sources:
        return None
    first = sources[0]
    shape, dtype, device = first.shape, first.dtype, first.device
    if not (first.is_cuda or _interpreted()):
        return f"fused routing runs on CUDA tensors (or under TRITON_INTERPRET=1), got device {device}"
    if dtype not in SOURCE_DTYPES or any(s.dtype != dtype or s.shape != shape or s.device != device for s in sources):
        return f"fused routing needs all sources of one shape, device and dtype out of {SOURCE_DTYPES}"
    width = shape[-1]
    tensors = (query,) if null_source is None else (query, null_source)
    if any(t.numel() != width or t.device != device for t in tensors) or width % num_heads:
        return f"fused routing needs [{width}] routing vectors on {device} and heads dividing {width}"
    tile = _tile(width, num_heads)
    if tile["H_PAD"] * tile["DH_PAD"] > MAX_TILE:
        return f"fused routing covers widths up to {MAX_TILE} (padded per head); got d={width}, H={num_heads}"
    return None


_tables: OrderedDict[tuple, torch.Tensor] = OrderedDict()
MAX_TABLES = 4096


def _address_table(tensors: Sequence[torch.Tensor], device) -> torch.Tensor:
    """The sources' addresses as an int64 tensor on `device`. Tables are kept by content: the
    caching allocator hands a training step the same addresses as the step before, so in the
    steady state no host-to-device copy is made at all (a blocking one would stall the stream,
    and a pinned staging buffer per call costs hundreds of microseconds of host time)."""
    key = (str(device), *(t.data_ptr() for t in tensors))
    table = _tables.get(key)
    if table is None:
        table = torch.tensor(key[1:], dtype=torch.int64)
        if device.type == "cuda":
            table = table.pin_memory().to(device, non_blocking=True)
        _tables[key] = table
        if len(_tables) > MAX_TABLES:
            _tables.popitem(last=False)
    else:
        _tables.move_to_end(key)
    return table


def _contiguous(tensors) -> list[torch.Tensor]:
    return [t if t.is_contiguous() else t.contiguous() for t in tensors]


def _forward(sources, query, key_norm_weight, null_source, num_heads, eps, store_lse):
    sources = _contiguous(sources)
    first = sources[0]
    width = first.shape[-1]
    tokens = first.numel() // width
    tile = _tile(width, num_heads)
    out = _empty(first.shape, dtype=first.dtype if null_source is None else null_source.dtype, device=first.device)
    lse = _empty((tokens, num_heads), dtype=torch.float32, device=first.device) if store_lse else out
    route_fwd[tokens >= TUNED_FROM_TOKENS][lambda meta: (triton.cdiv(tokens, meta["BLOCK_T"]),)](
        _address_table(sources, first.device), first, query if null_source is None else null_source,
        query, key_norm_weight, out, lse, len(sources), tokens, eps,
        HAS_NULL=null_source is not None, STORE_LSE=store_lse, **tile,
    )
    return out, lse


def _backward_programs(tokens: int, device) -> int:
    """A grid independent of the tuned block size, so the partial sums always have these many rows."""
    if device.type == "cuda":
        return min(tokens, 16 * torch.cuda.get_device_properties(device).multi_processor_count)
    return min(tokens, 2)  # the interpreter: several blocks per program, as on a GPU


class FusedRoute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, num_heads, eps, query, key_norm_weight, null_source, *sources):
        out, lse = _forward(sources, query, key_norm_weight, null_source, num_heads, eps, store_lse=True)
        ctx.num_heads, ctx.eps = num_heads, eps
        ctx.save_for_backward(query, key_norm_weight, null_source, lse, *sources)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key_norm_weight, null_source, lse, *sources = ctx.saved_tensors
        sources = _contiguous(sources)
        first = sources[0]
        width, device = first.shape[-1], first.device
        tokens = first.numel() // width
        programs = _backward_programs(tokens, device)
        grads = _empty((len(sources), *first.shape), dtype=first.dtype, device=device)
        # source n's gradient lives at a fixed stride in one buffer: its table needs no host copy
        step = first.numel() * first.element_size()
        grad_table = grads.data_ptr() + step * torch.arange(len(sources), dtype=torch.int64, device=device)
        dkey = _empty((programs, width), dtype=torch.float32, device=device)
        dnull = _empty((programs, width), dtype=torch.float32, device=device) if null_source is not None else dkey
        route_bwd[tokens >= TUNED_FROM_TOKENS][(programs,)](
            _address_table(sources, device), grad_table, first,
            query if null_source is None else null_source, query, key_norm_weight, lse,
            grad_out.contiguous(), dkey, dnull, len(sources), tokens, ctx.eps,
            HAS_NULL=null_source is not None, **_tile(width, ctx.num_heads),
        )
        dkey = dkey.sum(0)  # fixed-order reduction of per-program partials: deterministic
        dquery = (dkey * key_norm_weight.float()).to(query.dtype)
        dweight = (dkey * query.float()).to(key_norm_weight.dtype)
        dnull = dnull.sum(0).to(null_source.dtype) if null_source is not None else None
        return (None, None, dquery, dweight, dnull, *grads.unbind(0))


@torch.compiler.disable  # compiled models call the kernels eagerly between compiled regions
def fused_route(
    sources: Sequence[torch.Tensor],
    query: torch.Tensor,
    key_norm_weight: torch.Tensor,
    num_heads: int,
    eps: float,
    null_source: torch.Tensor | None = None,
) -> torch.Tensor:
    """`route_reference` computed by the Triton kernels (same arguments, same result)."""
    sources = tuple(sources)
    if null_source is None and len(sources) == 1:
        return sources[0]
    if not sources:
        return null_source
    inputs = (query, key_norm_weight, null_source, *sources)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs):
        return FusedRoute.apply(num_heads, eps, query, key_norm_weight, null_source, *sources)
    return _forward(sources, query, key_norm_weight, null_source, num_heads, eps, store_lse=False)[0]
