"""Fused Triton kernels of the routing op. `route_reference` in `mhar_hf.routing` is the spec."""

from .fused import (
    fused_route,
    fused_route_and_start,
    fused_route_group,
    group_unsupported_reason,
    track,
    unsupported_reason,
)

__all__ = ["fused_route", "fused_route_and_start", "fused_route_group", "group_unsupported_reason", "track",
           "unsupported_reason"]
