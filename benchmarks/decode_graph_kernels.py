"""Kernels inductor generates for one compiled decoding step, per residual mode and routing
implementation, without a GPU.

    python benchmarks/decode_graph_kernels.py --preset 1B

Under compiled decoding (a static cache, transformers' CUDA-graphed step) each kernel of the step
costs a launch's few microseconds however little it computes, so a step of a few tokens is paced
by its kernel count. This compiles `MHARModel`'s forward of one token without autograd, at a
preset's depth and routing but a small width, with inductor on the CPU, and reads inductor's count
of the kernels it generated: the same scheduler that generates a GPU's Triton kernels, so a count
that grows with the reads shows there too. The routing kernels' own launches (the fused path's
custom ops, one per read or per group of reads) are not generated, so not counted; their launches
are skipped here, which the count does not depend on. Each row is appended to
`results/decode_graph_kernels.jsonl` (`results_log.py`; gpu "cpu").
"""

from __future__ import annotations

import argparse
import os

os.environ["TRITON_INTERPRET"] = "1"  # lets the fused path take CPU tensors; set before triton loads

import torch  # noqa: E402
import torch._inductor.metrics as inductor_metrics  # noqa: E402

from mhar_hf import MHARConfig, MHARModel  # noqa: E402
from mhar_hf.ops.routing import kernels, outputs  # noqa: E402
from host_overhead import NoLaunch  # noqa: E402
from results_log import append_result, utc_now  # noqa: E402

ROWS = [("standard", None), ("delta", "reference"), ("delta", "fused"), ("full", "reference"), ("full", "fused")]


def step_kernels(preset: str, mode: str, routing: str | None) -> int:
    """Kernels inductor generates for a one-token forward of the preset's depth, width 256."""
    config = MHARConfig.from_preset(
        preset, residual_mode=mode, routing_implementation=routing or "auto", hidden_size=256,
        intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=256,
    )
    torch.manual_seed(0)
    model = MHARModel(config).eval()
    torch._dynamo.reset()
    inductor_metrics.reset()
    with torch.no_grad():
        torch.compile(model, fullgraph=True)(input_ids=torch.zeros(1, 1, dtype=torch.long))
    return inductor_metrics.generated_kernel_count


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="1B", choices=["100M", "350M", "1B"])
    args = parser.parse_args()
    for name in kernels.ENTRY_POINTS:
        setattr(kernels, name, NoLaunch())
    began = utc_now()
    with outputs.allocating(torch.zeros):  # what the skipped kernels would have written
        counts = {row: step_kernels(args.preset, *row) for row in ROWS}
    plain = counts[("standard", None)]
    for (mode, routing), count in counts.items():
        print(f"{args.preset} {mode} {routing or ''}: {count} kernels, {count - plain:+d} on the plain step")
        append_result("decode_graph_kernels", dict(preset=args.preset, mode=mode, routing=routing, width=256),
                      dict(kernels=count, over_standard=count - plain), date=began, gpu="cpu")


if __name__ == "__main__":
    main()
