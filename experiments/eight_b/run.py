"""The 8B path on one GPU: build a Llama-3.1-8B checkpoint, convert it, check it, train it, generate.

    python experiments/eight_b/run.py [--shape 8b|tiny] [--work DIR] [--results DIR]
        [--deadline-minutes 9] STEP...

Steps (run in the order given, sharing --work; each makes what it needs that is not there yet,
so any one of them runs alone on a fresh machine):

  convert        make the checkpoint (make_checkpoint.py), then, each from a cold page cache,
                 `cp -r` it and `mhar convert` it to delta mode (H=8, 8 blocks): wall time and peak
                 RSS of each child process
  verify         `mhar verify-identity` of source and converted model on --device in --dtype,
                 with SDPA and, where the flash_attn package imports, flash_attention_2: exit
                 status, logits bit-equal, greedy generations identical
  train          `mhar train` with LoRA (--lora-rank, routers fully trainable), activation
                 checkpointing and bf16 autocast at --seq-length, --steps steps, for the converted
                 model and for the plain Llama with identical settings (same data, same seed):
                 per-step losses (step 0 must be identical), step time, tokens/s, peak GPU memory
  train-routing  the same run of the converted model with --train-only-routing
  generate       greedy `model.generate` at batch 1 and --batch: time to first token and tokens/s
                 of the plain Llama, the converted model and, when `train` ran in this --work, the
                 mid-trained one (its LoRA adapter merged), loaded together and timed in turns;
                 whether converted and plain agree token for token

Every step appends rows (benchmarks/results_log.py's schema) to --results: eight_b_convert.jsonl,
eight_b_verify.jsonl, eight_b_train.jsonl, eight_b_generate.jsonl. A piece that the time left
before --deadline-minutes cannot hold (by the 8B estimates in ESTIMATES_S) is skipped and named
at the end; exit status 1 if anything failed or was skipped.

`--shape tiny` runs the same pipeline on a CPU in seconds (tests/test_eight_b.py); `--inline`
runs the `mhar` commands in this process instead of child processes (no per-process RSS).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.util
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "benchmarks"))
from make_checkpoint import make_checkpoint  # noqa: E402
from results_log import append_result, utc_now  # noqa: E402

STEPS = ("convert", "verify", "train", "train-routing", "generate")
HEADS, NUM_BLOCKS = 8, 8
# Settings per shape: the GPU run, and a CPU-sized one with the same structure.
SETTINGS = {
    "8b": dict(device="cuda", dtype="bfloat16", mixed_precision="bf16", seq_length=4096, steps=12, batch_size=1,
               lora_rank=16, lr=1e-4, corpus_mb=2.0, prompt_tokens=128, new_tokens=128, batch=32,
               repeats=3, max_new_tokens_verify=32),
    "tiny": dict(device="cpu", dtype="float32", mixed_precision="no", seq_length=64, steps=2, batch_size=1,
                 lora_rank=4, lr=1e-3, corpus_mb=0.3, prompt_tokens=8, new_tokens=4, batch=4,
                 repeats=2, max_new_tokens_verify=4),
}
MODEL_GB, COPY_GB = 17, 17  # the source or the converted model (16 GB each); the timed plain copy
# Seconds each piece may take at 8B on an H100 (the upper ends of README.md's estimates): a piece
# is skipped when less than this is left before the deadline. The tiny shape needs none.
ESTIMATES_S = {"make": 90, "convert_timed": 120, "convert": 60, "corpus": 30, "verify": 150, "train_run": 180,
               "generate_model": 90}


def filesystem(path: Path) -> str:
    """The type of the filesystem holding `path` (/proc/mounts' longest matching mount point)."""
    best, kind = "", "unknown"
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            _, mount, fstype, *_ = line.split()
            if str(path.resolve()).startswith(mount) and len(mount) > len(best):
                best, kind = mount, fstype
    except OSError:
        pass
    return kind


def log(message: str) -> None:
    print(f"[eight_b {time.strftime('%H:%M:%S')}] {message}", flush=True)


@dataclass
class Work:
    """Paths under --work, the settings, the clock and what went wrong."""

    root: Path
    shape: str
    results: Path | None
    deadline: float
    inline: bool
    settings: dict
    began: str = field(default_factory=utc_now)
    generate_models: tuple[str, ...] = ("llama", "mhar", "midtrained")
    explicit_models: bool = False
    failures: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    checkpoint_stats: dict | None = None

    @property
    def llama(self) -> Path:
        return self.root / "llama-3.1-8b"

    @property
    def mhar(self) -> Path:
        return self.root / "llama-3.1-8b-mhar"

    @property
    def corpus(self) -> Path:
        return self.root / "corpus"

    def run_dir(self, name: str) -> Path:
        return self.root / "runs" / name

    def fits(self, piece: str, seconds: float | None = None) -> bool:
        """Whether `piece` can still finish before the deadline; if not, it is skipped and named."""
        need = (seconds if seconds is not None else ESTIMATES_S[piece.split(":")[0]]) if self.shape == "8b" else 0
        if time.time() + need <= self.deadline:
            return True
        self.skipped.append(piece)
        log(f"skipping {piece}: {need:.0f}s needed, {self.deadline - time.time():.0f}s left")
        return False

    def record(self, benchmark: str, config: dict, metrics: dict) -> None:
        row = append_result(benchmark, {"shape": self.shape, **config}, metrics, date=self.began, folder=self.results)
        log(f"{benchmark}: {json.dumps(row['config'])} -> {json.dumps(row['metrics'])}")


# ----------------------------------------------------------------------------------------------
# Child processes

def run_child(command: list[str], timeout: float | None = None, capture: bool = False) -> dict:
    """Run `command`, its output passed through (and returned when `capture`): wall time, exit
    status and peak RSS. The peak is the child's VmHWM, read every 20 ms while it runs: the
    rusage of a child also counts the parent's memory at the fork, here the 8B run's driver."""
    import threading

    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE if capture else None,
                               stderr=subprocess.STDOUT if capture else None, text=True)
    lines: list[str] = []

    def relay():
        for line in process.stdout:
            print(line, end="", flush=True)
            lines.append(line)

    reader = threading.Thread(target=relay, daemon=True) if capture else None
    if reader:
        reader.start()
    peak, code = 0, None
    while True:
        peak = max(peak, high_water_mark(process.pid))
        try:
            code = process.wait(timeout=0.02)
            break
        except subprocess.TimeoutExpired:
            pass
        if timeout is not None and time.perf_counter() - started > timeout:
            process.kill()
            process.wait()
            log(f"killed after {timeout:.0f}s: {' '.join(command[:4])} ...")
            break
    if reader:
        reader.join(timeout=5)
    return {"seconds": time.perf_counter() - started, "max_rss_bytes": peak or None, "returncode": code,
            "output": "".join(lines)}


