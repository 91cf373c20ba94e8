"""Where one MHAR training step spends its GPU time, next to the plain Transformer's step.

    python benchmarks/profile_step.py --preset 100M --mode full --heads 8

Runs the harness of `bench_train.py` (same shapes, regional compile, fused AdamW) under the
PyTorch profiler and prints, for each model, the time of a step (unprofiled, then profiled), the GPU
time summed over its kernels (a gap between step and GPU time is time the GPU waited for the
host), and the kernels that take the most GPU time. The routing kernels' share says how much
a faster kernel can still win; the last table sums both models' GPU time by kernel family
(routing, compiled, matmul, attention, ...), whose differences say where MHAR's step spends time
outside the routing kernels. `--graph` captures each step in one CUDA graph, as the
benchmark's "+graph" paths run it, so that GPU busy against the step time is the idle time left
inside the graph; without it, a step longer than its GPU time waited for the host
(`--micro-batch 4 2048`: 8k tokens a step, the size at which the two models' host time is
compared). `--host N` adds the N Python functions that take the most host time in a step
(cProfile) and counts the calls that made the host wait for the GPU. `--trace`
writes the MHAR step's Chrome trace and sums the GPU's idle gaps by the kernel that ends each
one and the backward node that launched it: what the GPU waited for; and the routing kernels'
time by launch (kernel, registers, grid, block), which tells a kernel's variants apart. Each
model's step figures and kernel families are appended to `results/profile_step.jsonl`
(`results_log.py`).
"""

from __future__ import annotations

import argparse
import bisect
import cProfile
import io
import json
import pstats
import time
import warnings
from collections import Counter
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench_train import MICRO_BATCH, build, captured_step, compile_regions, training_step
from results_log import append_result, utc_now


# Kernel families by name (case apart), first match wins: where a step's GPU time goes outside the routing kernels
FAMILIES = (("routing", ("route_",)), ("compiled (Inductor)", ("triton_",)), ("optimizer", ("multi_tensor_apply",)),
            ("matmul", ("nvjet", "gemm", "cutlass", "cublas")), ("attention", ("sdpa", "fmha", "flash")),
            ("loss", ("softmax", "nll_loss")), ("copies and fills", ("copy", "fill", "memcpy", "memset")),
            ("other eager", ("",)))


def family(name: str) -> str:
    """The family of a kernel (or the profiler's "Memcpy HtoD (Pinned -> Device)", "Memset (Device)")."""
    return next(label for label, marks in FAMILIES if any(mark in name.lower() for mark in marks))


def families_table(times: dict[str, Counter]) -> str:
    """ms per step of each kernel family, per model, and each model's difference from the first."""
    labels = list(times)
    lines = ["GPU ms per step by kernel family | " + " | ".join(labels) + " | " + " | ".join(f"{m} - {labels[0]}" for m in labels[1:])]
    for name, _ in FAMILIES:
        row = [times[m][name] for m in labels]
        lines.append(f"  {name:20s} " + " ".join(f"{v:8.3f}" for v in row)
                     + " " + " ".join(f"{v - row[0]:+8.3f}" for v in row[1:]))
    return "\n".join(lines)


def profile_steps(model, batch: int, seq: int, steps: int, top: int, trace: Path | None = None, graph: bool = False
                  ) -> tuple[str, Counter, dict]:
    """The step's summary and top kernels (text), its GPU ms per step by kernel family, and its step
    times (ms: unprofiled, profiled). With
    `graph` the step is captured in one CUDA graph, as bench_train.py's "+graph" paths run it:
    what is left between GPU busy and the step time is then idle time inside the graph."""
    step = training_step(model, batch, seq, capturable=graph)
    if graph:
        step = captured_step(step, warmup=3)
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
    families = Counter()
    for e in events:
        families[family(e.key)] += e.self_device_time_total / 1e3 / steps
    lines = [f"step {plain_ms:.2f} ms ({wall_ms:.2f} ms profiled), GPU busy {sum(families.values()):.2f} ms, "
             f"routing kernels {families['routing']:.2f} ms"]
    events.sort(key=lambda e: -e.self_device_time_total)
    for e in events[:top]:
        lines.append(f"  {e.self_device_time_total / 1e3 / steps:8.3f} ms  {e.count // steps:5d}x  {e.key[:110]}")
    return "\n".join(lines), families, dict(step_ms=round(plain_ms, 3), profiled_step_ms=round(wall_ms, 3))


