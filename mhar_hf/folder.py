"""The model-folder contract: what each stage leaves in a folder for the next one to read.

`mhar convert` writes a model folder with a `ConversionRecord`; `mhar train` writes one (OUT/model)
with a `TrainingRecord`; `mhar eval` writes a run folder whose results.json carries an
`EvalRecord`; `mhar probe` writes PROBE_FILES (a `ProbeRecord` and two pictures) into PROBE_FOLDER;
`mhar card` reads all of them.
The file names, the records' fields, the date format, the one way a file is written (whole or not
at all, `write_atomically`), the one way a folder is built (aside, then renamed: `built_in_place`)
and the one test of which parameters belong to routing (`is_routing_parameter`) are all here.

Plain Python, no torch: `mhar info` loads this file on its own and answers at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import os
import re
import shutil
import socket
import struct
import tempfile
import threading
import types
import typing
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, ClassVar

# What the commands leave in a model folder, beside transformers' own files.
CONVERSION_RECORD = "mhar_conversion.json"  # `mhar convert`: the source and how it was converted
TRAINING_RECORD = "mhar_training.json"  # `mhar train` (in OUT/model): the source, data and settings
PROBE_FOLDER = "probe"  # `mhar probe`'s default output folder, inside the model folder
PROBE_FILES = ("probe.json", "routing_heatmap.png", "head_deviation.png")
# What `mhar eval` leaves in an evaluation run folder (by default MODEL/eval/DATE-TIME).
EVAL_RESULTS = "results.json"  # the harness's results, with an `mhar` block (EvalRecord)
ROUTER_SUFFIX = "_router"  # the name of every routing site's module ends so: attn_router, final_router


def utc_now() -> str:
    """The date and time records carry: UTC, ISO 8601, to the second."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def write_atomically(path: str | os.PathLike, data: str | bytes) -> None:
    """Write the file `path` whole or not at all: into a temporary file beside it (flushed to the
    disk), renamed over it. Text is written as UTF-8. On any error the temporary file is removed
    and an existing `path` is left as it was."""
    path = Path(path)
    partial = path.with_name(f".{path.name}.partial-{os.getpid()}-{threading.get_ident()}")
    payload = data.encode("utf-8") if isinstance(data, str) else data
    try:
        with open(partial, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
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


def is_router_module(name: str) -> bool:
    """A routing site's module, by its qualified name (`model.layers.3.attn_router`, `model.final_router`)."""
    return name.rsplit(".", 1)[-1].endswith(ROUTER_SUFFIX)


def is_routing_parameter(name: str) -> bool:
    """Parameters of a routing site: anything under a module named `*_router`
    (`layers.N.attn_router.query`, `...mlp_router.gate`, `final_router.key_norm_weight`, also
    under PEFT's wrappers). Every part of the package that treats routing apart (optimizer
    groups, weight decay, --train-only-routing, the converter, parameter counts) asks this."""
    return any(part.endswith(ROUTER_SUFFIX) for part in name.split(".")[:-1])


# --------------------------------------------------------------------------------------------
# Records: one JSON object each, one field per key. Reading tolerates keys this version does
# not know (a newer version's: kept in `extra` and written back) and keys an older version did
# not write (None); a file that is missing, not JSON, or lacks a required key or holds a value
# of the wrong kind is refused with an error naming the file.

# Keys older versions wrote under another name: the old name -> the current one.
RENAMED_KEYS = {"date_utc": "date"}


def _fits(value: Any, hint: Any) -> bool:
    """Whether a JSON value is of the kind a field's type names (containers checked one level deep)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, arg) for arg in typing.get_args(hint))
    if hint is Any:
        return True
    if hint is None or hint is type(None):
        return value is None
    if origin is not None:
        hint = origin
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Record:
    """What every record shares: its file name, how it is read (checked) and written (atomically)."""

    FILE: ClassVar[str]
    WRITER: ClassVar[str]  # the command that writes it, for error messages

    extra: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False, repr=False)
    """Keys this version does not know (written by a newer one), kept as read and written back."""

    @classmethod
    def path(cls, folder: str | os.PathLike) -> Path:
        """Where the record lies in `folder`."""
        return Path(folder) / cls.FILE

    def to_dict(self) -> dict[str, Any]:
        """The JSON object on disk: every field in order, then the unknown keys."""
        known = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        return {**known, **self.extra}

    @classmethod
    def from_dict(cls, data: Any, source: str | os.PathLike = "the record"):
        """The record a JSON object holds; `source` names it in errors (a file)."""
        if not isinstance(data, dict):
            raise ValueError(f"{source} holds a JSON {type(data).__name__}, not an object: it is not a {cls.FILE} "
                             f"as {cls.WRITER} writes it")
        data = dict(data)
        for old, new in RENAMED_KEYS.items():
            if old in data and new not in data:
                data[new] = data.pop(old)
        hints = typing.get_type_hints(cls)
        values, problems = {}, []
        for spec in dataclasses.fields(cls):
            if spec.name == "extra":
                continue
            required = spec.default is dataclasses.MISSING and spec.default_factory is dataclasses.MISSING
            if spec.name not in data:
                if required:
                    problems.append(f"it has no `{spec.name}`")
                values[spec.name] = None
                continue
            value = data.pop(spec.name)
            if not _fits(value, hints[spec.name]) or (required and value is None):
                problems.append(f"`{spec.name}` is {json.dumps(value)[:60]}, not {_kind(hints[spec.name])}")
            values[spec.name] = value
        if problems:
            raise ValueError(f"{source} is not a {cls.FILE} as {cls.WRITER} writes it: {'; '.join(problems)}")
        return cls(**values, extra=data)

    @classmethod
    def _load(cls, path: str | os.PathLike) -> tuple[Path, Any]:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: pass a folder that {cls.WRITER} wrote")
        try:
            return path, json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"{path} is not valid JSON ({error}): not a record as {cls.WRITER} writes it") from None

    @classmethod
    def read(cls, folder: str | os.PathLike):
        """The record in `folder`; FileNotFoundError or ValueError, naming the file, when it is
        missing or malformed."""
        return cls.read_file(cls.path(folder))

    @classmethod
    def read_file(cls, path: str | os.PathLike):
        """The record in the file `path` (a copy kept under another name, say); errors as `read`'s."""
        path, data = cls._load(path)
        return cls.from_dict(data, path)

    @classmethod
    def read_if_present(cls, folder: str | os.PathLike):
        """The record in `folder`, or None when there is none (a malformed one is still an error)."""
        return cls.read(folder) if cls.path(folder).is_file() else None

    def write(self, folder: str | os.PathLike) -> Path:
        """Write the record into `folder` (whole or not at all); returns its path."""
        path = self.path(folder)
        write_atomically(path, json.dumps(self.to_dict(), indent=2) + "\n")
        return path


def _kind(hint: Any) -> str:
    return str(hint).replace("typing.", "") if not isinstance(hint, type) else hint.__name__


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConversionRecord(_Record):
    """`mhar convert`'s provenance, in the converted model's folder (CONVERSION_RECORD)."""

    FILE: ClassVar[str] = CONVERSION_RECORD
    WRITER: ClassVar[str] = "`mhar convert`"

    source: str
    """The source checkpoint: its folder (a Hub download's snapshot folder) as an absolute path."""
    source_model_type: str | None = None
    """The source config's model_type (llama, mistral, qwen2, qwen3)."""
    source_format: str | None = None
    """How the source weights were stored: safetensors or bin (pickled PyTorch)."""
    source_files: list[str] | None = None
    """The source's weight files, by name."""
    heads: int | None = None
    """The new model's residual_heads (H)."""
    num_blocks: int | None = None
    """The new model's residual_num_blocks."""
    dtype: str | None = None
    """The --dtype asked for: keep (bytes copied as stored), bfloat16 or float32."""
    stored_dtypes: list[str] | None = None
    """The safetensors dtypes of the written tensors (F32, BF16...)."""
    max_shard_size: int | str | None = None
    """The output shard limit as given (bytes, or a size such as 5GB)."""
    shards: list[str] | None = None
    """The written weight files, by name."""
    routing_tensors: int | None = None
    """How many routing tensors were added (queries, key-norm weights, null sources, zero gates)."""
    dropped_tensors: list[str] | None = None
    """Source tensors left out because the model recomputes them (rotary inv_freq, say)."""
    ignored_config_fields: list[str] | None = None
    """Source config fields with no effect on the computation that the new config leaves out."""
    copied_files: list[str] | None = None
    """Files copied unchanged from the source: tokenizer, chat template, generation config, licences."""
    verification: dict[str, Any] | None = None
    """The identity check's report (`IdentityReport.to_dict()`) when --verify ran, else None."""
    mhar_hf_version: str | None = None
    """The mhar_hf version that converted."""
    date: str | None = dataclasses.field(default_factory=utc_now)
    """When: UTC, ISO 8601, to the second (`utc_now()`; records before 0.1.0 named it date_utc)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainingRecord(_Record):
    """`mhar train`'s account of a run, in the saved model's folder OUT/model (TRAINING_RECORD)."""

    FILE: ClassVar[str] = TRAINING_RECORD
    WRITER: ClassVar[str] = "`mhar train`"

    source_model: str
    """The model trained from: a local folder as an absolute path, else a Hub id as given."""
    steps: int | None = None
    """Optimizer steps completed."""
    tokens: int | None = None
    """Training tokens seen, over all processes."""
    data: list[str] | None = None
    """The training data (absolute paths, or `datasets` names as given)."""
    val_data: list[str] | None = None
    """The validation data, likewise; empty when a slice of the training data was held out."""
    seq_length: int | None = None
    """Tokens per packed training sequence."""
    global_batch_sequences: int | None = None
    """Sequences per optimizer step: processes x batch size x gradient accumulation."""
    processes: int | None = None
    """Training processes (one per GPU)."""
    distributed_type: str | None = None
    """accelerate's distributed type: NO, MULTI_GPU, FSDP..."""
    lr_schedule: dict[str, Any] | None = None
    """schedule, peak_lr, min_lr_ratio, warmup_steps, decay_fraction, routing_lr_multiplier."""
    weight_decay: float | None = None
    """AdamW weight decay of the backbone matrices (routing parameters get none)."""
    z_loss: float | None = None
    """The z-loss coefficient."""
    ema_decay: float | None = None
    """The weight EMA's decay when one was kept (the saved weights are then the EMA), else None."""
    trainable: str | None = None
    """What trained: all, routing, or lora-rR."""
    lora_merged: bool | None = None
    """With LoRA: whether the adapter was merged into the saved weights; None without LoRA."""
    final_train_loss: float | None = None
    """The last logged training loss."""
    final_val_loss: float | None = None
    """The last validation loss, when validation ran."""
    mixed_precision: str | None = None
    """accelerate's mixed precision: no, bf16 or fp16."""
    saved_dtype: str | None = None
    """The dtype the weights were saved in (bfloat16, float32...)."""
    mhar_hf_version: str | None = None
    """The mhar_hf version that trained."""
    date: str | None = dataclasses.field(default_factory=utc_now)
    """When the model was saved: UTC, ISO 8601, to the second (`utc_now()`)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProbeRecord(_Record):
    """`mhar probe`'s report (PROBE_FILES[0] in its output folder, by default MODEL/probe): what
    each head of each routing site reads, and the disagreement measures (docs/method.md)."""

    FILE: ClassVar[str] = PROBE_FILES[0]
    WRITER: ClassVar[str] = "`mhar probe`"

    model: dict[str, Any] | None = None
    """The probed model: path, residual_mode, residual_heads, num_hidden_layers, hidden_size."""
    data: dict[str, Any] | None = None
    """The text probed on: file, requested_tokens, tokens, seq_len."""
    settings: dict[str, Any] | None = None
    """The measures' settings: slices, null_draws, seed."""
    summary: dict[str, Any] | None = None
    """Means over sites: width_disagreement, null_disagreement, learned_excess, head_deviation,
    mean_head_deviation, collinearity, zero_queries, zero_gates, notes."""
    sites: list[dict[str, Any]] | None = None
    """Per routing site, in forward order: its sources, average weights, query norms, gate and measures."""
    date: str | None = dataclasses.field(default_factory=utc_now)
    """When the probe ran: UTC, ISO 8601, to the second (`utc_now()`)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalRecord(_Record):
    """`mhar eval`'s own block (`mhar`) in a run folder's results.json, beside the harness's
    results, configs, n-shot and n-samples."""

    FILE: ClassVar[str] = EVAL_RESULTS
    WRITER: ClassVar[str] = "`mhar eval`"
    KEY: ClassVar[str] = "mhar"

    model: str
    """The evaluated model folder, as an absolute path."""
    tasks: list[str]
    """The tasks run, in order."""
    primary: dict[str, dict[str, str]]
    """Each task's primary measure: {task: {"metric": ..., "filter": ...}}."""
    model_type: str | None = None
    """The model's config model_type (mhar, llama...)."""
    limit: int | float | None = None
    """The first N items of each task only (a smoke run), or None for all of them."""
    data_dir: str | None = None
    """The local data folder of the offline tasks, when given."""
    max_gen_toks: int | None = None
    """The cap on generated tokens, when given (else the harness's default)."""
    seed: int | None = None
    """The seed every harness RNG was derived from."""
    batch_size: str | None = None
    """The batch size as run (a number, or auto)."""
    mhar_hf_version: str | None = None
    """The mhar_hf version that evaluated."""
    lm_eval_version: str | None = None
    """The LM Evaluation Harness version that evaluated."""
    date: str | None = dataclasses.field(default_factory=utc_now)
    """When the run finished: UTC, ISO 8601, to the second (`utc_now()`)."""

    @classmethod
    def read_run(cls, folder: str | os.PathLike) -> tuple[EvalRecord, dict[str, Any]]:
        """The record of the run folder `folder` and the rest of its results.json (the harness's part)."""
        return cls._read_results(cls.path(folder))

    @classmethod
    def read_file(cls, path: str | os.PathLike) -> EvalRecord:
        return cls._read_results(path)[0]

    @classmethod
    def _read_results(cls, path: str | os.PathLike) -> tuple[EvalRecord, dict[str, Any]]:
        path, data = cls._load(path)
        if not isinstance(data, dict) or not isinstance(data.get(cls.KEY), dict):
            raise ValueError(f"{path} has no `{cls.KEY}` block: it was not written by {cls.WRITER}")
        harness = dict(data)
        return cls.from_dict(harness.pop(cls.KEY), path), harness

    def write(self, folder: str | os.PathLike, harness: dict[str, Any] | None = None,
              default: Callable[[Any], Any] | None = None) -> Path:
        """Write results.json into `folder`: the harness's output `harness` with this record as
        its `mhar` block; `default` turns what JSON cannot hold into what it can (the harness's
        handle_non_serializable)."""
        path = self.path(folder)
        data = {**(harness or {}), self.KEY: self.to_dict()}
        write_atomically(path, json.dumps(data, indent=2, default=default, ensure_ascii=False) + "\n")
        return path


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
