"""Training throughput of MHAR against the plain Transformer, and the routing kernels against
their byte floor, on one CUDA GPU (issue 3).

    python benchmarks/bench_train.py                       # everything, ~8 min on an H200
    python benchmarks/bench_train.py --presets 100M --paths fused

Both sides share this harness: the same preset shapes (docs/method.md), bf16 weights,
fused AdamW, SDPA attention and the same regional torch.compile (each decoder layer for the
plain model; each layer's attention and MLP sublayers around the routing op for MHAR, whose
layers take a different number of sources each). The baseline is the plain Transformer's
fastest configuration. The kernel table also gives what each variant's step would reach with its
routing kernels at their floor (`ratio_at_floor`). Appends a row per training configuration to
`results/train_throughput.jsonl` and one per variant's kernels to `results/routing_kernels.jsonl`
(`results_log.py`), and prints both tables.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import itertools
import time
from pathlib import Path

import torch
import transformers
import triton.testing
from torch.profiler import ProfilerActivity, profile

from mhar_hf import MHARConfig, MHARForCausalLM, MHARRouter
from mhar_hf.ops.routing import fused_route, fused_route_and_start, fused_route_group, track
from mhar_hf.ops.routing import launch
from mhar_hf.train.compile import compile_regions
from mhar_hf.routing import Read
from results_log import append_result, git_commit

MICRO_BATCH = {"100M": (8, 2048), "350M": (4, 1024), "1B": (2, 1024)}
VARIANTS = [  # (label, residual mode, heads)
    ("full H=1", "full", 1),
    ("full H=8", "full", 8),
    ("block", "block", 8),
    ("delta", "delta", 8),
]
PATHS = ("fused", "fused+graph", "reference", "reference+compile")
BASELINE_PATHS = ("eager", "compiled", "compiled+graph")


def build(preset: str, mode: str, heads: int, routing: str) -> MHARForCausalLM:
    config = MHARConfig.from_preset(
        preset, residual_mode=mode, residual_heads=heads, routing_implementation=routing
    )
    config._attn_implementation = "sdpa"
    with torch.device("cuda"):
        model = MHARForCausalLM(config).to(torch.bfloat16)
    return model.train()


def training_step(model, batch: int, seq: int, capturable: bool = False):
    """One optimizer step on random tokens (no KV cache: training never reads it back)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True, capturable=capturable)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), device="cuda")

    def step():
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def captured_step(step, warmup: int):
    """`step` captured in one CUDA graph, after `warmup` runs on a side stream (which compile what
    torch.compile will): a replay launches the step's kernels with no host work between them.
    The optimizer must be capturable (its step count lives on the GPU)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.reset_peak_memory_stats()  # the capture allocates the graph's memory: count it
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()  # its zero_grad leaves the next replay's backward to write the gradients afresh
    return graph.replay


def time_training(model, batch: int, seq: int, warmup: int, steps: int, graph: bool = False) -> dict:
    step = training_step(model, batch, seq, capturable=graph)
    if graph:
        step = captured_step(step, warmup)
        step()
    else:
        for _ in range(warmup):
            step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        step()
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / steps
    return dict(
        step_ms=round(seconds * 1e3, 2),
        tokens_per_s=round(batch * seq / seconds),
        peak_mem_gib=round(torch.cuda.max_memory_allocated() / 2**30, 3),
    )


def record_routing_sites(model: MHARForCausalLM) -> list[tuple[int, str]]:
    """A list that the model's next forward fills with, per routing site, the number of sources
    (null source included) it reads and how: "whole", as the first ("begin") or second ("end")
    read of a split pair (`route_and_start`), or as the first ("group") or a later ("ahead")
    read of a group (`route_group`, delta mode). One-source reads return their source and are
    left out."""
    sites = []

    def hook(router, args, kwargs):
        n = len(args[0]) + router.gated
        role = "begin" if kwargs.get("begin") is not None else "end" if kwargs.get("prefix") is not None else "whole"
        ahead = kwargs.get("ahead", ())
        if n > 1 and len(sites) < router_count:
            sites.extend([(n, "group" if ahead else role)] + [(n, "ahead")] * len(ahead))

    routers = [m for m in model.modules() if isinstance(m, MHARRouter)]
    router_count = len(routers)
    for router in routers:
        router.register_forward_pre_hook(hook, with_kwargs=True)
    return sites


def copy_bandwidth() -> float:
    """Bytes read plus written per second by a large device-to-device copy."""
    src = torch.randn(2**29, device="cuda", dtype=torch.bfloat16)  # 1 GiB
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * src.numel() * 2 / (ms / 1e3)


def step_reads(sites: list[tuple[int, str]], sources, first: tuple, second: tuple, heads: int,
               null=None, gate=None) -> list[torch.Tensor]:
    """The outputs of one training step's routing reads with the fused op, made as the model makes
    them. `sites`: (sources read, role) per read, a gated read's count including its null source;
    `first` and `second`: the (query, key-norm weight) of whole, beginning and grouped reads, and
    of ending ones; with a gate, delta mode's reads (`gate * mix`). Each source is marked once,
    chained, after the reads before its first, as the model makes it: autograd then runs each
    mark's backward before those reads', so sources pair up (DepthSource) as in a step. Marked all
    at once, no two would."""
    gated = gate is not None
    tracked, outs, prefix = [], [], None
    for i, (n, role) in enumerate(sites):
        while len(tracked) < n - gated:
            tracked.append(track(sources[len(tracked)], after=tracked[-1] if tracked else None))
        read = tracked[: n - gated]
        if role == "begin":
            out, prefix = fused_route_and_start(read, *first, *second, heads, 1e-6)
        elif role == "end":
            out = fused_route(read, *second, heads, 1e-6, prefix=prefix)
        elif role == "group":
            count = 1 + sum(1 for _ in itertools.takewhile(lambda site: site[1] == "ahead", sites[i + 1:]))
            outs.extend(fused_route_group(read, [Read(*first, null, gate)] * count, heads, 1e-6))
            continue
        elif role == "ahead":
            continue  # its group's first read made it
        else:
            out = fused_route(read, *first, heads, 1e-6, null, gate)
        outs.append(out)
    return outs


def time_routing(sites: list[tuple[int, str]], gated: bool, tokens: int, width: int, heads: int,
                 bandwidth: float) -> dict:
    """GPU time of one training step's routing reads (forward, and forward + backward) with the fused
    op, made as the model makes them (delta mode's grouped gated reads, full mode's split pairs),
    against the floor of the bytes they must move: per read, every source read once and the output
    written once in the forward, its sources and output gradient read once in the site backward
    and the output gradient once more per source it reads; a split pair reads the second read's
    sources once for both reads, and a group its sources once for all its reads, in each of the
    two passes.
    Also the wall time of forward + backward alone, which the host's launch time can bound."""
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    table_sources = max(n for n, _ in sites) - gated
    sources = [torch.randn(tokens, width, **bf16, requires_grad=True) for _ in range(table_sources)]
    query = (torch.randn(width, **bf16) / width**0.5).requires_grad_()
    norm_weight = torch.ones(width, **bf16, requires_grad=True)
    second_query = (torch.randn(width, **bf16) / width**0.5).requires_grad_()  # a pair's second read
    second_norm_weight = torch.ones(width, **bf16, requires_grad=True)
    null = torch.randn(width, **bf16, requires_grad=True) if gated else None
    gate = torch.randn(1, **bf16, requires_grad=True) if gated else None
    # one output gradient per read, as in a step (the source kernel reads every read's gradient of
    # its source: one shared by all could stay in L2)
    grads = [torch.randn(tokens, width, **bf16) for _ in sites]
    paired = any(role == "begin" for _, role in sites)
    params = [query, norm_weight] + ([null, gate] if gated else []) + (
        [second_query, second_norm_weight] if paired else [])

    def forward():
        return step_reads(sites, sources, (query, norm_weight), (second_query, second_norm_weight), heads,
                          null, gate)

    def forward_backward():
        outs = forward()
        torch.autograd.grad(outs, sources + params, grads)

    fwd_units = bwd_units = 0  # in [tokens, width] bf16 tensors
    for n, role in sites:
        sources_read = n - gated if role not in ("begin", "ahead") else 0  # a pair's or group's first reads them
        fwd_units += 1 + sources_read
        bwd_units += 1 + sources_read + (n - gated)
    unit = tokens * width * 2
    floor_fwd, floor_bwd = fwd_units * unit / bandwidth * 1e3, bwd_units * unit / bandwidth * 1e3
    kernels_ms = routing_kernel_ms(forward_backward)
    fwd_ms, fwd_bwd_ms = sum(routing_kernel_ms(forward).values()), sum(kernels_ms.values())
    return dict(
        sites=len(sites),
        fwd_ms=round(fwd_ms, 3),
        fwd_floor_ms=round(floor_fwd, 3),
        fwd_pct_of_floor=round(100 * floor_fwd / fwd_ms, 1),
        fwd_bwd_ms=round(fwd_bwd_ms, 3),
        fwd_bwd_floor_ms=round(floor_fwd + floor_bwd, 3),
        fwd_bwd_pct_of_floor=round(100 * (floor_fwd + floor_bwd) / fwd_bwd_ms, 1),
        fwd_bwd_kernels_ms={name: round(ms, 3) for name, ms in sorted(kernels_ms.items())},
        fwd_bwd_wall_ms=round(triton.testing.do_bench(forward_backward, return_mode="median"), 3),
    )