def high_water_mark(pid: int) -> int:
    """A running process's peak resident memory in bytes (0 once it has exited)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def mhar(work: Work, args: list[str], capture: bool = False) -> dict:
    """`mhar ARGS`: a child process (`python -m mhar_cli`), or in this process with --inline."""
    log("mhar " + " ".join(args))
    if not work.inline:
        timeout = max(work.deadline - time.time(), 1) if work.shape == "8b" else None
        return run_child([sys.executable, "-m", "mhar_cli", *args], timeout=timeout, capture=capture)
    import contextlib
    import io

    from mhar_cli import main as cli

    if args[0] == "train":
        reset_accelerate()
    started = time.perf_counter()
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer) if capture else contextlib.nullcontext():
        code = cli(args)
    if capture:
        print(buffer.getvalue(), end="")
    return {"seconds": time.perf_counter() - started, "max_rss_bytes": None, "returncode": code,
            "output": buffer.getvalue()}


def reset_accelerate() -> None:
    """A fresh accelerate state for the next in-process run (as a new process would have)."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


def evict(folder: Path) -> None:
    """Write the folder's files to disk and drop them from the page cache: the next reader reads
    the disk, as after a download on another day."""
    for file in folder.iterdir():
        if file.is_file():
            fd = os.open(file, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file())


