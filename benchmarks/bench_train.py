"""Training throughput of MHAR against the plain Transformer, and the routing kernels against
their byte floor, on one CUDA GPU (issues 3 and 42).

    python benchmarks/bench_train.py --protocol realistic                              # ~8 min, H100
    python benchmarks/bench_train.py --protocol realistic --realistic-paths compiled-whole
    python benchmarks/bench_train.py --protocol graph                                  # ~8 min, H200
    python benchmarks/bench_train.py --list                  # the realistic configurations, no GPU

Two protocols, each comparing MHAR with the plain model side by side in one run; `both` (the
default) runs the realistic one, then the graph one: longer than one 10-minute command.

`realistic` (issue 42): a step as users train. fp32 master weights under bf16 autocast (what
accelerate's mixed precision runs for `mhar train`, FSDP2, transformers' `Trainer` and TRL), fused
AdamW, gradient clipping, `mhar train`'s chunked fp32 loss on the logits (`--loss transformers`:
`labels=`, as Trainer and TRL; `--loss fused-linear`: `mhar train --loss fused-linear`, from the
hidden states without logits), no CUDA graph, 16k tokens a micro-batch (`REALISTIC_BATCH`) at every preset and
on an 8B-shape slice (Llama-3.1-8B's published config with 8 of its 32 layers, in delta mode as
`mhar convert` writes it, with non-reentrant activation checkpointing). The plain model is
transformers' own class of the same network (Qwen3 for the Qwen3-style presets, Llama for the
slice), with MHAR's `standard` mode beside it as a check. Both sides are compiled as
`mhar train --compile` compiles them (`compile_regions`: each plain layer whole, each MHAR layer's
sublayers around its routing reads), and also run eager (a plain loop); `--realistic-paths
compiled-whole` adds `torch.compile(model)` (`Trainer(torch_compile=True)`), minutes a model.
torch.compile keeps its default limits. A routing read that falls back to the reference op is an
error: the row is flagged and the run exits non-zero.

`graph` (issue 3): the same preset shapes at micro-batches of 2-16k tokens (`MICRO_BATCH`), bf16
weights, fused AdamW, SDPA attention and the same regional torch.compile, with and without the
whole step captured in one CUDA graph, and the reference op. The baseline is the plain
Transformer's fastest configuration. The kernel table also gives what each variant's step would
reach with its routing kernels at their floor (`ratio_at_floor`).

Appends a row per training configuration to `results/train_throughput.jsonl` (realistic rows have
`config.protocol == "realistic"`) and one per variant's kernels to `results/routing_kernels.jsonl`
(`results_log.py`), and prints the tables.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import itertools
import time
import warnings
from pathlib import Path
from typing import NamedTuple

import torch
import transformers
import triton.testing
from torch.profiler import ProfilerActivity, profile

from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from mhar_hf import MHARConfig, MHARForCausalLM, MHARRouter
from mhar_hf import routing
from mhar_hf.convert import mhar_config_for
from mhar_hf.ops.routing import fused_begin_group, fused_route, fused_route_and_start, fused_route_group, track
from mhar_hf.ops.routing import launch, launch_config
from mhar_hf.train.compile import compile_regions
from mhar_hf.train.optim import causal_lm_loss, fused_loss_head, model_loss
from mhar_hf.routing import Read
from results_log import REPO, append_result, git_commit

MICRO_BATCH = {"100M": (8, 2048), "350M": (4, 1024), "1B": (2, 1024)}
VARIANTS = [  # (label, residual mode, heads)
    ("full H=1", "full", 1),
    ("full H=8", "full", 8),
    ("block", "block", 8),
    ("delta", "delta", 8),
]
FULL_GROUPED = "full H=8"  # the variant `--full-group-layers` runs once per G
# LaunchConfig knobs that change how a model schedules its reads: a row records the one its mode reads
SCHEDULE_KNOBS = {"full": "full_group_layers", "block": "block_two_phase"}
PATHS = ("fused", "fused+graph", "reference", "reference+compile")
BASELINE_PATHS = ("eager", "compiled", "compiled+graph")

# The realistic protocol (issue 42). 16k tokens a micro-batch everywhere, as users train.
SLICE = "8B-slice"
SLICE_SOURCE = REPO / "tests" / "fixtures" / "real_configs" / "Llama-3.1-8B.json"
SLICE_LAYERS = 8
# `mhar convert`'s default number of blocks. On 8 layers a block is one layer: a read takes as many blocks on
# average (4.5) as in the 32-layer model, grouped two reads a pass instead of eight (the slice errs slow)
SLICE_BLOCKS = 8
REALISTIC_BATCH = {"100M": (8, 2048), "350M": (8, 2048), "1B": (4, 4096), SLICE: (4, 4096)}
REALISTIC_VARIANTS = ("full H=8", "block", "delta")  # the slice runs delta only: what a converted 8B model is
REALISTIC_PATHS = ("compiled", "eager", "compiled-whole")
REALISTIC_DEFAULT_PATHS = ("compiled", "eager")  # compiled-whole compiles each model whole, minutes each: asked for
WHOLE_VARIANTS = ("delta",)  # compiled-whole's MHAR variants by default: a converted model under Trainer or TRL
RATIO_TARGETS = {  # x plain (the fastest plain row of the preset), compiled path
    "full H=8": {"100M": 0.88, "350M": 0.85, "1B": 0.85},
    "block": {"100M": 0.95, "350M": 0.95, "1B": 0.95},
    "delta": {"100M": 0.97, "350M": 0.97, "1B": 0.97, SLICE: 0.97},
}
MEMORY_TARGET = 1.05  # peak memory x plain, at most
# causal_lm_loss on the logits (mhar train --loss chunked), labels= (Trainer, TRL), or the fused linear loss
# (mhar train --loss fused-linear: the peak-memory comparison of issue 42 item 3 runs this against mhar-train)
LOSSES = ("mhar-train", "transformers", "fused-linear")
CLIP = 1.0  # gradient-norm clipping: mhar train's and Trainer's default
FALLBACK_WARNING = "using the reference routing op"  # what routing.route & co. warn when they fall back
PROTOCOLS = ("realistic", "graph", "both")


def schedules(label: str, mode: str, groups: list[int] | None = None,
              block_two_phase: list[bool] | None = None) -> list[dict]:
    """The read schedules a variant runs with, one run each, as the `SCHEDULE_KNOBS` value its
    mode reads: full H=8 each G of `--full-group-layers`, block each of `--block-two-phase`
    (default: the current value); {} for a mode that reads none."""
    knob = SCHEDULE_KNOBS.get(mode)
    if knob is None:
        return [{}]
    asked = {"full_group_layers": groups if label == FULL_GROUPED else None, "block_two_phase": block_two_phase}[knob]
    return [{knob: value} for value in (asked or [getattr(launch.current(), knob)])]


def schedule_of(record: dict) -> dict:
    """The record's read schedule: the SCHEDULE_KNOBS values it holds."""
    return {knob: record[knob] for knob in SCHEDULE_KNOBS.values() if record.get(knob) is not None}