def routing_kernel_ms(fn, reps: int = 5) -> dict[str, float]:
    """GPU time of each routing kernel per call of fn (from the profiler, so host time between
    launches is not counted: the training step overlaps it with other work)."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    times = {}
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA and "route_" in e.key:
            name = e.key.split("(")[0]
            times[name] = times.get(name, 0.0) + e.self_device_time_total / 1e3 / reps
    return times


def release():
    """Free what a configuration leaves: its garbage, compiled graphs and cached blocks, and the
    cuBLAS workspaces. cuBLAS keeps one per stream it has run on (each captured step makes a
    side stream), which `empty_cache` leaves allocated: the 0.06 GiB that every configuration of
    a run used to add to what the next one found held (H100: held_gib 0.0 throughout since)."""
    gc.collect()
    torch._dynamo.reset()
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()


def held_bytes() -> int:
    """GPU memory still allocated (each configuration ends with `release()`; this collects the
    garbage of what ran since): what earlier work of the run left behind, which the next
    configuration's peak would otherwise count."""
    gc.collect()
    return torch.cuda.memory_allocated()


def own_memory(figures: dict, held: int) -> dict:
    """`figures` (time_training's) with the peak less what was held before the model was built
    (`held_gib`), so that a configuration's memory does not depend on what ran before it in the
    process (1B block, fused+graph: 1.107x plain on an H200 after the run's 100M and 350M
    configurations, 1.035x on an H100 run alone; every earlier run 1.039-1.040)."""
    return dict(figures, peak_mem_gib=round(figures["peak_mem_gib"] - held / 2**30, 3), held_gib=round(held / 2**30, 3))