# ----------------------------------------------------------------------------------------------
# What the steps need

def ensure_checkpoint(work: Work) -> bool:
    if (work.llama / "model.safetensors.index.json").exists():
        return True
    if not work.fits("make"):
        return False
    if work.llama.exists():
        shutil.rmtree(work.llama)
    log(f"making the {work.shape} checkpoint in {work.llama}")
    work.checkpoint_stats = make_checkpoint(work.llama, work.shape)
    log(f"checkpoint: {json.dumps(work.checkpoint_stats)}")
    return True


def ensure_converted(work: Work) -> bool:
    if (work.mhar / "mhar_conversion.json").exists():
        return True
    if not ensure_checkpoint(work) or not work.fits("convert"):
        return False
    done = mhar(work, ["convert", str(work.llama), str(work.mhar), "--heads", str(HEADS), "--num-blocks", str(NUM_BLOCKS)])
    if done["returncode"] != 0:
        work.failures.append(f"convert exited {done['returncode']}")
        return False
    return True


def ensure_corpus(work: Work) -> bool:
    """A small jsonl corpus of local text (experiments/build_corpus.py): the installed
    transformers package's sources (8b), this repository's mhar_hf (tiny)."""
    if (work.corpus / "train.jsonl").exists():
        return True
    if not work.fits("corpus"):
        return False
    if work.shape == "tiny":
        root = REPO / "mhar_hf"
    else:
        root = Path(importlib.util.find_spec("transformers").submodule_search_locations[0])
    sys.path.insert(0, str(REPO / "experiments"))
    from build_corpus import build

    stats = build(work.corpus, [root], max_mb=work.settings["corpus_mb"], val_permille=0, vocab_size=300, tokenizer_mb=0.05)
    log(f"corpus: {stats['train']['files']} files, {stats['train']['bytes'] / 1e6:.1f} MB from {root}")
    return True


# ----------------------------------------------------------------------------------------------
# Steps

def step_convert(work: Work) -> None:
    made_here = not (work.llama / "model.safetensors.index.json").exists()
    if not ensure_checkpoint(work) or not work.fits("convert_timed"):
        return
    if work.mhar.exists():
        shutil.rmtree(work.mhar)
    source_bytes = folder_bytes(work.llama)
    shards = sorted(f.stat().st_size for f in work.llama.glob("*.safetensors"))
    evict(work.llama)
    copy = work.root / "plain-copy"
    shutil.rmtree(copy, ignore_errors=True)
    log(f"cp -r {work.llama} {copy}, then fsync of each copied file (the converter fsyncs each shard it writes)")
    cp = run_child(["cp", "-r", str(work.llama), str(copy)])
    started = time.perf_counter()
    evict(copy)
    cp["seconds"] += time.perf_counter() - started
    if cp["returncode"] != 0:
        work.failures.append(f"cp exited {cp['returncode']}")
    shutil.rmtree(copy, ignore_errors=True)
    evict(work.llama)
    converted = mhar(work, ["convert", str(work.llama), str(work.mhar), "--heads", str(HEADS), "--num-blocks", str(NUM_BLOCKS)])
    if converted["returncode"] != 0:
        work.failures.append(f"convert exited {converted['returncode']}")
    metrics = {
        "source_bytes": source_bytes, "largest_shard_bytes": shards[-1], "shards": len(shards),
        "cp_s": cp["seconds"], "cp_max_rss_bytes": cp["max_rss_bytes"],
        "convert_s": converted["seconds"], "convert_max_rss_bytes": converted["max_rss_bytes"],
        "convert_over_cp": converted["seconds"] / cp["seconds"] if cp["seconds"] else None,
        "convert_rss_over_largest_shard": (converted["max_rss_bytes"] / shards[-1]) if converted["max_rss_bytes"] else None,
        "converted_bytes": folder_bytes(work.mhar) if work.mhar.exists() else None,
        "ok": converted["returncode"] == 0,
    }
    if made_here and work.checkpoint_stats:
        stats = work.checkpoint_stats
        metrics.update(make_s=stats["total_s"], make_weights_gb_per_s=stats["weights_gb_per_s"],
                       make_max_rss_bytes=stats["max_rss_bytes"], make_threads=stats["threads"])
    work.record("eight_b_convert", {"heads": HEADS, "num_blocks": NUM_BLOCKS, "options": "defaults",
                                    "filesystem": filesystem(work.root), "inline": work.inline}, metrics)


