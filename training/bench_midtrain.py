"""GPU check of the mid-training script (issues 5 and 42), all through `accelerate launch` of `mhar train`:

1. fsdp: training/configs/fsdp2_multi_gpu.yaml with ONE process on a tiny delta model: a few
   steps, a sharded checkpoint, a resume from it (losses compared with the uninterrupted run)
   and the final from_pretrained save.
2. throughput: for each of `--presets` (the paper's 100M and 1B presets, and `8B-slice`:
   Llama-3.1-8B's published config with 8 of its 32 layers, delta mode as `mhar convert` writes
   it, activation checkpointing), random init, MHAR delta against the plain model (transformers'
   own class of the same network: Qwen3 for the presets, Llama for the slice; `--models standard`
   adds MHAR `standard` mode as a check), each under every `--losses` (`fused-linear`, mhar train's
   default; `chunked`, today's loss on the logits), with `--compile` (the default) or without,
   through training/configs/single_gpu.yaml (bf16 autocast over fp32 master weights, fused
   kernels by default): median tokens/s after warm-up and peak memory, from mhar train's own
   metrics.jsonl. The models are bench_train.py's realistic protocol's (`case_config`).

    python training/bench_midtrain.py --out LOGS --skip-fsdp       # issue 42's targets: 1B, 8B-slice; ~8.5 min, H100
    python training/bench_midtrain.py --out LOGS --presets 100M    # the FSDP check and 100M, ~3 min
    python training/bench_midtrain.py --out LOGS --tiny --skip-fsdp --compile-backend aot_eager  # dry run on a CPU

The targets (issue 42, item 3): delta x plain >= 0.97 in tokens/s with `--compile` (1B and the
slice); delta's peak memory at 1B with the fused loss at least 30 % below the chunked loss's
(fused / chunked <= 0.70).

Each throughput run is one `accelerate launch` of this script as a worker: it writes the model
folder's random bf16 weights when the folder has none yet (on the GPU; timed as `write_s`), then
runs `mhar train` (`mhar_hf.train.__main__.main`) with the end-of-run checkpoint and final model
save left out (they come after the last measured step; at the slice they would write ~34 GB a
run). Steps and micro-batches per preset are in `SETTINGS`; `--budget-s` starts no run whose
estimate (`ESTIMATE_S`, H100) would end past it. Keeps the runs' logs in `--out`, appends a row
per part to benchmarks/results/midtrain.jsonl (benchmarks/results_log.py; --results or
$MHAR_RESULTS_DIR for another folder): the FSDP check, then, after each preset, one row per
model x loss (config: preset, model, architecture, mode, loss, compile, ...; metrics: tokens/s,
x plain of the same preset, loss and compile, peak memory, fused / chunked peak of the same model),
and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import shutil
import signal
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

PRESETS = ("100M", "1B", "8B-slice")
# each model's MHAR residual mode (None: transformers' own class of the network)
MODELS = {"plain": None, "standard": "standard", "delta": "delta"}
# A micro-batch of 16k tokens (bench_train.py's REALISTIC_BATCH), activation checkpointing (the slice), steps a
# run and the first logged steps left out of the median (the first compiles). Peak memory on one 80 GB GPU
# (estimates), AdamW over fp32 master weights: weights, gradients and the two moments are 16 bytes a parameter,
# plus bf16 activations and the loss's share (accelerate hands the logits back in fp32):
#   100M: 0.12B x 16 = 1.9 GB + activations, the 152k vocabulary's logits the largest part.
#   1B: 1.08B x 16 = 17 GB + activations of 36 layers at 16k tokens, no checkpointing (~30 GB; bench_train.py's
#       realistic protocol measured 48 GiB in all with the fused loss) + the loss: fused-linear a chunk of 2k
#       positions' logits (~1 GB), about 50 GB in all; chunked the fp32 logits (16k x 152k = 10 GB) and their
#       fp32 and bf16 gradients (15 GB), about 70-75 GB.
#   8B-slice: 2.8B parameters (1.05B of them the untied embedding and head) x 16 = 45 GB + autocast's bf16 copies
#       of the weights (5.6 GB) + checkpointed activations (8 fp32 layer inputs of 16k x 4096, 2 GB, and one
#       layer recomputed, ~4 GB) + the loss (fused-linear ~1 GB, chunked ~17 GB with the 128k vocabulary):
#       about 58 GB with fused-linear, 75 GB with chunked.
SETTINGS = {
    "100M": dict(batch_size=8, seq_length=2048, checkpointing=False, steps=30, warmup=10),
    "1B": dict(batch_size=4, seq_length=4096, checkpointing=False, steps=12, warmup=4),
    "8B-slice": dict(batch_size=4, seq_length=4096, checkpointing=True, steps=10, warmup=4),
}
# --tiny: every preset shrunk to milliseconds a step on a CPU, its kind of backbone kept
TINY_SIZES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=512, bos_token_id=None, eos_token_id=0)
TINY_SETTINGS = dict(batch_size=2, seq_length=64, steps=3, warmup=1)
# Wall seconds of a run on one H100, estimated (not yet timed here; bench_train.py's realistic rows give the
# steps and a cold compile at 1B: 0.36-0.40 s a step, 10-16 s for the first; the slice's step, ~1 s, is from its
# FLOPs): a model's first run, which writes its folder and compiles cold, and its later runs (folder written,
# inductor's cache warm). Each also starts two Pythons, packs the corpus and loads the weights (10-20 s).
ESTIMATE_S = {"100M": (45, 30), "1B": (60, 40), "8B-slice": (90, 60)}
TINY_ESTIMATE_S = (15, 10)  # --tiny on a CPU
FSDP_ESTIMATE_S = 60
GRACE_S = 30  # a run still going this long after --budget-s is killed
TARGETS = dict(tokens_per_s_vs_plain=0.97, peak_memory_vs_chunked=0.70, memory_preset="1B")
FALLBACK_WARNING = "using the reference routing op"  # what mhar_hf.routing warns when a read falls back
OUT_OF_MEMORY = ("OutOfMemoryError", "CUDA out of memory")


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


def launch(config: str, args: list[str], log: Path, env: dict | None = None, check: bool = True,
           module: bool = True, timeout: float | None = None) -> float | None:
    """Wall seconds of one `accelerate launch` of `-m mhar_hf.train args` (`module` off: of this
    script's worker, `args` starting with `--worker`); None when it failed (or ran past
    `timeout`, its processes then killed) and `check` is off."""
    target = ["-m", "mhar_hf.train"] if module else [str(Path(__file__).resolve())]
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / config),
               "--num_processes", "1", *target, *args]
    started = time.perf_counter()
    with log.open("w") as handle:
        process = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True,
                                   env={**os.environ, **(env or {})})
        try:
            returncode = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # the launcher and its worker (one process group)
            process.wait()
            handle.write(f"\nbench_midtrain: killed after {timeout:.0f} s\n")
            returncode = -signal.SIGKILL
    if returncode:
        print(log.read_text()[-5000:])
        if check:
            raise SystemExit(f"{' '.join(command)} failed with {returncode}")
        return None
    return time.perf_counter() - started


def metrics(output: Path) -> list[dict]:
    path = output / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def fsdp_check(work: Path, tokenizer, corpus: Path, out: Path) -> dict:
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


# ----------------------------------------------------------------------------------------------
# The throughput runs

def parse_losses(specs: list[str], presets: list[str]) -> dict[str, list[str]]:
    """`--losses` as the losses of each preset, in the order given: `LOSS` for every preset,
    `LOSS@PRESET[,PRESET]` for those only (`chunked@1B`)."""
    chosen = {preset: [] for preset in presets}
    for spec in specs:
        loss, _, where = spec.partition("@")
        if loss not in LOSSES:
            raise ValueError(f"--losses {spec}: {loss!r} is not one of {', '.join(LOSSES)}")
        for preset in where.split(",") if where else presets:
            if preset not in PRESETS:
                raise ValueError(f"--losses {spec}: {preset!r} is not one of {', '.join(PRESETS)}")
            if preset in chosen and loss not in chosen[preset]:
                chosen[preset].append(loss)
    return chosen


def settings(preset: str, args) -> dict:
    """A preset's micro-batch, checkpointing, steps and warm-up: `SETTINGS` (shrunk with --tiny),
    each overridden by the option of its name when given."""
    chosen = {**SETTINGS[preset], **(TINY_SETTINGS if args.tiny else {})}
    chosen.update({key: getattr(args, key) for key in ("batch_size", "seq_length", "steps", "warmup")
                   if getattr(args, key) is not None})
    return chosen


def plan(args) -> list[dict]:
    """The throughput runs in the order they run: per preset, per loss, per model (plain first),
    each with its settings and estimated wall seconds (a model's first run writes its folder and
    compiles cold)."""
    losses = parse_losses(args.losses, args.presets)
    runs, seen = [], set()
    for preset in args.presets:
        for loss in losses[preset]:
            for model in args.models:
                first, later = TINY_ESTIMATE_S if args.tiny else ESTIMATE_S[preset]
                runs.append(dict(preset=preset, model=model, loss=loss, **settings(preset, args),
                                 estimate_s=first if (preset, model) not in seen else later))
                seen.add((preset, model))
    return runs


def model_config(preset: str, model: str, tiny: bool = False):
    """The config of `model` at `preset`: bench_train.py's realistic protocol's (`case_config`:
    the plain class, or MHAR in `model`'s mode, the slice as `mhar convert --heads 8` writes
    it), with the routing implementation a converted model has (`auto`: the fused kernels on a
    GPU); `tiny`: every size shrunk."""
    import bench_train

    preset_name = bench_train.SLICE if preset == "8B-slice" else preset
    config = bench_train.case_config(dict(preset=preset_name, mode=MODELS[model] or "standard", heads=8,
                                          label="plain" if MODELS[model] is None else model))
    if MODELS[model] is not None:
        config.routing_implementation = "auto"
    if tiny:
        fields = {k: v for k, v in config.to_dict().items() if k != "layer_types"}  # Qwen3's, one a layer
        config = type(config).from_dict({**fields, **TINY_SIZES})
    from transformers import AutoModelForCausalLM

    config.architectures = [AutoModelForCausalLM._model_mapping[type(config)].__name__]
    return config


def write_weights(folder: Path) -> float:
    """Random bf16 weights for the config in `folder` (built on the GPU when there is one, seeded),
    saved there; the seconds it took. Frees what it allocated and resets the peak-memory counter."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import mhar_hf  # noqa: F401  (registers MHAR with the Auto classes)

    began = time.perf_counter()
    config = AutoConfig.from_pretrained(folder)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    del model
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return time.perf_counter() - began


