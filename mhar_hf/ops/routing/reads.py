"""Single, split and two-phase reads: `fused_route` (one read), `fused_route_and_start` (a read
that also begins the next one over the same sources, which `fused_route(..., prefix=)` ends), and
`fused_begin_group` (two-phase reads: block mode's reads of a block begun together over its
finished blocks, full mode's of a group of layers over the sources before it, each ended by
`fused_route(..., prefix=(mix, lse, begun))`).

`FusedRoute` is one read: its backward (the site kernel) computes the routing parameters'
gradients and leaves its record with the sources it read (depth_sources.py). `FusedRoutePair` and
`FusedRouteEnd` are the two reads of a split pair, which share the forward's and the site
backward's passes over their common sources.
"""

from __future__ import annotations

import bisect
import operator
from collections.abc import Sequence
from typing import NamedTuple

import torch

from mhar_hf.routing import Read, check_gated, route_reference

from . import group, kernels, launch, outputs, site, tables
from .depth_sources import ReadRecord, leave, needs_grad, on_one_chain, source_rstd


class SoftmaxState(NamedTuple):
    """A read's online softmax after its leading sources: the unnormalised mix (fp32 [T, d]) and
    the running max and sum (fp32 [2, T, H])."""

    acc: torch.Tensor
    stat: torch.Tensor


def read_forward(sources, table, query, key_norm_weight, null_source, gate, residual, num_heads, eps, store_stats,
                 kept: int = 0, second=None, init: SoftmaxState | None = None):
    """One read's output and, if `store_stats`, its lse (fp32 [T, H], else None); it stores the
    rstd of its sources past the first `kept`, and loads theirs (`source_rstd`). `second` =
    (query, key-norm weight) of a read begun over the same sources: its state comes back as a
    third value. `init`: the state this read starts from."""
    first = sources[0]
    width = first.shape[-1]
    tokens = first.numel() // width
    setup = launch.kernel_args("forward", width, num_heads)
    out = outputs.empty(first.shape, dtype=outputs.output_dtype(first, null_source, gate, residual), device=first.device)
    lse = outputs.empty((tokens, num_heads), dtype=torch.float32, device=first.device) if store_stats else None
    state = init
    if second is not None:
        state = SoftmaxState(outputs.empty((tokens, width), dtype=torch.float32, device=first.device),
                             outputs.empty((2, tokens, num_heads), dtype=torch.float32, device=first.device))
    q2, g2 = second if second is not None else (query, key_norm_weight)
    # for the pointer types of what this launch does not use
    stand_in = lse if lse is not None else outputs.empty((1,), dtype=torch.float32, device=first.device)
    kernels.route_fwd_kernel[(launch.cdiv(tokens, setup["BLOCK_T"]),)](
        table, table, first, query if null_source is None else null_source, query, key_norm_weight,
        query if gate is None else gate, first if residual is None else residual, out,
        lse if lse is not None else stand_in, q2, g2, *(state if state is not None else (stand_in, stand_in)),
        len(sources), kept, 1, tokens, eps,
        HAS_NULL=null_source is not None, HAS_GATE=gate is not None, STORE_STATS=store_stats,
        HAS_INIT=init is not None, HAS_SECOND=second is not None, GROUPED=False, **setup,
    )
    return out, lse, (state if second is not None else None)


