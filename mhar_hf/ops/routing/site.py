"""The site backward's launch and the summing of its partial sums, shared by single and grouped
reads: the site kernel computes a read's parameter gradients as per-program partial sums and
leaves the read's record for its sources."""

from __future__ import annotations

import torch

from . import kernels, launch, outputs



def launch_site(arguments, constexprs: dict, sources, rows: int, gated: bool, stand_in: torch.Tensor,
                reads: int = 1) -> tuple[int, torch.Tensor]:
    """Launch the site kernel for `reads` reads of `sources`, `arguments(partials)` its arguments
    and `rows` the parameter rows of partial sums per read: its programs per read
    (launch.site_programs, bounded by how many of the launch's variant one multiprocessor holds,
    counted with `stand_in`, an fp32 tensor, for the partials not yet made) and the partial sums
    they write ([reads, rows, programs, D], then with `gated` the gates' [reads, programs])."""
    first = sources[0]
    width, device = first.shape[-1], first.device
    resident = launch.resident_programs(kernels.route_site_bwd_kernel, arguments(stand_in), constexprs, device)
    token_blocks = launch.cdiv(first.numel() // width, constexprs["BLOCK_T"])
    programs = launch.site_programs(token_blocks, first.numel() * first.element_size() * len(sources),
                                    4 * width * rows, device, resident, reads)
    partials = outputs.empty((reads * programs * (rows * width + gated),), dtype=torch.float32, device=device)
    kernels.route_site_bwd_kernel[(reads * programs,)](*arguments(partials), **constexprs)
    return programs, partials


def sum_partials(partials, programs: int, width: int, params, gates, tile: str = "read"):
    """The gradients of `params` (one per row of the site kernel's partial sums) and of `gates`
    (one [programs] row each after those), from one route_partials_kernel launch instead of
    torch's four per read (strided sum, cast, and the gate's sum and cast); `tile` names its
    `partials_tile` (LaunchConfig)."""
    mixed = len({p.dtype for p in params}) > 1
    rows = len(params)
    sums = outputs.empty((rows, width), dtype=torch.float32 if mixed else params[0].dtype, device=partials.device)
    dgate = outputs.empty((len(gates),), dtype=gates[0].dtype, device=partials.device) if gates else sums
    config = launch.current()
    block_p, block_d = config.partials_tile[tile] if not launch.interpreted() else (32, 64)  # the interpreter: few programs
    kernels.route_partials_kernel[(rows + len(gates), launch.cdiv(width, block_d))](
        partials, sums, dgate, programs, rows, D=width, BLOCK_P=block_p, BLOCK_D=block_d, num_warps=config.partials_warps,
    )
    grads = [row.to(p.dtype) for row, p in zip(sums, params)] if mixed else list(sums.unbind(0))
    return grads, (list(dgate.view(-1, 1).unbind(0)) if gates else [])
