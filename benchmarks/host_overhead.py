"""Host time the fused routing path adds to a training step or a decoded token, measured without a GPU.

    python benchmarks/host_overhead.py --preset 350M
    python benchmarks/host_overhead.py --preset 1B --workload generate

At the paper's micro-batches the MHAR step is bound by the host (BENCHMARKS.md), so the Python
work around each routing kernel matters. This runs a model with a preset's layer count but a
tiny width and a few tokens on the CPU, with every routing kernel launch replaced by a no-op
(the Triton interpreter mode only lets the fused path accept CPU tensors), and compares the step
time with the same model in `standard` mode, which has no routing at all. The difference, per
routing site, is the host cost of dispatch, autograd functions, address tables and bookkeeping;
the Triton launch itself (tens of microseconds on a GPU) is not included. `--workload generate`
times greedy `model.generate` instead, per decoded token (batch 1, dynamic cache: eager decoding,
where a GPU waits on the host). The modes take turns,
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


def small_model(mode: str, preset: str) -> MHARForCausalLM:
    """A model with the preset's depth and routing but width 64, in `mode`, on the fused path."""
    config = MHARConfig.from_preset(
        preset, residual_mode=mode, routing_implementation="fused", hidden_size=64, intermediate_size=64,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, vocab_size=128,
    )
    torch.manual_seed(0)
    return MHARForCausalLM(config)


DECODED = 32  # tokens a timed generation decodes after its first


def timed_ms(step, steps: int) -> float:
    began = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - began) * 1e3 / steps


def workload_timer(mode: str, preset: str, workload: str):
    """`ms(runs)`: milliseconds per training step (8 tokens) or per token decoded (greedy generate,
    batch 1, dynamic cache, DECODED tokens after an 8-token prompt and the first token) of the
    small model in `mode`, warmed up; and the model's routing sites."""
    model = small_model(mode, preset)
    ids = torch.randint(0, 128, (1, 8))

    def train():
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()

    def generate(new: int):
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                           min_new_tokens=new, do_sample=False, pad_token_id=0)

    def decoded_ms(runs: int) -> float:  # the prefill and first token timed alone, and taken off
        whole = timed_ms(lambda: generate(1 + DECODED), runs)
        return (whole - timed_ms(lambda: generate(1), runs)) / DECODED

    if workload == "generate":
        model.eval()
        ms = decoded_ms
    else:
        def ms(runs: int) -> float:
            return timed_ms(train, runs)
    ms(3)
    return ms, sum(1 for m in model.modules() if type(m).__name__ == "MHARRouter")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="350M", choices=["100M", "350M", "1B"])
    parser.add_argument("--steps", type=int, default=30, help="steps per mode and round")
    parser.add_argument("--rounds", type=int, default=5, help="turns each mode takes; its fastest counts")
    parser.add_argument("--workload", choices=("train", "generate"), default="train",
                        help=f"a training step of 8 tokens, or a token decoded by greedy generate "
                             f"(batch 1, {DECODED} tokens after an 8-token prompt; steps: generations)")
    args = parser.parse_args()
    for name in kernels.ENTRY_POINTS:
        setattr(kernels, name, NoLaunch())
    torch.set_num_threads(1)
    began = utc_now()
    with outputs.allocating(torch.zeros):  # what the skipped kernels would have written
        timers = {mode: workload_timer(mode, args.preset, args.workload) for mode in ("standard", "full", "block", "delta")}
        fastest = dict.fromkeys(timers, float("inf"))
        for _ in range(args.rounds):
            for mode, (ms, _) in timers.items():
                fastest[mode] = min(fastest[mode], ms(args.steps))
    plain = fastest.pop("standard")
    measured = {mode: (routed, timers[mode][1]) for mode, routed in fastest.items()}
    unit = "token" if args.workload == "generate" else "step"
    for mode, (routed, sites) in measured.items():
        print(f"{args.preset} {args.workload} {mode}: {routed:.2f} ms per {unit} vs standard {plain:.2f} ms: "
              f"routing host time {routed - plain:.2f} ms per {unit}, {1e3 * (routed - plain) / sites:.0f} us per site")
        config = dict(preset=args.preset, mode=mode, steps=args.steps)
        if args.workload == "generate":  # training rows predate the field
            config["workload"] = "generate"
        append_result("host_overhead", config,
                      dict(step_ms=round(routed, 3), standard_step_ms=round(plain, 3), sites=sites,
                           host_ms_per_step=round(routed - plain, 3),
                           host_us_per_site=round(1e3 * (routed - plain) / sites)),
                      date=began, gpu="cpu")


if __name__ == "__main__":
    main()