def attention_implementations(device: str) -> list[str]:
    found = ["sdpa"]
    if device.startswith("cuda") and importlib.util.find_spec("flash_attn") is not None:
        found.append("flash_attention_2")
    return found


def parse_identity(output: str) -> dict:
    """The figures of `mhar verify-identity`'s summary line for one dtype."""
    for line in output.splitlines():
        if "logits bit-equal:" in line:
            parts = line.split()
            return {"max_abs_logit_diff": float(parts[parts.index("diff|") + 1]),
                    "logits_equal": "bit-equal: yes" in line, "generations_match": "match: yes" in line}
    return {}


def step_verify(work: Work) -> None:
    if not ensure_converted(work):
        return
    settings = work.settings
    for attn in attention_implementations(settings["device"]):
        if not work.fits(f"verify:{attn}", ESTIMATES_S["verify"]):
            continue
        done = mhar(work, ["verify-identity", str(work.llama), str(work.mhar), "--dtypes", settings["dtype"],
                           "--device", settings["device"], "--attn-implementation", attn,
                           "--max-new-tokens", str(settings["max_new_tokens_verify"])], capture=True)
        if done["returncode"] != 0:
            work.failures.append(f"verify-identity ({attn}) exited {done['returncode']}")
        work.record("eight_b_verify", {"dtype": settings["dtype"], "device": settings["device"], "attn_implementation": attn,
                                       "max_new_tokens": settings["max_new_tokens_verify"]},
                    {"identical": done["returncode"] == 0, "exit_status": done["returncode"], "seconds": done["seconds"],
                     "max_rss_bytes": done["max_rss_bytes"], **parse_identity(done["output"])})
    if settings["device"].startswith("cuda") and "flash_attention_2" not in attention_implementations(settings["device"]):
        log("flash_attention_2: the flash_attn package is not installed here; checked with sdpa only")
        work.record("eight_b_verify", {"dtype": settings["dtype"], "device": settings["device"],
                                       "attn_implementation": "flash_attention_2"}, {"installed": False})