def idle_gaps(trace: Path, top: int, min_us: float = 5.0) -> str:
    """The GPU's idle time in a Chrome trace, summed per (backward node or forward, kernel that
    ends the gap): a gap ends when the host launches the next kernel, so its key names the host
    work the GPU waited for."""
    events = json.loads(trace.read_text())["traceEvents"]
    work = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    launches = {e["args"].get("correlation"): e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")}
    nodes = sorted((e for e in events if e.get("cat") == "cpu_op" and e["name"].startswith("autograd::engine")),
                   key=lambda e: e["ts"])
    starts = [e["ts"] for e in nodes]

    def phase(ts: float) -> str:  # the backward node running on the host at ts, if any
        i = bisect.bisect_right(starts, ts) - 1
        while i >= 0 and nodes[i]["ts"] + nodes[i]["dur"] < ts and ts - nodes[i]["ts"] < 1e6:
            i -= 1
        inside = i >= 0 and nodes[i]["ts"] + nodes[i]["dur"] >= ts
        return nodes[i]["name"].split(": ")[-1] if inside else "forward"

    idle, count, busy_until = Counter(), Counter(), work[0]["ts"]
    for kernel in work:
        gap = kernel["ts"] - busy_until
        if gap > min_us:
            launch = launches.get(kernel["args"].get("correlation"))
            key = (phase(launch["ts"]) if launch else "?", kernel["name"][:60])
            idle[key] += gap
            count[key] += 1
        busy_until = max(busy_until, kernel["ts"] + kernel["dur"])
    span = busy_until - work[0]["ts"]
    lines = [f"GPU idle {sum(idle.values()) / 1e3:.1f} of {span / 1e3:.1f} ms traced; largest gaps by what ended them:"]
    for (where, name), us in idle.most_common(top):
        lines.append(f"  {us / 1e3:8.2f} ms {count[where, name]:5d}x  {where} | {name}")
    return "\n".join(lines)


def routing_launches(trace: Path, steps: int) -> str:
    """The routing kernels' GPU time per step in a Chrome trace, split by launch: one row per
    (kernel, registers per thread, grid, block). A kernel's variants (the flags a read launches
    it with) compile apart and hold different registers (`kernel_resources.py` names each
    variant's), so a row is one variant at one launch shape."""
    events = json.loads(trace.read_text())["traceEvents"]
    time_us, count = Counter(), Counter()
    for e in events:
        if e.get("cat") == "kernel" and e["name"].startswith("route_"):
            args = e["args"]
            key = (e["name"], args.get("registers per thread"), tuple(args.get("grid", ())),
                   tuple(args.get("block", ())))
            time_us[key] += e["dur"]
            count[key] += 1
    lines = ["routing launches per step: ms, launches, us each | kernel, registers, grid, block"]
    for key, us in time_us.most_common():
        name, registers, grid, block = key
        lines.append(f"  {us / 1e3 / steps:8.3f} ms {count[key] / steps:6.1f}x {us / count[key]:8.1f} us | "
                     f"{name}, {registers}, {list(grid)}, {list(block)}")
    return "\n".join(lines)


def host_profile(model, batch: int, seq: int, steps: int, top: int) -> str:
    """Host time per function over `steps` steps (cProfile, so every Python call costs a little
    more than unprofiled), and the steps' synchronising calls (CUDA sync debug mode)."""
    step = training_step(model, batch, seq)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    with warnings.catch_warnings(record=True) as syncs:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        profiler.enable()
        for _ in range(steps):
            step()
        profiler.disable()
        torch.cuda.set_sync_debug_mode("default")
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    sync_lines = sorted({str(w.message).splitlines()[0][:160] for w in syncs})
    return (f"host: {len(syncs)} synchronising calls in {steps} steps {sync_lines}\n"
            + out.getvalue().split("Ordered by")[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="100M", choices=list(MICRO_BATCH))
    parser.add_argument("--mode", default="full", choices=["full", "block", "delta"])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--host", type=int, default=0, help="also print the N functions with the most host time")
    parser.add_argument("--trace", type=Path, help="write the MHAR model's profiler trace (Chrome JSON) here")
    parser.add_argument("--graph", action="store_true", help="profile each step captured in a CUDA graph")
    parser.add_argument("--micro-batch", type=int, nargs=2, metavar=("BATCH", "SEQ"),
                        help="sequences and their length (default: the preset's in bench_train.py's graph protocol)")
    args = parser.parse_args()
    batch, seq = args.micro_batch or MICRO_BATCH[args.preset]
    torch._dynamo.config.recompile_limit = 256  # one compiled graph per layer
    families = {}
    began = utc_now()
    for label, mode, whole_layers in (("plain, compiled layers", "standard", True), (f"MHAR {args.mode}", args.mode, False)):
        model = build(args.preset, mode, args.heads, "fused")
        compile_regions(model, whole_layers=whole_layers)
        graphed = ", one CUDA graph" if args.graph else ""
        print(f"== {args.preset} {label}, H={args.heads}, {batch}x{seq}{graphed}")
        trace = args.trace if mode != "standard" else None
        text, families[label], step = profile_steps(model, batch, seq, args.steps, args.top, trace, args.graph)
        append_result("profile_step", dict(preset=args.preset, mode=mode, heads=args.heads, model=label,
                                           graph=args.graph, batch=batch, seq=seq, steps=args.steps),
                      dict(step, gpu_busy_ms=round(sum(families[label].values()), 3),
                           families_ms={name: round(ms, 3) for name, ms in families[label].items()}), date=began)
        print(text, flush=True)
        if trace is not None:
            print(idle_gaps(trace, args.top), flush=True)
            print(routing_launches(trace, args.steps), flush=True)
        if args.host:
            print(host_profile(model, batch, seq, args.steps, args.host), flush=True)
        del model
        torch.cuda.empty_cache()
    print(families_table(families))


if __name__ == "__main__":
    main()
