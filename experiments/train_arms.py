"""Train arms of the plan with `mhar train`, in pieces that continue with `--resume`.

    python experiments/train_arms.py --corpus DIR --runs DIR [--shape small]
        (--tokens N | --budget FILE | --calibrate) [--parallel K] [--piece-minutes 8]
        [--deadline UNIX_TIME] ARM...

RUNS/init.log is the log of making the initial models; RUNS/ARM/ holds init/ (the initial model: fresh, or converted from another arm), run/ (what
`mhar train` writes: metrics.jsonl, checkpoints/, model/), train.log and info.json (pieces, wall
time, settings). Arms train K at a time on one device; the first one alone until it has packed
the corpus (the others then read the packed cache), and an arm made from another arm's model
(the mid-training miniature) starts once that arm has finished.

A piece is one `mhar train ... --resume` process, stopped after --piece-minutes; the next piece
resumes from the run's newest checkpoint, so the run's metrics read as one uninterrupted run.
Nothing starts a piece past --deadline.

--calibrate first trains plain and full-h8 for a few steps each, alone (RUNS/ARM/calibration/),
and sets the token budget per arm to what fits before the deadline at their measured tokens/s,
counting the arms as if they ran one after the other, continuations at their share of the budget
(RUNS/budget.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from init_models import MHAR  # noqa: E402
from plan import (  # noqa: E402
    ARMS, MIDTRAIN_FRACTION, MIDTRAIN_OPTIMISER, MIDTRAIN_SEED, OPTIMISER, RECIPES, SHAPES, step_tokens, steps_for,
)

REPO = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
CALIBRATION_ARMS = ("plain", "full-h8")
CALIBRATION_STEPS = {"small": 40, "tiny": 4}
LOG_EVERY = {"small": 10, "tiny": 1}
RESERVE_SECONDS = 90  # start-up, final evaluation and saves, and a margin
ROUTED_SAFETY = 0.85  # routed arms other than full-h8 may be slower than it


def environment(parallel: int) -> dict:
    threads = max(1, min(4, (os.cpu_count() or 1) // max(parallel, 1)))
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": str(threads),
            "HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "HF_HUB_OFFLINE": "1"}


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def commit() -> str | None:
    """The commit the runs train at: $EXPERIMENT_COMMIT (a copy of the tree without .git), else git's."""
    if os.environ.get("EXPERIMENT_COMMIT"):
        return os.environ["EXPERIMENT_COMMIT"]
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return done.stdout.strip() or None