def train_run(work: Work, name: str, model: Path, *extra: str) -> dict | None:
    """One `mhar train` run; its per-step figures from metrics.jsonl."""
    settings = work.settings
    output = work.run_dir(name)
    if output.exists():
        shutil.rmtree(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    args = ["train", "--model", str(model), "--data", str(work.corpus / "train.jsonl"), "--output", str(output),
            "--seq-length", str(settings["seq_length"]), "--batch-size", str(settings["batch_size"]),
            "--max-steps", str(settings["steps"]), "--lr", str(settings["lr"]), "--schedule", "constant",
            "--warmup-steps", "0", "--mixed-precision", settings["mixed_precision"], "--gradient-checkpointing",
            "--val-sequences", "1", "--eval-every", "1000000", "--save-every", "1000000", "--report-to", "none",
            "--seed", "0", *extra]
    done = mhar(work, args)
    if done["returncode"] != 0:
        work.failures.append(f"train {name} exited {done['returncode']}")
        return None
    steps = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    tokens = settings["seq_length"] * settings["batch_size"]
    step_s = [tokens / s["tokens_per_s"] for s in steps]
    later = step_s[1:] or step_s
    return {
        "losses": [s["loss"] for s in steps], "step0_loss": steps[0]["loss"],
        "first_step_s": step_s[0], "step_s_median": statistics.median(later),
        "tokens_per_s_median": tokens / statistics.median(later),
        "peak_gpu_gib": max((s.get("peak_memory_gib") or 0.0) for s in steps) or None,
        "gate_abs_mean_last": steps[-1].get("gate_abs_mean"), "val_loss": steps[-1].get("val_loss"),
        "wall_s": done["seconds"], "max_rss_bytes": done["max_rss_bytes"],
        "checkpoint_bytes": sum(f.stat().st_size for f in (output / "checkpoints").rglob("*") if f.is_file()),
    }


def train_config(work: Work, model: str, trainable: str) -> dict:
    s = work.settings
    return {"model": model, "trainable": trainable, "seq_length": s["seq_length"], "batch_size": s["batch_size"],
            "steps": s["steps"], "lr": s["lr"], "mixed_precision": s["mixed_precision"], "activation_checkpointing": True,
            "seed": 0}


def step_train(work: Work) -> None:
    if not (ensure_converted(work) and ensure_corpus(work)):
        return
    rank = work.settings["lora_rank"]
    results = {}
    for name, model in (("mhar-lora", work.mhar), ("llama-lora", work.llama)):
        if not work.fits(f"train_run:{name}", ESTIMATES_S["train_run"]):
            continue
        metrics = train_run(work, name, model, "--lora-rank", str(rank))
        if metrics is not None:
            results[name] = metrics
            work.record("eight_b_train", train_config(work, "mhar-delta-h8" if name.startswith("mhar") else "llama",
                                                      f"lora-r{rank}"), metrics)
    if len(results) == 2:
        a, b = results["mhar-lora"], results["llama-lora"]
        same = a["step0_loss"] == b["step0_loss"]
        if not same:
            work.failures.append(f"step-0 losses differ: MHAR {a['step0_loss']!r}, Llama {b['step0_loss']!r}")
        work.record("eight_b_train", {**train_config(work, "mhar-delta-h8 vs llama", f"lora-r{rank}"), "comparison": True},
                    {"step0_identical": same, "step0_loss_mhar": a["step0_loss"], "step0_loss_llama": b["step0_loss"],
                     "tokens_per_s_ratio": a["tokens_per_s_median"] / b["tokens_per_s_median"],
                     "peak_gpu_ratio": (a["peak_gpu_gib"] / b["peak_gpu_gib"]) if a["peak_gpu_gib"] and b["peak_gpu_gib"] else None})


def step_train_routing(work: Work) -> None:
    if not (ensure_converted(work) and ensure_corpus(work)):
        return
    if not work.fits("train_run:mhar-routing", ESTIMATES_S["train_run"]):
        return
    metrics = train_run(work, "mhar-routing", work.mhar, "--train-only-routing")
    if metrics is not None:
        work.record("eight_b_train", train_config(work, "mhar-delta-h8", "routing"), metrics)


def prompt_batch(work: Work, tokenizer, batch: int, length: int):
    """`batch` rows of `length` token ids cut from the corpus (the same for every model)."""
    import torch

    ids: list[int] = []
    with (work.corpus / "train.jsonl").open() as handle:
        for line in handle:
            ids += tokenizer(json.loads(line)["text"], add_special_tokens=False)["input_ids"]
            if len(ids) >= batch * length:
                break
    if len(ids) < batch * length:
        raise ValueError(f"the corpus holds {len(ids)} tokens, fewer than {batch} prompts of {length}")
    return torch.tensor(ids[: batch * length]).reshape(batch, length)


def timed_generate(model, ids, new: int, pad: int, sync):
    """Greedy generation of exactly `new` tokens after `ids`: (the new tokens, seconds)."""
    import torch

    sync()
    started = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, pad_token_id=pad)
    sync()
    return out[:, ids.shape[1]:], time.perf_counter() - started


