"""The benchmarks' results: one append-only JSON Lines file per benchmark, one schema for all.

    benchmarks/results/<benchmark>.jsonl      one JSON object per line, oldest first

Every row has exactly these keys:

    benchmark     str   the file's name without .jsonl ("train_throughput", "launch_sweep", ...)
    date          str   UTC, ISO 8601: when the run began ("2026-12-06T04:25:45+00:00"; a bare
                        "2026-12-05" where only the day is known)
    commit        str   short git hash of the tree measured ("+dirty" if tracked files differed)
    gpu           str   torch.cuda.get_device_name(), or "cpu"
    torch, triton, transformers
                  str or null   the installed versions (null: not installed, or not recorded)
    config        object   what was run: preset, mode, heads, path, shapes, ...
    metrics       object   what was measured: numbers, booleans or null, possibly nested in lists
                           and objects (per-kernel times); never strings

The rows of one run share (benchmark, date, commit, gpu). Rows are only ever appended: a file
is never rewritten (earlier figures stay in the file and in git).

The folder is `benchmarks/results/` unless MHAR_RESULTS_DIR names another (or `folder` is
given). Under pytest, with neither, nothing is written: a test never appends to the
repository's records by accident.

    python benchmarks/results_log.py train_throughput      # the newest run of a benchmark
"""

from __future__ import annotations

import datetime
import json
import math
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_FOLDER = Path(__file__).resolve().parent / "results"
KEYS = ("benchmark", "date", "commit", "gpu", "torch", "triton", "transformers", "config", "metrics")
VERSIONED = ("torch", "triton", "transformers")


def utc_now() -> str:
    """The current time as the `date` column writes it (UTC, seconds)."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def results_folder(folder: str | Path | None = None) -> Path | None:
    """Where rows go: `folder`, else $MHAR_RESULTS_DIR, else benchmarks/results/ (None under
    pytest without either: nothing is written)."""
    if folder is not None:
        return Path(folder)
    if os.environ.get("MHAR_RESULTS_DIR"):
        return Path(os.environ["MHAR_RESULTS_DIR"])
    if "PYTEST_CURRENT_TEST" in os.environ:
        return None
    return DEFAULT_FOLDER


def git_commit(repo: Path = REPO) -> str:
    """$MHAR_COMMIT if set (a copy of the tree whose git metadata may be stale), else the short
    hash of HEAD, with "+dirty" when tracked files differ from it; "unknown" without git."""
    if os.environ.get("MHAR_COMMIT"):
        return os.environ["MHAR_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True,
                              check=True).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                                 capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if changed else "")


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except ImportError:
        return None


def gpu_name() -> str:
    """The CUDA device's name, or "cpu" (no torch, or no GPU)."""
    try:
        import torch
    except ImportError:
        return "cpu"
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def environment() -> dict:
    """The columns a row gets from where it runs: commit, gpu and the library versions."""
    return {"commit": git_commit(), "gpu": gpu_name(), **{name: _version(name) for name in VERSIONED}}


def _check_metric(value, where: str) -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ValueError(f"{where}: key {key!r} is not a string")
            _check_metric(item, f"{where}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_metric(item, f"{where}[{i}]")
    elif value is not None and not isinstance(value, (bool, int, float)):
        raise ValueError(f"{where}: {value!r} is not a number, a boolean or null")
    elif isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where}: {value!r} is not finite (write null)")


def check_row(row: dict) -> None:
    """Raise ValueError unless `row` has exactly the schema's keys, each of its type."""
    if not isinstance(row, dict) or tuple(sorted(row)) != tuple(sorted(KEYS)):
        keys = sorted(row) if isinstance(row, dict) else type(row).__name__
        raise ValueError(f"a row has the keys {sorted(KEYS)}, not {keys}")
    for key in ("benchmark", "date", "commit", "gpu"):
        if not isinstance(row[key], str) or not row[key]:
            raise ValueError(f"{key}: {row[key]!r} is not a non-empty string")
    for key in VERSIONED:
        if row[key] is not None and not isinstance(row[key], str):
            raise ValueError(f"{key}: {row[key]!r} is neither a string nor null")
    when = datetime.datetime.fromisoformat(row["date"])  # ValueError if not ISO 8601
    if len(row["date"]) > 10 and when.utcoffset() != datetime.timedelta(0):
        raise ValueError(f"date: {row['date']!r} is not in UTC")
    for key in ("config", "metrics"):
        if not isinstance(row[key], dict):
            raise ValueError(f"{key}: {row[key]!r} is not an object")
    _check_metric(row["metrics"], "metrics")


