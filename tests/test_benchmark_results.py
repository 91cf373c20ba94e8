"""The benchmarks' results files: one schema for every row, rows only ever appended, and a
benchmark run on the CPU appending a row of that schema."""

import datetime
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mhar_hf import MHARConfig

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
sys.path.insert(0, str(REPO / "benchmarks"))
import results_log  # noqa: E402

COLUMNS = {"benchmark", "date", "commit", "gpu", "torch", "triton", "transformers", "config", "metrics"}
COMMIT = re.compile(r"[0-9a-f]{7,40}(\+dirty)?")


def schema_errors(row, benchmark: str) -> list[str]:
    """What in `row` breaks the schema (checked here on its own, not by results_log.check_row)."""
    if not isinstance(row, dict):
        return [f"not an object: {row!r}"]
    if set(row) != COLUMNS:
        return [f"keys {sorted(row)}"]
    errors = []
    if row["benchmark"] != benchmark:
        errors.append(f"benchmark {row['benchmark']!r} in {benchmark}.jsonl")
    try:
        when = datetime.datetime.fromisoformat(row["date"])
        if len(row["date"]) > 10 and when.utcoffset() != datetime.timedelta(0):
            errors.append(f"date {row['date']!r} not UTC")
    except (TypeError, ValueError):
        errors.append(f"date {row['date']!r}")
    if not (isinstance(row["commit"], str) and COMMIT.fullmatch(row["commit"])):
        errors.append(f"commit {row['commit']!r}")
    if not (isinstance(row["gpu"], str) and row["gpu"]):
        errors.append(f"gpu {row['gpu']!r}")
    errors += [f"{key} {row[key]!r}" for key in ("torch", "triton", "transformers")
               if not (row[key] is None or isinstance(row[key], str) and row[key])]
    if not isinstance(row["config"], dict) or not row["config"]:
        errors.append(f"config {row['config']!r}")
    if not isinstance(row["metrics"], dict) or not row["metrics"]:
        errors.append(f"metrics {row['metrics']!r}")
    else:
        stack = list(row["metrics"].values())
        while stack:
            value = stack.pop()
            if isinstance(value, dict):
                stack += value.values()
            elif isinstance(value, list):
                stack += value
            elif not (value is None or isinstance(value, (bool, int, float)) and not
                      (isinstance(value, float) and not math.isfinite(value))):
                errors.append(f"metric {value!r}")
    return errors


def test_every_results_row_parses_and_has_the_schema():
    files = sorted(RESULTS.glob("*.jsonl"))
    assert {"train_throughput", "routing_kernels"} <= {f.stem for f in files}
    for path in files:
        lines = path.read_text().splitlines()
        assert lines, f"{path.name} is empty"
        for number, line in enumerate(lines, 1):
            row = json.loads(line)
            assert schema_errors(row, path.stem) == [], f"{path.name}:{number}"
        assert len(results_log.read_results(path.stem, RESULTS)) == len(lines)


def test_the_results_folder_holds_only_the_jsonl_files():
    """One append-only file per benchmark: no per-commit reports, logs or subfolders beside them."""
    assert sorted(p.name for p in RESULTS.iterdir() if p.suffix != ".jsonl") == []


def test_schema_errors_finds_what_breaks_the_schema():
    good = json.loads((RESULTS / "train_throughput.jsonl").read_text().splitlines()[-1])
    assert schema_errors(good, "train_throughput") == []
    for change in ({"date": "yesterday"}, {"date": "2026-12-06T04:39:03+02:00"}, {"commit": "HEAD"}, {"gpu": ""},
                   {"torch": 2.11}, {"config": []}, {"metrics": {"ms": "1.0"}}, {"metrics": {"ms": [float("nan")]}}):
        assert schema_errors({**good, **change}, "train_throughput"), change
    assert schema_errors({**good, "extra": 1}, "train_throughput")
    assert schema_errors(good, "routing_kernels")


