"""Grouped reads: several reads of the same sources (`fused_route_group`, delta mode's reads
between two block boundaries). One forward launch and one site launch serve them all, and each
read leaves its own record, so the source kernel sees them as separate reads.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mhar_hf.routing import Read, check_gated, route_reference

from . import kernels, launch, outputs, site, tables
from .depth_sources import ReadRecord, leave, needs_grad, on_one_chain, source_rstd


def _read_table(reads: Sequence[Read], lasts: Sequence[torch.Tensor], device) -> tuple[torch.Tensor, list]:
    """A group's read table (kernels.READ_FIELDS): per read its parameters (the query stands in
    for an absent null source or gate) and `lasts`, its output or output gradient; and the tensors
    it addresses, which the caller holds until the launch (a misaligned parameter's aligned copy
    exists nowhere else)."""
    fields = []
    for read, last in zip(reads, lasts):
        query = read.query
        fields += (*tables.aligned([t if t is not None else query for t in read]), last)
    return tables.address_table(tables.addresses(fields), device), fields


def _group_flags(reads: Sequence[Read]) -> dict:
    """A grouped launch's flags (every read of a group has what its first has)."""
    head = reads[0]
    return dict(HAS_NULL=head.null_source is not None, HAS_GATE=head.gate is not None, GROUPED=True)


def _stand_ins(read: Read) -> tuple:
    """Pointer arguments a grouped launch takes for their types only (each read's come from the
    read table): null source, query, key-norm weight, gate."""
    query = read.query
    return (query if read.null_source is None else read.null_source, query, read.key_norm_weight,
            query if read.gate is None else read.gate)


def forward_group(sources, table, reads: Sequence[Read], num_heads, eps, store_stats, kept: int = 0):
    """The outputs of a group of reads and, if `store_stats`, their lse ([reads, T, H], one block
    per read), else None; rstd as `read_forward`'s (reads.py)."""
    first = sources[0]
    width = first.shape[-1]
    tokens = first.numel() // width
    head = reads[0]
    dtype = outputs.output_dtype(first, head.null_source, head.gate)
    outs = [outputs.empty(first.shape, dtype=dtype, device=first.device) for _ in reads]
    lse = outputs.per_read(len(reads), (tokens, num_heads), first.device) if store_stats else None
    setup = launch.kernel_args("group_forward", width, num_heads)
    null, query, key_norm_weight, gate = _stand_ins(head)
    flags = _group_flags(reads)
    programs = launch.group_forward_programs(launch.cdiv(tokens, setup["BLOCK_T"]), len(reads), first.device)
    read_table, _addressed = _read_table(reads, outs, first.device)
    kernels.route_fwd_kernel[(len(reads) * programs,)](
        table, read_table, first, null, query, key_norm_weight, gate, first, outs[0],
        lse if lse is not None else outputs.empty((1,), dtype=torch.float32, device=first.device),  # for the pointer type
        query, key_norm_weight, outs[0], outs[0], len(sources), kept, len(reads), tokens, eps,
        STORE_STATS=store_stats, HAS_INIT=False, HAS_SECOND=False, **flags, **setup,
    )
    return outs, lse


