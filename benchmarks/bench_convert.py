"""Conversion speed and memory on a checkpoint with Llama-3.1-8B's exact shapes.

    python benchmarks/bench_convert.py [--workdir DIR] [--repeats 4]

Writes a synthetic bf16 checkpoint (random values, the published config, the published 4-shard
layout: about 16 GB) into a temporary folder, then alternates a plain copy of the same files and
`mhar convert` (each in its own process), evicting the source files from the page cache before
every run so both read from disk. Reports wall times, the ratio, and the converter's peak RSS
against the largest shard, and appends them to `results/convert.jsonl` (`results_log.py`; gpu
"cpu"). Needs ~33 GB of free disk; everything is deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from results_log import append_result, utc_now

REPO = Path(__file__).resolve().parent.parent
REAL_CONFIG = REPO / "tests" / "fixtures" / "real_configs" / "Llama-3.1-8B.json"
PUBLISHED_SHARD_BYTES = (4976698672, 4999802720, 4915916176, 1168138808)
SHARD_LIMIT = 5 * 10**9  # what save_pretrained used for the published files
BLOCK = 64 * 2**20  # bytes of random bf16 values, written over and over

COPY = """
import os, shutil, sys, time
src, dst = sys.argv[1], sys.argv[2]
os.makedirs(dst)
for name in sorted(os.listdir(src)):
    shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))
    fd = os.open(os.path.join(dst, name), os.O_RDONLY); os.fsync(fd); os.close(fd)
"""
CONVERT = """
import json, resource, sys, time
t0 = time.perf_counter()
from mhar_hf.convert import convert_checkpoint
t1 = time.perf_counter()
convert_checkpoint(sys.argv[1], sys.argv[2], log=lambda line: None)
t2 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "conversion_s": t2 - t1,
                  "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def llama_8b_layout():
    """(name, shape) of every tensor of Llama-3.1-8B, in state-dict order, and its config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = json.loads(REAL_CONFIG.read_text())
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return [(name, tuple(t.shape)) for name, t in model.state_dict().items()], config


def write_checkpoint(folder: Path) -> list[int]:
    """The synthetic checkpoint; returns the shard file sizes."""
    layout, config = llama_8b_layout()
    folder.mkdir(parents=True)
    config.save_pretrained(folder)
    shards, size = [[]], 0
    for name, shape in layout:
        nbytes = 2 * int(torch.Size(shape).numel())
        if shards[-1] and size + nbytes > SHARD_LIMIT:
            shards.append([])
            size = 0
        shards[-1].append((name, shape, nbytes))
        size += nbytes
    block = memoryview((torch.randn(BLOCK // 2) * 0.02).to(torch.bfloat16).view(torch.uint8).numpy())
    weight_map, sizes = {}, []
    for i, shard in enumerate(shards, 1):
        file = folder / f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name, shape, nbytes in shard:
            header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            weight_map[name] = file.name
        encoded = json.dumps(header).encode()
        encoded += b" " * (-len(encoded) % 8)
        with open(file, "wb") as f:
            f.write(struct.pack("<Q", len(encoded)) + encoded)
            for remaining in (n for _, _, n in shard):
                while remaining:
                    chunk = block[: min(remaining, len(block))]
                    f.write(chunk)
                    remaining -= len(chunk)
            f.flush()
            os.fsync(f.fileno())
        sizes.append(file.stat().st_size)
    index = {"metadata": {"total_size": sum(n for shard in shards for _, _, n in shard)}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return sizes


def evict(folder: Path) -> None:
    """Drop the folder's (clean) pages from the page cache, so the next run reads from disk."""
    for file in folder.iterdir():
        fd = os.open(file, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def timed(script: str, *args: str) -> tuple[float, str]:
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, check=True)
    return time.perf_counter() - t0, done.stdout


def summary(rows: list[dict], sizes: list[int]) -> dict:
    """The runs' figures, their best times, the ratios and the peak RSS against the largest shard."""
    best = {key: min(r[key] for r in rows) for key in ("copy_s", "convert_s", "conversion_s")}
    return {"runs": rows, "best": best, "ratio_of_best": best["convert_s"] / best["copy_s"],
            "median_ratio": statistics.median(r["ratio"] for r in rows),
            "max_rss_bytes": max(r["max_rss_bytes"] for r in rows),
            "rss_over_largest_shard": max(r["max_rss_bytes"] for r in rows) / max(sizes)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()
    began = utc_now()
    root = Path(tempfile.mkdtemp(prefix="bench-convert-", dir=args.workdir))
    try:
        src = root / "llama-3.1-8b"
        t0 = time.perf_counter()
        sizes = write_checkpoint(src)
        print(f"synthetic checkpoint: {len(sizes)} shards {sizes} (published {list(PUBLISHED_SHARD_BYTES)}), "
              f"written in {time.perf_counter() - t0:.0f}s")
        rows = []
        for repeat in range(args.repeats):
            row = {}
            # Alternate which goes first, so drift in the (shared) disk's speed hits both alike.
            for job in ("copy", "convert") if repeat % 2 == 0 else ("convert", "copy"):
                evict(src)
                out_dir = root / job
                seconds, out = timed(COPY if job == "copy" else CONVERT, str(src), str(out_dir))
                shutil.rmtree(out_dir)
                row[f"{job}_s"] = seconds
                if job == "convert":
                    row.update(json.loads(out.strip().splitlines()[-1]))
            row["ratio"] = row["convert_s"] / row["copy_s"]
            rows.append(row)
            print(f"run {repeat + 1}: copy {row['copy_s']:.1f}s, convert {row['convert_s']:.1f}s (import "
                  f"{row['import_s']:.1f}s, conversion {row['conversion_s']:.1f}s) = {row['ratio']:.2f}x copy; peak RSS "
                  f"{row['max_rss_bytes'] / 1e9:.2f} GB = {row['max_rss_bytes'] / max(sizes):.2f}x largest shard")
        metrics = summary(rows, sizes)
        print(json.dumps(metrics, indent=2))
        append_result("convert", dict(checkpoint="Llama-3.1-8B shapes, synthetic bf16", shard_bytes=sizes,
                                      repeats=args.repeats, options="defaults"), metrics, date=began, gpu="cpu")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
