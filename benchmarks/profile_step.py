"""Where one MHAR training step spends its GPU time, next to the plain Transformer's step.

    python benchmarks/profile_step.py --preset 100M --mode full --heads 8

Runs the harness of `bench_train.py` (same shapes, regional compile, fused AdamW) under the
PyTorch profiler and prints, for each model, the time of a step (unprofiled, then profiled), the GPU
time summed over its kernels (a gap between step and GPU time is time the GPU waited for the
host), and the kernels that take the most GPU time. The routing kernels' share says how much
a faster kernel can still win.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench_train import MICRO_BATCH, build, compile_regions, training_step


def profile_steps(model, batch: int, seq: int, steps: int, top: int, trace: Path | None = None) -> str:
    step = training_step(model, batch, seq)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    plain_ms = (time.perf_counter() - began) * 1e3 / steps
    began = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - began) * 1e3 / steps
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_ms = sum(e.self_device_time_total for e in events) / 1e3 / steps
    routing_ms = sum(e.self_device_time_total for e in events if "route_" in e.key) / 1e3 / steps
    lines = [f"step {plain_ms:.2f} ms ({wall_ms:.2f} ms profiled), GPU busy {gpu_ms:.2f} ms, "
             f"routing kernels {routing_ms:.2f} ms"]
    events.sort(key=lambda e: -e.self_device_time_total)
    for e in events[:top]:
        lines.append(f"  {e.self_device_time_total / 1e3 / steps:8.3f} ms  {e.count // steps:5d}x  {e.key[:110]}")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="100M", choices=list(MICRO_BATCH))
    parser.add_argument("--mode", default="full", choices=["full", "block", "delta"])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--trace", type=Path, help="write the MHAR model's profiler trace (Chrome JSON) here")
    args = parser.parse_args()
    batch, seq = MICRO_BATCH[args.preset]
    torch._dynamo.config.recompile_limit = 256  # one compiled graph per layer
    for label, mode, whole_layers in (("plain, compiled layers", "standard", True), (f"MHAR {args.mode}", args.mode, False)):
        model = build(args.preset, mode, args.heads, "fused")
        compile_regions(model, whole_layers=whole_layers)
        print(f"== {args.preset} {label}, H={args.heads}, {batch}x{seq}")
        trace = args.trace if mode != "standard" else None
        print(profile_steps(model, batch, seq, args.steps, args.top, trace), flush=True)
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
