"""The fused routing op: coverage check, launch configuration and its autograd functions.

`FusedRoute` is one read. Its backward (`route_site_bwd_kernel`) computes the routing
parameters' gradients and leaves a record (output gradient, lse, S, g*q) with every source it
read; it returns no source gradient. `DepthSource` marks a tensor that reads will use: autograd
runs its backward only after every read of it has run its own, and there one kernel
(`route_source_bwd_kernel`) turns all the records into the source's gradient. So each source
gradient is summed in fp32 and written once, instead of being written by every read and added
up by autograd (the source-major backward of docs/kernels.md). Marks made in order form a
chain (`_Chain`), so a read's one autograd input, its newest source, is enough to order every
source's backward after its own: no autograd edge or saved tensor per source it reads.
`FusedRoutePair` and `FusedRouteEnd` are the two reads of a split pair (`fused_route_and_start`),
which share the forward's and the site backward's passes over their common sources.
`FusedRouteGroup` is several reads of the same sources (`fused_route_group`, delta mode's reads
between two block boundaries): one forward launch and one site launch serve them all, and each
read leaves its own record, so the source kernel sees them as separate reads.
"""

from __future__ import annotations

import functools
import math
import os
from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton

from mhar_hf.routing import Read, check_gated, gated_dtype, route_reference

from . import kernels

SOURCE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_TILE = 16384  # padded elements per token row a program holds in registers
ALIGNMENT = 16  # bytes: kernels._address promises this of every tensor reached through a table
_empty = torch.empty  # every output the kernels write is allocated here (tests poison it with NaN)

# Launch shape per kernel: token rows per program, padded tile elements per warp, and the stages of
# its software-pipelined loop (kernels.py). Each was chosen by its own GPU time in one step's reads at
# every preset, the reads made as the model makes them (source pairs included); the figures are in
# docs/decisions.md. Source: rows per program share each read's g*q, which the source kernel loads
# for every read (4 bytes per column, twice its output gradient's row), so more rows load fewer
# bytes per element. A paired launch (`source_paired`) takes two: faster than one row despite a
# little spill, and faster than four at 1B. Unpaired, four.
# Site: 640 elements per warp gives the 1B width (1280) 2 warps; 4 were slower. Check a change on
# the step (`sweep_launch.py --on-step`) and for spills (kernel_resources.py).
# Ungated, unpaired reads of few sources (block mode, full mode's first layers) take their own
# site shape: two token rows per program, half the warps per row (delta mode's gated reads are
# slower so). A split pair's launch keeps `site`, which is faster for it.
# Grouped forwards (delta mode) take as many token rows as fit one warp's elements (rows 0):
# one row of 1280 at 1B, where two rows or two warps per row were slower.
LAUNCH = {"forward": (1, 2048, 3), "site": (1, 640, 3), "source": (4, 2048, 3), "source_paired": (2, 2048, 3),
          "total": (1, 512), "site_few": (2, 1280, 3), "group_forward": (0, 2048, 3)}
FEW_SOURCES = 16  # at most this many sources take the `site_few` shape
COLUMN_BLOCKS = ("site", "site_few", "total")  # the launches whose low tile is in column blocks (_split)
# An ungated read of at least this many sources takes S from its output in the site kernel
# (TOTAL_FROM_OUT): fewer instructions per source, for one more row loaded per token block, which a
# read of few sources feels most (swept with `sweep_launch.py --constant TOTAL_FROM_OUT_MIN_SOURCES
# 1 8 100000`; docs/decisions.md).
TOTAL_FROM_OUT_MIN_SOURCES = 8
# Whether a training read's forward loads the rstd that an earlier read computed for its leading
# sources (`_source_rstd`), or sums every source's rstd from its rows (False: nothing is kept on
# the marks). Loading is faster, in full mode above all (`sweep_launch.py --constant KEEP_RSTD True
# False`; docs/decisions.md).
KEEP_RSTD = True
# route_partials_kernel: partial rows per load and columns per program. Few columns per program
# give a grid of hundreds of programs (R x D / 8) and each program many rows in flight, for up to
# 16 x SM partials per column; 32 bytes per row is one memory sector. A group's launch sums the
# rows of all its reads, a grid R times larger: there 32 columns per program.
PARTIALS_TILE = {"read": (1024, 8), "group": (256, 32)}
PARTIALS_WARPS = 8
SITE_PROGRAMS_PER_SM = 4  # the fewest site programs per multiprocessor (_site_programs)
# The most: None, as many as a multiprocessor holds at once (_resident_programs); a number fixes it
SITE_PROGRAMS_MAX_PER_SM = None
SITE_PARTIALS_SHARE = 8  # a read's partial sums at most 1 / this of its sources' bytes (_site_programs)
GROUP_FORWARD_PROGRAMS_PER_SM = 32  # a grouped forward's programs, all reads together (_group_forward_programs)
INTERPRETER_ROWS = 16  # under the interpreter: few, large programs (a program costs host time there)


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _assembly() -> bool:
    """Whether kernels may run NVIDIA assembly (their PTX flag): not under the interpreter or on ROCm."""
    return not _interpreted() and torch.version.hip is None


@functools.cache  # called for every read
def _tile(width: int, num_heads: int) -> dict:
    """The kernels' tile constants: each head's columns in two power-of-two tiles (kernels.py)."""
    head_width = width // num_heads
    low = 1 << (head_width.bit_length() - 1)  # the largest power of two up to head_width
    high = triton.next_power_of_2(head_width - low) if head_width > low else 1  # 1: an empty, masked tile
    return dict(D=width, H=num_heads, DH=head_width, H_PAD=triton.next_power_of_2(num_heads), DH_LO=low, DH_HI=high)


def _padded_width(tile: dict) -> int:
    """Elements per token row a program holds: the high tile counts only when it holds columns."""
    return tile["H_PAD"] * (tile["DH_LO"] + (tile["DH_HI"] if tile["DH"] > tile["DH_LO"] else 0))


