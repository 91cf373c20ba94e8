"""Depth sources and their gradients.

A read's backward (its site kernel) returns no gradient for the sources it read: it leaves a
record (output gradient, lse, S, g*q and its terms) with each of them. `DepthSource` marks a
tensor that reads will use; autograd runs a mark's backward only after every read of it has run
its own, and there one kernel (`route_source_bwd_kernel`) turns all the records into the
source's gradient, summed in fp32 and written once (the source-major backward of
docs/kernels.md). Marks made in order form a chain (`_Chain`), so a read's one autograd input,
its newest source, orders every source's backward after its own.
"""

from __future__ import annotations

import operator
from typing import NamedTuple

import torch

from . import kernels, launch, outputs, tables


def source_rstd(sources, marks, eps: float) -> tuple[list[torch.Tensor], int]:
    """A training read's rstd row (fp32 [T]) per source, and how many of them, from the first on,
    earlier reads computed: a source's mark keeps the one its first read computed (for that eps).
    The forward loads those and computes the others into new rows, which the marks that had none
    keep from then on (the forwards load rstd instead of summing a row: fewer instructions per
    source)."""
    keep = launch.current().keep_rstd
    kept = []
    if keep:
        for mark, position in marks:  # in the sources' order: kept while every position has a row
            if position != len(kept) or mark.rstd is None or mark.rstd_eps != eps:
                break
            kept.append(mark.rstd)
    rows = kept
    if len(kept) < len(sources):
        first = sources[0]
        count, shape = len(sources) - len(kept), (first.numel() // first.shape[-1],)
        # one row: allocated alone, as it costs a torch call less than per_read's block of rows
        fresh = (outputs.empty(shape, dtype=torch.float32, device=first.device),) if count == 1 else \
            outputs.per_read(count, shape, first.device).unbind(0)
        rows = [*kept, *fresh]
        if keep:
            for mark, position in marks[len(kept):]:
                if mark.rstd is None:
                    mark.rstd, mark.rstd_eps = rows[position], eps
    return rows, len(kept)


class _Chain:
    """Marks linked in the order they were made. Each mark takes the one before it as an input,
    so autograd runs a mark's backward only after every later mark's: a read then needs one
    autograd input, its newest source's mark, for all of its sources to wait for it.

    A mark made after one that is not its chain's newest (a layer recomputed under activation
    checkpointing does that) starts a branch: a new chain whose `parent` is where it leaves.

    `ids`: the id of each mark's node, by position. A mark holds the one before it (DepthSource's
    `previous`), so while one lives, the ids of those before it name them and no other object."""

    __slots__ = ("ids", "parent")

    def __init__(self, parent: tuple[_Chain, int] | None = None):
        self.ids, self.parent = [], parent


def _precedes(node, newest) -> bool:
    """Whether mark `node` is `newest` or one autograd visits after it (on its chain or a parent)."""
    chain, limit = newest.chain, newest.position
    while chain is not None:
        if node.chain is chain:
            return node.position <= limit
        chain, limit = chain.parent or (None, None)
    return False


class DepthSource(torch.autograd.Function):
    """Marks a tensor that routing reads will use (the alias it returns is what they take).
    Its backward runs after every read of it: the source kernel sums their records, plus the
    gradient that reached the tensor any other way."""

    @staticmethod
    def forward(ctx, source, previous, chain, position):
        ctx.set_materialize_grads(False)  # reads return no gradient for it: no zeros to add
        ctx.records, ctx.chain, ctx.position = [], chain, position
        ctx.previous = previous.grad_fn if previous is not None else None  # the mark made before it
        ctx.partial = None  # a Partial its successor's backward left (see _partner)
        ctx.rstd = ctx.rstd_eps = None  # its rstd (fp32 [T]) and eps, once a training read computed it
        # held, not saved, as the reads of it hold it anyway: the next mark's backward may read it
        # too (_partner), and activation checkpointing lets a saved tensor be unpacked only once
        ctx.source = source
        return source.view_as(source)

    @staticmethod
    def backward(ctx, grad_in):
        # records and partial sums of this backward pass only: a pass that stopped short
        # (autograd.grad on a subset of inputs) may have left some that no later pass must count
        task = torch._C._current_graph_task_id()
        records = [(r, position) for r, position in ctx.records if r.task == task]
        partial = ctx.partial if ctx.partial is not None and ctx.partial.task == task else None
        ctx.records, ctx.partial = [], None
        if not records and partial is None:
            return grad_in, None, None, None
        grad = source_grad(ctx.source.contiguous(), records, grad_in, partial, _partner(ctx, records, task))
        return grad, None, None, None


_DEPTH_NODE = DepthSource._backward_cls
_GRAD_FN = operator.attrgetter("grad_fn")


def _mark(source: torch.Tensor, after: torch.Tensor | None) -> torch.Tensor:
    """A new mark of `source`, linked after the mark `after` (a new chain when there is none)."""
    node = after.grad_fn if after is not None else None
    if not isinstance(node, _DEPTH_NODE):
        chain, after = _Chain(), None
    elif len(node.chain.ids) == node.position + 1:  # the chain's newest
        chain = node.chain
    else:
        chain = _Chain(parent=(node.chain, node.position))
    marked = DepthSource.apply(source, after, chain, len(chain.ids))
    chain.ids.append(id(marked.grad_fn))
    return marked


def track(source: torch.Tensor, after: torch.Tensor | None = None) -> torch.Tensor:
    """`source` marked as a depth source (see DepthSource) when it needs a gradient, linked after
    `after`, the depth source made just before it; else `source` unchanged."""
    if not (torch.is_grad_enabled() and source.requires_grad) or isinstance(source.grad_fn, _DEPTH_NODE):
        return source
    return _mark(source, after)


def on_one_chain(sources, begun: int = 0) -> tuple[tuple, list, torch.Tensor | None]:
    """The sources with every one that needs a gradient marked on one chain, (mark, position
    among the sources) of those, and the newest marked source (None when no source needs a
    gradient). Sources marked where they were made, newest last (the model's), come back as they
    are; others are marked here. The first `begun` sources are a begun read's, already on one
    chain (`reads.ReadPrefix.marked`): sources after them are marked after them, so that the pair's
    site backward, which writes terms the second read's sources use, runs before any of theirs."""
    nodes = list(map(_GRAD_FN, sources))
    newest = nodes[-1]
    # full mode's reads: the marks of the newest one's chain from its first, in order (_Chain.ids),
    # checked without a Python step per source
    if (isinstance(newest, _DEPTH_NODE) and newest.position == len(nodes) - 1
            and newest.chain.ids[:len(nodes)] == list(map(id, nodes))):
        return sources, list(zip(nodes, range(len(nodes)))), sources[-1]
    marks = [(node, i) for i, (node, s) in enumerate(zip(nodes, sources)) if s.requires_grad]
    if not marks:
        return sources, [], None
    newest = marks[-1][0]
    if isinstance(newest, _DEPTH_NODE):
        chain, limit = newest.chain, newest.position
        # the model's sources are on the newest one's chain: _precedes only for the others
        if all(isinstance(m, _DEPTH_NODE) and (m.chain is chain and m.position <= limit or _precedes(m, newest))
               for m, _ in marks):
            return sources, marks, sources[marks[-1][1]]
    marked = list(sources[:begun])
    previous = next((s for s in reversed(marked) if s.requires_grad), None)
    for s in sources[begun:]:
        if s.requires_grad:
            s = previous = _mark(s, previous)
        marked.append(s)
    sources = tuple(marked)
    marks = [(sources[i].grad_fn, i) for _, i in marks]
    return sources, marks, sources[marks[-1][1]]


class ReadRecord:
    """What one read's backward leaves with each source it read (with the source's position
    among the read's sources), for the source kernel. `terms`: the read's dots and P per source
    (fp32 [sources, 2, T, H]), written by its site kernel (or, for a split pair's second read,
    partly by its total kernel, the rest by the pair's site kernel)."""

    __slots__ = ("task", "dout", "lse", "total", "gq", "terms", "eps", "addresses", "dtype", "terms_at")

    def __init__(self, task: int, dout, lse, total, gq, terms, eps: float):
        self.task, self.dout, self.lse, self.total, self.gq, self.terms = task, dout, lse, total, gq, terms
        self.eps, self.dtype = eps, dout.dtype
        self.addresses = tables.addresses((dout, lse, total, gq))  # a reader-table row starts with these
        # where its terms for the source at position p start: base + p * step
        self.terms_at = base, step = terms.data_ptr(), terms.stride(0) * terms.element_size()
        assert not any(a % tables.ALIGNMENT for a in (*self.addresses, base)), "kernels._address assumes it"


def leave(marks, record: ReadRecord) -> None:
    """A read's record left with each mark it read, with that source's position in the read."""
    for mark, position in marks:
        mark.records.append((record, position))


class Partial(NamedTuple):
    """A source's gradient terms from some of its reads, summed by its successor's launch."""

    task: int
    acc: torch.Tensor  # fp32 [T, d]: the sum of w dout + dlogit rstd gq
    norm: torch.Tensor  # fp32 [T]: the sum of sum_h dlogit dots
    eps: float
    heads: int


def _partner(ctx, records: list[tuple[ReadRecord, int]], task: int):
    """The mark made just before this one, when its reads so far are exactly this one's and there
    are enough of them to pay: one launch then sums both sources' terms. (In full mode an
    attention output and the MLP output of the layer before it: every read of the latter but the
    attention read, which comes next, also reads the former.)"""
    node = ctx.previous
    if (node is None or len(records) < launch.current().partner_min_reads or node.partial is not None
            or node.source.shape != ctx.source.shape):
        return None
    theirs = {r for r, _ in node.records if r.task == task}
    return node if theirs == {r for r, _ in records} else None


def _reader_table(records: list[tuple[ReadRecord, int]], partner) -> tuple[list[int], list[torch.Tensor]]:
    """The source kernel's reader table (per read: output gradient, lse, S, g*q, and its terms for
    the source and for the partner), and the output gradients converted to one dtype that the
    table points at (reads of mixed output dtypes)."""
    theirs = dict(partner.records) if partner is not None else None  # a record's position in the partner's reads
    dtype = records[0][0].dtype
    table, converted = [], []
    for r, position in records:
        addresses = r.addresses
        if r.dtype != dtype:
            converted.append(r.dout.to(dtype))
            addresses = (converted[-1].data_ptr(), *addresses[1:])
        base, step = r.terms_at
        table += (*addresses, base + position * step, base + theirs[r] * step if theirs is not None else 0)
    return table, converted


def source_grad(source, records: list[tuple[ReadRecord, int]], grad_in, partial: Partial | None, partner):
    """The source's gradient from its reads' records, its `partial` sums and `grad_in`; with a
    `partner` (see _partner), that mark's terms from the same records are left with it."""
    task, eps, heads = (partial.task, partial.eps, partial.heads) if partial is not None else (
        records[0][0].task, records[0][0].eps, records[0][0].lse.shape[-1])
    every_eps = {r.eps for r, _ in records} | {eps}
    if len(every_eps) > 1:
        raise ValueError(f"reads of one source must share one eps (the model's rms_norm_eps); got {sorted(every_eps)}")
    # `converted` is held until the launch, which reads them through the table
    addresses, converted = _reader_table(records, partner) if records else ([], [])
    width = source.shape[-1]
    tokens = source.numel() // width
    setup = launch.kernel_args("source" if partner is None else "source_paired", width, heads)
    grad = outputs.empty(source.shape, dtype=source.dtype, device=source.device)
    grad_in = grad_in.contiguous() if grad_in is not None else None
    # pointer types for the table's loads, and a stand-in for pointers a launch does not use
    dout0, stat0 = (records[0][0].dout, records[0][0].lse) if records else (source, partial.acc)
    readers = tables.upload(addresses or [stat0.data_ptr()] * 6, source.device)  # no reads left: a row it never reads
    other = left = None
    if partner is not None:
        other = partner.source.contiguous()
        left = Partial(task, outputs.empty((tokens, width), dtype=torch.float32, device=source.device),
                       outputs.empty((tokens,), dtype=torch.float32, device=source.device), eps, heads)
    kernels.route_source_bwd_kernel[(launch.cdiv(tokens, setup["BLOCK_T"]),)](
        source, readers, dout0, stat0, grad_in if grad_in is not None else grad, grad,
        *((other, left.acc, left.norm) if other is not None else (source, stat0, stat0)),
        *((partial.acc, partial.norm) if partial is not None else (stat0, stat0)),
        len(records), tokens, eps,
        HAS_GRAD_IN=grad_in is not None, HAS_PARTNER=left is not None, HAS_INIT=partial is not None, **setup,
    )
    if left is not None:
        done = {id(r) for r, _ in records}
        partner.records = [(r, position) for r, position in partner.records if id(r) not in done]
        partner.partial = left
    return grad


def needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
