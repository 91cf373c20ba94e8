"""Delta mode under FSDP2: the training step with each block's reads grouped (the later layers'
routers gathered by the block's first layer) against every site reading for itself.

    python benchmarks/fsdp_grouped_reads.py [--presets 100M 350M 1B] [--steps 10]

One GPU, one process (an NCCL group of one), each decoder layer its own FSDP2 unit as in
training/configs/fsdp2_multi_gpu.yaml. The model is in bf16 and its sublayers are compiled
(bench_train.py's fused path); no CUDA graph, which FSDP2's hooks rule out. Prints a Markdown
table and appends its rows to `results/fsdp_grouped_reads.jsonl` (`results_log.py`).
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from bench_train import MICRO_BATCH, build, compile_regions, time_training
from mhar_hf import modeling_mhar
from results_log import append_result, utc_now


def sharded(preset: str) -> torch.nn.Module:
    model = build(preset, "delta", 8, "fused")
    compile_regions(model, whole_layers=False)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", default=["100M", "350M", "1B"], choices=list(MICRO_BATCH))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    whole_here = modeling_mhar._whole_here
    began = utc_now()
    with tempfile.TemporaryDirectory() as folder:
        dist.init_process_group("nccl", init_method=f"file://{os.path.join(folder, 'store')}", rank=0, world_size=1)
        try:
            print("| preset | reads | step ms | tokens/s | peak GiB |")
            print("|---|---|---|---|---|")
            for preset in args.presets:
                batch, seq = MICRO_BATCH[preset]
                for label, rule in (("grouped", whole_here), ("one by one", lambda reads_ahead: False)):
                    modeling_mhar._whole_here = rule
                    model = sharded(preset)
                    result = time_training(model, batch, seq, args.warmup, args.steps)
                    print(f"| {preset} | {label} | {result['step_ms']} | {result['tokens_per_s']:,} "
                          f"| {result['peak_mem_gib']} |", flush=True)
                    append_result("fsdp_grouped_reads", dict(preset=preset, mode="delta", heads=8, reads=label,
                                                             batch=batch, seq=seq, warmup_steps=args.warmup,
                                                             timed_steps=args.steps), result, date=began)
                    del model
                    torch.cuda.empty_cache()
        finally:
            modeling_mhar._whole_here = whole_here
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