def schedule_config(record: dict):
    """A context running the record's model with its read schedule (none: as it is)."""
    schedule = schedule_of(record)
    return launch_config(**schedule) if schedule else contextlib.nullcontext()


def variant_label(record: dict) -> str:
    """A row's model label, with its read schedule where it has one."""
    label, schedule = record.get("label", "plain"), schedule_of(record)
    if "full_group_layers" in schedule:
        return f"{label} G={schedule['full_group_layers']}"
    if "block_two_phase" in schedule:
        return f"{label} {'two-phase' if schedule['block_two_phase'] else 'whole reads'}"
    return label


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


class Site(NamedTuple):
    """One routing read of a training step (`record_routing_sites`)."""

    sources: int  # the sources it reads, a gated read's null source included
    role: str
    begun: int = 0  # a two-phase read: the sources its state was begun over


def record_routing_sites(model: MHARForCausalLM) -> list[Site]:
    """A list that the model's next forward fills with a `Site` per routing read, whose role says
    how it reads: "whole", as the first ("begin") or second ("end") read of a split pair
    (`route_and_start`), as the first ("group") or a later ("ahead") read of a group
    (`route_group`, delta mode), or as a two-phase read ("two-phase": block mode, and full mode in
    groups of layers), which ends its state with its newer sources, if any. One-source reads
    return their source and are left out."""
    sites = []

    def hook(router, args, kwargs):
        n = len(args[0]) + router.gated
        prefix = kwargs.get("prefix")
        role = "begin" if kwargs.get("begin") is not None else "end" if prefix is not None else "whole"
        begun = prefix[2] if isinstance(prefix, tuple) else 0  # (mix, lse, begun sources)
        ahead = kwargs.get("ahead", ())
        if n > 1 and len(sites) < router_count:
            sites.extend([Site(n, "group" if ahead else "two-phase" if begun else role, begun)]
                         + [Site(n, "ahead")] * len(ahead))

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


def starts_two_phase(sites: list[Site], i: int) -> bool:
    """Whether two-phase site i is the first of its group: the reads of a group begin over the
    same sources (a block's over its finished blocks, a group of layers' over the sources before
    it), and the next group over more."""
    return i == 0 or sites[i - 1].role != "two-phase" or sites[i - 1].begun != sites[i].begun