def worker(argv: list[str]) -> int:
    """`--worker REPORT_JSON` then mhar train's arguments, inside `accelerate launch`: the model
    folder's weights written if it has none yet (`write_s` into REPORT_JSON), then mhar train
    with its end-of-run checkpoint and final save left out (nothing measured comes after them)."""
    report, train_args = Path(argv[0]), argv[1:]
    folder = Path(train_args[train_args.index("--model") + 1])
    written = None if any(folder.glob("*.safetensors")) else write_weights(folder)
    report.write_text(json.dumps({"write_s": written}))
    loop = importlib.import_module("mhar_hf.train.loop")
    for name in ("save_checkpoint", "save_final_model"):  # what the loop calls after its last step
        if not callable(getattr(loop, name, None)):
            raise RuntimeError(f"mhar_hf.train.loop.{name} is gone: update bench_midtrain.worker")
    loop.save_checkpoint = lambda *args, **kwargs: None
    loop.save_final_model = lambda accelerator, model, tokenizer, ema, output, *rest: Path(output) / "model"
    from mhar_hf.train.__main__ import main as train_main

    return train_main(train_args)


def throughput_run(run: dict, folder: Path, work: Path, corpus: Path, out: Path, args, timeout: float) -> dict:
    """One throughput run (`plan`'s dict): mhar train on `folder` as the run says; its figures, or
    what went wrong (`status`)."""
    name = f"{run['preset']}_{run['model']}_{run['loss']}"
    output, report = work / f"run-{name}", work / f"write-{name}.json"
    log = out / f"throughput_{name}.log"
    train_args = [
        "--model", str(folder), "--data", str(corpus), "--output", str(output),
        "--seq-length", str(run["seq_length"]), "--batch-size", str(run["batch_size"]),
        "--max-steps", str(run["steps"]), "--warmup-steps", str(min(5, run["steps"] - 1)), "--lr", "4e-4",
        "--z-loss", "1e-4", "--save-every", "100000", "--eval-every", "100000", "--val-sequences", "0",
        "--report-to", "none", "--loss", run["loss"],
        *(["--gradient-checkpointing"] if run["checkpointing"] else []),
        *(["--compile", args.compile_backend] if args.compile else []),
    ]
    wall = launch("single_gpu.yaml", ["--worker", str(report), *train_args], log, check=False, module=False,
                  timeout=timeout)
    text = log.read_text()
    result = dict(run, wall_s=wall, write_s=json.loads(report.read_text())["write_s"] if report.exists() else None,
                  fell_back_to_reference=FALLBACK_WARNING in text if MODELS[run["model"]] is not None else None)
    logged = metrics(output)
    if wall is None or len(logged) < run["steps"]:
        status = ("out of memory" if any(s in text for s in OUT_OF_MEMORY) else
                  "timed out" if "bench_midtrain: killed after" in text else "failed")
        return dict(result, status=status)
    tokens = run["batch_size"] * run["seq_length"]
    return dict(result, tokens_per_s_median=statistics.median(m["tokens_per_s"] for m in logged[run["warmup"]:]),
                first_step_s=tokens / logged[0]["tokens_per_s"],  # the first step compiles
                peak_memory_gib=logged[-1].get("peak_memory_gib"),  # logged on CUDA only
                first_loss=logged[0]["loss"], last_loss=logged[-1]["loss"])


