"""GPU check of the mid-training script (issue 5), all through `accelerate launch -m mhar_hf.train`:

1. fsdp: training/configs/fsdp2_multi_gpu.yaml with ONE process on a tiny delta model: a few
   steps, a sharded checkpoint, a resume from it (losses compared with the uninterrupted run)
   and the final from_pretrained save.
2. throughput: the paper's 100M preset, random init, delta mode against the plain model
   (residual_mode="standard") with the same script and settings (training/configs/single_gpu.yaml,
   bf16 autocast over fp32 master weights): median tokens/s after warm-up, and peak memory.

    python training/bench_midtrain.py --out RESULTS_DIR [--steps 30 --seq-length 2048 --batch-size 8] [--loss chunked]

Keeps the runs' logs in RESULTS_DIR, appends a row per part (the FSDP check, each model's throughput)
to benchmarks/results/midtrain.jsonl (benchmarks/results_log.py; --results or $MHAR_RESULTS_DIR for
another folder) and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIGS = Path(__file__).parent / "configs"
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from results_log import append_result, utc_now  # noqa: E402

from mhar_hf.train.optim import LOSSES  # noqa: E402


def write_synthetic_corpus(path: Path, tokens: int, seed: int = 0) -> None:
    """Documents of random words from the demo text (about `tokens` tokens for the tiny tokenizer)."""
    from mhar_hf.tiny import demo_corpus

    words = demo_corpus().split()
    rng = random.Random(seed)
    with path.open("w") as handle:
        written = 0
        while written < tokens:
            doc = " ".join(rng.choice(words) for _ in range(rng.randint(200, 2000)))
            handle.write(json.dumps({"text": doc}) + "\n")
            written += int(len(doc.split()) * 1.6)


def launch(config: str, args: list[str], log: Path, env: dict | None = None, check: bool = True) -> float | None:
    """Wall seconds of one `accelerate launch` (None when it failed and `check` is off)."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / config),
               "--num_processes", "1", "-m", "mhar_hf.train", *args]
    started = time.perf_counter()
    with log.open("w") as handle:
        result = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    if result.returncode:
        print(log.read_text()[-5000:])
        if check:
            raise SystemExit(f"{' '.join(command)} failed with {result.returncode}")
        return None
    return time.perf_counter() - started


def metrics(output: Path) -> list[dict]:
    return [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]


def fsdp_check(work: Path, tokenizer, corpus: Path, out: Path) -> dict:
    import shutil

    from mhar_hf import MHARForCausalLM
    from mhar_hf.folder import TrainingRecord
    from mhar_hf.tiny import tiny_config

    model = work / "tiny-delta"
    MHARForCausalLM(tiny_config(residual_mode="delta", vocab_size=len(tokenizer))).save_pretrained(model)
    tokenizer.save_pretrained(model)
    common = ["--model", str(model), "--data", str(corpus), "--seq-length", "256", "--batch-size", "4",
              "--max-steps", "8", "--save-every", "4", "--eval-every", "4", "--val-sequences", "8", "--lr", "3e-3",
              "--warmup-steps", "2", "--gradient-checkpointing", "--ema-decay", "0.9", "--z-loss", "1e-4",
              "--report-to", "none"]
    whole = work / "fsdp-whole"
    launch("fsdp2_multi_gpu.yaml", [*common, "--output", str(whole)], out / "fsdp_whole.log")
    resumed = work / "fsdp-resumed"  # the state a kill after step 5 would leave
    shutil.copytree(whole / "checkpoints" / "step-00000004", resumed / "checkpoints" / "step-00000004")
    (resumed / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics(whole)[:5]))
    launch("fsdp2_multi_gpu.yaml", [*common, "--output", str(resumed), "--resume"], out / "fsdp_resumed.log")
    a, b = metrics(whole), metrics(resumed)
    reloaded = MHARForCausalLM.from_pretrained(resumed / "model")
    meta = TrainingRecord.read(resumed / "model")
    return {
        "distributed_type": meta.distributed_type,
        "checkpoint_files": sorted(p.name for p in (whole / "checkpoints" / "step-00000008").iterdir()),
        "losses": [m["loss"] for m in a],
        "resumed_losses": [m["loss"] for m in b],
        "max_abs_loss_diff_after_resume": max(abs(x["loss"] - y["loss"]) for x, y in zip(a, b)),
        "reloaded_gate_abs_mean": sum(p.abs().sum().item() for n, p in reloaded.named_parameters() if n.endswith(".gate"))
        / sum(1 for n, _ in reloaded.named_parameters() if n.endswith(".gate")),
        "logged_gate_abs_mean": b[-1]["gate_abs_mean"],
    }