def step_reads(sites: list[Site], sources, first: tuple, second: tuple, heads: int,
               null=None, gate=None) -> list[torch.Tensor]:
    """The outputs of one training step's routing reads with the fused op, made as the model makes
    them. `sites`: (sources read, role) per read, a gated read's count including its null source;
    `first` and `second`: the (query, key-norm weight) of whole, beginning and grouped reads, and
    of ending ones; with a gate, delta mode's reads (`gate * mix`). Each source is marked once,
    chained, after the reads before its first, as the model makes it: autograd then runs each
    mark's backward before those reads', so sources pair up (DepthSource) as in a step. Marked all
    at once, no two would."""
    gated = gate is not None
    tracked, outs, prefix, states = [], [], None, []
    for i, (n, role, begun) in enumerate(sites):
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
        elif role == "two-phase":  # a group's first read begins every read of the group over its sources
            if starts_two_phase(sites, i):
                count = 1 + sum(1 for _ in itertools.takewhile(
                    lambda site: site.role == "two-phase" and site.begun == begun, sites[i + 1:]))
                states = fused_begin_group(read[:begun], [Read(*first)] * count, heads, 1e-6)
            out = fused_route(read, *first, heads, 1e-6, prefix=(*states.pop(0), begun))
        else:
            out = fused_route(read, *first, heads, 1e-6, null, gate)
        outs.append(out)
    return outs


def floor_units(sites: list[Site], gated: bool) -> tuple[int, int]:
    """The floor of the bytes a step's reads must move (`time_routing`), forward and backward, in
    [tokens, width] tensors of the sources' dtype: per read, every source read once and the output
    written once in the forward, its sources and output gradient read once in the site backward
    and the output gradient once more per source it reads; a split pair reads the second read's
    sources once for both reads, and a group its sources once for all its reads, in each of the
    two passes. A two-phase read (block mode, and full mode in groups of layers; docs/kernels.md)
    reads its group's begun sources once for the group in each pass; its state (in the sources'
    dtype) is written and read once, and its gradient G written once and read by the group's site
    pass and by each begun source's kernel; its newer sources are read as a read's."""
    fwd_units = bwd_units = 0
    for i, (n, role, begun) in enumerate(sites):
        if role == "two-phase":
            newer = n - begun
            shared = begun if starts_two_phase(sites, i) else 0  # the group's first reads them for all
            # state written (and read and the output written, with newer sources); backward: the
            # output gradient and newer sources in the end's site pass, G written, the output gradient
            # per newer source, G in the group's site pass and per begun source in the source kernels
            fwd_units += shared + 1 + (2 + newer if newer else 0)
            bwd_units += shared + (2 + 2 * newer if newer else 0) + 1 + begun
            continue
        sources_read = n - gated if role not in ("begin", "ahead") else 0  # a pair's or group's first reads them
        fwd_units += 1 + sources_read
        bwd_units += 1 + sources_read + (n - gated)
    return fwd_units, bwd_units


def time_routing(sites: list[Site], gated: bool, tokens: int, width: int, heads: int,
                 bandwidth: float) -> dict:
    """GPU time of one training step's routing reads (forward, and forward + backward) with the fused
    op, made as the model makes them (`step_reads`), against the floor of the bytes they must move
    (`floor_units`). Also the wall time of forward + backward alone, which the host's launch time can bound."""
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    table_sources = max(site.sources for site in sites) - gated
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
    paired = any(site.role == "begin" for site in sites)
    params = [query, norm_weight] + ([null, gate] if gated else []) + (
        [second_query, second_norm_weight] if paired else [])

    def forward():
        return step_reads(sites, sources, (query, norm_weight), (second_query, second_norm_weight), heads,
                          null, gate)

    def forward_backward():
        outs = forward()
        torch.autograd.grad(outs, sources + params, grads)

    fwd_units, bwd_units = floor_units(sites, gated)
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
    with schedule_config(record):
        return _measure_mhar(record, baseline, args, bandwidth)


def _measure_mhar(record: dict, baseline: dict, args, bandwidth: float) -> dict | None:
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
    return dict(preset=preset, mode=mode, heads=heads, tokens=batch * seq, **kernel, **schedule_of(record))


def ratio_at_floor(kernel: dict, training: list[dict], baseline: dict) -> float | None:
    """The x plain the variant's fastest fused step would reach if its routing kernels ran exactly
    at their byte floor: that step's time less the kernels' forward + backward GPU time, plus the
    floor. What this formulation allows, whatever the kernels do; None if no fused step was timed."""
    keys = ("preset", "mode", "heads", *SCHEDULE_KNOBS.values())
    steps = [r for r in training if r["path"].startswith("fused") and "tokens_per_s" in r
             and all(r.get(key) == kernel.get(key) for key in keys)]
    if not steps:
        return None
    step_s = kernel["tokens"] / max(r["tokens_per_s"] for r in steps)
    at_floor_s = step_s + (kernel["fwd_bwd_floor_ms"] - kernel["fwd_bwd_ms"]) / 1e3
    return round(kernel["tokens"] / baseline["tokens_per_s"] / at_floor_s, 3)


