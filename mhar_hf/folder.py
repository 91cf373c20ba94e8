"""Model folders on disk: facts read without loading the weights, and folders built beside their
destination and renamed into place. Plain Python, no torch: `mhar info` starts at once, and the
library and the command line share it."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import shutil
import socket
import struct
import tempfile
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path


# What the commands leave in a model folder, beside transformers' own files.
CONVERSION_RECORD = "mhar_conversion.json"  # `mhar convert`: the source and how it was converted
TRAINING_RECORD = "mhar_training.json"  # `mhar train` (in OUT/model): the source, data and settings
PROBE_FOLDER = "probe"  # `mhar probe`'s default output folder, inside the model folder
PROBE_FILES = ("probe.json", "routing_heatmap.png", "head_deviation.png")


def utc_now() -> str:
    """The date and time records carry: UTC, ISO 8601, to the second."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def write_atomically(path: str | os.PathLike, data: str | bytes) -> None:
    """Write the file `path` whole or not at all: into a temporary file beside it, renamed over it."""
    path = Path(path)
    partial = path.with_name(f".{path.name}.partial-{os.getpid()}")
    try:
        if isinstance(data, bytes):
            partial.write_bytes(data)
        else:
            partial.write_text(data)
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def read_mhar_config(path: str | os.PathLike) -> dict:
    """The raw config.json of an MHAR model folder; a clear error when it is not one."""
    folder = Path(path)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} not found: pass a model folder written by save_pretrained")
    config = json.loads(config_file.read_text())
    if config.get("model_type") != "mhar":
        raise ValueError(f"{folder} holds a {config.get('model_type')!r} model, not an MHAR one (model_type 'mhar')")
    return config


def is_routing_parameter(name: str) -> bool:
    """Parameters of a routing site: anything under a module named `*_router`
    (`layers.N.attn_router.query`, `...mlp_router.gate`, `final_router.key_norm_weight`, also
    under PEFT's wrappers)."""
    return any(part.endswith("_router") for part in name.split(".")[:-1])


def safetensors_header(path: Path) -> tuple[dict, int]:
    """A safetensors file's header (tensor name -> dtype, shape, data_offsets; `__metadata__` left
    out) and the offset where its data starts: the file opens with an 8-byte little-endian
    length, then that many bytes of JSON. A clear error when the file is not one."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        header_len = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else -1
        if not 0 < header_len <= size - 8:
            raise ValueError(f"{path} is not a valid safetensors file (bad header length); re-download it")
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"{path} has a corrupt safetensors header ({error}); re-download it") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path} has a corrupt safetensors header (not a JSON object); re-download it")
    header.pop("__metadata__", None)
    return header, 8 + header_len


def parameter_counts(path: str | os.PathLike) -> dict[str, int]:
    """Backbone and routing parameter counts, from the safetensors headers."""
    folder = Path(path)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    counts = {"backbone": 0, "routing": 0}
    for file in files:
        for name, entry in safetensors_header(file)[0].items():
            numel = 1
            for size in entry["shape"]:
                numel *= size
            counts["routing" if is_routing_parameter(name) else "backbone"] += numel
    counts["total"] = counts["backbone"] + counts["routing"]
    return counts


# Folders are built beside their destination and renamed into place when complete, so a reader
# never sees half of one. The staging folder's name says which process builds it, so that a
# later run can tell the leftovers of a killed one from work in progress.

def _this_host() -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", socket.gethostname()) or "host"


def _is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_staging(dst: Path, purpose: str, log: Callable[[str], None] = print) -> None:
    """Remove the staging folders of `dst` left by processes of this host that no longer run
    (a killed `mhar convert`, say); report those of other hosts, which this one cannot check."""
    prefix = f".{dst.name}.{purpose}-"
    for leftover in dst.parent.glob(f"{glob.escape(prefix)}*"):
        parts = leftover.name[len(prefix):].rsplit("-", 2)  # HOST-PID-RANDOM
        host, pid = parts[:2] if len(parts) == 3 else ("", "")
        if host == _this_host() and pid.isdigit():
            if not _is_running(int(pid)):
                shutil.rmtree(leftover, ignore_errors=True)
                log(f"removed {leftover}, left by a process (pid {pid}) that no longer runs")
        else:
            log(f"note: {leftover} was left by another host or an older version; once no process is "
                f"writing it, remove it with: rm -r '{leftover}'")


@contextlib.contextmanager
def built_in_place(dst: str | os.PathLike, purpose: str, log: Callable[[str], None] = print):
    """Build the folder `dst` in a staging folder beside it (yielded), which becomes `dst` when
    the block ends without an error; an existing `dst` is swapped out and removed only once the
    new one is in place. On an error nothing is left behind: neither the staging folder nor the
    parent folders made for it. Staging leftovers of killed runs are removed first. The folder
    gets the mode a plain mkdir would (the umask's), not a temporary folder's 0700."""
    dst = Path(dst).absolute()
    made = [folder for folder in (dst.parent, *dst.parent.parents) if not folder.exists()]
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        remove_stale_staging(dst, purpose, log)
        staging = Path(tempfile.mkdtemp(prefix=f".{dst.name}.{purpose}-{_this_host()}-{os.getpid()}-",
                                        dir=dst.parent))
    except BaseException:
        _remove_if_empty(made)
        raise
    umask = os.umask(0)
    os.umask(umask)
    staging.chmod(0o777 & ~umask)
    try:
        yield staging
        _move_into_place(staging, dst)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        _remove_if_empty(made)
        raise


def _remove_if_empty(folders: list[Path]) -> None:
    for folder in folders:  # innermost first
        try:
            folder.rmdir()
        except OSError:
            return


def _move_into_place(staging: Path, dst: Path) -> None:
    if not dst.exists():
        os.rename(staging, dst)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.replaced-", dir=dst.parent))
    os.rename(dst, old / dst.name)
    try:
        os.rename(staging, dst)
    except BaseException:
        os.rename(old / dst.name, dst)
        raise
    shutil.rmtree(old)