def throughput(work: Path, corpus: Path, tokenizer, out: Path, args) -> dict:
    from mhar_hf import MHARConfig, MHARForCausalLM

    results = {}
    for mode in ("standard", "delta"):
        model = work / f"100M-{mode}"
        network = MHARForCausalLM(MHARConfig.from_preset("100M", residual_mode=mode))
        network.save_pretrained(model)
        tokenizer.save_pretrained(model)
        for attempt in ("auto", "reference"):  # the fused kernels by default; the reference op if they fail
            output = work / f"run-{mode}-{attempt}"
            wall = launch("single_gpu.yaml", [
                "--model", str(model), "--data", str(corpus), "--output", str(output),
                "--seq-length", str(args.seq_length), "--batch-size", str(args.batch_size),
                "--max-steps", str(args.steps), "--warmup-steps", str(min(5, args.steps - 1)), "--lr", "4e-4",
                "--z-loss", "1e-4", "--save-every", "100000", "--eval-every", "100000", "--val-sequences", "4",
                "--report-to", "none", "--loss", args.loss,
            ], out / f"throughput_{mode}_{attempt}.log", env={"MHAR_ROUTING": attempt}, check=attempt == "reference")
            if wall is not None:
                routing = attempt
                break
        log = metrics(output)
        steady = [m["tokens_per_s"] for m in log[args.warmup :]]
        results[mode] = {
            "parameters": network.num_parameters(), "routing_implementation": routing if mode == "delta" else None,
            "tokens_per_s_median": statistics.median(steady),
            "peak_memory_gib": log[-1].get("peak_memory_gib", float("nan")),  # logged on CUDA only
            "first_loss": log[0]["loss"], "last_loss": log[-1]["loss"],
            "final_val_loss": log[-1].get("val_loss"), "wall_s": wall,
        }
    results["delta_over_standard_tokens_per_s"] = results["delta"]["tokens_per_s_median"] / results["standard"]["tokens_per_s_median"]
    results["delta_over_standard_peak_memory"] = results["delta"]["peak_memory_gib"] / results["standard"]["peak_memory_gib"]
    return results


def result_rows(summary: dict, args) -> list[tuple[dict, dict]]:
    """(config, metrics) of each part of a run: the FSDP check if it ran, then each model's
    throughput (delta's with its ratios to the plain model's)."""
    rows = []
    if "fsdp_one_process" in summary:
        check = dict(summary["fsdp_one_process"])
        config = dict(part="fsdp_resume", model="tiny delta", processes=1,
                      distributed_type=check.pop("distributed_type"))
        check.pop("checkpoint_files")
        rows.append((config, check))
    t = summary["throughput_100M"]
    for mode in ("standard", "delta"):
        figures = dict(t[mode])
        config = dict(part="throughput", preset="100M", mode=mode, routing=figures.pop("routing_implementation"),
                      loss=args.loss, seq_length=args.seq_length, batch_size=args.batch_size, steps=args.steps, warmup=args.warmup)
        if mode == "delta":
            figures.update(tokens_per_s_vs_standard=t["delta_over_standard_tokens_per_s"],
                           peak_memory_vs_standard=t["delta_over_standard_peak_memory"])
        # NaN (peak memory is logged on CUDA only) is written as null
        rows.append((config, {k: None if isinstance(v, float) and v != v else v for k, v in figures.items()}))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10, help="logged steps left out of the median")
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--skip-fsdp", action="store_true")
    parser.add_argument("--loss", choices=LOSSES, default=LOSSES[0], help="the throughput runs' mhar train --loss "
                        "(the FSDP check keeps mhar train's default)")
    parser.add_argument("--results", type=Path, help="the results folder (default: $MHAR_RESULTS_DIR, else "
                        "benchmarks/results)")
    args = parser.parse_args()
    began = utc_now()

    from mhar_hf.tiny import demo_corpus, train_tokenizer

    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    summary = {}
    with tempfile.TemporaryDirectory(prefix="mhar-midtrain-bench-") as tmp:
        work = Path(tmp)
        tokenizer = train_tokenizer([demo_corpus()])
        corpus = work / "synthetic.jsonl"
        write_synthetic_corpus(corpus, tokens=int(1.2 * (args.steps + 2) * args.batch_size * args.seq_length))
        if not args.skip_fsdp:
            summary["fsdp_one_process"] = fsdp_check(work, tokenizer, corpus, args.out)
            print(json.dumps(summary["fsdp_one_process"], indent=2), flush=True)
        summary["throughput_100M"] = throughput(work, corpus, tokenizer, args.out, args)
    for config, metrics in result_rows(summary, args):
        append_result("midtrain", config, metrics, date=began, folder=args.results)
    t = summary["throughput_100M"]
    print(f"| model | tokens/s | peak memory (GiB) |\n|---|---|---|")
    for mode in ("standard", "delta"):
        print(f"| 100M {mode} | {t[mode]['tokens_per_s_median']:,.0f} | {t[mode]['peak_memory_gib']:.2f} |")
    print(f"delta / standard: {t['delta_over_standard_tokens_per_s']:.3f}x tokens/s, "
          f"{t['delta_over_standard_peak_memory']:.3f}x peak memory")


if __name__ == "__main__":
    main()
