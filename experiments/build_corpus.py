"""Build the experiments' corpus offline, from the Python sources and docs installed on this machine.

    python experiments/build_corpus.py --out experiments/corpus [--root DIR ...] [--max-mb 200]

Files ending in .py, .md, .rst or .txt under the roots (default: this interpreter's
site-packages and /usr/lib/python3*) become one document each. Identical files are kept once.
Each file goes to train or validation by a hash of its path relative to its root, so the split
is stable across machines and runs; files are visited in the order of that hash, so the size cap
keeps an even sample of every package rather than the alphabetically first ones.

Writes OUT/train.jsonl and OUT/val.jsonl ({"text": ...} per line, in hash order),
OUT/tokenizer/ (a byte-level BPE tokenizer trained on the first --tokenizer-mb of the train
split, loadable with AutoTokenizer) and OUT/stats.json (files, bytes and tokens per split).
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import site
import sys
import sysconfig
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SUFFIXES = (".py", ".md", ".rst", ".txt")
MIN_BYTES, MAX_BYTES = 200, 512 * 1024  # skip stubs and generated giants


def default_roots() -> list[Path]:
    candidates = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *site.getsitepackages()]
    candidates += sorted(glob.glob("/usr/lib/python3*"))
    roots: list[Path] = []
    for path in map(Path, candidates):
        if path.is_dir() and path.resolve() not in {r.resolve() for r in roots}:
            roots.append(path)
    return roots


def path_hash(relative: str) -> int:
    return int.from_bytes(hashlib.sha1(relative.encode()).digest()[:8], "big")


def list_files(roots: list[Path]) -> list[tuple[int, str, Path]]:
    """(hash, relative path, path) of every candidate file, each real file once, in hash order."""
    seen: set[Path] = set()
    found = []
    for root in roots:
        for folder, dirs, names in os.walk(root):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in names:
                if not name.endswith(SUFFIXES):
                    continue
                path = Path(folder, name)
                try:
                    real = path.resolve()
                    size = real.stat().st_size
                except OSError:
                    continue
                if real in seen or not MIN_BYTES <= size <= MAX_BYTES:
                    continue
                seen.add(real)
                relative = path.relative_to(root).as_posix()
                found.append((path_hash(relative), relative, path))
    found.sort()
    return found


def read_text(path: Path) -> str | None:
    try:
        return path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def split_documents(files, max_bytes: int, val_permille: int):
    """Read files in hash order until `max_bytes` of text; yield (split, text), duplicates once."""
    digests: set[bytes] = set()
    total = 0
    with ThreadPoolExecutor(max_workers=min(32, (os.cpu_count() or 1) * 2)) as pool:
        for start in range(0, len(files), 2048):
            chunk = files[start : start + 2048]
            for (key, _, _), text in zip(chunk, pool.map(read_text, [f[2] for f in chunk])):
                if not text or not text.strip():
                    continue
                digest = hashlib.sha1(text.encode()).digest()
                if digest in digests:
                    continue
                digests.add(digest)
                yield ("val" if key % 1000 < val_permille else "train"), text
                total += len(text.encode())
                if total >= max_bytes:
                    return


def count_tokens(tokenizer, path: Path) -> int:
    """Tokens of a jsonl split as training packs them: each document's ids plus its eos."""
    backend = tokenizer.backend_tokenizer
    total, batch = 0, []
    with path.open() as handle:
        for line in handle:
            batch.append(json.loads(line)["text"])
            if len(batch) == 1024:
                total += sum(len(e.ids) + 1 for e in backend.encode_batch(batch, add_special_tokens=False))
                batch = []
    if batch:
        total += sum(len(e.ids) + 1 for e in backend.encode_batch(batch, add_special_tokens=False))
    return total


def build(out: Path, roots: list[Path], max_mb: float, val_permille: int, vocab_size: int, tokenizer_mb: float) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from mhar_hf.tiny import train_tokenizer

    started = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    files = list_files(roots)
    stats = {split: {"files": 0, "bytes": 0} for split in ("train", "val")}
    sample, sample_bytes = [], 0
    with (out / "train.jsonl").open("w") as train, (out / "val.jsonl").open("w") as val:
        for split, text in split_documents(files, int(max_mb * 2**20), val_permille):
            (train if split == "train" else val).write(json.dumps({"text": text}) + "\n")
            stats[split]["files"] += 1
            stats[split]["bytes"] += len(text.encode())
            if split == "train" and sample_bytes < tokenizer_mb * 2**20:
                sample.append(text)
                sample_bytes += len(text.encode())
    seconds = {"read_and_write": time.perf_counter() - started}
    tokenizer = train_tokenizer(sample, vocab_size=vocab_size)
    tokenizer.save_pretrained(out / "tokenizer")
    seconds["tokenizer"] = time.perf_counter() - started - sum(seconds.values())
    for split in stats:
        stats[split]["tokens"] = count_tokens(tokenizer, out / f"{split}.jsonl")
    seconds["count_tokens"] = time.perf_counter() - started - sum(seconds.values())
    stats.update(
        roots=[str(r) for r in roots], candidate_files=len(files), max_mb=max_mb, val_permille=val_permille,
        vocab_size=len(tokenizer), tokenizer_sample_bytes=sample_bytes,
        python=sys.version.split()[0], build_seconds=round(time.perf_counter() - started, 1),
        phase_seconds={k: round(v, 1) for k, v in seconds.items()},
    )
    (out / "stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    return stats


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--root", type=Path, action="append", help="folder to read (repeatable; default: the installed Python)")
    parser.add_argument("--max-mb", type=float, default=200.0, help="stop after this much text (MiB, both splits)")
    parser.add_argument("--val-permille", type=int, default=10, help="files per thousand held out for validation")
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--tokenizer-mb", type=float, default=16.0, help="train-split text the tokenizer learns from (MiB)")
    args = parser.parse_args(argv)
    stats = build(args.out, args.root or default_roots(), args.max_mb, args.val_permille, args.vocab_size, args.tokenizer_mb)
    print(json.dumps({k: stats[k] for k in ("train", "val", "vocab_size", "build_seconds", "phase_seconds")}))


if __name__ == "__main__":
    main()