def measure_baselines(preset: str, args) -> list[dict]:
    """The plain Transformer eager, with each decoder layer compiled, and compiled with the whole
    training step captured in a CUDA graph."""
    batch, seq = MICRO_BATCH[preset]
    records = []
    for path in BASELINE_PATHS:
        held = held_bytes()
        model = build(preset, "standard", 8, "reference")
        if path != "eager":
            compile_regions(model, whole_layers=True)
        record = dict(preset=preset, mode="standard", heads=None, path=path)
        figures = time_training(model, batch, seq, args.warmup, args.steps, path.endswith("graph"))
        records.append(dict(record, **own_memory(figures, held)))
        del model
        release()
        print(records[-1], flush=True)
    return records


def measure_mhar(record: dict, baseline: dict, args, bandwidth: float) -> dict | None:
    """Fill `record` (preset, mode, heads, path) with the training figures; for the fused path
    also return the routing kernel figures of the same model's reads."""
    preset, mode, heads, path = record["preset"], record["mode"], record["heads"], record["path"]
    batch, seq = MICRO_BATCH[preset]
    fused = path.startswith("fused")
    held = held_bytes()
    model = build(preset, mode, heads, "fused" if fused else "reference")
    sites = record_routing_sites(model)
    if path != "reference":
        compile_regions(model, whole_layers=path == "reference+compile")
    try:
        record.update(own_memory(time_training(model, batch, seq, args.warmup, args.steps, path.endswith("graph")), held))
        record["ratio_vs_baseline"] = round(record["tokens_per_s"] / baseline["tokens_per_s"], 3)
        record["mem_ratio_vs_baseline"] = round(record["peak_mem_gib"] / baseline["peak_mem_gib"], 3)
    except torch.OutOfMemoryError:
        record["status"] = "out of memory"
    print(record, flush=True)
    width = model.config.hidden_size
    del model
    release()
    if path != "fused":  # the kernel table: once per variant
        return None
    kernel = time_routing(sites, mode == "delta", batch * seq, width, heads, bandwidth)
    print(kernel, flush=True)
    return dict(preset=preset, mode=mode, heads=heads, tokens=batch * seq, **kernel)


