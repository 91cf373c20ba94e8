"""Reads inside a compiled graph: the fused kernels as `torch.library` custom ops, so that
`torch.compile(model)` traces a whole model through its routing reads (no graph break, one graph
for every layer, however many sources each read takes).

The eager path (reads.py, group.py) passes state between reads on the host: marks that gather
every read's record for one source-major gradient launch, rstd kept on the marks, split pairs,
address tables. None of that can live in a traced graph, whose backward is a function of saved
tensors. So a traced read is one opaque op that takes only tensors and numbers, and its backward
another:

  - the forward (`mhar::route_read`, `mhar::route_group`) launches the forward kernel (grouped
    reads: one launch for the group), with every source's rstd loaded from an input: the caller
    computes each rstd in the graph (`source_rstd`), where the compiler fuses it into the code
    that makes the source and shares it between the reads of that source. In a graph that keeps
    no gradient (compiled decoding) the ops take no rstd and the kernel sums it itself, as the
    eager path's reads without gradient do: inductor computed the graph's rstd again for every
    read there, a kernel per read and source, in a step of a few tokens;
  - the backward (`mhar::route_read_backward`, `mhar::route_group_backward`) launches the site
    kernel and then, per source, the source kernel with this read's record (a group's: every
    read of the group, summed in fp32 in one launch). The source gradients it returns are
    summed over reads by autograd, in the graph: read-major, as the reference op's, not the
    eager path's one launch per source for all of its reads;
  - split pairs are not formed: `route_and_start` returns no prefix and the second read runs
    whole.

Each op allocates its tables and outputs itself and keeps nothing between calls, so a recomputed
read (activation checkpointing) is the same call again.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mhar_hf.routing import Read, check_gated, route_reference

from . import group, launch, outputs, reads, tables
from .depth_sources import source_grad


def source_rstd(source: torch.Tensor, eps: float) -> torch.Tensor:
    """A source's rstd per token (fp32, the source's shape without its last dimension), as the
    forward kernel computes it; no gradient flows through it (the read's backward differentiates
    the norm itself)."""
    return torch.rsqrt(source.detach().float().pow(2).mean(-1) + eps)


def _rows(rstd: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The rstd rows as the kernels reach them through a table: fp32, contiguous, aligned."""
    return tables.aligned([r.float() for r in rstd])


def _rstd_inputs(sources: Sequence[torch.Tensor], eps: float) -> list[torch.Tensor]:
    """The sources' rstd for a traced op: computed in the graph where a backward will load it,
    else none (`_sources_table`)."""
    return [source_rstd(s, eps) for s in sources] if torch.is_grad_enabled() else []


def _sources_table(sources, rstd):
    """The sources and their table, with the rstd given, or none: the forward kernel then sums
    each itself and stores no statistics (no backward will run), and the op's lse is empty."""
    return tables.with_table(sources, _rows(rstd) if rstd else None)