# ----------------------------------------------------------------------------------------------
# The realistic protocol

def slice_source_config() -> LlamaConfig:
    """Llama-3.1-8B's published config with 8 of its 32 layers: the plain side of the 8B slice."""
    config = LlamaConfig.from_json_file(SLICE_SOURCE)
    config.num_hidden_layers = SLICE_LAYERS
    return config


def plain_config_for(config: MHARConfig):
    """The config of transformers' own class for an MHAR config's backbone (the same network as
    its `standard` mode): Qwen3's where queries and keys are normed per head (the presets), else
    Llama's."""
    if config.qkv_bias:
        raise ValueError("q/k/v biases (Qwen2) have no plain class here")
    fields = {key: getattr(config, key) for key in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "hidden_act", "max_position_embeddings", "initializer_range", "rms_norm_eps",
        "tie_word_embeddings", "rope_parameters", "attention_bias", "attention_dropout", "bos_token_id",
        "eos_token_id", "pad_token_id")}
    fields["head_dim"] = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if config.qk_norm:
        return Qwen3Config(**fields, use_sliding_window=False)
    return LlamaConfig(**fields, mlp_bias=config.mlp_bias)


def case_config(case: dict):
    """The model config of a realistic case: the plain class's, or MHAR's (routing forced onto the
    fused kernels, which `auto` picks on a GPU anyway). The slice's MHAR config is the one
    `mhar convert --heads 8 --num-blocks 8` writes for the sliced Llama config."""
    preset, mode, heads = case["preset"], case["mode"], case["heads"] or 8
    if preset == SLICE:
        source = slice_source_config()
        if case["label"] == "plain":
            return source
        config, _ = mhar_config_for(source, heads=heads, num_blocks=SLICE_BLOCKS)
        config.residual_mode = mode  # delta, or standard for the check row
    else:
        config = MHARConfig.from_preset(preset, residual_mode=mode, residual_heads=heads)
        if case["label"] == "plain":
            return plain_config_for(config)
    config.routing_implementation = "fused"
    return config


def realistic_cases(presets: list[str], variants: list[str], paths: list[str],
                    whole_variants: list[str] = WHOLE_VARIANTS, checkpointed: list[str] = (SLICE,),
                    loss: str = LOSSES[0], full_group_layers: list[int] | None = None,
                    block_two_phase: list[bool] | None = None) -> list[dict]:
    """The realistic protocol's configurations, in the order they run: first each preset's compiled
    rows (what the targets are about: the plain class, MHAR `standard` as a check of it, each
    variant), then the eager rows, then `torch.compile(model)` on the whole model (the plain class
    and `whole_variants` of `variants`). The slice runs delta only; the `checkpointed` presets
    with activation checkpointing; full H=8 once per G of `full_group_layers`, block once per value of
    `block_two_phase` (`schedules`)."""
    cases = []
    for path in (p for p in REALISTIC_PATHS if p in paths):
        if path == "compiled-whole":
            variants = [v for v in variants if v in whole_variants]
        for preset in presets:
            batch, seq = REALISTIC_BATCH[preset]
            base = dict(protocol="realistic", preset=preset, path=path, batch=batch, seq=seq,
                        checkpointing=preset in checkpointed, loss=loss)
            cases.append(dict(base, label="plain", mode="standard", heads=None))
            if path == "compiled":
                cases.append(dict(base, label="MHAR standard", mode="standard", heads=None))
            cases += [dict(base, label=label, mode=mode, heads=heads, **schedule)
                      for label, mode, heads in VARIANTS if label in variants and (preset != SLICE or mode == "delta")
                      for schedule in schedules(label, mode, full_group_layers, block_two_phase)]
    return cases


def build_realistic(case: dict, device: torch.device, backend: str):
    """The case's model in fp32 on `device`, training, checkpointed and compiled as the case says:
    `compiled` as `mhar train --compile` does (`compile_regions`; MHAR `standard`, standing for the
    plain model, with each layer whole), `compiled-whole` as `Trainer(torch_compile=True)` does."""
    config = case_config(case)
    config._attn_implementation = "sdpa"
    config.use_cache = False
    cls = (MHARForCausalLM if isinstance(config, MHARConfig) else Qwen3ForCausalLM if isinstance(config, Qwen3Config)
           else LlamaForCausalLM)
    with torch.device(device):
        model = cls(config).float().train()
    if case["checkpointing"]:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if case["path"] == "compiled":
        compile_regions(model, whole_layers=True if case["mode"] == "standard" else None, backend=backend)
    elif case["path"] == "compiled-whole":
        model = torch.compile(model, backend=backend)
    return model