def ratio_at_floor(kernel: dict, training: list[dict], baseline: dict) -> float | None:
    """The x plain the variant's fastest fused step would reach if its routing kernels ran exactly
    at their byte floor: that step's time less the kernels' forward + backward GPU time, plus the
    floor. What this formulation allows, whatever the kernels do; None if no fused step was timed."""
    steps = [r for r in training if r["path"].startswith("fused") and "tokens_per_s" in r
             and (r["preset"], r["mode"], r["heads"]) == (kernel["preset"], kernel["mode"], kernel["heads"])]
    if not steps:
        return None
    step_s = kernel["tokens"] / max(r["tokens_per_s"] for r in steps)
    at_floor_s = step_s + (kernel["fwd_bwd_floor_ms"] - kernel["fwd_bwd_ms"]) / 1e3
    return round(kernel["tokens"] / baseline["tokens_per_s"] / at_floor_s, 3)


def run(args) -> dict:
    torch._dynamo.config.recompile_limit = 256  # reference+compile: one graph per source count
    torch._dynamo.config.accumulated_recompile_limit = 4096
    began = time.monotonic()
    bandwidth = copy_bandwidth()
    report = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        gpu=torch.cuda.get_device_name(),
        commit=args.commit,
        torch=torch.__version__,
        triton=triton.__version__,
        copy_bandwidth_tb_s=round(bandwidth / 1e12, 2),
        warmup_steps=args.warmup,
        timed_steps=args.steps,
        training=[],
        kernels=[],
    )
    baselines = {}
    # the fused paths run first for every preset (the targets are about them), the references after
    for paths in (("fused", "fused+graph"), ("reference", "reference+compile")):
        for preset in args.presets:
            if preset not in baselines:
                records = measure_baselines(preset, args)
                report["training"] += records
                baselines[preset] = max(records, key=lambda r: r["tokens_per_s"])
            for label, mode, heads in (v for v in VARIANTS if v[0] in args.variants):
                for path in (p for p in paths if p in args.paths):
                    record = dict(preset=preset, mode=mode, heads=heads, label=label, path=path)
                    report["training"].append(record)
                    if time.monotonic() - began > args.budget_s:
                        record["status"] = "skipped: time budget"
                    elif path == "reference+compile" and (preset not in args.compile_reference or label != "full H=8"):
                        record["status"] = "not run: compile time (see --compile-reference)"
                    else:
                        kernel = measure_mhar(record, baselines[preset], args, bandwidth)
                        if kernel is not None:
                            report["kernels"].append(kernel)
    for kernel in report["kernels"]:
        kernel["ratio_at_floor"] = ratio_at_floor(kernel, report["training"], baselines[kernel["preset"]])
    report["launch"] = {kind: dict(rows_per_program=rows, tile_elements_per_warp=per_warp,
                                   pipeline_stages=stages[0] if stages else None)
                        for kind, (rows, per_warp, *stages) in launch.current().shapes.items()}
    report["elapsed_s"] = round(time.monotonic() - began)
    return report