def step_generate(work: Work) -> None:
    """Every model of `--generate-models` loaded at once (three 8B models take 48 GB), then timed in
    turns, `repeats` rounds, each keeping its fastest: the host paces eager decoding at these sizes
    and its pace drifts over minutes, so models timed one after another are not compared."""
    if not (ensure_converted(work) and ensure_corpus(work)):
        return
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    importlib.import_module("mhar_hf")  # registers the mhar model type

    settings = work.settings
    device = torch.device(settings["device"])
    dtype = getattr(torch, settings["dtype"])
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    tokenizer = AutoTokenizer.from_pretrained(work.llama)
    pad = tokenizer.eos_token_id
    prompts = prompt_batch(work, tokenizer, settings["batch"], settings["prompt_tokens"]).to(device)
    adapter = work.run_dir("mhar-lora") / "model"
    available = {"llama": ("llama", work.llama, None), "mhar": ("mhar-delta-h8", work.mhar, None),
                 "midtrained": ("mhar-delta-h8-midtrained", work.mhar, adapter)}
    loaded = []  # (name, model, load seconds, mean |gate| of a mid-trained model, weight bytes)
    for key in work.generate_models:
        if key == "midtrained" and not (adapter / "adapter_config.json").exists():
            log("generate: no mid-trained model (run the train step first in this --work); left out")
            if work.explicit_models:
                work.failures.append("generate: midtrained asked for, but no LoRA run of the converted model exists")
            continue
        name, path, lora = available[key]
        if not work.fits(f"generate_model:{name}", ESTIMATES_S["generate_model"] * (len(loaded) + 1)):  # all are timed at the end
            continue
        started = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa", device_map=device)
        gates = None
        if lora is not None:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, lora).merge_and_unload()
            values = [p.detach().float().abs().reshape(-1) for n, p in model.named_parameters() if n.endswith("_router.gate")]
            gates = torch.cat(values).mean().item() if values else None
        model.eval()
        sync()
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        loaded.append((name, model, time.perf_counter() - started, gates, weights))

    new = settings["new_tokens"]
    for batch in sorted({1, settings["batch"]}):
        ids = prompts[:batch]
        for _, model, *_ in loaded:
            # warm-up as long as a timed run: kernels compiled, and the allocator holds the blocks a
            # cache of every length up to the last takes (growing it costs device allocations)
            timed_generate(model, ids, new, pad, sync)
        best: dict[str, dict] = {}
        for _ in range(settings["repeats"]):
            for name, model, _, _, weights in loaded:
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated() if cuda else 0
                _, first_s = timed_generate(model, ids, 1, pad, sync)
                tokens, total_s = timed_generate(model, ids, new, pad, sync)
                # this model alone: its weights, plus what its generation allocated at most
                peak = (weights + torch.cuda.max_memory_allocated() - before) / 2**30 if cuda else None
                tokens = tokens.cpu()
                # the same tokens in every round: a model that parts from another is then not
                # just parting from itself (nondeterministic kernels)
                repeatable = name not in best or (best[name]["repeatable"] and torch.equal(tokens, best[name]["tokens"]))
                if name not in best or total_s < best[name]["total_s"]:
                    best[name] = {"ttft_s": first_s, "total_s": total_s, "tokens": tokens, "peak_gpu_gib": peak}
                best[name]["repeatable"] = repeatable
        for name, _, load_s, gates, _ in loaded:
            run = best[name]
            total_s, first_s = run["total_s"], run["ttft_s"]
            metrics = {"load_s": load_s, "ttft_s": first_s, "total_s": total_s, "tokens_per_s": batch * new / total_s,
                       "decode_tokens_per_s": batch * (new - 1) / (total_s - first_s) if total_s > first_s else None,
                       "peak_gpu_gib": run["peak_gpu_gib"], "repeats": settings["repeats"],
                       "same_tokens_every_repeat": run["repeatable"]}
            if name != "llama" and "llama" in best:
                plain = best["llama"]
                metrics["tokens_per_s_ratio_vs_llama"] = plain["total_s"] / total_s
                same = run["tokens"] == plain["tokens"]
                metrics["same_tokens_as_llama"] = bool(same.all())
                # per sequence, the first new token that differs (None: all the same): a late first
                # difference is a near-tie greedy step resolved the other way, not a different model
                metrics["first_difference"] = [int(row.logical_not().nonzero()[0]) if not row.all() else None
                                               for row in same]
                if gates is None and not metrics["same_tokens_as_llama"]:
                    work.failures.append(f"generate: converted and plain models differ at batch {batch}")
            if gates is not None:
                metrics["gate_abs_mean"] = gates
            work.record("eight_b_generate", {"model": name, "batch": batch, "prompt_tokens": settings["prompt_tokens"],
                                             "new_tokens": new, "dtype": settings["dtype"], "attn_implementation": "sdpa",
                                             "greedy": True, "cache": "dynamic"}, metrics)
    del loaded
    gc.collect()  # the PEFT wrapper of the mid-trained model holds references until collected
    if cuda:
        torch.cuda.empty_cache()


