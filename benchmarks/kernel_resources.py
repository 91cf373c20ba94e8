"""Registers and spills of the routing kernels at their launch shapes, without a GPU.

    python benchmarks/kernel_resources.py
    python benchmarks/kernel_resources.py --presets 350M --launch source=2,2048,3
    python benchmarks/kernel_resources.py --loops

Builds each kernel variant (the flags a training step launches it with) for Hopper at the launch
shape `LaunchConfig().shapes` (mhar_hf.ops.routing.launch) gives it for each preset's width (full mode, H heads),
and prints what the compiled code uses per thread: registers, and stack bytes, where spilled
registers go (any stack is a spill: the kernels keep no local arrays). A shape that spills is slow
in the step even where it times well alone (as two source rows did while the reads timed alone
formed no source pairs). Runs on a CPU (Triton's compiler and its bundled cuobjdump); the figures
are the installed Triton's. Count with the GPU machine's version: versions differ in layouts, not
only in registers (3.6 and 3.9 give a tile's lanes to its dimensions in opposite orders where
contiguity ties), e.g. `pip install --target /tmp/t36 triton==3.6.0` and `PYTHONPATH=/tmp/t36:..`. `--launch` tries
other shapes. `--loops` adds, per kernel, the SASS instructions and barriers (BAR, not the DEPBAR
waits of asynchronous copies) of its innermost loop: one iteration's work per source (forward,
site) or per read (source kernel). Each row printed is also appended to
`results/kernel_resources.jsonl` (`results_log.py`; gpu "cpu": nothing runs on a GPU).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import tempfile

import triton

from mhar_hf import MHARConfig
from mhar_hf.ops.routing import kernels, launch, launch_config
from mhar_hf.ops.routing.ahead import compile_kernel
from results_log import append_result, utc_now
from sweep_launch import parse_choice

VARIANTS = [  # (kernel kind, variant, kernel, flags): the launches of a training step
    ("forward", "whole", kernels.route_fwd_kernel, dict(STORE_STATS=True)),
    ("forward", "begins a second", kernels.route_fwd_kernel, dict(STORE_STATS=True, HAS_SECOND=True)),
    ("forward", "ends a begun one", kernels.route_fwd_kernel, dict(STORE_STATS=True, HAS_INIT=True)),
    ("group_forward", "gated, null", kernels.route_fwd_kernel,
     dict(STORE_STATS=True, HAS_NULL=True, HAS_GATE=True, GROUPED=True)),
    ("site", "whole", kernels.route_site_bwd_kernel, dict(TOTAL_FROM_OUT=True)),
    ("site", "with a second", kernels.route_site_bwd_kernel, dict(HAS_SECOND=True, TOTAL_FROM_OUT=True)),
    ("site", "grouped, gated, null", kernels.route_site_bwd_kernel, dict(HAS_NULL=True, HAS_GATE=True, GROUPED=True)),
    ("site_few", "whole", kernels.route_site_bwd_kernel, dict(TOTAL_FROM_OUT=True)),
    ("source", "alone", kernels.route_source_bwd_kernel, {}),
    ("source_paired", "with a partner", kernels.route_source_bwd_kernel, dict(HAS_PARTNER=True)),
    ("source", "from a partial", kernels.route_source_bwd_kernel, dict(HAS_INIT=True)),
]
FLAGS = ("HAS_NULL", "HAS_GATE", "STORE_STATS", "HAS_INIT", "HAS_SECOND", "HAS_GRAD_IN", "HAS_PARTNER", "GROUPED",
         "TOTAL_FROM_OUT")


def cuobjdump() -> str:
    bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    found = bundled if os.path.exists(bundled) else shutil.which("cuobjdump")
    if found is None:
        raise SystemExit("cuobjdump not found: neither Triton's bundled one nor one on PATH")
    return found


def dump(compiled, tool: str, option: str) -> str:
    """cuobjdump's report (`option`) on a compiled kernel."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        return subprocess.run([tool, option, path], capture_output=True, text=True, check=True).stdout


