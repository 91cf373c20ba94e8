"""Fused Triton kernels of the routing op. `route_reference` in `mhar_hf.routing` is the spec;
docs/kernels.md explains the design. One reason to change per module, imported in this order:

    kernels.py        the Triton kernels
    launch.py         LaunchConfig (tuning knobs) and each kernel's launch shape and grid
    coverage.py       which calls the kernels can run
    outputs.py        allocation of every kernel output (a seam for NaN-poisoning tests)
    tables.py         device address tables of sources and reads
    depth_sources.py  marked depth sources and their one-launch gradients
    site.py           the site backward's launch and partial sums
    group.py          grouped reads of the same sources (delta mode)
    reads.py          single, split and two-phase reads
    traced.py         reads as custom ops, for graphs torch.compile traces
"""

from .coverage import group_unsupported_reason, unsupported_reason
from .depth_sources import track
from .group import fused_route_group
from .launch import LaunchConfig, launch_config
from .reads import fused_begin_group, fused_route, fused_route_and_start
from .traced import traced_route, traced_route_group

__all__ = ["LaunchConfig", "fused_begin_group", "fused_route", "fused_route_and_start", "fused_route_group",
           "group_unsupported_reason", "launch_config", "traced_route", "traced_route_group", "track",
           "unsupported_reason"]