class FusedRoute(torch.autograd.Function):
    """One read. The sources come as one tuple, not as autograd inputs: the read returns no
    gradient for them (their marks compute it from its record), and its one source input, the
    newest mark, orders every mark's backward after its own (see depth_sources). A gated read's
    residual gets the output gradient as it is."""

    @staticmethod
    def forward(ctx, num_heads, eps, sources, marks, query, key_norm_weight, null_source, gate, residual, newest):
        rstd, kept = source_rstd(sources, marks, eps)
        sources, table = tables.with_table(sources, rstd)
        out, lse, _ = read_forward(sources, table, query, key_norm_weight, null_source, gate, residual, num_heads,
                                   eps, store_stats=True, kept=kept)
        # the sources and their rstd are held, not saved: the table points at them. (Under
        # non-reentrant activation checkpointing this keeps alive a source made and read inside one
        # layer, block mode's running sum after attention, that saving would let the layer recompute.)
        ctx.num_heads, ctx.eps, ctx.sources, ctx.rstd, ctx.marks = num_heads, eps, sources, rstd, marks
        ctx.table, ctx.residual_dtype = table, residual.dtype if residual is not None else None
        # kept for S (launch.total_from_out). A compiled sublayer after the read saves the same tensor
        # for its norm, so this costs nothing there; eager, one activation per read (docs/decisions.md)
        mix = out if launch.total_from_out(gate, len(sources)) else None
        ctx.save_for_backward(query, key_norm_weight, null_source, gate, lse, mix)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key_norm_weight, null_source, gate, lse, out = ctx.saved_tensors
        (grad_out,) = tables.aligned((grad_out,))  # the source kernel reaches it through a table
        grads, record, _ = _site_backward(ctx.sources, ctx.table, ctx.num_heads, ctx.eps, query, key_norm_weight,
                                          null_source, gate, lse, grad_out, out)
        leave(ctx.marks, record)
        dresidual = grad_out.to(ctx.residual_dtype) if gate is not None and ctx.needs_input_grad[8] else None
        return None, None, None, None, *grads, dresidual, None


def _site_backward(sources, table, num_heads, eps, query, key_norm_weight, null_source, gate, lse, grad_out,
                   out=None, second=None):
    """The site kernel of one read (`out`: its output, given when S is to come from it), and given
    `second` = (query, key-norm weight, ReadRecord, sources, table) of a split pair's second read,
    of that read too (whose sources start with this read's; the kernel writes that record's
    terms). Returns this read's parameter gradients (query, key-norm weight, null source, gate;
    None where absent), its record, and the second read's two (None without one)."""
    num_sources = len(sources)
    q2, g2, later = second[:3] if second is not None else (query, key_norm_weight, None)
    if second is not None:
        sources, table = second[3:]
    first = sources[0]
    width, device = first.shape[-1], first.device
    tokens = first.numel() // width
    few = gate is None and second is None and len(sources) <= launch.current().few_sources
    setup = launch.kernel_args("site_few" if few else "site", width, num_heads)
    has_null, has_gate = null_source is not None, gate is not None
    params = (query, key_norm_weight, null_source) if has_null else (query, key_norm_weight)
    rows = len(params) + 2 * (second is not None)
    total = outputs.empty((tokens, num_heads), dtype=torch.float32, device=device)
    gq = outputs.empty((width + 1,), dtype=torch.float32, device=device)
    terms = outputs.empty((len(sources), 2, tokens, num_heads), dtype=torch.float32, device=device)

    def arguments(partials):
        return (table, table, first, null_source if has_null else query, query, key_norm_weight,
                gate if has_gate else query, lse, grad_out, out if out is not None else grad_out, total, gq, partials,
                terms, q2, g2, *((later.lse, later.dout, later.total, later.terms) if second is not None
                                 else (lse, grad_out, total, terms)), lse,
                num_sources, len(sources), 1, tokens, eps)

    constexprs = dict(HAS_NULL=has_null, HAS_GATE=has_gate, HAS_SECOND=second is not None, GROUPED=False,
                      TOTAL_FROM_OUT=out is not None, HAS_LSE_GRAD=False,
                      IN_PLACE=launch.stores_in_place(setup, second is not None),
                      **setup)
    programs, partials = site.launch_site(arguments, constexprs, sources, rows, has_gate, total)
    record = ReadRecord(torch._C._current_graph_task_id(), grad_out, lse, total, gq, terms, eps)

    params += (q2, g2) if second is not None else ()
    grads, dgates = site.sum_partials(partials, programs, width, params, [gate] if has_gate else [])
    second_grads = (grads.pop(), grads.pop())[::-1] if second is not None else None
    dnull = grads[2] if has_null else None
    return (grads[0], grads[1], dnull, dgates[0] if has_gate else None), record, second_grads