def resources(compiled, tool: str) -> tuple[int, int]:
    """(registers, stack bytes) per thread of a compiled kernel."""
    report = dump(compiled, tool, "--dump-resource-usage")
    found = re.search(r"REG:(\d+) STACK:(\d+)", report)
    if found is None:
        raise RuntimeError(f"no resource line in cuobjdump's report:\n{report}")
    return int(found[1]), int(found[2])


def innermost_loop(compiled, tool: str) -> tuple[int, int]:
    """(instructions, barriers) of the kernel's first innermost loop: the SASS from a backward
    branch's target to the branch, holding no other backward branch."""
    code = [(int(address, 16), text.strip())
            for address, text in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", dump(compiled, tool, "-sass"))]
    loops = []
    for address, text in code:
        target = re.search(r"\bBRA\b[^0-9]*0x([0-9a-f]+)", text)
        if target and int(target[1], 16) < address:
            loops.append((int(target[1], 16), address))
    inner = [(start, end) for start, end in loops
             if not any(start <= s and e < end for s, e in loops if (s, e) != (start, end))]
    if not inner:
        raise RuntimeError("no loop in the kernel's SASS")
    start, end = inner[0]
    body = [text for address, text in code if start <= address <= end]
    opcodes = [text.split()[1] if text.startswith("@") else text.split()[0] for text in body]  # past a predicate
    return len(body), sum(opcode.startswith("BAR") for opcode in opcodes)


def parse_launch(text: str) -> tuple[str, tuple[int, int, int]]:
    kind, _, shape = text.partition("=")
    kinds = sorted({kind for kind, *_ in VARIANTS})
    if kind not in kinds:
        raise argparse.ArgumentTypeError(f"expected KIND=ROWS,PER_WARP,STAGES with KIND one of {kinds}, got {text!r}")
    return kind, parse_choice(shape)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", default=["100M", "350M", "1B"])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--launch", type=parse_launch, action="append", default=[], metavar="KIND=ROWS,PER_WARP,STAGES")
    parser.add_argument("--loops", action="store_true",
                        help="also the instructions and barriers of each kernel's innermost loop")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("unset TRITON_INTERPRET: this builds the kernels for the GPU")
    tool = cuobjdump()
    began = utc_now()
    loop_columns = (" loop instructions | loop barriers |", "---|---|") if args.loops else ("", "")
    print("| preset | kernel | launch | rows | warps | stages | registers | stack bytes |" + loop_columns[0])
    print("|---|---|---|---|---|---|---|---|" + loop_columns[1])
    with launch_config(shapes={**launch.current().shapes, **dict(args.launch)}):
        for preset in args.presets:
            report_preset(preset, args.heads, args.loops, tool, began)


def report_preset(preset: str, heads: int, loops: bool, tool: str, began: str) -> None:
    """Each kernel variant's table row, and its results row, at `preset`'s width."""
    width = MHARConfig.from_preset(preset).hidden_size
    for kind, variant, kernel, flags in VARIANTS:
        setup = launch.kernel_args(kind, width, heads)
        every_flag = {flag: flags.get(flag, False) for flag in FLAGS}
        every_flag["IN_PLACE"] = launch.stores_in_place(setup, every_flag["HAS_SECOND"])
        compiled = compile_kernel(kernel, every_flag, width, heads, setup["BLOCK_T"], setup["num_warps"],
                                  setup["STAGES"], setup["SPLIT"])
        registers, stack = resources(compiled, tool)
        loop = innermost_loop(compiled, tool) if loops else None
        print(f"| {preset} | {kind} | {variant} | {setup['BLOCK_T']} | {setup['num_warps']} | {setup['STAGES']} "
              f"| {registers} | {stack} |" + (" {} | {} |".format(*loop) if loop else ""), flush=True)
        metrics = dict(registers=registers, stack_bytes=stack)
        if loop:
            metrics.update(loop_instructions=loop[0], loop_barriers=loop[1])
        append_result("kernel_resources", dict(preset=preset, kernel=kind, variant=variant, heads=heads,
                                               rows=setup["BLOCK_T"], warps=setup["num_warps"],
                                               stages=setup["STAGES"], capability=90), metrics,
                      date=began, gpu="cpu")


if __name__ == "__main__":
    main()