def realistic_step(model, batch: int, seq: int, device: torch.device, loss: str = LOSSES[0]):
    """One optimizer step as accelerate runs it with bf16 mixed precision: the forward under
    autocast over the fp32 weights; the loss as `mhar train` takes it (`causal_lm_loss`: fp32 a
    chunk of positions at a time, after the forward) or, with `loss="transformers"`, as Trainer and
    TRL do (`labels=`: inside the forward, on the logits made fp32 whole), or with
    `loss="fused-linear"` in the output layer's forward under autocast (`model_loss`, no logits);
    the backward, gradient clipping and fused AdamW outside autocast."""
    parameters = list(model.parameters())
    optimizer = torch.optim.AdamW(parameters, lr=1e-4, fused=True)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), device=device)
    labels = ids if loss == "transformers" else None
    head = fused_loss_head(model)[0] if loss == "fused-linear" else None
    if loss == "fused-linear" and head is None:
        raise ValueError(f"--loss fused-linear does not cover {type(model).__name__}: {fused_loss_head(model)[1]}")

    def step():
        out = None
        with torch.autocast(device.type, dtype=torch.bfloat16):
            if head is not None:
                cross_entropy, z_loss = model_loss(model, ids, head)
            else:
                out = model(input_ids=ids, labels=labels, use_cache=False)
        if labels is None:
            if head is None:
                cross_entropy, z_loss = causal_lm_loss(out.logits, ids)
            (cross_entropy + 0.0 * z_loss).backward()  # mhar train's default z-loss weight
        else:
            out.loss.backward()
        del out
        torch.nn.utils.clip_grad_norm_(parameters, CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def time_steps(step, tokens: int, warmup: int, steps: int, device: torch.device) -> dict:
    """Wall time of `steps` steps after `warmup` (at least 1: the first compiles, and its time is
    `first_step_s`); the peak memory allocated over the timed steps (None off CUDA)."""
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    began = time.perf_counter()
    step()
    sync()
    first = time.perf_counter() - began
    for _ in range(warmup - 1):
        step()
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    began = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    seconds = (time.perf_counter() - began) / steps
    return dict(step_ms=round(seconds * 1e3, 2), tokens_per_s=round(tokens / seconds),
                peak_mem_gib=round(torch.cuda.max_memory_allocated() / 2**30, 3) if cuda else None,
                first_step_s=round(first, 1))


@contextlib.contextmanager
def fused_reads_only():
    """Every routing read must run on the fused kernels: the dispatch's fallback warning becomes
    an error (its once-only memory cleared, so that a fallback seen before still raises)."""
    routing._warned.clear()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=f".*{FALLBACK_WARNING}", category=UserWarning)
        yield