def _record_totals(grad_out, out, query, key_norm_weight, num_heads, sources, table, first: int):
    """S, the g*q record and the terms of the sources from `first` on, of a split pair's second
    read, from its output (route_total_kernel); the pair's site kernel writes every source's terms
    later."""
    width = out.shape[-1]
    tokens = out.numel() // width
    setup = launch.kernel_args("total", width, num_heads)
    total = outputs.empty((tokens, num_heads), dtype=torch.float32, device=out.device)
    gq = outputs.empty((width + 1,), dtype=torch.float32, device=out.device)
    terms = outputs.empty((len(sources), 2, tokens, num_heads), dtype=torch.float32, device=out.device)
    kernels.route_total_kernel[(launch.cdiv(tokens, setup["BLOCK_T"]),)](
        grad_out, out, query, key_norm_weight, total, gq, table, sources[0], terms, first, len(sources), tokens,
        **setup,
    )
    return total, gq, terms


class _Pair:
    """What the two reads of a split pair share: the rstd rows of the first read's sources, set by
    its forward (`source_rstd`), the second read's sources and table, set by its forward, and its
    backward's record, which the first read's backward (always after it) takes."""

    __slots__ = ("sources", "table", "rstd", "second")

    def __init__(self):
        self.sources = self.table = self.rstd = self.second = None


class ReadPrefix:
    """A read begun over leading sources (`fused_route_and_start`): `fused_route(..., prefix=)`
    ends it, once, given sources that start with those and the query it was begun with."""

    def __init__(self, sources, marked, query, key_norm_weight, state: SoftmaxState, pair: _Pair | None):
        self.sources, self.marked, self.query, self.key_norm_weight = sources, marked, query, key_norm_weight
        self.state, self.pair, self.ended = state, pair, False

    def check(self, sources, query, key_norm_weight, null_source, gate) -> None:
        if self.ended:
            raise ValueError("this prefix already ended a read: a begun read ends once")
        k = len(self.sources)
        if len(sources) <= k or not all(map(operator.is_, sources, self.sources)):
            raise ValueError(f"a begun read ends with the {k} sources it began with, then at least one more; "
                             f"got {len(sources)} sources that do not start with those")
        if query is not self.query or key_norm_weight is not self.key_norm_weight:
            raise ValueError("a begun read ends with the query and key-norm weight it was begun with "
                             "(route_and_start's next_query, next_key_norm_weight)")
        if null_source is not None or gate is not None:
            raise ValueError("split reads are ungated and have no null source (full mode's reads)")


class FusedRoutePair(torch.autograd.Function):
    """A read that also begins the next one over the same sources (the pair's second read, ended
    by FusedRouteEnd): one pass of the forward and one of the site backward serve both. The
    second read's query and key-norm weight are inputs here, and get their gradients here, when
    this backward's pass over the sources serves both reads. The state it returns is the second
    read's input, so autograd runs that read's backward first."""

    @staticmethod
    def forward(ctx, num_heads, eps, sources, marks, pair, query, key_norm_weight, next_query, next_key_norm_weight,
                newest):
        pair.rstd, kept = source_rstd(sources, marks, eps)
        sources, table = tables.with_table(sources, pair.rstd)
        out, lse, state = read_forward(sources, table, query, key_norm_weight, None, None, None, num_heads, eps,
                                       store_stats=True, kept=kept, second=(next_query, next_key_norm_weight))
        ctx.num_heads, ctx.eps, ctx.sources, ctx.marks, ctx.table, ctx.pair = num_heads, eps, sources, marks, table, pair
        mix = out if launch.total_from_out(None, len(sources)) else None  # for S, as FusedRoute's
        ctx.save_for_backward(query, key_norm_weight, next_query, next_key_norm_weight, lse, mix)
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(state.stat)
        return out, state.acc, state.stat

    @staticmethod
    def backward(ctx, grad_out, _acc, _stat):
        query, key_norm_weight, next_query, next_key_norm_weight, lse, out = ctx.saved_tensors
        later, pair = ctx.pair.second, ctx.pair
        pair.second = None
        if later is not None and later.task != torch._C._current_graph_task_id():
            later = None  # left by a pass that stopped short
        if grad_out is None:
            grad_out = torch.zeros_like(ctx.sources[0])
        (grad_out,) = tables.aligned((grad_out,))
        second = (next_query, next_key_norm_weight, later, pair.sources, pair.table) if later is not None else None
        grads, record, second_grads = _site_backward(ctx.sources, ctx.table, ctx.num_heads, ctx.eps, query,
                                                     key_norm_weight, None, None, lse, grad_out, out, second)
        leave(ctx.marks, record)
        return None, None, None, None, None, grads[0], grads[1], *(second_grads or (None, None)), None