def markdown(report: dict) -> str:
    lines = [
        f"Measured {report['date']} on {report['gpu']}, commit {report['commit']}, torch {report['torch']}, "
        f"triton {report['triton']}; copy bandwidth {report['copy_bandwidth_tb_s']} TB/s; "
        f"{report['timed_steps']} timed steps after {report['warmup_steps']} warm-up steps.",
        "",
        "| preset | model | path | tokens/s | x plain | peak GiB | mem x plain |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in report["training"]:
        model = r.get("label", "plain")
        if "tokens_per_s" not in r:
            lines.append(f"| {r['preset']} | {model} | {r['path']} | {r.get('status')} | | | |")
            continue
        lines.append(
            f"| {r['preset']} | {model} | {r['path']} | {r['tokens_per_s']:,} | {r.get('ratio_vs_baseline', '')} "
            f"| {r['peak_mem_gib']} | {r.get('mem_ratio_vs_baseline', '')} |"
        )
    if not report["kernels"]:  # no `fused` path ran
        return "\n".join(lines) + "\n"
    lines += [
        "",
        "Routing kernels, one training step's reads (fused op, sources marked as the model marks them): "
        "GPU time of the kernels, and the wall time of forward + backward run alone:",
        "",
        "At floor: the x plain of the variant's fastest fused step with these kernels' forward + backward time "
        "replaced by their floor (what the op's bytes allow, whatever the kernels do).",
        "",
        "| preset | mode | H | sites | fwd ms | floor ms | % of floor | fwd+bwd ms | floor ms | % of floor | wall ms "
        "| x plain at floor |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for k in report["kernels"]:
        lines.append(
            f"| {k['preset']} | {k['mode']} | {k['heads']} | {k['sites']} | {k['fwd_ms']} | {k['fwd_floor_ms']} "
            f"| {k['fwd_pct_of_floor']} | {k['fwd_bwd_ms']} | {k['fwd_bwd_floor_ms']} | {k['fwd_bwd_pct_of_floor']} "
            f"| {k['fwd_bwd_wall_ms']} | {k.get('ratio_at_floor') or ''} |"
        )
    return "\n".join(lines) + "\n"


def result_rows(report: dict) -> list[tuple[str, dict, dict]]:
    """(benchmark, config, metrics) for each measured configuration of a run's report: a training
    step (`train_throughput`; x plain against the run's fastest plain configuration) or a
    variant's routing kernels (`routing_kernels`). A configuration skipped for time or not run
    has no row; one that ran out of memory has `out_of_memory`."""
    steps = dict(warmup_steps=report["warmup_steps"], timed_steps=report["timed_steps"])
    rows = []
    for r in report["training"]:
        if "tokens_per_s" not in r and r.get("status") != "out of memory":
            continue
        batch, seq = MICRO_BATCH[r["preset"]]
        config = dict(preset=r["preset"], mode=r["mode"], heads=r["heads"], variant=r.get("label", "plain"),
                      path=r["path"], batch=batch, seq=seq, **steps)
        metrics = {key: r[key] for key in ("step_ms", "tokens_per_s", "peak_mem_gib", "held_gib",
                                           "ratio_vs_baseline", "mem_ratio_vs_baseline") if key in r}
        rows.append(("train_throughput", config, metrics if metrics else {"out_of_memory": True}))
    for k in report["kernels"]:
        config = {key: k[key] for key in ("preset", "mode", "heads", "tokens", "sites")}
        metrics = {key: value for key, value in k.items() if key not in config}
        rows.append(("routing_kernels", config, dict(metrics, copy_bandwidth_tb_s=report["copy_bandwidth_tb_s"])))
    return rows


def record(report: dict, folder: Path | None = None) -> None:
    """Append the report's rows to the results files, with the run's date, GPU, commit and versions."""
    for benchmark, config, metrics in result_rows(report):
        append_result(benchmark, config, metrics, date=report["date"], folder=folder, commit=report["commit"],
                      gpu=report["gpu"], torch=report["torch"], triton=report["triton"],
                      transformers=transformers.__version__)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", default=list(MICRO_BATCH), choices=list(MICRO_BATCH))
    parser.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS)
    parser.add_argument("--variants", nargs="+", default=[v[0] for v in VARIANTS], choices=[v[0] for v in VARIANTS])
    parser.add_argument("--compile-reference", nargs="*", default=["100M"],
                        help="presets where full H=8 also runs with the reference op compiled (one graph per "
                        "layer, since every layer reads a different number of sources: minutes to build)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--budget-s", type=float, default=480, help="start no new configuration after this long")
    parser.add_argument("--commit", help="the commit measured (default: $MHAR_COMMIT, else git's HEAD here)")
    parser.add_argument("--results", type=Path, help="the results folder (default: $MHAR_RESULTS_DIR, else "
                        "benchmarks/results)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_train.py needs a CUDA GPU")
    args.commit = args.commit or git_commit()
    report = run(args)
    record(report, args.results)
    print(markdown(report))


if __name__ == "__main__":
    main()
