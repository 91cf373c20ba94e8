"""Fused Triton kernels of the routing op. `route_reference` in `mhar_hf.routing` is the spec."""

from .fused import fused_route, track, unsupported_reason

__all__ = ["fused_route", "track", "unsupported_reason"]