class FusedRouteEnd(torch.autograd.Function):
    """The second read of a split pair: folds the sources it adds into the begun state. Its
    backward leaves its record with every source it read (S from its output, which is the mix)
    and hands the same to the pair's first read, whose site kernel computes its parameters'
    gradients."""

    @staticmethod
    def forward(ctx, num_heads, eps, sources, marks, prefix, acc, query, key_norm_weight, newest):
        begun = len(prefix.sources)
        newer = bisect.bisect_left(marks, begun, key=operator.itemgetter(1))  # marks are in the sources' order
        added, kept = source_rstd(sources[begun:], [(m, p - begun) for m, p in marks[newer:]], eps)
        rstd = [*prefix.pair.rstd, *added]
        sources, table = tables.with_table(sources, rstd)
        out, lse, _ = read_forward(sources[begun:], table[2 * begun:], query, key_norm_weight, None, None, None,
                                   num_heads, eps, store_stats=True, kept=kept, init=SoftmaxState(acc, prefix.state.stat))
        # the new sources detached: they are usually made from the first read's output, so holding
        # their marks would close a reference cycle through autograd nodes, which nothing frees
        prefix.pair.sources = [*sources[:begun], *(s.detach() for s in sources[begun:])]
        prefix.pair.table, prefix.pair.rstd = table, rstd
        ctx.num_heads, ctx.eps, ctx.marks, ctx.pair, ctx.begun = num_heads, eps, marks, prefix.pair, begun
        ctx.save_for_backward(query, key_norm_weight, lse, out)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key_norm_weight, lse, out = ctx.saved_tensors
        (grad_out,) = tables.aligned((grad_out,))
        # the terms of the sources whose source kernels may run before the pair's site kernel: those
        # the first read does not take, and the partner of the earliest (the first read's last)
        total, gq, terms = _record_totals(grad_out, out, query, key_norm_weight, ctx.num_heads, ctx.pair.sources,
                                          ctx.pair.table, max(ctx.begun - 1, 0))
        task = torch._C._current_graph_task_id()
        record = ReadRecord(task, grad_out, lse, total, gq, terms, ctx.eps)
        leave(ctx.marks, record)
        ctx.pair.second = record
        return (None,) * 9


# Two-phase reads: the reads of one block (block mode) all take the finished blocks, those of a
# group of layers (full mode) the sources made before it, and each then its own newer sources
# (any number of them). Phase 1 (`fused_begin_group`) is one grouped pass over the finished
# blocks that leaves each read's softmax state over them; phase 2 (`end_begun`, a read's own
# call) folds its newer sources into that state with an online-softmax step. docs/kernels.md
# derives the backward.