def test_append_result_appends_and_fills_the_environment(tmp_path, monkeypatch):
    import torch
    import transformers
    import triton

    monkeypatch.delenv("MHAR_COMMIT", raising=False)
    path = tmp_path / "demo.jsonl"
    path.write_bytes(b'{"written": "before"}\n')  # whatever was there stays, byte for byte
    first = results_log.append_result("demo", {"preset": "100M"}, {"ms": 1.5, "per_kernel": {"a": [1, None]}},
                                      folder=tmp_path)
    after_first = path.read_bytes()
    second = results_log.append_result("demo", {"preset": "1B"}, {"ms": 2}, folder=tmp_path, date="2026-12-06")
    after_second = path.read_bytes()
    assert after_second.startswith(after_first) and after_first.startswith(b'{"written": "before"}\n')
    lines = after_second.decode().splitlines()
    assert [json.loads(line) for line in lines[1:]] == [first, second]
    assert lines[1] == after_first.decode().splitlines()[1]

    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    if head.returncode == 0:
        assert first["commit"] in (head.stdout.strip(), head.stdout.strip() + "+dirty")
    else:  # a copy of the tree without git's history
        assert first["commit"] == "unknown"
    assert first["gpu"] == (torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
    assert (first["torch"], first["triton"], first["transformers"]) == (
        torch.__version__, triton.__version__, transformers.__version__)
    began = datetime.datetime.fromisoformat(first["date"])
    assert abs(datetime.datetime.now(datetime.timezone.utc) - began) < datetime.timedelta(minutes=5)
    assert second["date"] == "2026-12-06"
    assert schema_errors({**first, "commit": "0123abc"}, "demo") == []
    assert schema_errors({**second, "commit": "0123abc"}, "demo") == []


def test_append_result_takes_given_columns_and_mhar_commit(tmp_path, monkeypatch):
    monkeypatch.setenv("MHAR_COMMIT", "abc1234")
    row = results_log.append_result("demo", {"a": 1}, {"b": 2}, folder=tmp_path, gpu="cpu")
    assert (row["commit"], row["gpu"]) == ("abc1234", "cpu")
    row = results_log.append_result("demo", {"a": 1}, {"b": 2}, folder=tmp_path, commit="1234567", gpu="NVIDIA H200",
                                    torch=None, triton="3.6.0", transformers=None)
    assert (row["commit"], row["gpu"], row["torch"], row["triton"]) == ("1234567", "NVIDIA H200", None, "3.6.0")
    assert results_log.read_results("demo", tmp_path) == [
        json.loads(line) for line in (tmp_path / "demo.jsonl").read_text().splitlines()]


def test_append_result_refuses_a_row_off_the_schema_and_writes_nothing(tmp_path):
    for metrics in ({"status": "out of memory"}, {"ms": float("nan")}, {"per_kernel": {"a": "1"}}):
        with pytest.raises(ValueError):
            results_log.append_result("demo", {"a": 1}, metrics, folder=tmp_path)
    with pytest.raises(ValueError):
        results_log.append_result("demo", "preset 100M", {"ms": 1.0}, folder=tmp_path)
    with pytest.raises(ValueError):
        results_log.append_result("demo", {"a": 1}, {"ms": 1.0}, folder=tmp_path, date="2026-12-06T04:39:03")
    with pytest.raises(TypeError):
        results_log.append_result("demo", {"a": 1}, {"ms": 1.0}, folder=tmp_path, machine="h100")
    assert not (tmp_path / "demo.jsonl").exists()


def test_read_results_names_the_line_that_breaks_the_schema(tmp_path):
    results_log.append_result("demo", {"a": 1}, {"b": 2}, folder=tmp_path)
    with (tmp_path / "demo.jsonl").open("a") as handle:
        handle.write('{"benchmark": "demo"}\n')
    with pytest.raises(ValueError, match=r"demo\.jsonl:2"):
        results_log.read_results("demo", tmp_path)
    assert results_log.read_results("absent", tmp_path) == []


def test_the_folder_comes_from_the_environment_and_a_test_never_writes_the_repositorys(tmp_path, monkeypatch):
    monkeypatch.setenv("MHAR_RESULTS_DIR", str(tmp_path))
    results_log.append_result("demo", {"a": 1}, {"b": 2})
    assert len((tmp_path / "demo.jsonl").read_text().splitlines()) == 1
    monkeypatch.delenv("MHAR_RESULTS_DIR")
    assert "PYTEST_CURRENT_TEST" in os.environ
    before = {p.name: p.read_bytes() for p in RESULTS.iterdir()}
    row = results_log.append_result("train_throughput", {"a": 1}, {"b": 2})
    assert row["metrics"] == {"b": 2}
    assert {p.name: p.read_bytes() for p in RESULTS.iterdir()} == before
    monkeypatch.delenv("PYTEST_CURRENT_TEST")
    assert results_log.results_folder() == RESULTS


def test_newest_run_and_table():
    rows = [{"date": d, "commit": c, "gpu": g, "config": {"preset": p}, "metrics": {"ms": m, "k": {"a": m}}}
            for d, c, g, p, m in [("2026-12-05", "1111111", "A", "100M", 1.0), ("2026-12-06", "2222222", "A", "100M", 2.0),
                                  ("2026-12-06", "2222222", "A", "1B", 3.0), ("2026-12-07", "3333333", "B", "1B", 4.0)]]
    assert [r["metrics"]["ms"] for r in results_log.newest_run(rows)] == [4.0]
    assert [r["metrics"]["ms"] for r in results_log.newest_run(rows, "A")] == [2.0, 3.0]
    assert results_log.table(rows[1:3]).splitlines() == ["| preset | ms | k.a |", "|---|---|---|",
                                                         "| 100M | 2.0 | 2.0 |", "| 1B | 3.0 | 3.0 |"]


def test_host_overhead_on_the_cpu_appends_a_row_per_mode(tmp_path):
    """benchmarks/host_overhead.py runs without a GPU: its rows land in the folder it is given."""
    env = {**os.environ, "MHAR_RESULTS_DIR": str(tmp_path), "MHAR_COMMIT": "0123abc"}
    env.pop("PYTEST_CURRENT_TEST", None)
    done = subprocess.run([sys.executable, "benchmarks/host_overhead.py", "--preset", "100M", "--steps", "1"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = results_log.read_results("host_overhead", tmp_path)
    assert [r["config"]["mode"] for r in rows] == ["full", "block", "delta"]
    assert [schema_errors(r, "host_overhead") for r in rows] == [[], [], []]
    assert {(r["commit"], r["gpu"], r["date"]) for r in rows} == {("0123abc", "cpu", rows[0]["date"])}
    for row in rows:
        metrics = row["metrics"]
        assert row["config"] == {"preset": "100M", "mode": row["config"]["mode"], "steps": 1}
        assert metrics["sites"] > 0 and metrics["step_ms"] > 0 and metrics["standard_step_ms"] > 0
        assert metrics["host_ms_per_step"] == pytest.approx(metrics["step_ms"] - metrics["standard_step_ms"], abs=2e-3)


def test_host_overhead_of_decoding_records_its_workload(tmp_path):
    """`--workload generate`: a row per mode, per decoded token, named as decoding (training rows
    carry no workload)."""
    env = {**os.environ, "MHAR_RESULTS_DIR": str(tmp_path), "MHAR_COMMIT": "0123abc"}
    env.pop("PYTEST_CURRENT_TEST", None)
    done = subprocess.run([sys.executable, "benchmarks/host_overhead.py", "--preset", "100M", "--steps", "1",
                           "--rounds", "1", "--workload", "generate"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ms per token" in done.stdout
    rows = results_log.read_results("host_overhead", tmp_path)
    assert [r["config"] for r in rows] == [{"preset": "100M", "mode": m, "steps": 1, "workload": "generate"}
                                           for m in ("full", "block", "delta")]
    assert [schema_errors(r, "host_overhead") for r in rows] == [[], [], []]
    assert all(r["metrics"]["standard_step_ms"] > 0 and r["metrics"]["sites"] > 0 for r in rows)


def test_decode_graph_kernels_counts_fewer_kernels_for_the_fused_reads(tmp_path):
    """benchmarks/decode_graph_kernels.py runs without a GPU, a row per mode and routing; a step
    whose reads are the fused ops generates hardly more kernels than the plain step, and fewer than
    with the reference reads (whose every read's statistics are kernels of their own)."""
    env = {**os.environ, "MHAR_RESULTS_DIR": str(tmp_path), "MHAR_COMMIT": "0123abc"}
    env.pop("PYTEST_CURRENT_TEST", None)
    done = subprocess.run([sys.executable, "benchmarks/decode_graph_kernels.py", "--preset", "100M"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = results_log.read_results("decode_graph_kernels", tmp_path)
    assert [schema_errors(r, "decode_graph_kernels") for r in rows] == [[]] * 5
    over = {(r["config"]["mode"], r["config"]["routing"]): r["metrics"]["over_standard"] for r in rows}
    assert over[("standard", None)] == 0
    layers = MHARConfig.from_preset("100M").num_hidden_layers
    for mode in ("delta", "full"):
        assert 0 <= over[(mode, "fused")] < layers < over[(mode, "reference")]


def test_bench_train_records_each_measured_configuration(tmp_path):
    """bench_train.record: a row per timed training configuration (an out-of-memory one flagged, a
    skipped one left out) and one per variant's kernels, each with the run's date, GPU and commit."""
    import bench_train

    report = {"date": "2026-12-06T04:39:03+00:00", "gpu": "NVIDIA H100 80GB HBM3", "commit": "6fac0ba",
              "torch": "2.11.0+cu130", "triton": "3.6.0", "copy_bandwidth_tb_s": 3.02, "warmup_steps": 3,
              "timed_steps": 8,
              "training": [
                  {"preset": "350M", "mode": "standard", "heads": None, "path": "compiled+graph", "step_ms": 42.7,
                   "tokens_per_s": 95875, "peak_mem_gib": 13.9, "held_gib": 0.0},
                  {"preset": "350M", "mode": "delta", "heads": 8, "label": "delta", "path": "fused+graph",
                   "step_ms": 45.4, "tokens_per_s": 90232, "peak_mem_gib": 14.0, "held_gib": 0.0,
                   "ratio_vs_baseline": 0.941, "mem_ratio_vs_baseline": 1.004},
                  {"preset": "1B", "mode": "full", "heads": 8, "label": "full H=8", "path": "fused",
                   "status": "out of memory"},
                  {"preset": "1B", "mode": "block", "heads": 8, "label": "block", "path": "fused",
                   "status": "skipped: time budget"}],
              "kernels": [{"preset": "350M", "mode": "delta", "heads": 8, "tokens": 4096, "sites": 47, "fwd_ms": 0.6,
                           "fwd_floor_ms": 0.23, "fwd_pct_of_floor": 38.8, "fwd_bwd_ms": 2.284,
                           "fwd_bwd_floor_ms": 1.04, "fwd_bwd_pct_of_floor": 45.5, "fwd_bwd_wall_ms": 17.1,
                           "fwd_bwd_kernels_ms": {"route_fwd_kernel": 0.6}, "ratio_at_floor": 0.968}]}
    bench_train.record(report, tmp_path)
    training = results_log.read_results("train_throughput", tmp_path)
    kernels = results_log.read_results("routing_kernels", tmp_path)
    assert [(r["config"]["variant"], r["config"]["path"]) for r in training] == [
        ("plain", "compiled+graph"), ("delta", "fused+graph"), ("full H=8", "fused")]
    assert training[1]["config"] == {"preset": "350M", "mode": "delta", "heads": 8, "variant": "delta",
                                     "path": "fused+graph", "batch": 4, "seq": 1024, "warmup_steps": 3,
                                     "timed_steps": 8}
    assert training[1]["metrics"]["ratio_vs_baseline"] == 0.941 and training[2]["metrics"] == {"out_of_memory": True}
    assert kernels[0]["config"] == {"preset": "350M", "mode": "delta", "heads": 8, "tokens": 4096, "sites": 47}
    assert kernels[0]["metrics"]["copy_bandwidth_tb_s"] == 3.02
    assert kernels[0]["metrics"]["fwd_bwd_kernels_ms"] == {"route_fwd_kernel": 0.6}
    for row in training + kernels:
        assert (row["date"], row["commit"], row["gpu"], row["triton"]) == (
            report["date"], "6fac0ba", report["gpu"], "3.6.0")
        assert schema_errors(row, row["benchmark"]) == []
