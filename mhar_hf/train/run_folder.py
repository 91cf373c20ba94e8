"""The run folder (`--output`) of one training run: checked before anything is created, made
only once every input check has passed, held by one run at a time, and removed again when the
run fails before it has written anything of its own."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import threading
import time
from pathlib import Path

from ..folder import utc_now

RUN_MARKERS = ("checkpoints", "metrics.jsonl", "model")
LOCK_FILE = ".mhar-train.lock"


def check_output(output: Path, resume: bool) -> None:
    """Refuse a file, or a previous run not continued on purpose; creates nothing."""
    if output.exists() and not output.is_dir():
        raise ValueError(f"--output {output} is a file, not a folder: choose a folder path")
    if not resume and output.is_dir() and any((output / name).exists() for name in RUN_MARKERS):
        raise FileExistsError(f"--output {output} holds a previous run: pass --resume to continue it, or choose a new folder")


def _lock(output: Path):
    """This process's exclusive lock on the run folder (an open file; the kernel releases it when
    the process ends, however it ends), or an error naming the run that holds it."""
    import fcntl

    handle = open(output / LOCK_FILE, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise FileExistsError(f"--output {output} is in use by a run that is still going ({holder}): wait for it to "
                              "end, or stop it, before starting or resuming another run there") from None
    except OSError:  # a filesystem without locks (some network mounts): run unguarded
        return handle
    handle.seek(0)
    handle.truncate()
    handle.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": utc_now()}) + "\n")
    handle.flush()
    return handle


@contextlib.contextmanager
def run_folder(output: Path, is_main: bool):
    """Create `output` if needed and, on the main process, hold its lock for the run. If the run
    fails before writing a checkpoint, metrics or a model, a folder it created goes again."""
    created = not output.exists()
    try:
        output.mkdir(parents=True, exist_ok=True)
        probe = output / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as error:
        raise ValueError(f"--output {output} is not writable ({error.strerror or error}): choose a folder you can write to") from None
    lock = None
    try:
        lock = _lock(output) if is_main else None
        yield
    except BaseException:
        if created and is_main and not any((output / name).exists() for name in RUN_MARKERS):
            shutil.rmtree(output, ignore_errors=True)
        raise
    finally:
        if lock is not None:
            lock.close()


def stop_with_launcher() -> None:
    """A worker that `accelerate launch` (torchrun) started runs in a process session of its own,
    so killing the launcher, even with its process group, leaves it running and writing into the
    run folder. Here a worker ends itself once its launcher is gone (it is then re-parented)."""
    if "LOCAL_RANK" not in os.environ:  # not started by a launcher
        return
    launcher = os.getppid()

    def watch():
        while os.getppid() == launcher:
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGKILL)  # checkpoints are renamed into place: none is left half-written

    threading.Thread(target=watch, name="stop-with-launcher", daemon=True).start()