class FusedBeginGroup(torch.autograd.Function):
    """Phase 1: per read, the normalised mix of the sources (in their dtype and shape) and its
    lse (fp32 [T, H]), from one forward launch (`group.forward_group`). Its backward takes the
    gradients of both (from the reads' ends, `FusedEndBegun`) in one site launch, the lse's
    gradient lowering each read's S (kernels.route_site_bwd_kernel, HAS_LSE_GRAD), and leaves
    each read's record with the sources, as grouped reads do."""

    @staticmethod
    def forward(ctx, num_heads, eps, sources, marks, newest, *params):
        rstd, kept = source_rstd(sources, marks, eps)
        sources, table = tables.with_table(sources, rstd)
        reads = group._unflatten(params, (False, False))
        mixes, lse = group.forward_group(sources, table, reads, num_heads, eps, store_stats=True, kept=kept)
        ctx.num_heads, ctx.eps, ctx.sources, ctx.rstd, ctx.marks = num_heads, eps, sources, rstd, marks
        ctx.table = table
        ctx.save_for_backward(lse, *params)
        ctx.set_materialize_grads(False)
        return (*mixes, *lse.unbind(0))

    @staticmethod
    def backward(ctx, *grads):
        lse, *params = ctx.saved_tensors
        reads = group._unflatten(params, (False, False))
        count = len(reads)
        first = ctx.sources[0]
        grad_mixes = tables.aligned(g.to(first.dtype) if g is not None else torch.zeros_like(first)
                                    for g in grads[:count])
        lse_grad = None
        if any(g is not None for g in grads[count:]):
            lse_grad = outputs.per_read(count, lse.shape[1:], first.device)
            for row, g in zip(lse_grad.unbind(0), grads[count:]):  # one unbind, not two indexings a read
                if g is None:
                    row.zero_()
                else:
                    row.copy_(g.reshape(row.shape))
        per_read, records = group._site_backward_group(ctx.sources, ctx.table, reads, ctx.num_heads, ctx.eps, lse,
                                                       grad_mixes, lse_grad)
        for record in records:
            leave(ctx.marks, record)
        return None, None, None, None, None, *(g for read in per_read for g in read)


class FusedEndBegun(torch.autograd.Function):
    """Phase 2: a begun read's state (normalised mix and lse over its leading sources) with its
    newer sources folded in (`read_forward` from that state). Its backward leaves the
    read's record with the newer sources (S from its output, the mix) and gives the state its
    gradients: the mix's a * dout, with a = exp(lse_state - lse) the weight the state keeps, and
    the lse's a * (<dout, mix> - S) = -(the newer sources' dlogits) per head (docs/kernels.md),
    so the state's mix is not kept for the backward."""

    @staticmethod
    def forward(ctx, num_heads, eps, sources, marks, mix, lse, query, key_norm_weight, newest):
        rstd, kept = source_rstd(sources, marks, eps)
        sources, table = tables.with_table(sources, rstd)
        out, total_lse, _ = read_forward(sources, table, query, key_norm_weight, None, None, None, num_heads, eps,
                                         store_stats=True, kept=kept, init=_state(mix, lse))
        ctx.num_heads, ctx.eps, ctx.sources, ctx.rstd, ctx.marks = num_heads, eps, sources, rstd, marks
        ctx.table = table
        ctx.mix_shape, ctx.mix_dtype = mix.shape, mix.dtype
        ctx.save_for_backward(lse, query, key_norm_weight, total_lse, out)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        lse, query, key_norm_weight, total_lse, out = ctx.saved_tensors
        (grad_out,) = tables.aligned((grad_out,))
        grads, record, _ = _site_backward(ctx.sources, ctx.table, ctx.num_heads, ctx.eps, query, key_norm_weight,
                                          None, None, total_lse, grad_out, out)
        leave(ctx.marks, record)
        width = ctx.mix_shape[-1]
        tokens = grad_out.numel() // width
        setup = launch.kernel_args("total", width, ctx.num_heads)
        grad_mix = outputs.empty(ctx.mix_shape, dtype=ctx.mix_dtype, device=grad_out.device)
        grad_lse = outputs.empty(lse.shape, dtype=torch.float32, device=grad_out.device)
        kernels.route_begun_grad_kernel[(launch.cdiv(tokens, setup["BLOCK_T"]),)](
            grad_out, lse.contiguous(), total_lse, record.total, record.terms, ctx.table, grad_mix, grad_lse,
            len(ctx.sources), tokens, **setup,
        )
        return None, None, None, None, grad_mix, grad_lse, grads[0], grads[1], None