STEP_FUNCTIONS = {"convert": step_convert, "verify": step_verify, "train": step_train,
                  "train-routing": step_train_routing, "generate": step_generate}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("steps", nargs="+", choices=STEPS, metavar="STEP", help=f"any of {', '.join(STEPS)}")
    parser.add_argument("--shape", choices=("8b", "tiny"), default="8b")
    parser.add_argument("--work", type=Path, default=Path("/tmp/eight-b"), help="models, corpus and runs")
    parser.add_argument("--results", type=Path, default=None,
                        help="folder of the .jsonl rows (default: $MHAR_RESULTS_DIR, else benchmarks/results)")
    parser.add_argument("--deadline-minutes", type=float, default=9.0,
                        help="skip pieces that would end later than this after the start")
    parser.add_argument("--inline", action="store_true", help="run the mhar commands in this process")
    parser.add_argument("--steps-per-run", type=int, default=None, help="optimizer steps of each training run")
    parser.add_argument("--seq-length", type=int, default=None)
    parser.add_argument("--device", default=None, help="default: cuda (8b), cpu (tiny)")
    parser.add_argument("--generate-models", default=None,
                        help="generate: comma-separated, from llama, mhar, midtrained, each once (default: all;"
                             " midtrained when train ran in this --work); loaded together, timed in turns")
    args = parser.parse_args(argv)
    settings = dict(SETTINGS[args.shape])
    for key, value in (("steps", args.steps_per_run), ("seq_length", args.seq_length), ("device", args.device)):
        if value is not None:
            settings[key] = value
    args.work.mkdir(parents=True, exist_ok=True)
    work = Work(args.work, args.shape, args.results, time.time() + args.deadline_minutes * 60, args.inline, settings)
    if args.generate_models:
        work.generate_models = tuple(m.strip() for m in args.generate_models.split(","))
        work.explicit_models = True
        unknown = set(work.generate_models) - {"llama", "mhar", "midtrained"}
        if unknown:
            parser.error(f"--generate-models: unknown {sorted(unknown)}")
        if len(set(work.generate_models)) < len(work.generate_models):
            parser.error("--generate-models: name each model once (they are timed in turns)")
    log(f"shape {args.shape}, steps {' '.join(args.steps)}, settings {json.dumps(settings)}")
    free = shutil.disk_usage(args.work).free
    log(f"{args.work}: {free / 1e9:.0f} GB free on a {filesystem(args.work)} filesystem")
    # what is still to be written: a model already in --work (an earlier command on a machine still
    # held) is reused, except the converted one, which `convert` writes again beside a timed copy
    to_write = [not (work.llama / "model.safetensors.index.json").exists(),
                "convert" in args.steps or not (work.mhar / "mhar_conversion.json").exists()]
    needed = MODEL_GB * sum(to_write) + (COPY_GB if "convert" in args.steps else 0)
    if args.shape == "8b" and free < needed * 1e9:
        log(f"too little disk: these steps need {needed} GB more (16 GB for each model not yet in {args.work}, "
            f"{COPY_GB} GB for convert's timed copy)")
        return 1
    for step in args.steps:
        started = time.perf_counter()
        try:
            STEP_FUNCTIONS[step](work)
        except Exception as error:  # the next step may still run; the status says it failed
            import traceback

            traceback.print_exc()
            work.failures.append(f"{step}: {type(error).__name__}: {error}")
        log(f"{step} done in {time.perf_counter() - started:.0f}s")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    log(f"finished: peak RSS of this process {rss / 1e9:.1f} GB; failed: {work.failures or 'nothing'}; "
        f"skipped: {work.skipped or 'nothing'}")
    return 1 if work.failures or work.skipped else 0


if __name__ == "__main__":
    sys.exit(main())
