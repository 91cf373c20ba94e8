"""Launch shapes of the routing kernels, swept one kernel at a time on one training step's reads.

    python benchmarks/sweep_launch.py --presets 100M 350M
    python benchmarks/sweep_launch.py --presets 1B --on-step --kinds source --choices 1,1024,3 2,2048,3
    python benchmarks/sweep_launch.py --presets 1B --mode block --kinds site_few
    python benchmarks/sweep_launch.py --mode delta --field group_forward_programs_per_sm 8 16 32
    python benchmarks/sweep_launch.py --presets 100M --mode block --field column_block_kinds "('site', 'site_few', 'total')" "()"

For one residual mode (H = 8; full by default) at each preset's micro-batch, every (token rows
per program, tile elements per warp, pipeline stages) choice of one kernel is timed by that
kernel's own GPU time in one step's reads (forward + backward), the other kernels at their shape in
`LaunchConfig().shapes` (mhar_hf.ops.routing.launch); with --on-step, the whole training step instead
(`fused+graph`, as bench_train.py times it, with the plain model's compiled+graph step timed in
the same run for the ratio; slower, and what the default shapes are checked on: a shape that
speeds a kernel alone can slow the step). Prints each choice's milliseconds as it is measured,
then per kernel all choices, best first.
With --field, another field of `LaunchConfig` (programs per multiprocessor, the partials tile,
the launches in column blocks, ...) is swept instead, and every routing kernel's time is printed
per value.
Every measurement is also appended to `results/launch_sweep.jsonl` as it is made (`results_log.py`).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import itertools

import torch

from bench_train import (MICRO_BATCH, build, compile_regions, copy_bandwidth, record_routing_sites, release,
                         time_routing, time_training)
from mhar_hf import MHARConfig, MHARForCausalLM
from mhar_hf.ops.routing import LaunchConfig, launch, launch_config
from results_log import append_result, utc_now

CHOICES = {  # (token rows per program, padded elements per warp, pipeline stages)
    "forward": list(itertools.product((1, 2), (512, 1024, 2048), (2, 3))),
    "site": list(itertools.product((1, 2), (256, 512, 1024), (2, 3))),
    **dict.fromkeys(("source", "source_paired"), list(itertools.product((1, 2, 4), (1024, 2048, 4096), (2, 3)))),
    "site_few": list(itertools.product((1, 2, 4), (320, 640, 1280), (2, 3))),
    "group_forward": list(itertools.product((0, 1, 2, 4), (1024, 2048), (2, 3))),  # rows 0: as fit one warp
}


KERNEL = {"forward": "route_fwd_kernel", "site": "route_site_bwd_kernel", "source": "route_source_bwd_kernel",
          "source_paired": "route_source_bwd_kernel", "site_few": "route_site_bwd_kernel",
          "group_forward": "route_fwd_kernel"}


def model_sites(preset: str, mode: str) -> list[tuple[int, str]]:
    """(sources, role) per multi-source read of the preset's model in `mode` (H = 8), as
    `bench_train.time_routing` takes them, recorded from one forward of a narrow copy (same
    depth and blocks, which alone decide the reads) on the fused path, which alone splits reads."""
    config = MHARConfig.from_preset(preset, residual_mode=mode, residual_heads=8, routing_implementation="fused",
                                    hidden_size=64, intermediate_size=64, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=16, vocab_size=64)
    with torch.device("cuda"):
        model = MHARForCausalLM(config)
        sites = record_routing_sites(model)
        with torch.no_grad():
            model(input_ids=torch.zeros(1, 4, dtype=torch.long), use_cache=False)
    return sites


def step_ms(preset: str, mode: str = "full") -> float:
    """One training step with the whole step in a CUDA graph: MHAR (H = 8) in `mode` as
    bench_train's fused+graph, or with mode="standard" the plain model as its compiled+graph
    baseline."""
    batch, seq = MICRO_BATCH[preset]
    plain = mode == "standard"
    model = build(preset, mode, 8, "reference" if plain else "fused")
    compile_regions(model, whole_layers=plain)
    ms = time_training(model, batch, seq, warmup=3, steps=8, graph=True)["step_ms"]
    del model
    release()
    return ms


def field_error(name: str, *values: str) -> str | None:
    """What is wrong with a --field sweep (a sentence), or None."""
    known = [field.name for field in dataclasses.fields(LaunchConfig)]
    if name not in known:
        return f"--field: {name!r} is not a field of LaunchConfig (one of {known})"
    if not values:
        return f"--field {name}: give the values to sweep after the name"
    for value in values:
        try:
            ast.literal_eval(value)
        except (ValueError, SyntaxError):
            return f"--field {name}: {value!r} is not a Python literal (quote tuples and dicts for the shell)"
    return None


def sweep_field(presets, mode: str, name: str, *values: str, bandwidth: float, date: str | None = None) -> None:
    """Every routing kernel's time in one step's reads with LaunchConfig's `name` set to each
    value in turn (Python literals), through `launch_config`, which restores the default."""
    for preset in presets:
        config = MHARConfig.from_preset(preset)
        batch, seq = MICRO_BATCH[preset]
        sites = model_sites(preset, mode)
        for value in values:
            with launch_config(**{name: ast.literal_eval(value)}):
                figures = time_routing(sites, mode == "delta", batch * seq, config.hidden_size, 8, bandwidth)
            print(f"{preset} {name}={value}: {figures['fwd_bwd_kernels_ms']}", flush=True)
            append_result("launch_sweep", dict(sweep="field", preset=preset, mode=mode, heads=8, field=name,
                                               value=value),
                          dict(kernels_ms=figures["fwd_bwd_kernels_ms"], fwd_bwd_ms=figures.get("fwd_bwd_ms")),
                          date=date)


def parse_choice(text: str) -> tuple[int, int, int]:
    try:
        rows, per_warp, stages = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ROWS,PER_WARP,STAGES (three integers), got {text!r}") from None
    return rows, per_warp, stages


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", default=["100M", "350M"], choices=list(MICRO_BATCH))
    parser.add_argument("--mode", default="full", choices=["full", "block", "delta"])
    parser.add_argument("--kinds", nargs="+", default=["forward", "site", "source"], choices=list(CHOICES))
    parser.add_argument("--choices", nargs="+", type=parse_choice, metavar="ROWS,PER_WARP,STAGES",
                        help="try only these shapes (for every kind swept)")
    parser.add_argument("--on-step", action="store_true",
                        help="time the whole training step per choice, and the plain model's step in the same run")
    parser.add_argument("--field", nargs="+", metavar="NAME VALUE",
                        help="sweep this field of LaunchConfig over these values (Python literals)")
    args = parser.parse_args()
    if args.field and (error := field_error(*args.field)):
        parser.error(error)
    began = utc_now()
    bandwidth = copy_bandwidth()
    if args.field:
        sweep_field(args.presets, args.mode, *args.field, bandwidth=bandwidth, date=began)
        return
    for preset in args.presets:
        config = MHARConfig.from_preset(preset)
        batch, seq = MICRO_BATCH[preset]
        sites = model_sites(preset, args.mode)
        plain = step_ms(preset, "standard") if args.on_step else None
        if plain is not None:
            print(f"{preset} plain compiled+graph step: {plain:.3f} ms", flush=True)
        for kind in args.kinds:
            timings = []
            for choice in args.choices or CHOICES[kind]:
                with launch_config(shapes={**launch.current().shapes, kind: choice}):
                    if args.on_step:
                        ms = step_ms(preset, args.mode)
                    else:
                        figures = time_routing(sites, args.mode == "delta", batch * seq, config.hidden_size, 8,
                                               bandwidth)
                        ms = figures["fwd_bwd_kernels_ms"][KERNEL[kind]]
                print(f"{preset} {kind} {choice}: {ms:.3f} ms", flush=True)  # kept if a time limit cuts the sweep
                measure = "step_ms" if args.on_step else "kernel_ms"
                append_result("launch_sweep", dict(sweep="shape", preset=preset, mode=args.mode, heads=8, kind=kind,
                                                   choice=list(choice), measure=measure),
                              dict(ms=ms, plain_step_ms=plain), date=began)
                timings.append((ms, choice))
            timings.sort()
            ratio = (lambda ms: f" ({plain / ms:.3f}x plain)") if plain is not None else (lambda ms: "")
            print(f"{preset} {kind}: " + ", ".join(f"{c} {ms:.3f} ms{ratio(ms)}" for ms, c in timings), flush=True)


if __name__ == "__main__":
    main()