def add_ratios(results: list[dict]) -> None:
    """Each MHAR result's tokens/s and peak memory over the plain model's (same preset, loss and
    compile), and each fused-linear result's peak memory over the same model's chunked one."""
    def find(**match):
        ran = (r for r in results if "tokens_per_s_median" in r)
        return next((r for r in ran if all(r[k] == v for k, v in match.items())), None)

    for r in results:
        if "tokens_per_s_median" not in r:
            continue
        plain = find(preset=r["preset"], loss=r["loss"], model="plain")
        if r["model"] != "plain" and plain is not None:
            r["tokens_per_s_vs_plain"] = r["tokens_per_s_median"] / plain["tokens_per_s_median"]
            if r["peak_memory_gib"] is not None and plain["peak_memory_gib"]:
                r["peak_memory_vs_plain"] = r["peak_memory_gib"] / plain["peak_memory_gib"]
        chunked = find(preset=r["preset"], model=r["model"], loss="chunked")
        if r["loss"] == "fused-linear" and chunked is not None and r["peak_memory_gib"] is not None \
                and chunked["peak_memory_gib"]:
            r["peak_memory_vs_chunked"] = r["peak_memory_gib"] / chunked["peak_memory_gib"]


def throughput(work: Path, corpus: Path, tokenizer, out: Path, args, runs: list[dict], deadline: float,
               record=lambda results: None) -> list[dict]:
    """Every planned run that fits before `deadline` (perf_counter seconds), a preset at a time:
    its model folders written (config and tokenizer; the weights by the first run's worker),
    its runs, `record(results of the preset)`, its folders removed. From the first run whose
    estimate goes past `deadline` on, runs are returned with `status: skipped (time)`."""
    results, out_of_time = [], False
    for preset in dict.fromkeys(r["preset"] for r in runs):
        mine = []
        for run in (r for r in runs if r["preset"] == preset):
            folder = work / f"model-{preset}-{run['model']}"
            if not folder.exists():
                config = model_config(preset, run["model"], args.tiny)
                config.save_pretrained(folder)
                tokenizer.save_pretrained(folder)
            architecture = json.loads((folder / "config.json").read_text())["architectures"][0]
            run = dict(run, architecture=architecture, mode=MODELS[run["model"]],
                       compile=args.compile_backend if args.compile else None)
            left = deadline - time.perf_counter()
            out_of_time = out_of_time or run["estimate_s"] > left
            if out_of_time:
                mine.append(dict(run, status="skipped (time)"))
                print(f"skipped {preset} {run['model']} {run['loss']}: about {run['estimate_s']} s, {left:.0f} s left",
                      flush=True)
                continue
            # killed at most GRACE_S past the deadline: the rows of what finished are still written
            result = throughput_run(run, folder, work, corpus, out, args, timeout=max(left, 0) + GRACE_S)
            mine.append(result)
            print(json.dumps({k: v for k, v in result.items() if k not in ("estimate_s",)}), flush=True)
        add_ratios(mine)
        record(mine)
        results += mine
        for folder in work.glob(f"model-{preset}-*"):
            shutil.rmtree(folder)
    return results