def _state(mix, lse):
    """A begun read's state as the forward kernel starts from it (SoftmaxState): the mix
    as its unnormalised sum, the lse as its max, and a sum of 1."""
    tokens = lse.numel() // lse.shape[-1]
    stat = torch.stack((lse, torch.ones_like(lse))).view(2, tokens, -1)
    (mix,) = tables.aligned((mix,))
    return SoftmaxState(mix, stat)


@torch.compiler.disable
def fused_begin_group(sources: Sequence[torch.Tensor], reads: Sequence[Read], num_heads: int,
                      eps: float) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """Phase 1 of two-phase reads: one launch over `sources` for every read (ungated `Read`s),
    returning per read its state, (mix, lse): the normalised mix of the sources (their dtype and
    shape; in fp32 inside, rounded once) and its lse (fp32, [..., H]). `end_begun` ends each
    read. None for no sources."""
    sources, reads = tuple(sources), [Read(*read) for read in reads]
    if not sources:
        return None
    if any(read.null_source is not None or read.gate is not None for read in reads):
        raise ValueError("two-phase reads are ungated and have no null source (block and full mode's reads)")
    params = [t for read in reads for t in read[:2]]
    shape = (*sources[0].shape[:-1], num_heads)
    if needs_grad(*params, *sources):
        sources, marks, newest = on_one_chain(sources)
        states = FusedBeginGroup.apply(num_heads, eps, sources, marks, newest, *params)
    else:
        rstd, _ = source_rstd(sources, [], eps)
        sources, table = tables.with_table(sources, rstd)
        mixes, lse = group.forward_group(sources, table, reads, num_heads, eps, store_stats=True)
        states = (*mixes, *lse.unbind(0))
    count = len(reads)
    return [(states[r], states[count + r].view(shape)) for r in range(count)]


def end_begun(sources: Sequence[torch.Tensor], query: torch.Tensor, key_norm_weight: torch.Tensor, num_heads: int,
              eps: float, state: tuple) -> torch.Tensor:
    """Phase 2: the read of `sources` whose first `begun` were read by `fused_begin_group`, given
    `state` = (mix, lse, begun) from it: its newer sources (`sources[begun:]`) folded into the
    state; with none, the state's mix is the read."""
    mix, lse, begun = state
    sources = tuple(sources)
    if not 0 < begun <= len(sources) or mix.shape != sources[0].shape or lse.shape != (*mix.shape[:-1], num_heads):
        raise ValueError(f"a begun read ends with the {begun} sources it began with (state {tuple(mix.shape)}, "
                         f"lse {tuple(lse.shape)}, H={num_heads}), then its newer ones; got {len(sources)} sources "
                         f"of shape {tuple(sources[0].shape)}")
    added = sources[begun:]
    if not added:
        return mix
    if needs_grad(query, key_norm_weight, mix, lse, *added):
        added, marks, newest = on_one_chain(added)
        return FusedEndBegun.apply(num_heads, eps, added, marks, mix, lse, query, key_norm_weight, newest)
    added, table = tables.with_table(added)
    return read_forward(added, table, query, key_norm_weight, None, None, None, num_heads, eps, store_stats=False,
                        init=_state(mix, lse))[0]