def _site_backward_group(sources, table, reads: Sequence[Read], num_heads, eps, lse, grad_outs, lse_grad=None):
    """The site kernel of a group of reads, in one launch: every read's parameter gradients
    (per read query, key-norm weight, then null source and gate where it has them) and records.
    `lse_grad` (outputs.per_read [reads, T, H]): the gradients of the reads' lse, where the lse
    is an output (the first phase of two-phase reads, `FusedBeginGroup`)."""
    first = sources[0]
    width, device = first.shape[-1], first.device
    tokens = first.numel() // width
    head, count = reads[0], len(reads)
    flags = _group_flags(reads)
    few = not flags["HAS_GATE"] and len(sources) <= launch.current().few_sources
    setup = launch.kernel_args("site_few" if few else "site", width, num_heads)
    rows = 2 + flags["HAS_NULL"]
    total = outputs.per_read(count, (tokens, num_heads), device)
    gq = outputs.per_read(count, (width + 1,), device)
    terms = outputs.per_read(count, (len(sources), 2, tokens, num_heads), device)
    null, query, key_norm_weight, gate = _stand_ins(head)
    read_table, _addressed = _read_table(reads, grad_outs, device)

    def arguments(partials):
        return (table, read_table, first, null, query, key_norm_weight, gate, lse, grad_outs[0], grad_outs[0], total,
                gq, partials, terms, query, key_norm_weight, lse, grad_outs[0], total, terms,
                lse_grad if lse_grad is not None else lse, len(sources), len(sources), count, tokens, eps)

    constexprs = dict(HAS_SECOND=False, TOTAL_FROM_OUT=False, HAS_LSE_GRAD=lse_grad is not None,
                      IN_PLACE=launch.stores_in_place(setup, False), **flags,
                      **setup)
    programs, partials = site.launch_site(arguments, constexprs, sources, rows, flags["HAS_GATE"], total, count)
    task = torch._C._current_graph_task_id()
    records = [ReadRecord(task, *fields, eps)
               for fields in zip(grad_outs, lse.unbind(0), total.unbind(0), gq.unbind(0), terms.unbind(0))]
    params = [t for read in reads for t in read[:rows]]
    grads, dgates = site.sum_partials(partials, programs, width, params,
                                  [read.gate for read in reads] if flags["HAS_GATE"] else [], tile="group")
    per_read = [(*grads[r * rows:(r + 1) * rows], *dgates[r:r + 1]) for r in range(count)]
    return per_read, records


class FusedRouteGroup(torch.autograd.Function):
    """Reads of the same sources (`fused_route_group`): one forward launch and one site launch
    serve them all, and each read leaves its own record with the sources, as if it ran alone.
    The parameters come flattened (`_flatten`)."""

    @staticmethod
    def forward(ctx, num_heads, eps, sources, marks, layout, newest, *params):
        rstd, kept = source_rstd(sources, marks, eps)
        sources, table = tables.with_table(sources, rstd)
        outs, lse = forward_group(sources, table, _unflatten(params, layout), num_heads, eps, store_stats=True,
                                   kept=kept)
        ctx.num_heads, ctx.eps, ctx.sources, ctx.rstd, ctx.marks = num_heads, eps, sources, rstd, marks
        ctx.table, ctx.layout = table, layout
        ctx.save_for_backward(lse, *params)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grad_outs):
        lse, *params = ctx.saved_tensors
        reads = _unflatten(params, ctx.layout)
        grads, records = _site_backward_group(ctx.sources, ctx.table, reads, ctx.num_heads, ctx.eps, lse,
                                              tables.aligned(grad_outs))
        for record in records:
            leave(ctx.marks, record)
        return None, None, None, None, None, None, *(g for read in grads for g in read)


def _flatten(reads: Sequence[Read]) -> tuple[tuple[bool, bool], list[torch.Tensor]]:
    """A group's parameters as one list, each read's query, key-norm weight, and null source and
    gate where the reads have them, and its layout (whether they do) for `_unflatten`."""
    return (reads[0].null_source is not None, reads[0].gate is not None), [t for r in reads for t in r if t is not None]


def _unflatten(params: Sequence[torch.Tensor], layout: tuple[bool, bool]) -> list[Read]:
    has_null, has_gate = layout
    width = 2 + has_null + has_gate
    reads = []
    for i in range(0, len(params), width):
        query, key_norm_weight, *rest = params[i:i + width]
        reads.append(Read(query, key_norm_weight, rest[0] if has_null else None, rest[-1] if has_gate else None))
    return reads


@torch.compiler.disable
def fused_route_group(sources: Sequence[torch.Tensor], reads: Sequence[Read], num_heads: int,
                      eps: float) -> tuple[torch.Tensor, ...]:
    """`route_group` computed by the Triton kernels (same arguments, same results)."""
    sources, reads = tuple(sources), [Read(*read) for read in reads]
    for read in reads:
        check_gated(read.gate, None)
    if len(sources) + (reads[0].null_source is not None) == 1:  # nothing to mix
        return tuple(route_reference(sources, *read[:2], num_heads, eps, *read[2:]) for read in reads)
    layout, params = _flatten(reads)
    if needs_grad(*params, *sources):
        sources, marks, newest = on_one_chain(sources)
        return FusedRouteGroup.apply(num_heads, eps, sources, marks, layout, newest, *params)
    sources, table = tables.with_table(sources)
    return tuple(forward_group(sources, table, reads, num_heads, eps, store_stats=False)[0])