def result_rows(summary: dict, args) -> list[tuple[dict, dict]]:
    """(config, metrics) of each part of a run: the FSDP check if it ran, then each throughput run
    that ran (one that failed with `out_of_memory`, `timed_out` or `failed`)."""
    rows = []
    if "fsdp_one_process" in summary:
        check = dict(summary["fsdp_one_process"])
        config = dict(part="fsdp_resume", model="tiny delta", processes=1,
                      distributed_type=check.pop("distributed_type"))
        check.pop("checkpoint_files")
        rows.append((config, check))
    rows += [throughput_row(r, args) for r in summary.get("throughput", ()) if r.get("status") != "skipped (time)"]
    return rows


def throughput_row(r: dict, args) -> tuple[dict, dict]:
    config = dict(part="throughput", preset=("tiny-" if args.tiny else "") + r["preset"], model=r["model"],
                  architecture=r["architecture"], mode=r["mode"],
                  routing="auto" if r["mode"] is not None else None, loss=r["loss"], compile=r["compile"],
                  checkpointing=r["checkpointing"], seq_length=r["seq_length"], batch_size=r["batch_size"],
                  steps=r["steps"], warmup=r["warmup"], weights="float32", autocast="bfloat16")
    if "status" in r:
        figures = {r["status"].replace(" ", "_"): True}
    else:
        figures = {key: None if r[key] is None else round(r[key], digits or None) for key, digits in ROUNDING.items()
                   if key in r}
    if r["fell_back_to_reference"] is not None:
        figures["fell_back_to_reference"] = r["fell_back_to_reference"]
    return config, figures


