"""Host time the fused routing path adds to a training step, measured without a GPU.

    python benchmarks/host_overhead.py --preset 350M

At the paper's micro-batches the MHAR step is bound by the host (BENCHMARKS.md), so the Python
work around each routing kernel matters. This runs a model with a preset's layer count but a
tiny width and a few tokens on the CPU, with every routing kernel launch replaced by a no-op
(the Triton interpreter mode only lets the fused path accept CPU tensors), and compares the step
time with the same model in `standard` mode, which has no routing at all. The difference, per
routing site, is the host cost of dispatch, autograd functions, address tables and bookkeeping;
the Triton launch itself (tens of microseconds on a GPU) is not included. The modes take turns,
`--rounds` times, and each keeps its fastest round: on a shared machine a mode timed once, alone,
can be slowed by whatever else runs then. Each mode's figures are appended to
`results/host_overhead.jsonl` (`results_log.py`; gpu "cpu": no GPU takes part).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ["TRITON_INTERPRET"] = "1"  # lets the fused path take CPU tensors; set before triton loads

import torch  # noqa: E402

from mhar_hf import MHARConfig, MHARForCausalLM  # noqa: E402
from mhar_hf.ops.routing import kernels, outputs  # noqa: E402
from results_log import append_result, utc_now  # noqa: E402

class NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def training_step(mode: str, preset: str):
    """One training step of the small model in `mode` (warmed up), and its routing sites."""
    config = MHARConfig.from_preset(
        preset, residual_mode=mode, routing_implementation="fused", hidden_size=64, intermediate_size=64,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, vocab_size=128,
    )
    torch.manual_seed(0)
    model = MHARForCausalLM(config)
    ids = torch.randint(0, 128, (1, 8))

    def step():
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()

    for _ in range(3):
        step()
    return step, sum(1 for m in model.modules() if type(m).__name__ == "MHARRouter")


def timed_ms(step, steps: int) -> float:
    began = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - began) * 1e3 / steps


def step_ms(mode: str, preset: str, steps: int) -> tuple[float, int]:
    """Milliseconds per step in `mode`, timed once, and the routing sites (for profiling scripts)."""
    step, sites = training_step(mode, preset)
    return timed_ms(step, steps), sites


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="350M", choices=["100M", "350M", "1B"])
    parser.add_argument("--steps", type=int, default=30, help="steps per mode and round")
    parser.add_argument("--rounds", type=int, default=5, help="turns each mode takes; its fastest counts")
    args = parser.parse_args()
    for name in kernels.ENTRY_POINTS:
        setattr(kernels, name, NoLaunch())
    torch.set_num_threads(1)
    began = utc_now()
    with outputs.allocating(torch.zeros):  # what the skipped kernels would have written
        steps = {mode: training_step(mode, args.preset) for mode in ("standard", "full", "block", "delta")}
        fastest = dict.fromkeys(steps, float("inf"))
        for _ in range(args.rounds):
            for mode, (step, _) in steps.items():
                fastest[mode] = min(fastest[mode], timed_ms(step, args.steps))
    plain = fastest.pop("standard")
    measured = {mode: (routed, steps[mode][1]) for mode, routed in fastest.items()}
    for mode, (routed, sites) in measured.items():
        print(f"{args.preset} {mode}: step {routed:.2f} ms vs standard {plain:.2f} ms: "
              f"routing host time {routed - plain:.2f} ms per step, {1e3 * (routed - plain) / sites:.0f} us per site")
        append_result("host_overhead", dict(preset=args.preset, mode=mode, steps=args.steps),
                      dict(step_ms=round(routed, 3), standard_step_ms=round(plain, 3), sites=sites,
                           host_ms_per_step=round(routed - plain, 3),
                           host_us_per_site=round(1e3 * (routed - plain) / sites)),
                      date=began, gpu="cpu")


if __name__ == "__main__":
    main()
