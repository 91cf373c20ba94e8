"""Depth routing: the op every MHAR residual mode is built from.

`route_reference` is the specification (docs/method.md), written for clarity in plain
PyTorch. `route` is the one entry point the model calls; it picks an implementation.

This file is copied flat into the trust_remote_code bundle, so it imports nothing from
`mhar_hf` at module level: fused kernels are found at call time when the package is installed.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from typing import NamedTuple

import torch

IMPLEMENTATIONS = ("auto", "reference", "fused")
ENV_VAR = "MHAR_ROUTING"  # overrides the config's `routing_implementation`


def _with_null_source(sources, null_source):
    if null_source is None:
        return list(sources)
    return [null_source.expand_as(sources[0]), *sources] if sources else [null_source]


def _stack_for_math(sources) -> torch.Tensor:
    """Stack in fp32 (fp64 stays fp64, for gradient checks)."""
    dtype = torch.promote_types(sources[0].dtype, torch.float32)
    return torch.stack([s.to(dtype) for s in sources])


def routing_keys(
    sources: Sequence[torch.Tensor],
    key_norm_weight: torch.Tensor,
    eps: float,
    null_source: torch.Tensor | None = None,
) -> torch.Tensor:
    """The keys, `[N, ..., d]` in fp32 (fp64 for fp64 inputs): each source RMS-normalised over the
    FULL width d (not per head) and scaled by `key_norm_weight`; `null_source` is source 0."""
    values = _stack_for_math(_with_null_source(sources, null_source))
    return values * torch.rsqrt(values.pow(2).mean(-1, keepdim=True) + eps) * key_norm_weight.to(values.dtype)


def routing_weights(
    sources: Sequence[torch.Tensor],
    query: torch.Tensor,
    key_norm_weight: torch.Tensor,
    num_heads: int,
    eps: float,
    null_source: torch.Tensor | None = None,
) -> torch.Tensor:
    """The depth distribution of every head, `[N, ..., H]`, summing to 1 over N: the logit of
    head h is the plain dot product of its slice of `query` with its slice of the key."""
    keys = routing_keys(sources, key_norm_weight, eps, null_source)
    per_head = (*keys.shape[:-1], num_heads, keys.shape[-1] // num_heads)
    logits = (keys.view(per_head) * query.to(keys.dtype).view(num_heads, -1)).sum(-1)
    return logits.softmax(dim=0)


def route_reference(
    sources: Sequence[torch.Tensor],
    query: torch.Tensor,
    key_norm_weight: torch.Tensor,
    num_heads: int,
    eps: float,
    null_source: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mix the raw `sources` (each `[..., d]`) with `routing_weights`, head by head.

    `null_source` (a `[d]` vector) is prepended as source 0. Statistics, logits, softmax and
    mix run in fp32; the result has the sources' dtype. One source is returned unchanged.
    A gated (delta-mode) read passes `gate` (shape `(1,)`) and gets `gate * mix`, or with
    `residual` (a stream shaped like a source) `residual + gate * mix`, computed in fp32 and
    rounded once to the dtype torch promotes them to.
    """
    check_gated(gate, residual)
    sources = _with_null_source(sources, null_source)
    if len(sources) == 1:
        mixed = sources[0]
    else:
        weights = routing_weights(sources, query, key_norm_weight, num_heads, eps)  # [N, ..., H]
        values = _stack_for_math(sources)
        per_head = (*values.shape[:-1], num_heads, values.shape[-1] // num_heads)
        mixed = (weights.unsqueeze(-1) * values.view(per_head)).sum(0).reshape(values.shape[1:])
    if gate is None:
        return mixed.to(sources[0].dtype)
    dtype = gated_dtype(gate, residual, sources[0].dtype)
    math = torch.promote_types(dtype, torch.float32)
    gated = gate.to(math) * mixed.to(math)
    return (gated if residual is None else residual.to(math) + gated).to(dtype)


def check_gated(gate: torch.Tensor | None, residual: torch.Tensor | None) -> None:
    if residual is not None and gate is None:
        raise ValueError("`residual` is the stream a gated read adds to: pass the read's `gate` with it")
    if gate is not None and gate.numel() != 1:
        raise ValueError(f"the gate is one number (shape (1,)); got shape {tuple(gate.shape)}")


def gated_dtype(gate: torch.Tensor, residual: torch.Tensor | None, mix_dtype: torch.dtype) -> torch.dtype:
    """The dtype of `gate * mix` (plus `residual`) under torch's promotion rules."""
    dtype = torch.promote_types(gate.dtype, mix_dtype)
    return dtype if residual is None else torch.promote_types(residual.dtype, dtype)


class Read(NamedTuple):
    """One read's routing parameters, for `route_group`."""

    query: torch.Tensor
    key_norm_weight: torch.Tensor
    null_source: torch.Tensor | None = None
    gate: torch.Tensor | None = None


def resolve_implementation(requested: str) -> str:
    """The implementation to use: the environment variable wins over the config value."""
    choice = os.environ.get(ENV_VAR, requested) or "auto"
    if choice not in IMPLEMENTATIONS:
        raise ValueError(f"{ENV_VAR} / routing_implementation is {choice!r}; allowed: {', '.join(IMPLEMENTATIONS)}")
    return choice


def route(
    sources: Sequence[torch.Tensor],
    query: torch.Tensor,
    key_norm_weight: torch.Tensor,
    num_heads: int,
    eps: float,
    null_source: torch.Tensor | None = None,
    implementation: str = "auto",
    gate: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    prefix=None,
) -> torch.Tensor:
    """`route_reference`, dispatched to the fused kernels when they apply.

    `auto` uses the kernels for CUDA sources when Triton is installed; `fused` asks for them
    anywhere they run. Calls the kernels do not cover fall back, with a one-time warning.
    `prefix` (from `route_and_start`) ends the read begun there; None: the read runs whole.
    """
    if prefix is not None:  # only the fused path makes one
        return _fused_kernels(required=True).fused_route(
            sources, query, key_norm_weight, num_heads, eps, null_source, gate, residual, prefix=prefix
        )
    kernels = _kernels_for(implementation, sources[0]) if sources else None
    if kernels is not None:
        reason = kernels.unsupported_reason(sources, query, num_heads, null_source, residual)
        if reason is None:
            fused = kernels.traced_route if torch.compiler.is_compiling() else kernels.fused_route
            return fused(sources, query, key_norm_weight, num_heads, eps, null_source, gate, residual)
        _warn_once(f"{reason}; using the reference routing op for this call.")
    return route_reference(sources, query, key_norm_weight, num_heads, eps, null_source, gate, residual)


def route_and_start(
    sources: Sequence[torch.Tensor],
    query: torch.Tensor,
    key_norm_weight: torch.Tensor,
    next_query: torch.Tensor,
    next_key_norm_weight: torch.Tensor,
    num_heads: int,
    eps: float,
    implementation: str = "auto",
):
    """`route(sources, query, key_norm_weight, ...)`, and a prefix for the next read
    (`next_query`, `next_key_norm_weight`) when that read takes these sources and more:
    `route(more_sources, next_query, next_key_norm_weight, ..., prefix=prefix)` then folds in
    only the sources added. On the fused path both reads share one pass over the common sources
    in the forward and one in the site backward (full mode's attention and MLP reads); elsewhere
    (also traced by torch.compile) the prefix is None and the next read runs whole. Ungated reads only.
    """
    kernels = _kernels_for(implementation, sources[0]) if sources else None
    if kernels is not None:
        reason = kernels.unsupported_reason(sources, query, num_heads, next_query=next_query)
        if reason is None:
            if torch.compiler.is_compiling():  # a traced read is one op: no pair (ops/routing/traced.py)
                return kernels.traced_route(sources, query, key_norm_weight, num_heads, eps), None
            return kernels.fused_route_and_start(sources, query, key_norm_weight, next_query, next_key_norm_weight,
                                                 num_heads, eps)
        _warn_once(f"{reason}; using the reference routing op for this call.")
    return route_reference(sources, query, key_norm_weight, num_heads, eps), None


def route_group(
    sources: Sequence[torch.Tensor],
    reads: Sequence[Read],
    num_heads: int,
    eps: float,
    implementation: str = "auto",
) -> tuple[torch.Tensor, ...]:
    """Several reads of the same `sources`, one per `Read`: `route(sources, *read, ...)` each,
    a gated read giving `gate * mix` (its caller adds the stream). Delta mode's reads between
    two block boundaries all take the same blocks. On the fused path one launch computes every
    read, reading each source from memory once, and one launch gives their parameters'
    gradients; the reads must then agree on having a null source and a gate."""
    kernels = _kernels_for(implementation, sources[0]) if sources else None
    if kernels is not None:
        reason = kernels.group_unsupported_reason(sources, reads, num_heads)
        if reason is None:
            fused = kernels.traced_route_group if torch.compiler.is_compiling() else kernels.fused_route_group
            return fused(sources, reads, num_heads, eps)
        _warn_once(f"{reason}; using the reference routing op for this call.")
    return tuple(route_reference(sources, read.query, read.key_norm_weight, num_heads, eps, read.null_source, read.gate)
                 for read in reads)


def route_begin_group(
    sources: Sequence[torch.Tensor],
    reads: Sequence[Read],
    num_heads: int,
    eps: float,
    implementation: str = "auto",
) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """Reads that each take `sources` and then newer ones, begun together (block mode's reads of
    one block over its finished blocks, full mode's reads of a group of layers over the sources
    made before it; docs/kernels.md, two-phase reads). On the fused path one launch over the
    sources gives each ungated `Read` its state (mix, lse), and `route(sources + newer, query,
    key_norm_weight, ..., prefix=(mix, lse, len(sources)))` ends it, folding in only the newer
    sources. Elsewhere (also traced by torch.compile, or a call the kernels do not cover, which
    the reads themselves then report) None: each read runs whole."""
    kernels = _kernels_for(implementation, sources[0]) if sources and not torch.compiler.is_compiling() else None
    if kernels is None or kernels.unsupported_reason(sources, reads[0].query, num_heads) is not None:
        return None
    return kernels.fused_begin_group(sources, reads, num_heads, eps)


def launch_setting(name: str, default):
    """A knob of the fused path's `LaunchConfig` that sets how the model schedules its reads
    (`full_group_layers`, `block_two_phase`; docs/kernels.md), or `default` without the kernels."""
    kernels = _fused_kernels(required=False)
    return getattr(kernels.launch.current(), name) if kernels is not None else default


def track(source: torch.Tensor, implementation: str = "auto", after: torch.Tensor | None = None) -> torch.Tensor:
    """Mark a tensor that routing reads will use, where it is made (a depth source); `after` is
    the depth source made just before it (None for the first).

    On the fused path the kernels then compute its gradient once, from all its reads, instead
    of once per read, and a read of sources marked in a chain costs the host the same however
    many sources it reads. Marking where the tensor is made (not at its first read) also keeps
    a layer recomputed under activation checkpointing identical to its first run. Elsewhere
    (the reference path, no gradient, a graph torch.compile traces) the tensor comes back unchanged.
    """
    if not (torch.is_grad_enabled() and source.requires_grad) or torch.compiler.is_compiling():
        return source  # traced reads (torch.compile) need no marks
    kernels = _kernels_for(implementation, source)
    return kernels.track(source, after) if kernels is not None else source


def _kernels_for(implementation: str, tensor: torch.Tensor):
    """The fused kernels module when `implementation` picks it for `tensor`, else None.

    Traced by torch.compile, the kernels are custom ops in the graph (ops/routing/traced.py), no
    graph break. `auto` still leaves them out while it traces a read without autograd (compiled
    decoding, e.g. `generate` with a static cache), where the reference op is fused with the rest of
    the step; `fused` keeps them. Which is faster there is not yet timed on a GPU: the reference
    reads generate many more kernels (BENCHMARKS.md, kernels of a compiled decoding step)."""
    choice = resolve_implementation(implementation)
    if choice == "auto" and torch.compiler.is_compiling() and not torch.is_grad_enabled():
        return None
    if choice == "fused" or (choice == "auto" and tensor.is_cuda):
        return _fused_kernels(required=choice == "fused")
    return None


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=3)


_kernels_module = None  # imported once: an import statement costs every read a few microseconds


def _fused_kernels(required: bool):
    """The fused kernels module (`fused_route`, `fused_route_group`, `track`, ...), or None when not installed."""
    global _kernels_module
    if _kernels_module is not None:
        return _kernels_module
    try:
        from mhar_hf.ops import routing as kernels
    except ImportError:
        if required:
            raise ImportError(
                "routing_implementation='fused' needs the mhar_hf package with Triton installed "
                "(pip install 'mhar-hf[kernels]'); use 'auto' or 'reference' instead."
            ) from None
        return None
    _kernels_module = kernels
    return kernels