ROUNDING = dict(tokens_per_s_median=0, tokens_per_s_vs_plain=3, peak_memory_gib=2, peak_memory_vs_plain=3,
                peak_memory_vs_chunked=3, first_step_s=1, first_loss=3, last_loss=3, write_s=1, wall_s=1)


def markdown(results: list[dict]) -> str:
    lines = ["| preset | model | loss | compile | tokens/s | x plain | peak GiB | mem x plain | fused / chunked peak |",
             "|---|---|---|---|---|---|---|---|---|"]

    def number(value, form):
        return "" if value is None else format(value, form)

    for r in results:
        head = f"| {r['preset']} | {r['model']} | {r['loss']} | {r['compile'] or 'off'} |"
        if "status" in r:
            lines.append(f"{head} {r['status']} | | | | |")
            continue
        lines.append(f"{head} {r['tokens_per_s_median']:,.0f} | {number(r.get('tokens_per_s_vs_plain'), '.3f')} | "
                     f"{number(r['peak_memory_gib'], '.2f')} | {number(r.get('peak_memory_vs_plain'), '.3f')} | "
                     f"{number(r.get('peak_memory_vs_chunked'), '.3f')} |")
    return "\n".join(lines)


def target_lines(results: list[dict]) -> list[str]:
    """The issue-42 targets met or missed by what ran (delta's rows)."""
    lines = []
    for r in results:
        if r["model"] != "delta" or "status" in r:
            continue
        if r["compile"] and "tokens_per_s_vs_plain" in r:
            ratio, goal = r["tokens_per_s_vs_plain"], TARGETS["tokens_per_s_vs_plain"]
            lines.append(f"{r['preset']} delta, {r['loss']}, compiled: {ratio:.3f}x plain tokens/s (target >= {goal}): "
                         + ("met" if ratio >= goal else "missed"))
        if r["preset"] == TARGETS["memory_preset"] and "peak_memory_vs_chunked" in r:
            ratio, goal = r["peak_memory_vs_chunked"], TARGETS["peak_memory_vs_chunked"]
            lines.append(f"{r['preset']} delta peak memory, fused-linear / chunked: {ratio:.3f} (target <= {goal}): "
                         + ("met" if ratio <= goal else "missed"))
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for the runs' logs")
    parser.add_argument("--presets", nargs="+", choices=PRESETS, default=["1B", "8B-slice"])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=["plain", "delta"],
                        help="plain: transformers' own class; standard: MHAR standard mode (a check of plain); "
                        "delta: MHAR delta H=8")
    parser.add_argument("--losses", nargs="+", default=list(LOSSES), metavar="LOSS[@PRESET,...]",
                        help=f"mhar train --loss of the runs, in this order ({', '.join(LOSSES)}), at every preset "
                        "or, with @PRESET[,PRESET], at those only (e.g. chunked@1B)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                        help="mhar train --compile on both sides (the targets' configuration)")
    parser.add_argument("--compile-backend", default="inductor")
    parser.add_argument("--steps", type=int, help="steps a run (default: per preset, SETTINGS)")
    parser.add_argument("--warmup", type=int, help="logged steps left out of the median (default: per preset)")
    parser.add_argument("--seq-length", type=int, help="default: per preset")
    parser.add_argument("--batch-size", type=int, help="default: per preset")
    parser.add_argument("--tiny", action="store_true", help="every preset shrunk (a dry run on a CPU)")
    parser.add_argument("--budget-s", type=float, default=530,
                        help="start no run whose estimate would end it past this many seconds into the script")
    parser.add_argument("--skip-fsdp", action="store_true")
    parser.add_argument("--results", type=Path, help="the results folder (default: $MHAR_RESULTS_DIR, else "
                        "benchmarks/results)")
    args = parser.parse_args(argv)
    try:
        parse_losses(args.losses, args.presets)
    except ValueError as error:
        parser.error(str(error))
    for key in ("steps", "warmup", "seq_length", "batch_size"):
        if getattr(args, key) is not None and getattr(args, key) < (0 if key == "warmup" else 1):
            parser.error(f"--{key.replace('_', '-')} {getattr(args, key)} is out of range")
    if any(s["warmup"] >= s["steps"] for s in map(lambda p: settings(p, args), args.presets)):
        parser.error("--warmup must be below --steps: the median needs a step after the warm-up")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker(argv[1:])
    args = parse_args(argv)
    began, start = utc_now(), time.perf_counter()
    runs = plan(args)
    estimate = sum(r["estimate_s"] for r in runs) + (0 if args.skip_fsdp else FSDP_ESTIMATE_S)
    print(f"{len(runs)} throughput runs" + ("" if args.skip_fsdp else " and the FSDP check")
          + f": about {estimate / 60:.1f} min {'on a CPU' if args.tiny else 'on an H100'} (estimate; --budget-s "
          f"{args.budget_s:.0f} starts no run expected to end past it)", flush=True)
    for r in runs:
        print(f"  {r['preset']} {r['model']} {r['loss']}: {r['batch_size']}x{r['seq_length']}, {r['steps']} steps"
              + (", checkpointing" if r["checkpointing"] else "") + f", ~{r['estimate_s']} s", flush=True)

    from mhar_hf.tiny import demo_corpus, train_tokenizer

    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    summary = {}

    def record(results: list[dict]) -> None:
        for config, figures in result_rows({"throughput": results}, args):
            append_result("midtrain", config, figures, date=began, folder=args.results)

    with tempfile.TemporaryDirectory(prefix="mhar-midtrain-bench-") as tmp:
        work = Path(tmp)
        tokenizer = train_tokenizer([demo_corpus()])
        corpus = work / "synthetic.jsonl"
        most = max((r["steps"] + 2) * r["batch_size"] * r["seq_length"] for r in runs)
        # enough for every run, and for the FSDP check's 8 steps x 4 rows + 8 held out, of 256 tokens
        write_synthetic_corpus(corpus, tokens=int(1.2 * max(most, 16 * 4 * 256)))
        if not args.skip_fsdp:
            summary["fsdp_one_process"] = fsdp_check(work, tokenizer, corpus, args.out)
            print(json.dumps(summary["fsdp_one_process"], indent=2), flush=True)
            for config, figures in result_rows({"fsdp_one_process": summary["fsdp_one_process"]}, args):
                append_result("midtrain", config, figures, date=began, folder=args.results)
        summary["throughput"] = throughput(work, corpus, tokenizer, args.out, args, runs,
                                           deadline=start + args.budget_s, record=record)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(markdown(summary["throughput"]))
    if not args.tiny:
        print("\n".join(target_lines(summary["throughput"])))
    print(f"wall: {time.perf_counter() - start:.0f} s")
    failed = [r for r in summary["throughput"] if r.get("status") not in (None, "skipped (time)")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