def _empty_lse(first: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    return first.new_empty(shape, dtype=torch.float32)


def _tokens(first: torch.Tensor):
    return first.numel() // first.shape[-1]


def _lse_stride(tokens, num_heads: int):
    """Elements per read of a group's lse block (outputs.per_read, kernels._read_stride)."""
    return (tokens * num_heads + 3) // 4 * 4


# one read --------------------------------------------------------------------------------------

@torch.library.custom_op("mhar::route_read", mutates_args=(),
                         schema="(Tensor[] sources, Tensor[] rstd, Tensor query, Tensor key_norm_weight, "
                                "Tensor? null_source, Tensor? gate, Tensor? residual, int num_heads, float eps) "
                                "-> (Tensor, Tensor)")
def _route_read(sources, rstd, query, key_norm_weight, null_source, gate, residual, num_heads, eps):
    sources, table = _sources_table(sources, rstd)
    residual = residual.contiguous() if residual is not None else None
    out, lse, _ = reads.read_forward(sources, table, query, key_norm_weight, null_source, gate, residual, num_heads,
                                     eps, store_stats=bool(rstd), kept=len(rstd))
    return out, lse if rstd else _empty_lse(sources[0], (0, num_heads))


@_route_read.register_fake
def _(sources, rstd, query, key_norm_weight, null_source, gate, residual, num_heads, eps):
    first = sources[0]
    out = first.new_empty(first.shape, dtype=outputs.output_dtype(first, null_source, gate, residual))
    return out, _empty_lse(first, (_tokens(first) if rstd else 0, num_heads))


@torch.library.custom_op("mhar::route_read_backward", mutates_args=(),
                         schema="(Tensor[] sources, Tensor[] rstd, Tensor query, Tensor key_norm_weight, "
                                "Tensor? null_source, Tensor? gate, Tensor lse, Tensor? out, Tensor grad_out, "
                                "bool[] wants, int num_heads, float eps) -> Tensor[]")
def _route_read_backward(sources, rstd, query, key_norm_weight, null_source, gate, lse, out, grad_out, wants,
                         num_heads, eps):
    """The parameters' gradients (query, key-norm weight, then the null source's and the gate's
    where the read has them), then the gradient of each source that `wants` one."""
    (grad_out,) = tables.aligned((grad_out,))
    sources, table = tables.with_table(sources, _rows(rstd))
    grads, record, _ = reads._site_backward(sources, table, num_heads, eps, query, key_norm_weight, null_source, gate,
                                            lse, grad_out, out)
    result = [g.clone() for g in grads if g is not None]  # rows of one tensor: outputs may not alias
    result += [source_grad(s, [(record, n)], None, None, None) for n, (s, want) in enumerate(zip(sources, wants))
               if want]
    return result


@_route_read_backward.register_fake
def _(sources, rstd, query, key_norm_weight, null_source, gate, lse, out, grad_out, wants, num_heads, eps):
    params = [t for t in (query, key_norm_weight, null_source, gate) if t is not None]
    return [p.new_empty(p.shape) for p in params] + [s.new_empty(s.shape) for s, want in zip(sources, wants) if want]


def _read_setup(ctx, inputs, output):
    sources, rstd, query, key_norm_weight, null_source, gate, residual, num_heads, eps = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.count, ctx.num_heads, ctx.eps = len(sources), num_heads, eps
    ctx.wants = [s.requires_grad for s in sources]
    ctx.has_null, ctx.has_gate = null_source is not None, gate is not None
    ctx.residual_dtype = residual.dtype if residual is not None else None
    mix = out if launch.total_from_out(gate, len(sources)) else None  # S from the output, as FusedRoute's
    ctx.save_for_backward(*sources, *rstd, query, key_norm_weight, null_source, gate, lse, mix)


def _read_backward(ctx, grad_out, _grad_lse):
    saved = ctx.saved_tensors
    count = ctx.count
    sources, rstd = saved[:count], saved[count:2 * count]
    query, key_norm_weight, null_source, gate, lse, mix = saved[2 * count:]
    grads = torch.ops.mhar.route_read_backward(list(sources), list(rstd), query, key_norm_weight, null_source, gate,
                                               lse, mix, grad_out, ctx.wants, ctx.num_heads, ctx.eps)
    dquery, dkey_norm_weight, *rest = grads
    dnull = rest.pop(0) if ctx.has_null else None
    dgate = rest.pop(0) if ctx.has_gate else None
    left = iter(rest)
    dsources = [next(left) if want else None for want in ctx.wants]
    dresidual = grad_out.to(ctx.residual_dtype) if ctx.residual_dtype is not None else None
    return dsources, [None] * count, dquery, dkey_norm_weight, dnull, dgate, dresidual, None, None


_route_read.register_autograd(_read_backward, setup_context=_read_setup)


# a group of reads of the same sources ---------------------------------------------------------

@torch.library.custom_op("mhar::route_group", mutates_args=(),
                         schema="(Tensor[] sources, Tensor[] rstd, Tensor[] params, bool has_null, bool has_gate, "
                                "int num_heads, float eps) -> Tensor[]")
def _route_group(sources, rstd, params, has_null, has_gate, num_heads, eps):
    """Every read's output, then the group's lse as one [reads, stride] block (per_read's base)."""
    sources, table = _sources_table(sources, rstd)
    group_reads = group._unflatten(params, (has_null, has_gate))
    outs, lse = group.forward_group(sources, table, group_reads, num_heads, eps, store_stats=bool(rstd),
                                    kept=len(rstd))
    if not rstd:
        return [*outs, _empty_lse(sources[0], (len(group_reads), 0))]
    # the whole block the reads' lse are rows of (inside a custom op a view has no `_base`)
    block = torch.as_strided(lse, (len(group_reads), _lse_stride(_tokens(sources[0]), num_heads)), (lse.stride(0), 1))
    return [*outs, block]


@_route_group.register_fake
def _(sources, rstd, params, has_null, has_gate, num_heads, eps):
    first = sources[0]
    group_reads = group._unflatten(params, (has_null, has_gate))
    head = group_reads[0]
    dtype = outputs.output_dtype(first, head.null_source, head.gate)
    outs = [first.new_empty(first.shape, dtype=dtype) for _ in group_reads]
    return [*outs, _empty_lse(first, (len(group_reads), _lse_stride(_tokens(first), num_heads) if rstd else 0))]


@torch.library.custom_op("mhar::route_group_backward", mutates_args=(),
                         schema="(Tensor[] sources, Tensor[] rstd, Tensor[] params, bool has_null, bool has_gate, "
                                "Tensor lse, Tensor[] grad_outs, bool[] wants, int num_heads, float eps) -> Tensor[]")
def _route_group_backward(sources, rstd, params, has_null, has_gate, lse, grad_outs, wants, num_heads, eps):
    """Every parameter's gradient (in `params`' order), then the gradient of each source that
    `wants` one: one source launch per source for all the group's reads."""
    sources, table = tables.with_table(sources, _rows(rstd))
    group_reads = group._unflatten(params, (has_null, has_gate))
    tokens = _tokens(sources[0])
    lse = lse[:, :tokens * num_heads].unflatten(1, (tokens, num_heads))
    per_read, records = group._site_backward_group(sources, table, group_reads, num_heads, eps, lse,
                                                   tables.aligned(grad_outs))
    result = [g.clone() for read in per_read for g in read]
    result += [source_grad(s, [(record, n) for record in records], None, None, None)
               for n, (s, want) in enumerate(zip(sources, wants)) if want]
    return result


@_route_group_backward.register_fake
def _(sources, rstd, params, has_null, has_gate, lse, grad_outs, wants, num_heads, eps):
    return [p.new_empty(p.shape) for p in params] + [s.new_empty(s.shape) for s, want in zip(sources, wants) if want]


def _group_setup(ctx, inputs, output):
    sources, rstd, params, has_null, has_gate, num_heads, eps = inputs
    lse = output[-1]
    ctx.mark_non_differentiable(lse)
    ctx.counts = len(sources), len(params)
    ctx.layout, ctx.num_heads, ctx.eps = (has_null, has_gate), num_heads, eps
    ctx.wants = [s.requires_grad for s in sources]
    ctx.save_for_backward(*sources, *rstd, *params, lse)


def _group_backward(ctx, grad_outputs):
    saved = ctx.saved_tensors
    count, num_params = ctx.counts
    sources, rstd, params = saved[:count], saved[count:2 * count], saved[2 * count:2 * count + num_params]
    lse = saved[-1]
    grad_outs = list(grad_outputs[:-1])
    grads = torch.ops.mhar.route_group_backward(list(sources), list(rstd), list(params), *ctx.layout, lse, grad_outs,
                                                ctx.wants, ctx.num_heads, ctx.eps)
    left = iter(grads[num_params:])
    dsources = [next(left) if want else None for want in ctx.wants]
    return dsources, [None] * count, list(grads[:num_params]), None, None, None, None


_route_group.register_autograd(_group_backward, setup_context=_group_setup)


# what routing.py calls while torch.compile traces -----------------------------------------------

def traced_route(sources: Sequence[torch.Tensor], query: torch.Tensor, key_norm_weight: torch.Tensor, num_heads: int,
                 eps: float, null_source: torch.Tensor | None = None, gate: torch.Tensor | None = None,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
    """`route_reference` as one custom op (`mhar::route_read`); a gated read without a residual
    is a group of one, as on the eager path."""
    check_gated(gate, residual)
    sources = list(sources)
    if len(sources) + (null_source is not None) == 1:  # nothing to mix
        return route_reference(sources, query, key_norm_weight, num_heads, eps, null_source, gate, residual)
    if gate is not None and residual is None:
        return traced_route_group(sources, [Read(query, key_norm_weight, null_source, gate)], num_heads, eps)[0]
    rstd = _rstd_inputs(sources, eps)
    out, _ = torch.ops.mhar.route_read(sources, rstd, query, key_norm_weight, null_source, gate, residual, num_heads,
                                       eps)
    return out


def traced_route_group(sources: Sequence[torch.Tensor], group_reads: Sequence[Read], num_heads: int,
                       eps: float) -> tuple[torch.Tensor, ...]:
    """`route_group` as one custom op (`mhar::route_group`)."""
    sources, group_reads = list(sources), [Read(*read) for read in group_reads]
    for read in group_reads:
        check_gated(read.gate, None)
    if len(sources) + (group_reads[0].null_source is not None) == 1:  # nothing to mix
        return tuple(route_reference(sources, *read[:2], num_heads, eps, *read[2:]) for read in group_reads)
    layout, params = group._flatten(group_reads)
    rstd = _rstd_inputs(sources, eps)
    return tuple(torch.ops.mhar.route_group(sources, rstd, params, *layout, num_heads, eps)[:-1])
