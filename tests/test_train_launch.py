"""`accelerate launch -m mhar_hf.train` with two gloo/DDP processes on the CPU: a tiny converted
model trains and saves a loadable model; a run SIGKILLed between checkpoints and resumed logs
exactly the losses of an uninterrupted run."""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import HANG_GUARD_S
from train_setup import converted_model_and_corpus, launch_command, read_metrics, run_launch, train_args


pytestmark = pytest.mark.slow
STEPS, SAVE_EVERY = 16, 5


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tokenizer):
    return converted_model_and_corpus(tmp_path_factory.mktemp("launch"), tokenizer)


def start_run(args: list[str], cache) -> subprocess.Popen:
    command, env = launch_command(args, cache)
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def kill_between_checkpoints(process: subprocess.Popen, output) -> int:
    """SIGKILL the launcher and both workers once the run is past its first checkpoint."""
    metrics_file = output / "metrics.jsonl"
    deadline = time.monotonic() + HANG_GUARD_S
    while time.monotonic() < deadline and process.poll() is None:
        lines = metrics_file.read_text().splitlines() if metrics_file.exists() else []
        if len(lines) >= SAVE_EVERY + 2:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=HANG_GUARD_S)
            return len(lines)
        time.sleep(0.01)
    raise AssertionError(f"the run ended before it could be killed: {process.communicate()[0][-3000:]}")


def launch_runs(setup):
    """An uninterrupted run and one killed between checkpoints (launched side by side), then resumed."""
    root, model, data = setup
    options = ("--max-steps", str(STEPS), "--save-every", str(SAVE_EVERY), "--eval-every", "8", "--keep-last", "2")
    whole, killed = root / "uninterrupted", root / "killed"
    cache = root / "datasets-cache"
    reference = start_run(train_args(model, data, whole, *options), cache)
    victim = start_run(train_args(model, data, killed, *options), cache)
    killed_after = kill_between_checkpoints(victim, killed)
    assert killed_after < STEPS and not (killed / "model").exists()
    log = reference.communicate(timeout=HANG_GUARD_S)[0]
    assert reference.returncode == 0, log[-4000:]
    resumed = run_launch(train_args(model, data, killed, *options, "--resume"), cache)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "resumed from" in resumed.stdout + resumed.stderr
    return whole, killed


def test_two_processes_train_save_a_loadable_model_and_resume_after_sigkill_exactly(setup):
    # One test, so that pytest-xdist runs the three launches once, on one worker.
    uninterrupted, killed = launch_runs(setup)
    check_trained_model(setup, uninterrupted)
    check_resumed_run(uninterrupted, killed)


def check_trained_model(setup, uninterrupted):
    from transformers import AutoModelForCausalLM

    _, source_path, _ = setup
    metrics = read_metrics(uninterrupted)
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert metrics[-1]["loss"] < metrics[0]["loss"] - 0.5  # it learns
    assert [m["step"] for m in metrics if "val_loss" in m] == [8, 16]
    assert metrics[0]["gate_abs_mean"] > 0  # only the gates get a gradient at step 0, and they move
    assert sorted(p.name for p in (uninterrupted / "checkpoints").iterdir()) == ["step-00000015", "step-00000016"]

    final = uninterrupted / "model"
    meta = json.loads((final / "mhar_training.json").read_text())
    assert meta["steps"] == STEPS and meta["processes"] == 2 and meta["tokens"] == STEPS * 2 * 2 * 64
    assert meta["final_val_loss"] == metrics[-1]["val_loss"]
    assert (final / "modeling_mhar.py").exists() and json.loads((final / "config.json").read_text())["auto_map"]

    # Loadable by a process that never imported mhar_hf (the remote-code bundle).
    script = (
        "import sys, torch; from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(final)!r}, trust_remote_code=True)\n"
        "assert 'mhar_hf' not in sys.modules and type(m).__name__ == 'MHARForCausalLM'\n"
        f"t = AutoTokenizer.from_pretrained({str(final)!r}); print(len(t))\n"
    )
    check = subprocess.run([os.sys.executable, "-c", script], capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert check.returncode == 0, check.stderr[-3000:]

    trained = AutoModelForCausalLM.from_pretrained(final)
    source = AutoModelForCausalLM.from_pretrained(source_path)
    gates = [p.item() for n, p in trained.named_parameters() if n.endswith("_router.gate")]
    assert all(g != 0 for g in gates)
    assert not torch.equal(trained.model.layers[0].mlp.up_proj.weight, source.model.layers[0].mlp.up_proj.weight)


def check_resumed_run(uninterrupted, output):
    """The resumed run logs exactly the uninterrupted run's losses, step by step."""
    expected, got = read_metrics(uninterrupted), read_metrics(output)
    assert [m["step"] for m in got] == list(range(1, STEPS + 1))
    for want, have in zip(expected, got):
        assert have["loss"] == want["loss"], (want["step"], want["loss"], have["loss"])
        assert have["lr"] == want["lr"] and have.get("val_loss") == want.get("val_loss")
    assert not any(p.name.startswith(".tmp") for p in (output / "checkpoints").iterdir())
    a = (uninterrupted / "model" / "model.safetensors").read_bytes()
    assert a == (output / "model" / "model.safetensors").read_bytes()


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (Linux /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_run_folder_in_use_is_refused_and_workers_stop_with_their_launcher(setup):
    """Workers run in process sessions of their own: killing the launcher alone must still stop
    them, and while they run, a second run (a resume, say) must not write into their folder."""
    root, model, data = setup
    output, cache = root / "held", root / "datasets-cache"
    long = ("--max-steps", "1000", "--save-every", "1000", "--eval-every", "1000")
    holder = start_run(train_args(model, data, output, *long), cache)
    deadline = time.monotonic() + HANG_GUARD_S
    while not ((output / "metrics.jsonl").exists() and (output / "metrics.jsonl").read_text().strip()):
        assert holder.poll() is None and time.monotonic() < deadline, holder.communicate()[0][-3000:]
        time.sleep(0.05)
    workers = children(holder.pid)
    assert len(workers) == 2

    second = run_launch(train_args(model, data, output, "--max-steps", "4", "--resume"), cache)
    assert second.returncode != 0
    assert "is in use by a run that is still going" in second.stdout + second.stderr

    os.kill(holder.pid, signal.SIGKILL)  # the launcher alone, not its process group
    holder.wait(timeout=HANG_GUARD_S)
    while any(running(pid) for pid in workers):
        assert time.monotonic() < deadline, "the workers outlived their launcher"
        time.sleep(0.1)
    assert not (output / "model").exists()  # they stopped, rather than finishing the 1000 steps