def fell_back(error: BaseException) -> str | None:
    """The fallback warning's text if `error` is it or was raised from it (torch.compile may wrap
    it), else None."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if FALLBACK_WARNING in str(error):
            return str(error)
        error = error.__cause__ or error.__context__
    return None


def measure_realistic(case: dict, args, device: torch.device) -> dict:
    """Time one realistic case: its record, with the figures, `status` "out of memory" or
    "fell back to the reference op" (and the warning in `fallback`)."""
    with schedule_config(case):
        return _measure_realistic(case, args, device)


def _measure_realistic(case: dict, args, device: torch.device) -> dict:
    record = dict(case)
    cuda = device.type == "cuda"
    held = held_bytes() if cuda else 0
    backend = args.compile_backend
    model = build_realistic(case, device, backend)
    record["model"] = type(getattr(model, "_orig_mod", model)).__name__
    record["compile_backend"] = None if case["path"] == "eager" else backend
    counters = torch._dynamo.utils.counters
    counters.clear()
    step = realistic_step(model, case["batch"], case["seq"], device, case["loss"])
    try:
        with fused_reads_only():
            figures = time_steps(step, case["batch"] * case["seq"], args.warmup, args.steps, device)
        record.update(own_memory(figures, held) if cuda else figures)
        record["dynamo_graphs"] = counters["stats"]["unique_graphs"]
        record["graph_breaks"] = sum(counters["graph_break"].values())
    except torch.OutOfMemoryError:
        record["status"] = "out of memory"
    except Exception as error:
        reason = fell_back(error)
        if reason is None:
            raise
        record["status"], record["fallback"] = "fell back to the reference op", reason
    print(record, flush=True)
    del model, step
    if cuda:
        release()
    else:
        gc.collect()
        torch._dynamo.reset()
    return record


def check_fallbacks(records: list[dict]) -> None:
    """Exit with an error naming every realistic configuration whose routing reads fell back to
    the reference op (its rows are written first)."""
    failed = [r for r in records if "fallback" in r]
    if failed:
        raise SystemExit("routing reads fell back to the reference op in "
                         + "; ".join(f"{r['preset']} {r['label']} {r['path']}: {r['fallback']}" for r in failed))


def compare_realistic(records: list[dict]) -> None:
    """Per preset, each timed row against the fastest plain row (the plain class or MHAR
    `standard`, any path): `ratio_vs_baseline` (tokens/s) and `mem_ratio_vs_baseline` (peak); and
    against the plain class at the same path (`ratio_same_path`, `mem_ratio_same_path`)."""
    timed = [r for r in records if "tokens_per_s" in r]
    for preset in dict.fromkeys(r["preset"] for r in timed):
        rows = [r for r in timed if r["preset"] == preset]
        plain = [r for r in rows if r["mode"] == "standard"]
        if not plain:
            continue
        baseline = max(plain, key=lambda r: r["tokens_per_s"])
        same_path = {r["path"]: r for r in plain if r["label"] == "plain"}
        for r in rows:
            for suffix, other in (("vs_baseline", baseline), ("same_path", same_path.get(r["path"]))):
                if other is None or other is r:
                    continue
                r[f"ratio_{suffix}"] = round(r["tokens_per_s"] / other["tokens_per_s"], 3)
                if r.get("peak_mem_gib") is not None and other.get("peak_mem_gib"):
                    r[f"mem_ratio_{suffix}"] = round(r["peak_mem_gib"] / other["peak_mem_gib"], 3)


def meets_target(r: dict) -> bool | None:
    """Whether a realistic row meets its issue-42 target (speed and memory x plain); None if it
    has none (only the compiled MHAR variants do)."""
    target = RATIO_TARGETS.get(r.get("label"), {}).get(r["preset"])
    if target is None or r["path"] != "compiled":
        return None
    if "ratio_vs_baseline" not in r:
        return False
    return r["ratio_vs_baseline"] >= target and r.get("mem_ratio_vs_baseline", 0) <= MEMORY_TARGET


def run_realistic(args, device: torch.device) -> list[dict]:
    """The realistic protocol's records (`realistic_cases` of the presets and variants asked for),
    compared with `compare_realistic`. torch.compile keeps its default recompile limits here, as
    in a user's run. No new configuration starts after `args.budget_s`."""
    began = time.monotonic()
    presets = [p for p in (args.presets or REALISTIC_BATCH) if p in REALISTIC_BATCH]
    variants = args.variants or list(REALISTIC_VARIANTS)
    records = []
    for case in realistic_cases(presets, variants, args.realistic_paths, args.whole_variants, args.checkpointing,
                                args.loss, args.full_group_layers, args.block_two_phase):
        if time.monotonic() - began > args.budget_s:
            records.append(dict(case, status="skipped: time budget"))
            continue
        records.append(measure_realistic(case, args, device))
    compare_realistic(records)
    return records


# ----------------------------------------------------------------------------------------------
# Both protocols

def run_graph(args, report: dict) -> None:
    """The graph protocol: its records into `report["training"]`, the kernel table into
    `report["kernels"]`. No new configuration starts after `args.budget_s`."""
    began = time.monotonic()
    bandwidth = copy_bandwidth()
    report["copy_bandwidth_tb_s"] = round(bandwidth / 1e12, 2)
    presets = [p for p in (args.presets or MICRO_BATCH) if p in MICRO_BATCH]
    variants = args.variants or [v[0] for v in VARIANTS]
    baselines = {}
    # the fused paths run first for every preset (the targets are about them), the references after
    for paths in (("fused", "fused+graph"), ("reference", "reference+compile")):
        for preset in presets:
            if preset not in baselines:
                records = measure_baselines(preset, args)
                report["training"] += records
                baselines[preset] = max(records, key=lambda r: r["tokens_per_s"])
            for label, mode, heads in (v for v in VARIANTS if v[0] in variants):
                for schedule, path in itertools.product(
                        schedules(label, mode, args.full_group_layers, args.block_two_phase),
                        [p for p in paths if p in args.paths]):
                    record = dict(preset=preset, mode=mode, heads=heads, label=label, path=path, **schedule)
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


def run(args) -> dict:
    """The protocols `args.protocol` names, realistic first, into one report."""
    began = time.monotonic()
    report = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        gpu=torch.cuda.get_device_name(),
        commit=args.commit,
        torch=torch.__version__,
        triton=triton.__version__,
        copy_bandwidth_tb_s=None,
        warmup_steps=args.warmup,
        timed_steps=args.steps,
        training=[],
        kernels=[],
        realistic=[],
    )
    if args.protocol in ("realistic", "both"):
        report["realistic"] = run_realistic(args, torch.device("cuda"))
    if args.protocol in ("graph", "both"):
        # reference+compile: one graph per source count
        with torch._dynamo.config.patch(recompile_limit=256, accumulated_recompile_limit=4096):
            run_graph(args, report)
    report["elapsed_s"] = round(time.monotonic() - began)
    return report


