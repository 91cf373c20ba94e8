"""How each kernel is launched: the tuning knobs in one frozen `LaunchConfig`, and the functions
that turn it, a width and H into a kernel's constexprs and grid (tile, warps, column blocks,
programs per multiprocessor). Every choice here was made by its GPU time; the figures are in
docs/decisions.md. Change a knob for a sweep or a test with `launch_config(...)`, never by hand.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from collections.abc import Iterator, Mapping
from types import MappingProxyType

import torch
import triton

@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """The fused path's tuning knobs. The defaults are what the kernels run with."""

    # Per kernel: token rows per program (0: as many as fit one warp's elements), padded tile
    # elements per warp, and the stages of its software-pipelined loop (kernels.py).
    # Source: rows per program share each read's g*q, which the source kernel loads for every read
    # (4 bytes per column, twice its output gradient's row), so more rows load fewer bytes per
    # element; a paired launch takes two (a little spill, still faster than one or four).
    # Site: 640 elements per warp gives the 1B width (1280) 2 warps; `site_few` (ungated, unpaired
    # reads of few sources) takes two rows per program at half the warps per row; a split pair
    # keeps `site`. Grouped forwards (delta mode) take as many rows as fit one warp.
    shapes: Mapping[str, tuple[int, ...]] = dataclasses.field(default_factory=lambda: MappingProxyType({
        "forward": (1, 2048, 3), "site": (1, 640, 3), "source": (4, 2048, 3), "source_paired": (2, 2048, 3),
        "total": (1, 512), "site_few": (2, 1280, 3), "group_forward": (0, 2048, 3)}))
    # at most this many sources take the `site_few` shape
    few_sources: int = 16
    # the launches whose low tile is in column blocks (column_blocks)
    column_block_kinds: tuple[str, ...] = ("site", "site_few", "total")
    # An ungated read of at least this many sources takes S from its output in the site kernel:
    # fewer instructions per source, for one more row loaded per token block.
    total_from_out_min_sources: int = 8
    # A training read's forward loads the rstd an earlier read computed for its leading sources
    # (kept on their marks) instead of summing every source's rstd from its rows.
    keep_rstd: bool = True
    # route_partials_kernel: partial rows per load and columns per program, for one read and for a
    # group (whose grid is R times larger); 32 bytes per row is one memory sector.
    partials_tile: Mapping[str, tuple[int, int]] = dataclasses.field(
        default_factory=lambda: MappingProxyType({"read": (1024, 8), "group": (256, 32)}))
    partials_warps: int = 8
    # site backward programs (site_programs): the fewest per multiprocessor, the most (None: as
    # many as one holds at once), and the share of a read's source bytes its partials may take
    site_programs_per_sm: int = 4
    site_programs_max_per_sm: int | None = None
    site_partials_share: int = 8
    # a grouped forward's programs per multiprocessor, all reads together (group_forward_programs)
    group_forward_programs_per_sm: int = 32
    # A source's gradient launch also sums its predecessor's terms (a partner) when both have
    # exactly the same reads and at least this many: the partner's terms cost 8 bytes per element
    # to write and read back, each read's output gradient read once for both saves 2.
    partner_min_reads: int = 4
    # under the interpreter: few, large programs (a program costs host time there)
    interpreter_rows: int = 16
    # Full mode's layers per group of two-phase reads (1: split pairs; docs/kernels.md): a group
    # passes over its older sources once for its 2G reads, against 2G - 1 pending states alive at
    # once per token ([d] in the sources' dtype and an fp32 lse each). Read at each group's first
    # layer: a layer recomputed under activation checkpointing must see the same value.
    full_group_layers: int = 1
    # Block mode's reads of one block begun together over its finished blocks, at the block's first
    # layer (two-phase reads; docs/kernels.md), or each read whole over its sources. Read there, as
    # full_group_layers is.
    block_two_phase: bool = True

    def __post_init__(self):
        if self.full_group_layers < 1:
            raise ValueError(f"full_group_layers is a number of layers, at least 1; got {self.full_group_layers}")


_current = LaunchConfig()


def current() -> LaunchConfig:
    return _current