def train_command(arm_name: str, model: Path, corpus: Path, output: Path, shape: str, steps: int) -> list[str]:
    import torch

    arm, recipe = ARMS[arm_name], RECIPES[shape]
    opt = MIDTRAIN_OPTIMISER if arm.midtrain else OPTIMISER
    warmup = min(steps - 1, max(1, round(steps * recipe["warmup_fraction"])))
    log_every = min(LOG_EVERY[shape], steps)
    eval_every = max(1, steps // recipe["evals"] // log_every) * log_every  # validation runs on logged steps only
    return [
        *MHAR, "train", "--model", str(model), "--tokenizer", str(corpus / "tokenizer"),
        "--data", str(corpus / "train.jsonl"), "--val-data", str(corpus / "val.jsonl"), "--output", str(output),
        "--seq-length", str(recipe["seq_length"]), "--batch-size", str(recipe["batch_size"]),
        "--grad-accum", str(recipe["grad_accum"]),
        "--val-sequences", str(recipe["val_sequences"]), "--max-steps", str(steps),
        "--seed", str(MIDTRAIN_SEED if arm.midtrain else arm.seed),
        "--lr", str(opt["lr"]), "--min-lr-ratio", str(opt["min_lr_ratio"]), "--schedule", opt["schedule"],
        "--warmup-steps", str(warmup), "--weight-decay", str(opt["weight_decay"]),
        "--adam-betas", *map(str, opt["adam_betas"]), "--clip", str(opt["clip"]),
        "--mixed-precision", "bf16" if torch.cuda.is_available() else "no",
        "--eval-every", str(eval_every), "--save-every", str(max(1, steps // 10)),
        "--keep-last", "1", "--log-every", str(log_every), "--report-to", "none", "--resume",
    ]


def finished(output: Path, steps: int) -> bool:
    from mhar_cli import folder_module

    record = folder_module().TrainingRecord.read_if_present(output / "model")  # without loading transformers
    return record is not None and record.steps == steps


def run_pieces(command: list[str], output: Path, log: Path, steps: int, piece_seconds: float, deadline: float,
               env: dict, packed: threading.Event | None = None) -> list[dict]:
    """`command` as pieces of at most `piece_seconds` until the run has finished, failed, or
    the deadline stops it. Sets `packed` once the run has logged a step (its corpus is packed)."""
    pieces = []
    while not finished(output, steps):
        start = time.time()
        limit = min(piece_seconds, deadline - start)
        if limit <= 0:
            break
        with log.open("a") as handle:
            handle.write(f"\n# piece {len(pieces) + 1}: {' '.join(command)}\n")
            handle.flush()
            process = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, cwd=REPO, env=env)
            stopped = False
            while process.poll() is None:
                if packed is not None and (output / "metrics.jsonl").is_file():
                    packed.set()
                if time.time() - start > limit:
                    process.terminate()
                    try:
                        process.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        process.kill()
                        process.wait()
                    stopped = True
                    break
                time.sleep(1.0)
        pieces.append({"seconds": round(time.time() - start, 1), "returncode": process.returncode, "stopped": stopped})
        if not stopped:
            break  # finished, or failed: the log says why
    if packed is not None:
        packed.set()
    return pieces


def initialise(arms: list[str], runs: Path, corpus: Path, shape: str, env: dict) -> None:
    """RUNS/ARM/init for each arm that needs one, by init_models.py in a process of its own."""
    needed = [a for a in arms if not (ARMS[a].convert_from and ARMS[a].mode != "delta")]
    if not needed:
        return
    command = [sys.executable, str(HERE / "init_models.py"), "--corpus", str(corpus), "--runs", str(runs),
               "--shape", shape, *needed]
    with (runs / "init.log").open("a") as handle:
        subprocess.run(command, check=True, cwd=REPO, env=env, stdout=handle, stderr=subprocess.STDOUT)


def model_folder(arm_name: str, runs: Path) -> Path:
    """What the arm trains from: its init/, or (the mid-training control) the source's trained model."""
    arm = ARMS[arm_name]
    if arm.convert_from and arm.mode != "delta":
        return runs / arm.convert_from / "run" / "model"
    return runs / arm_name / "init"


def train_arm(arm_name: str, runs: Path, corpus: Path, shape: str, tokens: int, parallel: int,
              piece_seconds: float, deadline: float, packed: threading.Event | None,
              wait_for: threading.Event | None, output_name: str = "run") -> dict:
    env = environment(parallel)
    folder = runs / arm_name
    folder.mkdir(parents=True, exist_ok=True)
    steps = steps_for(RECIPES[shape], tokens, MIDTRAIN_FRACTION if ARMS[arm_name].midtrain else 1.0)
    info = {"arm": arm_name, "shape": shape, "steps": steps, "budget_tokens": tokens, "parallel": parallel,
            "device": device_name(), "commit": commit(), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        if ARMS[arm_name].mode == "delta":
            initialise([arm_name], runs, corpus, shape, env)
        model = model_folder(arm_name, runs)
        if wait_for is not None:
            wait_for.wait()
        output = folder / output_name
        command = train_command(arm_name, model, corpus, output, shape, steps)
        info["pieces"] = run_pieces(command, output, folder / "train.log", steps, piece_seconds, deadline, env, packed)
        info["finished"] = finished(output, steps)
    except Exception as error:  # noqa: BLE001  one arm's failure is recorded; the others go on
        info.update(finished=False, error=repr(error))
    finally:
        if packed is not None:
            packed.set()
    info["wall_seconds"] = round(sum(p["seconds"] for p in info.get("pieces", [])), 1)
    (folder / f"info{'' if output_name == 'run' else '-' + output_name}.json").write_text(json.dumps(info, indent=2) + "\n")
    print(json.dumps({k: info[k] for k in ("arm", "steps", "finished", "wall_seconds")}), flush=True)
    return info


def median_speed(metrics: Path) -> float:
    """Median tokens/s of the logged windows after the first (which holds warm-up and compiles)."""
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    speeds = [r["tokens_per_s"] for r in records[1:]] or [records[0]["tokens_per_s"]]
    return statistics.median(speeds)


def calibrate(runs: Path, corpus: Path, shape: str, arms: list[str], deadline: float) -> dict:
    """Train the calibration arms alone for a few steps; the budget per arm that fits before the deadline."""
    per_step = step_tokens(RECIPES[shape])
    initialise(list(CALIBRATION_ARMS), runs, corpus, shape, environment(1))
    speeds = {}
    for arm_name in CALIBRATION_ARMS:
        train_arm(arm_name, runs, corpus, shape, CALIBRATION_STEPS[shape] * per_step, 1, 3600.0, deadline,
                  None, None, output_name="calibration")
        speeds[arm_name] = median_speed(runs / arm_name / "calibration" / "metrics.jsonl")
    later_wave = any(ARMS[a].convert_from for a in arms)
    seconds = deadline - time.time() - RESERVE_SECONDS * (2 if later_wave else 1)
    per_token = sum((MIDTRAIN_FRACTION if ARMS[a].midtrain else 1.0)
                    * (1 / speeds["plain"] if ARMS[a].mode in ("standard", "qwen3") else 1 / (speeds["full-h8"] * ROUTED_SAFETY))
                    for a in arms)
    tokens = max(2, int(seconds / per_token) // per_step) * per_step
    budget = {"tokens_per_arm": tokens, "calibration_tokens_per_s": speeds, "seconds_available": round(seconds),
              "arms": arms, "device": device_name(), "date": time.strftime("%Y-%m-%d")}
    (runs / "budget.json").write_text(json.dumps(budget, indent=2) + "\n")
    print(json.dumps(budget), flush=True)
    return budget


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", type=Path, required=True, help="folder written by build_corpus.py")
    parser.add_argument("--runs", type=Path, required=True)
    parser.add_argument("--shape", choices=SHAPES, default="small")
    budget = parser.add_mutually_exclusive_group(required=True)
    budget.add_argument("--tokens", type=int, help="training tokens per from-scratch arm")
    budget.add_argument("--budget", type=Path, help="a budget.json written by --calibrate")
    budget.add_argument("--calibrate", action="store_true", help="measure, then fit the budget before --deadline")
    parser.add_argument("--parallel", type=int, default=1, help="arms training at once")
    parser.add_argument("--piece-minutes", type=float, default=8.0)
    parser.add_argument("--deadline", type=float, default=float("inf"), help="UNIX time after which no piece starts")
    parser.add_argument("arms", nargs="+", choices=ARMS)
    args = parser.parse_args(argv)
    args.runs.mkdir(parents=True, exist_ok=True)

    if args.calibrate:
        tokens = calibrate(args.runs, args.corpus, args.shape, args.arms, args.deadline)["tokens_per_arm"]
    elif args.budget:
        tokens = json.loads(args.budget.read_text())["tokens_per_arm"]
    else:
        tokens = args.tokens
    packed = None if args.calibrate else threading.Event()
    initialise([a for a in args.arms if not ARMS[a].convert_from], args.runs, args.corpus, args.shape, environment(1))
    waves = [[a for a in args.arms if not ARMS[a].convert_from], [a for a in args.arms if ARMS[a].convert_from]]
    results = []
    for wave in filter(None, waves):
        with ThreadPoolExecutor(max_workers=args.parallel) as pool:
            futures = [pool.submit(train_arm, arm, args.runs, args.corpus, args.shape, tokens, args.parallel,
                                   args.piece_minutes * 60, args.deadline,
                                   packed if i == 0 else None, packed if i > 0 else None)
                       for i, arm in enumerate(wave)]
            results += [f.result() for f in futures]
        packed = None
    sys.exit(0 if all(r.get("finished") for r in results) else 1)


if __name__ == "__main__":
    main()
