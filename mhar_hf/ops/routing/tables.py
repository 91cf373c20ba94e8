"""Address tables: the kernels reach a read's sources (and a source's reads) through int64 tables
of device addresses, so one launch takes any number of tensors. Tables are uploaded without
waiting for the GPU and kept by content, since training steps reuse the same addresses."""

from __future__ import annotations

import array
import functools
import itertools
import operator
from collections import OrderedDict
from collections.abc import Sequence

import torch

ALIGNMENT = 16  # bytes: kernels._address promises this of every tensor reached through a table


def _host(addresses: Sequence[int]) -> torch.Tensor:
    """Addresses as an int64 tensor in host memory, also under a `torch.device("cuda")` context
    (through an array: several times faster than torch.tensor on a list of ints)."""
    if not addresses:
        return torch.empty(0, dtype=torch.int64, device="cpu")
    return torch.frombuffer(array.array("q", addresses), dtype=torch.int64)


class _PinnedStaging:
    """The host side of address-table uploads: one pinned buffer used in two halves, so a table
    the cache does not hold costs a small asynchronous copy, never a pinned allocation (which can
    take milliseconds) nor a pageable copy (which waits for the GPU to drain its queue)."""

    def __init__(self, entries: int = 1 << 17):
        self.buffer = torch.empty(2 * entries, dtype=torch.int64, device="cpu", pin_memory=True)
        self.half, self.offset, self.side = entries, 0, 0
        self.done = [None, None]  # per half: an event after its last copy

    def upload(self, addresses: Sequence[int], device) -> torch.Tensor:
        count = len(addresses)
        if count > self.half:
            return _host(addresses).pin_memory().to(device, non_blocking=True)
        if self.offset + count > self.half:  # switch halves; the other one's copies must have run
            self.done[self.side] = torch.cuda.Event()
            self.done[self.side].record()
            self.side, self.offset = 1 - self.side, 0
            if self.done[self.side] is not None:
                self.done[self.side].synchronize()
        start = self.side * self.half + self.offset
        host = self.buffer[start : start + count]
        host.numpy()[:] = addresses
        self.offset += count
        return host.to(device, non_blocking=True)


_staging: dict[torch.device, _PinnedStaging] = {}
_tables: OrderedDict[tuple, torch.Tensor] = OrderedDict()
MAX_TABLES = 4096


def _capturing(device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class _CapturedUploads:
    """Table copies recorded into CUDA graphs, on a side stream that joins a capture at its first
    table and, from there on, waits only for its own earlier copies. A replay then runs the
    copies beside the kernels, not each one between the kernel before it and the kernel that
    reads the table, where every copy would leave the GPU idle for several microseconds
    (figures: docs/decisions.md).

    Every replay reads the host side of a copy again, and the side stream's copies wait for no
    kernel that reads an earlier table: so both sides of every table are kept for the life of
    the process, never freed (to a later upload of the capture, or to a staging buffer)."""

    def __init__(self, device):
        self.stream = torch.cuda.Stream(device)
        self.kept: list[torch.Tensor] = []

    def upload(self, addresses: Sequence[int], device) -> torch.Tensor:
        capturing = torch.cuda.current_stream(device)
        with torch.cuda.stream(self.stream):
            if not torch.cuda.is_current_stream_capturing():  # this capture's first table
                self.stream.wait_stream(capturing)
            host = _host(addresses).pin_memory()
            table = host.to(device, non_blocking=True)
        capturing.wait_stream(self.stream)
        self.kept += (host, table)
        return table


_captured: dict[torch.device, _CapturedUploads] = {}


def upload(addresses: Sequence[int], device) -> torch.Tensor:
    """Tensor addresses as an int64 tensor on `device`, copied without waiting for the GPU
    (under CUDA graph capture, recorded on a side stream: `_CapturedUploads`)."""
    if device.type != "cuda":
        return _host(addresses)
    with torch.cuda.device(device):
        uploads = _captured if _capturing(device) else _staging
        if device not in uploads:  # made once: a stream, or a pinned buffer
            uploads[device] = _CapturedUploads(device) if uploads is _captured else _PinnedStaging()
        return uploads[device].upload(addresses, device)


def address_table(addresses: tuple[int, ...], device) -> torch.Tensor:
    """`upload`, kept by content: the caching allocator hands a training step the same source
    addresses as the step before, so in the steady state a read's table is never copied again.
    (The source kernel's reader tables change every step: they are uploaded, not kept.) A table
    made under CUDA graph capture is not kept either: its contents exist only once replayed."""
    if _capturing(device):
        return upload(addresses, device)
    key = (device, addresses)
    table = _tables.get(key)
    if table is None:
        table = _tables[key] = upload(addresses, device)
        if len(_tables) > MAX_TABLES:
            _tables.popitem(last=False)
    else:
        _tables.move_to_end(key)
    return table


def aligned(tensors) -> list[torch.Tensor]:
    """The tensors contiguous and at 16-byte-aligned addresses, as the kernels assume of every
    address in a table (they load 16 bytes at a time); only a tensor that is not gets copied."""
    return [t if t.is_contiguous() and t.data_ptr() % ALIGNMENT == 0 else t.clone(memory_format=torch.contiguous_format)
            for t in tensors]


def addresses(tensors) -> tuple[int, ...]:
    return tuple(map(torch.Tensor.data_ptr, tensors))


def with_table(sources, rstd: Sequence[torch.Tensor] | None = None) -> tuple[Sequence[torch.Tensor], torch.Tensor]:
    """The sources as the kernels take them (`aligned`), and their table: per source the
    addresses of its rows and of its rstd (`rstd`, fp32 [T] each, from `sources.source_rstd`). Without
    them the rows' address stands in: a forward that keeps nothing sums every rstd itself."""
    rows = addresses(sources)
    # every address is aligned when their bitwise OR is: the usual case, checked without a Python step per source
    if functools.reduce(operator.or_, rows) % ALIGNMENT or not all(map(torch.Tensor.is_contiguous, sources)):
        sources = aligned(sources)
        rows = addresses(sources)
    pairs = zip(rows, addresses(rstd) if rstd is not None else rows)
    return sources, address_table(tuple(itertools.chain.from_iterable(pairs)), sources[0].device)


def clear() -> None:
    """Forget every kept table and staging buffer (tests start from a cold cache with it)."""
    _tables.clear()
    _staging.clear()


def staging_buffers() -> list[torch.Tensor]:
    """The pinned host buffers uploads are staged in (a CUDA-graph test overwrites them to show
    that a replay never reads them)."""
    return [staging.buffer for staging in _staging.values()]