@torch.compiler.disable  # compiled models call the kernels eagerly between compiled regions
def fused_route(
    sources: Sequence[torch.Tensor],
    query: torch.Tensor,
    key_norm_weight: torch.Tensor,
    num_heads: int,
    eps: float,
    null_source: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    prefix: ReadPrefix | tuple | None = None,
) -> torch.Tensor:
    """`route_reference` computed by the Triton kernels (same arguments, same result).

    Sources marked with `track` where they are made, each after the one made before it, get
    their gradient computed once, from all their reads; others are marked here, per call
    (correct, but one source kernel per read). `prefix` ends a read that
    `fused_route_and_start` began over the leading sources, or, a tuple (mix, lse, begun), one
    that `fused_begin_group` began over the first `begun` (`end_begun`)."""
    check_gated(gate, residual)
    sources = tuple(sources)
    if isinstance(prefix, tuple):  # (mix, lse, begun): a read begun by fused_begin_group
        if null_source is not None or gate is not None:
            raise ValueError("two-phase reads are ungated and have no null source (block and full mode's reads)")
        return end_begun(sources, query, key_norm_weight, num_heads, eps, prefix)
    if prefix is not None:
        prefix.check(sources, query, key_norm_weight, null_source, gate)
        prefix.ended = True
        sources = (*prefix.marked, *sources[len(prefix.sources):])
        if needs_grad(query, key_norm_weight, prefix.state.acc, *sources):
            if prefix.pair is None:
                raise ValueError("this read was begun without autograd recording (under no_grad) and cannot end "
                                 "with it: begin and end a split read under the same grad mode")
            sources, marks, newest = on_one_chain(sources, begun=len(prefix.sources))
            return FusedRouteEnd.apply(num_heads, eps, sources, marks, prefix, prefix.state.acc, query,
                                       key_norm_weight, newest)
        sources, table = tables.with_table(sources)
        begun = len(prefix.sources)
        return read_forward(sources[begun:], table[2 * begun:], query, key_norm_weight, None, None, None, num_heads, eps,
                            store_stats=False, init=prefix.state)[0]
    if len(sources) + (null_source is not None) == 1:  # nothing to mix
        return route_reference(sources, query, key_norm_weight, num_heads, eps, null_source, gate, residual)
    if gate is not None and residual is None:  # gate * mix: the grouped kernels' read
        return group.fused_route_group(sources, [Read(query, key_norm_weight, null_source, gate)], num_heads, eps)[0]
    if residual is not None:
        residual = residual.contiguous()
    if needs_grad(query, key_norm_weight, null_source, gate, residual, *sources):
        sources, marks, newest = on_one_chain(sources)
        return FusedRoute.apply(num_heads, eps, sources, marks, query, key_norm_weight, null_source, gate, residual,
                                newest)
    sources, table = tables.with_table(sources)
    return read_forward(sources, table, query, key_norm_weight, null_source, gate, residual, num_heads, eps,
                        store_stats=False)[0]


@torch.compiler.disable
def fused_route_and_start(
    sources: Sequence[torch.Tensor],
    query: torch.Tensor,
    key_norm_weight: torch.Tensor,
    next_query: torch.Tensor,
    next_key_norm_weight: torch.Tensor,
    num_heads: int,
    eps: float,
) -> tuple[torch.Tensor, ReadPrefix | None]:
    """The read `fused_route(sources, query, key_norm_weight, ...)`, and the next read
    (`next_query`, `next_key_norm_weight`) begun over the same sources in the same pass: a
    `ReadPrefix` that `fused_route(more_sources, next_query, ..., prefix=)` ends. The site backward
    of both reads is one pass too. (None instead of a prefix when there is one source: nothing to
    mix, so the next read just runs.)"""
    sources = tuple(sources)
    if len(sources) == 1:
        return sources[0], None
    if needs_grad(query, key_norm_weight, next_query, next_key_norm_weight, *sources):
        marked, marks, newest = on_one_chain(sources)
        pair = _Pair()
        out, acc, stat = FusedRoutePair.apply(num_heads, eps, marked, marks, pair, query, key_norm_weight, next_query,
                                              next_key_norm_weight, newest)
        return out, ReadPrefix(sources, marked, next_query, next_key_norm_weight, SoftmaxState(acc, stat), pair)
    aligned, table = tables.with_table(sources)
    out, _, state = read_forward(aligned, table, query, key_norm_weight, None, None, None, num_heads, eps,
                                 store_stats=False, second=(next_query, next_key_norm_weight))
    return out, ReadPrefix(sources, sources, next_query, next_key_norm_weight, state, None)