@contextlib.contextmanager
def launch_config(config: LaunchConfig | None = None, **changes) -> Iterator[LaunchConfig]:
    """Run the fused path with `config` (default: the current one) with `changes` applied, e.g.
    `with launch_config(keep_rstd=False):`; the launch caches are cleared on entry and exit."""
    global _current
    previous = _current
    _current = dataclasses.replace(config or previous, **changes)
    _clear_caches()
    try:
        yield _current
    finally:
        _current = previous
        _clear_caches()


def _clear_caches() -> None:
    _cached_kernel_args.cache_clear()
    _resident.clear()


def cdiv(a: int, b: int) -> int:
    """`triton.cdiv` for the host: that is a constexpr function, whose every call costs microseconds."""
    return -(-a // b)


# read once, as Triton reads it once: when the kernels are decorated (kernels.py, imported first)
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def interpreted() -> bool:
    return _INTERPRETED


def assembly() -> bool:
    """Whether kernels may run NVIDIA assembly (their PTX flag): not under the interpreter or on ROCm."""
    return not interpreted() and torch.version.hip is None


@functools.cache  # called for every read
def tile(width: int, num_heads: int) -> dict:
    """The kernels' tile constants: each head's columns in two power-of-two tiles (kernels.py)."""
    head_width = width // num_heads
    low = 1 << (head_width.bit_length() - 1)  # the largest power of two up to head_width
    high = triton.next_power_of_2(head_width - low) if head_width > low else 1  # 1: an empty, masked tile
    return dict(D=width, H=num_heads, DH=head_width, H_PAD=triton.next_power_of_2(num_heads), DH_LO=low, DH_HI=high)


def padded_width(tiled: dict) -> int:
    """Elements per token row a program holds: the high tile counts only when it holds columns."""
    return tiled["H_PAD"] * (tiled["DH_LO"] + (tiled["DH_HI"] if tiled["DH"] > tiled["DH_LO"] else 0))


@functools.cache  # per call this is host time on the critical path; launch_config clears it
def kernel_args(kind: str, width: int, num_heads: int) -> dict:
    """The tile constants and launch shape (BLOCK_T, num_warps, and STAGES for a kernel with a
    loop) of one kernel for this width and H, and whether it may run NVIDIA assembly (PTX)."""
    tiled = dict(tile(width, num_heads), PTX=assembly())
    rows, per_warp, *stages = _current.shapes[kind]
    if not rows:  # the rows that fit one warp (a power of two: a tile dimension)
        rows = 1 << (max(1, per_warp // padded_width(tiled)).bit_length() - 1)
    if stages:
        tiled = dict(tiled, STAGES=stages[0])
    if interpreted():  # two column blocks where a GPU launch takes them, so the tests run the split tile
        split = min(2, tiled["DH_LO"]) if kind in _current.column_block_kinds else 1
        return dict(tiled, BLOCK_T=_current.interpreter_rows, num_warps=4, SPLIT=split)
    warps = min(max(triton.next_power_of_2(cdiv(rows * padded_width(tiled), per_warp)), 1), 8)
    return dict(tiled, BLOCK_T=rows, num_warps=warps, SPLIT=column_blocks(kind, tiled, warps))


_cached_kernel_args = kernel_args  # what launch_config clears, also while a test wraps kernel_args


def column_blocks(kind: str, tiled: dict, warps: int) -> int:
    """Column blocks per head in the low tile (kernels._row_layout). Triton gives a tile's lanes to
    its last dimension first, 16 bytes (8 bf16) each, so a head's DH_LO columns in one block span
    DH_LO / 8 lanes, and each per-head sum crosses them all. In blocks, the lanes go to more
    heads and each lane holds its head's blocks: as many blocks as leave the warps on heads (a
    head split across warps sums through shared memory). Only the site and total kernels take
    them: they run faster in blocks, the forwards slower, and the source kernels gain nothing."""
    if kind not in _current.column_block_kinds:
        return 1
    return max(1, min(tiled["DH_LO"] * tiled["H_PAD"] // (8 * 32 * warps), tiled["DH_LO"] // 8))


def total_from_out(gate, num_sources: int) -> bool:
    """Whether a read's site kernel takes S from its output (`total_from_out_min_sources`): only an
    ungated read's output is its mix."""
    return gate is None and num_sources >= _current.total_from_out_min_sources


def stores_in_place(launch: dict, second: bool) -> bool:
    """Whether a site launch stores its per-head sums from the threads that hold them
    (kernels._store_sums, whose store is NVIDIA assembly: not under the interpreter or ROCm), and
    not in a one-warp launch with a second read, whose layout change needs no barrier and whose
    in-place stores are twice as many (slower there)."""
    return assembly() and (launch["num_warps"] > 1 or not second)


@functools.cache
def multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0


def site_programs(token_blocks: int, source_bytes: int, partial_bytes: int, device: torch.device,
                  resident: int, reads: int = 1) -> int:
    """Programs per read of the site backward, each looping over token blocks and writing
    `partial_bytes` of partial sums: enough to fill every multiprocessor with warps (memory
    latency is hidden by many loads in flight), but no more than keep a read's partials under
    1 / `site_partials_share` of the bytes its sources hold (otherwise a read of few sources, as
    in delta mode, spends more time writing and summing partials than reading its sources), and
    never fewer than `site_programs_per_sm` per multiprocessor: with fewer, a read of few sources
    leaves its loads' latency bare. A launch for a group of `reads` shares those among its reads,
    not the byte bound: shared, its fewer programs are slower. At most `resident` per
    multiprocessor, the launch's variant's programs that one runs at once (or
    `site_programs_max_per_sm` where set): more run in waves, the last likely leaving
    multiprocessors idle, and add partials. The site kernels' register counts differ by preset and
    variant, so the cap comes from each compiled variant."""
    count = multiprocessors(device)
    if not count:
        return min(token_blocks, 2)  # the interpreter: several token blocks per program, as on a GPU
    most = _current.site_programs_max_per_sm or resident
    by_bytes = source_bytes // (_current.site_partials_share * partial_bytes)
    return min(token_blocks, most * count, max(by_bytes, cdiv(_current.site_programs_per_sm * count, reads)))


def fitting_programs(registers: int, warps: int, shared_bytes: int, device: torch.device) -> int:
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


_resident: dict[tuple, int] = {}  # resident_programs' counts, per kernel variant


def specialized(arg):
    """What Triton compiles a kernel variant for, of one argument: a tensor's dtype and 16-byte
    alignment, an integer's being 1 or a multiple of 16, a float's type."""
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    if isinstance(arg, int):
        return arg == 1, arg % 16 == 0
    return type(arg)


def resident_programs(kernel, args: tuple, constexprs: dict, device: torch.device) -> int:
    """How many programs of the variant of `kernel` that these arguments launch one multiprocessor
    of `device` runs at once, from its compiled binary: Triton's warmup compiles the variant
    without running it, so the count is known before its first launch, and every launch of it
    gets the same grid (the partials' summing order, so the gradients' bits, stays fixed).
    1 where nothing is compiled (the interpreter, or a CPU), where the count does not matter."""
    if interpreted() or device.type != "cuda":
        return 1
    # the constexprs in the caller's order, unsorted: another order only adds an entry
    key = (kernel, device, tuple(constexprs.items()), tuple(map(specialized, args)))
    if key not in _resident:
        compiled = kernel.warmup(*args, grid=(1,), **constexprs)
        compiled._init_handles()  # loads the binary, which sets its register count (n_regs)
        _resident[key] = fitting_programs(compiled.n_regs, compiled.metadata.num_warps, compiled.metadata.shared,
                                          device)
    return _resident[key]


def resident_counts() -> list[int]:
    """The counts `resident_programs` has made, one per kernel variant, oldest first."""
    return list(_resident.values())


def group_forward_programs(token_blocks: int, reads: int, device: torch.device) -> int:
    """Programs per read of a grouped forward, each looping over token blocks, so that a read's
    parameters are loaded, and its null source's logit computed, once per program rather than
    once per token block: with one program per block and read, that per-program work bound the
    launch."""
    count = multiprocessors(device)
    if not count:
        return min(token_blocks, 2)  # the interpreter: several token blocks per program, as on a GPU
    return min(token_blocks, cdiv(_current.group_forward_programs_per_sm * count, reads))