def realistic_markdown(records: list[dict]) -> list[str]:
    """The realistic protocol's table: a row per configuration, the target where it has one."""
    lines = [
        "Realistic protocol (as users train): fp32 weights under bf16 autocast, fused AdamW, no CUDA graph. "
        "x plain: against the fastest plain row of the preset; same path: against the plain class on the "
        f"row's path. Targets: compiled MHAR, x plain at least the figure and peak memory at most {MEMORY_TARGET}x.",
        "",
        "| preset | batch | model | path | tokens/s | x plain | x plain, same path | peak GiB | mem x plain "
        "| first step s | target |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        head = f"| {r['preset']} | {r['batch']}x{r['seq']} | {variant_label(r)} | {r['path']} |"
        if "tokens_per_s" not in r:
            lines.append(f"{head} {r.get('status')} | | | | | | |")
            continue
        met = meets_target(r)
        target = "" if met is None else f"{RATIO_TARGETS[r['label']][r['preset']]}: {'met' if met else 'missed'}"
        lines.append(
            f"{head} {r['tokens_per_s']:,} | {r.get('ratio_vs_baseline', '')} | {r.get('ratio_same_path', '')} "
            f"| {r['peak_mem_gib'] or ''} | {r.get('mem_ratio_vs_baseline', '')} | {r['first_step_s']} | {target} |"
        )
    return lines


def markdown(report: dict) -> str:
    bandwidth = report.get("copy_bandwidth_tb_s")
    lines = [
        f"Measured {report['date']} on {report['gpu']}, commit {report['commit']}, torch {report['torch']}, "
        f"triton {report['triton']}; " + (f"copy bandwidth {bandwidth} TB/s; " if bandwidth else "")
        + f"{report['timed_steps']} timed steps after {report['warmup_steps']} warm-up steps.",
        "",
    ]
    if report.get("realistic"):
        lines += realistic_markdown(report["realistic"])
    if not report["training"]:  # the graph protocol did not run
        return "\n".join(lines) + "\n"
    if report.get("realistic"):
        lines += ["", "Graph protocol (issue 3): bf16 weights, the whole step in one CUDA graph on the +graph paths.", ""]
    lines += [
        "| preset | model | path | tokens/s | x plain | peak GiB | mem x plain |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in report["training"]:
        model = variant_label(r)
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
            f"| {k['preset']} | {variant_label(dict(k, label=k['mode']))} | {k['heads']} | {k['sites']} "
            f"| {k['fwd_ms']} | {k['fwd_floor_ms']} "
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
                      path=r["path"], batch=batch, seq=seq, **steps, **schedule_of(r))
        metrics = {key: r[key] for key in ("step_ms", "tokens_per_s", "peak_mem_gib", "held_gib",
                                           "ratio_vs_baseline", "mem_ratio_vs_baseline") if key in r}
        rows.append(("train_throughput", config, metrics if metrics else {"out_of_memory": True}))
    rows += [("train_throughput", *realistic_row(r, steps)) for r in report.get("realistic", ())
             if "tokens_per_s" in r or r.get("status") in ("out of memory", "fell back to the reference op")]
    for k in report["kernels"]:
        config = {key: k[key] for key in ("preset", "mode", "heads", "tokens", "sites", *SCHEDULE_KNOBS.values())
                  if key in k}
        metrics = {key: value for key, value in k.items() if key not in config}
        rows.append(("routing_kernels", config, dict(metrics, copy_bandwidth_tb_s=report["copy_bandwidth_tb_s"])))
    return rows


def realistic_row(r: dict, steps: dict) -> tuple[dict, dict]:
    """(config, metrics) of a realistic record; one that ran out of memory has `out_of_memory`,
    one whose reads fell back to the reference op `fell_back_to_reference`."""
    config = dict(protocol="realistic", preset=r["preset"], mode=r["mode"], heads=r["heads"], variant=r["label"],
                  model=r["model"], path=r["path"], batch=r["batch"], seq=r["seq"], weights="float32",
                  autocast="bfloat16", loss=r["loss"], checkpointing=r["checkpointing"],
                  compile_backend=r["compile_backend"],
                  **steps)
    config = dict(config, **schedule_of(r))
    if "tokens_per_s" not in r:
        return config, {"out_of_memory" if r["status"] == "out of memory" else "fell_back_to_reference": True}
    metrics = {key: r[key] for key in ("step_ms", "tokens_per_s", "peak_mem_gib", "held_gib", "first_step_s",
                                       "ratio_vs_baseline", "mem_ratio_vs_baseline", "ratio_same_path",
                                       "mem_ratio_same_path", "dynamo_graphs", "graph_breaks") if key in r}
    met = meets_target(r)
    return config, metrics if met is None else dict(metrics, meets_target=met)


def record(report: dict, folder: Path | None = None) -> None:
    """Append the report's rows to the results files, with the run's date, GPU, commit and versions."""
    for benchmark, config, metrics in result_rows(report):
        append_result(benchmark, config, metrics, date=report["date"], folder=folder, commit=report["commit"],
                      gpu=report["gpu"], torch=report["torch"], triton=report["triton"],
                      transformers=transformers.__version__)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--protocol", choices=PROTOCOLS, default="both",
                        help="realistic (as users train), graph (issue 3's harness) or both, realistic first "
                        "(default; about 16 min: on a 10-minute machine run them as two commands)")
    parser.add_argument("--presets", nargs="+", choices=list(REALISTIC_BATCH),
                        help=f"default: every preset ({SLICE}: realistic protocol only)")
    parser.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS, help="graph protocol's paths")
    parser.add_argument("--realistic-paths", nargs="+", default=list(REALISTIC_DEFAULT_PATHS), choices=REALISTIC_PATHS,
                        help="realistic protocol's paths: compiled (as `mhar train --compile`; the targets), eager "
                        "(a plain loop), compiled-whole (torch.compile(model), as Trainer(torch_compile=True): "
                        "a minute or two a model, so only when asked)")
    parser.add_argument("--whole-variants", nargs="+", default=list(WHOLE_VARIANTS), choices=[v[0] for v in VARIANTS],
                        help="the MHAR variants compiled-whole runs beside the plain model")
    parser.add_argument("--variants", nargs="+", choices=[v[0] for v in VARIANTS],
                        help=f"default: every variant (graph), {', '.join(REALISTIC_VARIANTS)} (realistic)")
    parser.add_argument("--compile-reference", nargs="*", default=["100M"],
                        help="graph protocol: presets where full H=8 also runs with the reference op compiled "
                        "(one graph per layer, since every layer reads a different number of sources: minutes to build)")
    parser.add_argument("--full-group-layers", nargs="+", type=int, metavar="G",
                        help="full mode's layers per group of two-phase reads (LaunchConfig.full_group_layers, "
                        "docs/kernels.md): full H=8 runs once per G, each row recording it (default: the current "
                        "value; 1: split pairs)")
    parser.add_argument("--block-two-phase", nargs="+", choices=["on", "off"],
                        help="block mode's two-phase reads (LaunchConfig.block_two_phase, docs/kernels.md) or "
                        "whole reads: block runs once per value, each row recording it (default: the current value)")
    parser.add_argument("--compile-backend", default="inductor", help="realistic protocol's torch.compile backend")
    parser.add_argument("--checkpointing", nargs="*", default=[SLICE], choices=list(REALISTIC_BATCH),
                        help="realistic protocol: presets run with (non-reentrant) activation checkpointing")
    parser.add_argument("--loss", choices=LOSSES, default=LOSSES[0],
                        help="realistic protocol's loss: mhar train's chunked fp32 loss on the logits, fused-linear "
                        "(mhar train --loss fused-linear; not with compiled-whole), or transformers' labels= "
                        "(Trainer, TRL: the whole logits in fp32)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--budget-s", type=float, default=480,
                        help="start no new configuration of a protocol after this long into it")
    parser.add_argument("--list", action="store_true", help="print the realistic protocol's configurations and exit")
    parser.add_argument("--commit", help="the commit measured (default: $MHAR_COMMIT, else git's HEAD here)")
    parser.add_argument("--results", type=Path, help="the results folder (default: $MHAR_RESULTS_DIR, else "
                        "benchmarks/results)")
    args = parser.parse_args()
    if args.warmup < 1:
        parser.error("--warmup must be at least 1 (the first step compiles)")
    args.block_two_phase = args.block_two_phase and [value == "on" for value in args.block_two_phase]
    if args.full_group_layers and min(args.full_group_layers) < 1:
        parser.error("--full-group-layers takes numbers of layers, at least 1")
    if args.loss == "fused-linear" and "compiled-whole" in args.realistic_paths:
        # its output layer's forward is swapped for the loss each step: a whole-model graph would recompile
        parser.error("--loss fused-linear runs on the compiled (mhar train --compile) and eager paths, not compiled-whole")
    if args.list:
        presets = [p for p in (args.presets or REALISTIC_BATCH) if p in REALISTIC_BATCH]
        for case in realistic_cases(presets, args.variants or list(REALISTIC_VARIANTS), args.realistic_paths,
                                    args.whole_variants, args.checkpointing, args.loss, args.full_group_layers,
                                    args.block_two_phase):
            print(f"{case['preset']} {case['batch']}x{case['seq']} {variant_label(case)} {case['path']}"
                  + (" checkpointed" if case["checkpointing"] else ""))
        return
    if not torch.cuda.is_available():
        raise SystemExit("bench_train.py needs a CUDA GPU")
    args.commit = args.commit or git_commit()
    report = run(args)
    record(report, args.results)
    print(markdown(report))
    check_fallbacks(report["realistic"])


if __name__ == "__main__":
    main()