def append_result(benchmark: str, config: dict, metrics: dict, *, date: str | None = None,
                  folder: str | Path | None = None, **columns) -> dict:
    """Append one row to <folder>/<benchmark>.jsonl and return it. The environment columns are
    filled from where this runs unless given in `columns` (commit, gpu, torch, triton,
    transformers); `date` defaults to now: give a run's rows the time it began. The line goes out
    in one write on a file opened for appending, then flushed to disk."""
    unknown = set(columns) - {"commit", "gpu", *VERSIONED}
    if unknown:
        raise TypeError(f"append_result: unknown columns {sorted(unknown)}")
    env = dict(columns)
    if len(env) < 2 + len(VERSIONED):
        env = {**environment(), **env}
    row = {"benchmark": benchmark, "date": date or utc_now(), "commit": env["commit"], "gpu": env["gpu"],
           **{name: env[name] for name in VERSIONED}, "config": config, "metrics": metrics}
    check_row(row)
    line = (json.dumps(row, allow_nan=False) + "\n").encode()
    target = results_folder(folder)
    if target is None:
        return row
    target.mkdir(parents=True, exist_ok=True)
    fd = os.open(target / f"{benchmark}.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        written = os.write(fd, line)
        while written < len(line):  # a regular file takes it whole; just in case
            written += os.write(fd, line[written:])
        os.fsync(fd)
    finally:
        os.close(fd)
    return row


def read_results(benchmark: str, folder: str | Path | None = None) -> list[dict]:
    """Every row of a benchmark's file, oldest first ([] if there is none); ValueError naming the
    line if one does not parse or breaks the schema."""
    path = (results_folder(folder) or DEFAULT_FOLDER) / f"{benchmark}.jsonl"
    if not path.exists():
        return []
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        try:
            row = json.loads(line)
            check_row(row)
        except ValueError as error:
            raise ValueError(f"{path}:{number}: {error}") from None
        if row["benchmark"] != benchmark:
            raise ValueError(f"{path}:{number}: a row of {row['benchmark']!r} in {benchmark}.jsonl")
        rows.append(row)
    return rows


def newest_run(rows: list[dict], gpu: str | None = None) -> list[dict]:
    """The rows of the newest run (latest date; on `gpu` if given)."""
    rows = [r for r in rows if gpu is None or r["gpu"] == gpu]
    if not rows:
        return []
    key = max((r["date"], r["commit"], r["gpu"]) for r in rows)
    return [r for r in rows if (r["date"], r["commit"], r["gpu"]) == key]


def _flat(prefix: str, value) -> dict:
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in _flat(f"{prefix}{key}.", item).items()}
    return {prefix[:-1]: value}


def table(rows: list[dict]) -> str:
    """A Markdown table of rows: a column per config and metric key (nested ones dotted)."""
    flat = [{**_flat("", r["config"]), **_flat("", r["metrics"])} for r in rows]
    columns = list(dict.fromkeys(k for f in flat for k in f))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for f in flat:
        lines.append("| " + " | ".join("" if f.get(c) is None else str(f[c]) for c in columns) + " |")
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) not in (2, 3):
        raise SystemExit("usage: python benchmarks/results_log.py BENCHMARK [GPU]")
    run = newest_run(read_results(sys.argv[1]), *sys.argv[2:])
    if not run:
        raise SystemExit(f"no rows for {sys.argv[1]}")
    first = run[0]
    print(f"{first['benchmark']}: {first['date']}, {first['gpu']}, commit {first['commit']}, torch {first['torch']}, "
          f"triton {first['triton']}, transformers {first['transformers']}\n")
    print(table(run))


if __name__ == "__main__":
    main()