@functools.cache  # per call this is host time on the critical path; sweep_launch.py clears it
def _kernel_args(kind: str, width: int, num_heads: int) -> dict:
    """The tile constants and launch shape (BLOCK_T, num_warps, and STAGES for a kernel with a
    loop) of one kernel for this width and H, and whether it may run NVIDIA assembly (PTX)."""
    tile = dict(_tile(width, num_heads), PTX=_assembly())
    rows, per_warp, *stages = LAUNCH[kind]
    if not rows:  # the rows that fit one warp (a power of two: a tile dimension)
        rows = 1 << (max(1, per_warp // _padded_width(tile)).bit_length() - 1)
    if stages:
        tile = dict(tile, STAGES=stages[0])
    if _interpreted():  # two column blocks where a GPU launch takes them, so the tests run the split tile
        split = min(2, tile["DH_LO"]) if kind in COLUMN_BLOCKS else 1
        return dict(tile, BLOCK_T=INTERPRETER_ROWS, num_warps=4, SPLIT=split)
    warps = min(max(triton.next_power_of_2(triton.cdiv(rows * _padded_width(tile), per_warp)), 1), 8)
    return dict(tile, BLOCK_T=rows, num_warps=warps, SPLIT=_split(kind, tile, warps))


def _split(kind: str, tile: dict, warps: int) -> int:
    """Column blocks per head in the low tile (kernels._row_layout). Triton gives a tile's lanes to
    its last dimension first, 16 bytes (8 bf16) each, so a head's DH_LO columns in one block span
    DH_LO / 8 lanes, and each per-head sum crosses them all. In blocks, the lanes go to more
    heads and each lane holds its head's blocks: as many blocks as leave the warps on heads (a
    head split across warps sums through shared memory). Only the site and total kernels take
    them: they run faster in blocks, the forwards slower, and the source kernels gain nothing
    (docs/decisions.md)."""
    if kind not in COLUMN_BLOCKS:
        return 1
    return max(1, min(tile["DH_LO"] * tile["H_PAD"] // (8 * 32 * warps), tile["DH_LO"] // 8))


def _total_from_out(gate, num_sources: int) -> bool:
    """Whether a read's site kernel takes S from its output (see TOTAL_FROM_OUT_MIN_SOURCES): only
    an ungated read's output is its mix."""
    return gate is None and num_sources >= TOTAL_FROM_OUT_MIN_SOURCES


def _stores_in_place(launch: dict, second: bool) -> bool:
    """Whether a site launch stores its per-head sums from the threads that hold them
    (kernels._store_sums, whose store is NVIDIA assembly: not under the interpreter or ROCm), and
    not in a one-warp launch with a second read, whose layout change needs no barrier and whose
    in-place stores are twice as many (slower there; docs/decisions.md)."""
    return _assembly() and (launch["num_warps"] > 1 or not second)


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0


def _site_programs(token_blocks: int, source_bytes: int, partial_bytes: int, device: torch.device,
                   resident: int, reads: int = 1) -> int:
    """Programs per read of the site backward, each looping over token blocks and writing
    `partial_bytes` of partial sums: enough to fill every multiprocessor with warps (memory
    latency is hidden by many loads in flight), but no more than keep a read's partials under
    1 / SITE_PARTIALS_SHARE of the bytes its sources hold (otherwise a read of few sources, as in
    delta mode, spends more time writing and summing partials than reading its sources), and
    never fewer than SITE_PROGRAMS_PER_SM per multiprocessor: with fewer, a read of few sources
    leaves its loads' latency bare. A launch for a group of `reads` shares those among its reads,
    not the byte bound: shared, its fewer programs are slower. At most `resident` per
    multiprocessor, the launch's variant's programs that one runs at once (or
    SITE_PROGRAMS_MAX_PER_SM where set): more run in waves, the last likely leaving
    multiprocessors idle, and add partials. The site kernels' register counts differ by preset and
    variant, so the cap comes from each compiled variant (figures: docs/decisions.md)."""
    multiprocessors = _multiprocessors(device)
    if not multiprocessors:
        return min(token_blocks, 2)  # the interpreter: several token blocks per program, as on a GPU
    most = SITE_PROGRAMS_MAX_PER_SM or resident
    by_bytes = source_bytes // (SITE_PARTIALS_SHARE * partial_bytes)
    return min(token_blocks, most * multiprocessors,
               max(by_bytes, triton.cdiv(SITE_PROGRAMS_PER_SM * multiprocessors, reads)))


def _fitting_programs(registers: int, warps: int, shared_bytes: int, device: torch.device) -> int:
    """Programs of `warps` warps, each thread holding `registers` registers and each program
    `shared_bytes` of shared memory, that one multiprocessor of `device` runs at once (NVIDIA's
    rules: registers go to warps in blocks of 256, and the driver keeps 1 KiB of shared memory
    per program)."""
    limits = _multiprocessor_limits(device)
    per_warp = -(-registers * 32 // 256) * 256
    fitting = [limits["registers"] // (per_warp * warps), limits["threads"] // (32 * warps), 32]
    if shared_bytes:
        fitting.append(limits["shared"] // (shared_bytes + 1024))
    return max(1, min(fitting))


@functools.cache
def _multiprocessor_limits(device: torch.device) -> dict:
    index = device.index if device.index is not None else torch.cuda.current_device()
    properties = torch.cuda.get_device_properties(index)
    registers = triton.runtime.driver.active.utils.get_device_properties(index)["max_num_regs"]
    return dict(registers=registers, threads=properties.max_threads_per_multi_processor,
                shared=properties.shared_memory_per_multiprocessor)


_RESIDENT: dict[tuple, int] = {}  # _resident_programs' counts, per kernel variant


def _specialized(arg):
    """What Triton compiles a kernel variant for, of one argument: a tensor's dtype and 16-byte
    alignment, an integer's being 1 or a multiple of 16, a float's type."""
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    if isinstance(arg, int):
        return arg == 1, arg % 16 == 0
    return type(arg)


def _resident_programs(kernel, args: tuple, constexprs: dict, device: torch.device) -> int:
    """How many programs of the variant of `kernel` that these arguments launch one multiprocessor
    of `device` runs at once, from its compiled binary: Triton's warmup compiles the variant
    without running it, so the count is known before its first launch, and every launch of it
    gets the same grid (the partials' summing order, so the gradients' bits, stays fixed).
    1 where nothing is compiled (the interpreter, or a CPU), where the count does not matter."""
    if _interpreted() or device.type != "cuda":
        return 1
    key = (kernel, device, tuple(sorted(constexprs.items())), tuple(_specialized(a) for a in args))
    if key not in _RESIDENT:
        compiled = kernel.warmup(*args, grid=(1,), **constexprs)
        compiled._init_handles()  # loads the binary, which sets its register count (n_regs)
        _RESIDENT[key] = _fitting_programs(compiled.n_regs, compiled.metadata.num_warps, compiled.metadata.shared,
                                           device)
    return _RESIDENT[key]


def _group_forward_programs(token_blocks: int, reads: int, device: torch.device) -> int:
    """Programs per read of a grouped forward, each looping over token blocks, so that a read's
    parameters are loaded, and its null source's logit computed, once per program rather than
    once per token block: with one program per block and read, that per-program work bound the
    launch (figures: docs/decisions.md)."""
    multiprocessors = _multiprocessors(device)
    if not multiprocessors:
        return min(token_blocks, 2)  # the interpreter: several token blocks per program, as on a GPU
    return min(token_blocks, triton.cdiv(GROUP_FORWARD_PROGRAMS_PER_SM * multiprocessors, reads))


def unsupported_reason(sources: Sequence[torch.Tensor], query: torch.Tensor, num_heads: int, null_source=None,
                       residual=None):
    """Why the kernels cannot run this call (a sentence), or None when they can."""
    if not sources:
        return None
    first = sources[0]
    shape, dtype, device = first.shape, first.dtype, first.device
    if not (first.is_cuda or _interpreted()):
        return f"fused routing runs on CUDA tensors (or under TRITON_INTERPRET=1), got device {device}"
    if dtype not in SOURCE_DTYPES or any(s.dtype != dtype or s.shape != shape or s.device != device for s in sources):
        return f"fused routing needs all sources of one shape, device and dtype out of {SOURCE_DTYPES}"
    if residual is not None and (residual.shape != shape or residual.device != device or residual.dtype not in SOURCE_DTYPES):
        return f"fused routing needs the residual shaped like the sources ({tuple(shape)}) on {device}"
    width = shape[-1]
    tensors = (query,) if null_source is None else (query, null_source)
    if any(t.numel() != width or t.device != device for t in tensors) or width % num_heads:
        return f"fused routing needs [{width}] routing vectors on {device} and heads dividing {width}"
    tile = _tile(width, num_heads)
    if _padded_width(tile) > MAX_TILE:
        return f"fused routing covers widths up to {MAX_TILE} (padded per head); got d={width}, H={num_heads}"
    return None


def group_unsupported_reason(sources: Sequence[torch.Tensor], reads: Sequence[Read], num_heads: int):
    """`unsupported_reason` for a group of reads (`fused_route_group`), or None when it runs."""
    kinds = {(r.null_source is not None, r.gate is not None) for r in reads}
    if len(kinds) > 1:
        return "fused routing groups reads that all have, or all lack, a null source and a gate"
    dtypes = {tuple(t.dtype for t in r if t is not None) for r in reads}
    if len(dtypes) > 1:
        return "fused routing groups reads whose parameters share their dtypes"
    for read in reads:
        reason = unsupported_reason(sources, read.query, num_heads, read.null_source)
        if reason is not None:
            return reason
    return None


def _host(addresses: Sequence[int]) -> torch.Tensor:
    """Addresses as an int64 tensor in host memory, also under a `torch.device("cuda")` context."""
    return torch.tensor(addresses, dtype=torch.int64, device="cpu")


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


def _upload(addresses: Sequence[int], device) -> torch.Tensor:
    """Tensor addresses as an int64 tensor on `device`, copied without waiting for the GPU
    (under CUDA graph capture, recorded on a side stream: `_CapturedUploads`)."""
    if device.type != "cuda":
        return _host(addresses)
    with torch.cuda.device(device):
        uploads = _captured if _capturing(device) else _staging
        if device not in uploads:  # made once: a stream, or a pinned buffer
            uploads[device] = _CapturedUploads(device) if uploads is _captured else _PinnedStaging()
        return uploads[device].upload(addresses, device)


def _address_table(addresses: tuple[int, ...], device) -> torch.Tensor:
    """`_upload`, kept by content: the caching allocator hands a training step the same source
    addresses as the step before, so in the steady state a read's table is never copied again.
    (The source kernel's reader tables change every step: they are uploaded, not kept.) A table
    made under CUDA graph capture is not kept either: its contents exist only once replayed."""
    if _capturing(device):
        return _upload(addresses, device)
    key = (device, *addresses)
    table = _tables.get(key)
    if table is None:
        table = _tables[key] = _upload(addresses, device)
        if len(_tables) > MAX_TABLES:
            _tables.popitem(last=False)
    else:
        _tables.move_to_end(key)
    return table


def _aligned(tensors) -> list[torch.Tensor]:
    """The tensors contiguous and at 16-byte-aligned addresses, as the kernels assume of every
    address in a table (they load 16 bytes at a time); only a tensor that is not gets copied."""
    return [t if t.is_contiguous() and t.data_ptr() % ALIGNMENT == 0 else t.clone(memory_format=torch.contiguous_format)
            for t in tensors]


def _addresses(tensors) -> tuple[int, ...]:
    return tuple(t.data_ptr() for t in tensors)


def _with_table(sources, rstd: Sequence[torch.Tensor] | None = None) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The sources as the kernels take them (`_aligned`), and their table: per source the
    addresses of its rows and of its rstd (`rstd`, fp32 [T] each, from `_source_rstd`). Without
    them the rows' address stands in: a forward that keeps nothing sums every rstd itself."""
    sources = _aligned(sources)
    pairs = zip(_addresses(sources), _addresses(rstd if rstd is not None else sources))
    return sources, _address_table(tuple(address for pair in pairs for address in pair), sources[0].device)


def _source_rstd(sources, marks, eps: float) -> tuple[list[torch.Tensor], int]:
    """A training read's rstd row (fp32 [T]) per source, and how many of them, from the first on,
    earlier reads computed: a source's mark keeps the one its first read computed (for that eps).
    The forward loads those and computes the others into new rows, which the marks that had none
    keep from then on (the forwards load rstd instead of summing a row: fewer instructions per
    source)."""
    mark_at = {position: mark for mark, position in marks} if KEEP_RSTD else {}
    kept = []
    for position in range(len(sources)):
        mark = mark_at.get(position)
        if mark is None or mark.rstd is None or mark.rstd_eps != eps:
            break
        kept.append(mark.rstd)
    first = sources[0]
    rows = [*kept, *_per_read(len(sources) - len(kept), (first.numel() // first.shape[-1],), first.device)]
    for position in range(len(kept), len(sources)):
        mark = mark_at.get(position)
        if mark is not None and mark.rstd is None:
            mark.rstd, mark.rstd_eps = rows[position], eps
    return rows, len(kept)


class SoftmaxState(NamedTuple):
    """A read's online softmax after its leading sources: the unnormalised mix (fp32 [T, d]) and
    the running max and sum (fp32 [2, T, H])."""

    acc: torch.Tensor
    stat: torch.Tensor


def _output_dtype(first, null_source, gate, residual=None) -> torch.dtype:
    """A read's output dtype, as route_reference gives it: the mix has the dtype of its source 0
    (the null source where there is one), promoted with the gate's and the residual's."""
    dtype = first.dtype if null_source is None else null_source.dtype
    return dtype if gate is None else gated_dtype(gate, residual, dtype)


def _forward(sources, table, query, key_norm_weight, null_source, gate, residual, num_heads, eps, store_stats,
             kept: int = 0, second=None, init: SoftmaxState | None = None):
    """One read's output and, if `store_stats`, its lse (fp32 [T, H], else None); it stores the
    rstd of its sources past the first `kept`, and loads theirs (`_source_rstd`). `second` =
    (query, key-norm weight) of a read begun over the same sources: its state comes back as a
    third value. `init`: the state this read starts from."""
    first = sources[0]
    width = first.shape[-1]
    tokens = first.numel() // width
    launch = _kernel_args("forward", width, num_heads)
    out = _empty(first.shape, dtype=_output_dtype(first, null_source, gate, residual), device=first.device)
    lse = _empty((tokens, num_heads), dtype=torch.float32, device=first.device) if store_stats else None
    state = init
    if second is not None:
        state = SoftmaxState(_empty((tokens, width), dtype=torch.float32, device=first.device),
                             _empty((2, tokens, num_heads), dtype=torch.float32, device=first.device))
    q2, g2 = second if second is not None else (query, key_norm_weight)
    stand_in = _empty((1,), dtype=torch.float32, device=first.device)  # for the pointer types
    kernels.route_fwd_kernel[(triton.cdiv(tokens, launch["BLOCK_T"]),)](
        table, table, first, query if null_source is None else null_source, query, key_norm_weight,
        query if gate is None else gate, first if residual is None else residual, out,
        lse if lse is not None else stand_in, q2, g2, *(state if state is not None else (stand_in, stand_in)),
        len(sources), kept, 1, tokens, eps,
        HAS_NULL=null_source is not None, HAS_GATE=gate is not None, STORE_STATS=store_stats,
        HAS_INIT=init is not None, HAS_SECOND=second is not None, GROUPED=False, **launch,
    )
    return out, lse, (state if second is not None else None)


class _Chain:
    """Marks linked in the order they were made. Each mark takes the one before it as an input,
    so autograd runs a mark's backward only after every later mark's: a read then needs one
    autograd input, its newest source's mark, for all of its sources to wait for it.

    A mark made after one that is not its chain's newest (a layer recomputed under activation
    checkpointing does that) starts a branch: a new chain whose `parent` is where it leaves."""

    __slots__ = ("tip", "parent")

    def __init__(self, parent: tuple[_Chain, int] | None = None):
        self.tip, self.parent = -1, parent


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
        grad = _source_grad(ctx.source.contiguous(), records, grad_in, partial, _partner(ctx, records, task))
        return grad, None, None, None


_DEPTH_NODE = DepthSource._backward_cls


def _mark(source: torch.Tensor, after: torch.Tensor | None) -> torch.Tensor:
    """A new mark of `source`, linked after the mark `after` (a new chain when there is none)."""
    node = after.grad_fn if after is not None else None
    if not isinstance(node, _DEPTH_NODE):
        chain, after = _Chain(), None
    elif node.chain.tip == node.position:
        chain = node.chain
    else:
        chain = _Chain(parent=(node.chain, node.position))
    chain.tip += 1
    return DepthSource.apply(source, after, chain, chain.tip)


def track(source: torch.Tensor, after: torch.Tensor | None = None) -> torch.Tensor:
    """`source` marked as a depth source (see DepthSource) when it needs a gradient, linked after
    `after`, the depth source made just before it; else `source` unchanged."""
    if not (torch.is_grad_enabled() and source.requires_grad) or isinstance(source.grad_fn, _DEPTH_NODE):
        return source
    return _mark(source, after)


def _on_one_chain(sources, begun: int = 0) -> tuple[tuple, list, torch.Tensor | None]:
    """The sources with every one that needs a gradient marked on one chain, (mark, position
    among the sources) of those, and the newest marked source (None when no source needs a
    gradient). Sources marked where they were made, newest last (the model's), come back as they
    are; others are marked here. The first `begun` sources are a begun read's, already on one
    chain (`ReadPrefix.marked`): sources after them are marked after them, so that the pair's
    site backward, which writes terms the second read's sources use, runs before any of theirs."""
    positions = [i for i, s in enumerate(sources) if s.requires_grad]
    if not positions:
        return sources, [], None
    marks = [sources[i].grad_fn for i in positions]
    newest = marks[-1]
    if not (isinstance(newest, _DEPTH_NODE) and all(isinstance(m, _DEPTH_NODE) and _precedes(m, newest)
                                                    for m in marks)):
        marked = list(sources[:begun])
        previous = next((s for s in reversed(marked) if s.requires_grad), None)
        for s in sources[begun:]:
            if s.requires_grad:
                s = previous = _mark(s, previous)
            marked.append(s)
        sources = tuple(marked)
        marks = [sources[i].grad_fn for i in positions]
    return sources, list(zip(marks, positions)), sources[positions[-1]]


class ReadRecord:
    """What one read's backward leaves with each source it read (with the source's position
    among the read's sources), for the source kernel. `terms`: the read's dots and P per source
    (fp32 [sources, 2, T, H]), written by its site kernel (or, for a split pair's second read,
    partly by its total kernel, the rest by the pair's site kernel)."""

    __slots__ = ("task", "dout", "lse", "total", "gq", "terms", "eps", "addresses", "_terms_at")

    def __init__(self, task: int, dout, lse, total, gq, terms, eps: float):
        self.task, self.dout, self.lse, self.total, self.gq, self.terms = task, dout, lse, total, gq, terms
        self.eps = eps
        self.addresses = _addresses((dout, lse, total, gq))  # a reader-table row starts with these
        assert not any(a % ALIGNMENT for a in (*self.addresses, terms.data_ptr())), "kernels._address assumes it"
        self._terms_at = (terms.data_ptr(), terms.stride(0) * terms.element_size())

    def terms_address(self, position: int) -> int:
        """Where this read's terms for its source at `position` start."""
        base, step = self._terms_at
        return base + position * step


def _leave(marks, record: ReadRecord) -> None:
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


# a partner's terms cost 8 bytes per element to write and read back; each read's output gradient
# read once for both sources instead of once each saves 2
PARTNER_MIN_READS = 4


def _partner(ctx, records: list[tuple[ReadRecord, int]], task: int):
    """The mark made just before this one, when its reads so far are exactly this one's and there
    are enough of them to pay: one launch then sums both sources' terms. (In full mode an
    attention output and the MLP output of the layer before it: every read of the latter but the
    attention read, which comes next, also reads the former.)"""
    node = ctx.previous
    if (node is None or len(records) < PARTNER_MIN_READS or node.partial is not None
            or node.source.shape != ctx.source.shape):
        return None
    theirs = {id(r) for r, _ in node.records if r.task == task}
    return node if theirs == {id(r) for r, _ in records} else None


def _reader_table(records: list[tuple[ReadRecord, int]], partner) -> tuple[list[int], list[torch.Tensor]]:
    """The source kernel's reader table (per read: output gradient, lse, S, g*q, and its terms for
    the source and for the partner), and the output gradients converted to one dtype that the
    table points at (reads of mixed output dtypes)."""
    theirs = {id(r): position for r, position in partner.records} if partner is not None else {}
    dtype = records[0][0].dout.dtype
    table, converted = [], []
    for r, position in records:
        addresses = r.addresses
        if r.dout.dtype != dtype:
            converted.append(r.dout.to(dtype))
            addresses = (converted[-1].data_ptr(), *addresses[1:])
        table += (*addresses, r.terms_address(position), r.terms_address(theirs[id(r)]) if partner is not None else 0)
    return table, converted


def _source_grad(source, records: list[tuple[ReadRecord, int]], grad_in, partial: Partial | None, partner):
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
    launch = _kernel_args("source" if partner is None else "source_paired", width, heads)
    grad = _empty(source.shape, dtype=source.dtype, device=source.device)
    grad_in = grad_in.contiguous() if grad_in is not None else None
    # pointer types for the table's loads, and a stand-in for pointers a launch does not use
    dout0, stat0 = (records[0][0].dout, records[0][0].lse) if records else (source, partial.acc)
    readers = _upload(addresses or [stat0.data_ptr()] * 6, source.device)  # no reads left: a row it never reads
    other = left = None
    if partner is not None:
        other = partner.source.contiguous()
        left = Partial(task, _empty((tokens, width), dtype=torch.float32, device=source.device),
                       _empty((tokens,), dtype=torch.float32, device=source.device), eps, heads)
    kernels.route_source_bwd_kernel[(triton.cdiv(tokens, launch["BLOCK_T"]),)](
        source, readers, dout0, stat0, grad_in if grad_in is not None else grad, grad,
        *((other, left.acc, left.norm) if other is not None else (source, stat0, stat0)),
        *((partial.acc, partial.norm) if partial is not None else (stat0, stat0)),
        len(records), tokens, eps,
        HAS_GRAD_IN=grad_in is not None, HAS_PARTNER=left is not None, HAS_INIT=partial is not None, **launch,
    )
    if left is not None:
        done = {id(r) for r, _ in records}
        partner.records = [(r, position) for r, position in partner.records if id(r) not in done]
        partner.partial = left
    return grad


class FusedRoute(torch.autograd.Function):
    """One read. The sources come as one tuple, not as autograd inputs: the read returns no
    gradient for them (their marks compute it from its record), and its one source input, the
    newest mark, orders every mark's backward after its own (see _Chain). A gated read's
    residual gets the output gradient as it is."""

    @staticmethod
    def forward(ctx, num_heads, eps, sources, marks, query, key_norm_weight, null_source, gate, residual, newest):
        rstd, kept = _source_rstd(sources, marks, eps)
        sources, table = _with_table(sources, rstd)
        out, lse, _ = _forward(sources, table, query, key_norm_weight, null_source, gate, residual, num_heads,
                               eps, store_stats=True, kept=kept)
        # the sources and their rstd are held, not saved: the table points at them. (Under
        # non-reentrant activation checkpointing this keeps alive a source made and read inside one
        # layer, block mode's running sum after attention, that saving would let the layer recompute.)
        ctx.num_heads, ctx.eps, ctx.sources, ctx.rstd, ctx.marks = num_heads, eps, sources, rstd, marks
        ctx.table, ctx.residual_dtype = table, residual.dtype if residual is not None else None
        # kept for S (_total_from_out). A compiled sublayer after the read saves the same tensor for
        # its norm, so this costs nothing there; eager, one activation per read (total_from_out.md in
        # benchmarks/results/sweeps)
        mix = out if _total_from_out(gate, len(sources)) else None
        ctx.save_for_backward(query, key_norm_weight, null_source, gate, lse, mix)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key_norm_weight, null_source, gate, lse, out = ctx.saved_tensors
        (grad_out,) = _aligned((grad_out,))  # the source kernel reaches it through a table
        grads, record, _ = _site_backward(ctx.sources, ctx.table, ctx.num_heads, ctx.eps, query, key_norm_weight,
                                          null_source, gate, lse, grad_out, out)
        _leave(ctx.marks, record)
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
    few = gate is None and second is None and len(sources) <= FEW_SOURCES
    launch = _kernel_args("site_few" if few else "site", width, num_heads)
    has_null, has_gate = null_source is not None, gate is not None
    params = (query, key_norm_weight, null_source) if has_null else (query, key_norm_weight)
    rows = len(params) + 2 * (second is not None)
    total = _empty((tokens, num_heads), dtype=torch.float32, device=device)
    gq = _empty((width + 1,), dtype=torch.float32, device=device)
    terms = _empty((len(sources), 2, tokens, num_heads), dtype=torch.float32, device=device)

    def arguments(partials):
        return (table, table, first, null_source if has_null else query, query, key_norm_weight,
                gate if has_gate else query, lse, grad_out, out if out is not None else grad_out, total, gq, partials,
                terms, q2, g2, *((later.lse, later.dout, later.total, later.terms) if second is not None
                                 else (lse, grad_out, total, terms)),
                num_sources, len(sources), 1, tokens, eps)

    constexprs = dict(HAS_NULL=has_null, HAS_GATE=has_gate, HAS_SECOND=second is not None, GROUPED=False,
                      TOTAL_FROM_OUT=out is not None, IN_PLACE=_stores_in_place(launch, second is not None),
                      **launch)
    programs, partials = _launch_site(arguments, constexprs, sources, rows, has_gate, total)
    record = ReadRecord(torch._C._current_graph_task_id(), grad_out, lse, total, gq, terms, eps)

    params += (q2, g2) if second is not None else ()
    grads, dgates = _sum_partials(partials, programs, width, params, [gate] if has_gate else [])
    second_grads = (grads.pop(), grads.pop())[::-1] if second is not None else None
    dnull = grads[2] if has_null else None
    return (grads[0], grads[1], dnull, dgates[0] if has_gate else None), record, second_grads


def _launch_site(arguments, constexprs: dict, sources, rows: int, gated: bool, stand_in: torch.Tensor,
                 reads: int = 1) -> tuple[int, torch.Tensor]:
    """Launch the site kernel for `reads` reads of `sources`, `arguments(partials)` its arguments
    and `rows` the parameter rows of partial sums per read: its programs per read
    (_site_programs, bounded by how many of the launch's variant one multiprocessor holds,
    counted with `stand_in`, an fp32 tensor, for the partials not yet made) and the partial sums
    they write ([reads, rows, programs, D], then with `gated` the gates' [reads, programs])."""
    first = sources[0]
    width, device = first.shape[-1], first.device
    resident = _resident_programs(kernels.route_site_bwd_kernel, arguments(stand_in), constexprs, device)
    token_blocks = triton.cdiv(first.numel() // width, constexprs["BLOCK_T"])
    programs = _site_programs(token_blocks, first.numel() * first.element_size() * len(sources), 4 * width * rows,
                              device, resident, reads)
    partials = _empty((reads * programs * (rows * width + gated),), dtype=torch.float32, device=device)
    kernels.route_site_bwd_kernel[(reads * programs,)](*arguments(partials), **constexprs)
    return programs, partials


def _sum_partials(partials, programs: int, width: int, params, gates, tile: str = "read"):
    """The gradients of `params` (one per row of the site kernel's partial sums) and of `gates`
    (one [programs] row each after those), from one route_partials_kernel launch instead of
    torch's four per read (strided sum, cast, and the gate's sum and cast); `tile` names its
    PARTIALS_TILE."""
    mixed = len({p.dtype for p in params}) > 1
    rows = len(params)
    sums = _empty((rows, width), dtype=torch.float32 if mixed else params[0].dtype, device=partials.device)
    dgate = _empty((len(gates),), dtype=gates[0].dtype, device=partials.device) if gates else sums
    block_p, block_d = PARTIALS_TILE[tile] if not _interpreted() else (32, 64)  # the interpreter: few programs
    kernels.route_partials_kernel[(rows + len(gates), triton.cdiv(width, block_d))](
        partials, sums, dgate, programs, rows, D=width, BLOCK_P=block_p, BLOCK_D=block_d, num_warps=PARTIALS_WARPS,
    )
    grads = [row.to(p.dtype) for row, p in zip(sums, params)] if mixed else list(sums.unbind(0))
    return grads, (list(dgate.split(1)) if gates else [])


def _record_totals(grad_out, out, query, key_norm_weight, num_heads, sources, table, first: int):
    """S, the g*q record and the terms of the sources from `first` on, of a split pair's second
    read, from its output (route_total_kernel); the pair's site kernel writes every source's terms
    later."""
    width = out.shape[-1]
    tokens = out.numel() // width
    launch = _kernel_args("total", width, num_heads)
    total = _empty((tokens, num_heads), dtype=torch.float32, device=out.device)
    gq = _empty((width + 1,), dtype=torch.float32, device=out.device)
    terms = _empty((len(sources), 2, tokens, num_heads), dtype=torch.float32, device=out.device)
    kernels.route_total_kernel[(triton.cdiv(tokens, launch["BLOCK_T"]),)](
        grad_out, out, query, key_norm_weight, total, gq, table, sources[0], terms, first, len(sources), tokens,
        **launch,
    )
    return total, gq, terms


class _Pair:
    """What the two reads of a split pair share: the rstd rows of the first read's sources, set by
    its forward (`_source_rstd`), the second read's sources and table, set by its forward, and its
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
        if len(sources) <= k or any(a is not b for a, b in zip(sources, self.sources)):
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
        pair.rstd, kept = _source_rstd(sources, marks, eps)
        sources, table = _with_table(sources, pair.rstd)
        out, lse, state = _forward(sources, table, query, key_norm_weight, None, None, None, num_heads, eps,
                                   store_stats=True, kept=kept, second=(next_query, next_key_norm_weight))
        ctx.num_heads, ctx.eps, ctx.sources, ctx.marks, ctx.table, ctx.pair = num_heads, eps, sources, marks, table, pair
        mix = out if _total_from_out(None, len(sources)) else None  # for S, as FusedRoute's
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
        (grad_out,) = _aligned((grad_out,))
        second = (next_query, next_key_norm_weight, later, pair.sources, pair.table) if later is not None else None
        grads, record, second_grads = _site_backward(ctx.sources, ctx.table, ctx.num_heads, ctx.eps, query,
                                                     key_norm_weight, None, None, lse, grad_out, out, second)
        _leave(ctx.marks, record)
        return None, None, None, None, None, grads[0], grads[1], *(second_grads or (None, None)), None


class FusedRouteEnd(torch.autograd.Function):
    """The second read of a split pair: folds the sources it adds into the begun state. Its
    backward leaves its record with every source it read (S from its output, which is the mix)
    and hands the same to the pair's first read, whose site kernel computes its parameters'
    gradients."""

    @staticmethod
    def forward(ctx, num_heads, eps, sources, marks, prefix, acc, query, key_norm_weight, newest):
        begun = len(prefix.sources)
        added, kept = _source_rstd(sources[begun:], [(m, p - begun) for m, p in marks if p >= begun], eps)
        rstd = [*prefix.pair.rstd, *added]
        sources, table = _with_table(sources, rstd)
        out, lse, _ = _forward(sources[begun:], table[2 * begun:], query, key_norm_weight, None, None, None,
                               num_heads, eps, store_stats=True, kept=kept, init=SoftmaxState(acc, prefix.state.stat))
        # detached: the new sources are usually made from the first read's output, so holding
        # their marks would close a reference cycle through autograd nodes, which nothing frees
        prefix.pair.sources, prefix.pair.table, prefix.pair.rstd = [s.detach() for s in sources], table, rstd
        ctx.num_heads, ctx.eps, ctx.marks, ctx.pair, ctx.begun = num_heads, eps, marks, prefix.pair, begun
        ctx.save_for_backward(query, key_norm_weight, lse, out)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key_norm_weight, lse, out = ctx.saved_tensors
        (grad_out,) = _aligned((grad_out,))
        # the terms of the sources whose source kernels may run before the pair's site kernel: those
        # the first read does not take, and the partner of the earliest (the first read's last)
        total, gq, terms = _record_totals(grad_out, out, query, key_norm_weight, ctx.num_heads, ctx.pair.sources,
                                          ctx.pair.table, max(ctx.begun - 1, 0))
        task = torch._C._current_graph_task_id()
        record = ReadRecord(task, grad_out, lse, total, gq, terms, ctx.eps)
        _leave(ctx.marks, record)
        ctx.pair.second = record
        return (None,) * 9


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


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
    prefix: ReadPrefix | None = None,
) -> torch.Tensor:
    """`route_reference` computed by the Triton kernels (same arguments, same result).

    Sources marked with `track` where they are made, each after the one made before it, get
    their gradient computed once, from all their reads; others are marked here, per call
    (correct, but one source kernel per read). `prefix` ends a read that
    `fused_route_and_start` began over the leading sources."""
    check_gated(gate, residual)
    sources = tuple(sources)
    if prefix is not None:
        prefix.check(sources, query, key_norm_weight, null_source, gate)
        prefix.ended = True
        sources = (*prefix.marked, *sources[len(prefix.sources):])
        if _needs_grad(query, key_norm_weight, prefix.state.acc, *sources):
            if prefix.pair is None:
                raise ValueError("this read was begun without autograd recording (under no_grad) and cannot end "
                                 "with it: begin and end a split read under the same grad mode")
            sources, marks, newest = _on_one_chain(sources, begun=len(prefix.sources))
            return FusedRouteEnd.apply(num_heads, eps, sources, marks, prefix, prefix.state.acc, query,
                                       key_norm_weight, newest)
        sources, table = _with_table(sources)
        begun = len(prefix.sources)
        return _forward(sources[begun:], table[2 * begun:], query, key_norm_weight, None, None, None, num_heads, eps,
                        store_stats=False, init=prefix.state)[0]
    if len(sources) + (null_source is not None) == 1:  # nothing to mix
        return route_reference(sources, query, key_norm_weight, num_heads, eps, null_source, gate, residual)
    if gate is not None and residual is None:  # gate * mix: the grouped kernels' read
        return fused_route_group(sources, [Read(query, key_norm_weight, null_source, gate)], num_heads, eps)[0]
    if residual is not None:
        residual = residual.contiguous()
    if _needs_grad(query, key_norm_weight, null_source, gate, residual, *sources):
        sources, marks, newest = _on_one_chain(sources)
        return FusedRoute.apply(num_heads, eps, sources, marks, query, key_norm_weight, null_source, gate, residual,
                                newest)
    sources, table = _with_table(sources)
    return _forward(sources, table, query, key_norm_weight, null_source, gate, residual, num_heads, eps,
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
    if _needs_grad(query, key_norm_weight, next_query, next_key_norm_weight, *sources):
        marked, marks, newest = _on_one_chain(sources)
        pair = _Pair()
        out, acc, stat = FusedRoutePair.apply(num_heads, eps, marked, marks, pair, query, key_norm_weight, next_query,
                                              next_key_norm_weight, newest)
        return out, ReadPrefix(sources, marked, next_query, next_key_norm_weight, SoftmaxState(acc, stat), pair)
    aligned, table = _with_table(sources)
    out, _, state = _forward(aligned, table, query, key_norm_weight, None, None, None, num_heads, eps,
                             store_stats=False, second=(next_query, next_key_norm_weight))
    return out, ReadPrefix(sources, sources, next_query, next_key_norm_weight, state, None)


def _read_table(reads: Sequence[Read], lasts: Sequence[torch.Tensor], device) -> torch.Tensor:
    """A group's read table (kernels.READ_FIELDS): per read its parameters (the query stands in
    for an absent null source or gate) and `lasts`, its output or output gradient."""
    addresses = []
    for read, last in zip(reads, lasts):
        addresses += _addresses((*_aligned(t if t is not None else read.query for t in read), last))
    return _address_table(tuple(addresses), device)


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


def _per_read(count: int, shape: tuple[int, ...], device) -> torch.Tensor:
    """fp32 [count, *shape], one block per read of a group, each 16-byte aligned (the source
    kernel reaches a read's blocks through its table; kernels._read_stride steps by the same)."""
    numel = math.prod(shape)
    stride = triton.cdiv(numel, 4) * 4
    return _empty((count, stride), dtype=torch.float32, device=device)[:, :numel].unflatten(1, shape)


def _forward_group(sources, table, reads: Sequence[Read], num_heads, eps, store_stats, kept: int = 0):
    """The outputs of a group of reads and, if `store_stats`, their lse ([reads, T, H], one block
    per read), else None; rstd as `_forward`'s."""
    first = sources[0]
    width = first.shape[-1]
    tokens = first.numel() // width
    head = reads[0]
    dtype = _output_dtype(first, head.null_source, head.gate)
    outs = [_empty(first.shape, dtype=dtype, device=first.device) for _ in reads]
    lse = _per_read(len(reads), (tokens, num_heads), first.device) if store_stats else None
    launch = _kernel_args("group_forward", width, num_heads)
    null, query, key_norm_weight, gate = _stand_ins(head)
    flags = _group_flags(reads)
    programs = _group_forward_programs(triton.cdiv(tokens, launch["BLOCK_T"]), len(reads), first.device)
    kernels.route_fwd_kernel[(len(reads) * programs,)](
        table, _read_table(reads, outs, first.device), first, null, query, key_norm_weight, gate, first, outs[0],
        lse if lse is not None else _empty((1,), dtype=torch.float32, device=first.device),  # for the pointer type
        query, key_norm_weight, outs[0], outs[0], len(sources), kept, len(reads), tokens, eps,
        STORE_STATS=store_stats, HAS_INIT=False, HAS_SECOND=False, **flags, **launch,
    )
    return outs, lse


def _site_backward_group(sources, table, reads: Sequence[Read], num_heads, eps, lse, grad_outs):
    """The site kernel of a group of reads, in one launch: every read's parameter gradients
    (per read query, key-norm weight, then null source and gate where it has them) and records."""
    first = sources[0]
    width, device = first.shape[-1], first.device
    tokens = first.numel() // width
    head, count = reads[0], len(reads)
    flags = _group_flags(reads)
    few = not flags["HAS_GATE"] and len(sources) <= FEW_SOURCES
    launch = _kernel_args("site_few" if few else "site", width, num_heads)
    rows = 2 + flags["HAS_NULL"]
    total = _per_read(count, (tokens, num_heads), device)
    gq = _per_read(count, (width + 1,), device)
    terms = _per_read(count, (len(sources), 2, tokens, num_heads), device)
    null, query, key_norm_weight, gate = _stand_ins(head)
    read_table = _read_table(reads, grad_outs, device)

    def arguments(partials):
        return (table, read_table, first, null, query, key_norm_weight, gate, lse, grad_outs[0], grad_outs[0], total,
                gq, partials, terms, query, key_norm_weight, lse, grad_outs[0], total, terms,
                len(sources), len(sources), count, tokens, eps)

    constexprs = dict(HAS_SECOND=False, TOTAL_FROM_OUT=False, IN_PLACE=_stores_in_place(launch, False), **flags,
                      **launch)
    programs, partials = _launch_site(arguments, constexprs, sources, rows, flags["HAS_GATE"], total, count)
    task = torch._C._current_graph_task_id()
    records = [ReadRecord(task, dout, lse[r], total[r], gq[r], terms[r], eps)
               for r, dout in enumerate(grad_outs)]
    params = [t for read in reads for t in read[:rows]]
    grads, dgates = _sum_partials(partials, programs, width, params,
                                  [read.gate for read in reads] if flags["HAS_GATE"] else [], tile="group")
    per_read = [(*grads[r * rows:(r + 1) * rows], *dgates[r:r + 1]) for r in range(count)]
    return per_read, records


class FusedRouteGroup(torch.autograd.Function):
    """Reads of the same sources (`fused_route_group`): one forward launch and one site launch
    serve them all, and each read leaves its own record with the sources, as if it ran alone.
    The parameters come flattened (`_flatten`)."""

    @staticmethod
    def forward(ctx, num_heads, eps, sources, marks, layout, newest, *params):
        rstd, kept = _source_rstd(sources, marks, eps)
        sources, table = _with_table(sources, rstd)
        outs, lse = _forward_group(sources, table, _unflatten(params, layout), num_heads, eps, store_stats=True,
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
                                              _aligned(grad_outs))
        for record in records:
            _leave(ctx.marks, record)
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
    if _needs_grad(*params, *sources):
        sources, marks, newest = _on_one_chain(sources)
        return FusedRouteGroup.apply(num_heads, eps, sources, marks, layout, newest, *params)
    sources, table = _with_table(sources)
    return tuple(_forward_group(sources, table, reads, num_heads, eps, store_stats=False)[0])
