"""Identity-preserving conversion of a dense Llama-family checkpoint into an MHAR `delta` model.

    convert_checkpoint(src, dst, heads=8, num_blocks=8, dtype="keep", max_shard_size="5GB",
                       verify=False, overwrite=False)

The converted model computes exactly what the source computes (every routing gate starts at
zero, docs/method.md), so mid-training starts from the pretrained model itself.

How it works, and why:
- Plan first, write second. The source config is mapped to an `MHARConfig` (anything it cannot
  represent exactly is refused), every shard header is read, and the set of tensor names and
  every shape are checked against a model built from that config on the meta device. Nothing
  is written before the whole checkpoint has passed.
- Stream. Backbone tensors are copied as raw byte ranges from the source safetensors files
  into the new ones (no tensor is materialised unless `dtype` asks for a cast), so memory stays
  near a copy buffer and the time near a plain file copy. Pickled `.bin` checkpoints are read
  one shard at a time with `torch.load(weights_only=True)`.
- Atomic. Everything goes into a temporary folder beside `dst`, renamed into place at the end;
  an interrupted run leaves no `dst` and the source is only ever read.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import os
import re
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import torch
from huggingface_hub.errors import StrictDataclassError
from transformers import PretrainedConfig

from .configuration_mhar import MHARConfig
from .folder import ConversionRecord, built_in_place, is_routing_parameter, safetensors_header

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
DTYPE_CHOICES = ("keep", "bfloat16", "float32")
SAFE_INDEX = "model.safetensors.index.json"
SAFE_SINGLE = "model.safetensors"
BIN_INDEX = "pytorch_model.bin.index.json"
BIN_SINGLE = "pytorch_model.bin"

# Files next to the weights that the converted model needs unchanged (tokenizer, chat template,
# generation defaults) or that must travel with the weights (licences).
AUXILIARY_FILES = (
    "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "added_tokens.json", "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja",
    "chat_template.json",
)
AUXILIARY_PATTERNS = ("LICENSE*", "NOTICE*", "USE_POLICY*")

# safetensors dtype codes. Backbone weights must be one of the floating ones.
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
DTYPE_CODES = {dtype: code for code, dtype in SAFETENSORS_DTYPES.items()}
FLOAT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
_COPY_BUFFER = 16 * 2**20


# ----------------------------------------------------------------------------------------------
# Config mapping

# Generic PretrainedConfig fields: they describe no architecture and get their defaults.
_GENERIC_FIELDS = {f.name for f in dataclasses.fields(PretrainedConfig)} | {
    "model_type", "_name_or_path", "output_attentions",
}
# Fields of the MHAR config that mean exactly what the same field of a supported source means.
_SHARED_FIELDS = {f.name for f in dataclasses.fields(MHARConfig)} - _GENERIC_FIELDS - {
    "residual_mode", "residual_heads", "residual_num_blocks", "residual_block_layers",
    "routing_implementation", "qkv_bias", "qk_norm",
}
# Source fields that are checked (they must leave every layer a full-attention layer) and not copied.
_CHECKED_FIELDS = {
    "llama": set(),
    "mistral": {"sliding_window"},
    "qwen2": {"use_sliding_window", "sliding_window", "max_window_layers", "layer_types"},
    "qwen3": {"use_sliding_window", "sliding_window", "max_window_layers", "layer_types"},
}
# What each architecture has that Llama spells differently.
_IMPLIED_FIELDS = {
    "llama": {},
    "mistral": {},
    "qwen2": {"qkv_bias": True, "attention_bias": False},  # bias on q/k/v, none on o_proj
    "qwen3": {"qk_norm": True},  # per-head RMSNorm on queries and keys
}
_MOE_MARKERS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")


def _unsupported_features(model_type: str, values: dict) -> list[str]:
    """Every reason why `values` (a source config) has no exact MHAR equivalent."""
    reasons = []
    if values.get("quantization_config"):
        reasons.append("quantized weights (quantization_config); convert the original unquantized checkpoint")
    if any(values.get(key) for key in _MOE_MARKERS):
        reasons.append("mixture-of-experts layers")
    if model_type == "mistral" and values.get("sliding_window") is not None:
        reasons.append(f"sliding-window attention (sliding_window={values['sliding_window']}); "
                       "MHAR layers attend to the whole context")
    layer_types = values.get("layer_types") or []
    if set(layer_types) - {"full_attention"}:
        counts = {kind: layer_types.count(kind) for kind in dict.fromkeys(layer_types)}
        reasons.append(f"layer types other than full attention ({counts}, "
                       f"use_sliding_window={values.get('use_sliding_window')})")
    return reasons


def mhar_config_for(source_config, heads: int, num_blocks: int, dtype: str = "keep") -> tuple[MHARConfig, list[str]]:
    """The delta-mode `MHARConfig` equivalent to a loaded source config, and the names of the
    source's undeclared extra fields that were left out (e.g. `use_mrope`).

    Raises ValueError naming every feature that MHAR cannot represent exactly.
    """
    model_type = source_config.model_type
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(_unknown_model_type_message(model_type, source_config.to_dict()))
    values = source_config.to_dict()
    declared = {f.name for f in dataclasses.fields(type(source_config))} - _GENERIC_FIELDS
    reasons = _unsupported_features(model_type, values)
    unknown = declared - _SHARED_FIELDS - _CHECKED_FIELDS[model_type]
    if unknown:
        reasons.append(f"config fields with no MHAR equivalent: {', '.join(sorted(unknown))}")
    if reasons:
        raise ValueError(f"cannot convert this {model_type} checkpoint exactly: " + "; ".join(reasons))

    fields = {key: values[key] for key in declared & _SHARED_FIELDS}
    fields.update(_IMPLIED_FIELDS[model_type])
    if dtype != "keep":
        fields["dtype"] = dtype
    elif values.get("dtype") is not None:
        fields["dtype"] = str(values["dtype"]).removeprefix("torch.")
    try:
        config = MHARConfig(
            **fields,
            architectures=["MHARForCausalLM"],
            residual_mode="delta",
            residual_heads=heads,
            residual_num_blocks=num_blocks,
        )
    except StrictDataclassError as error:  # a field value MHARConfig's validators reject
        raise ValueError(f"the MHAR config cannot represent this {model_type} checkpoint: {error}") from None
    extras = sorted(set(values) - declared - _GENERIC_FIELDS)
    return config, extras


def _unknown_model_type_message(model_type: str, values: dict) -> str:
    if model_type == "mhar":
        return "the source is already an MHAR model; convert its original checkpoint instead"
    kind = "a mixture-of-experts model" if "moe" in str(model_type) or "mixtral" in str(model_type) or any(
        values.get(key) for key in _MOE_MARKERS) else "an architecture the converter does not know"
    return (f"model_type {model_type!r} is not supported ({kind}); supported are dense "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} checkpoints with full attention in every layer")


# ----------------------------------------------------------------------------------------------
# Reading the source

@dataclasses.dataclass(frozen=True)
class SourceTensor:
    """One tensor of the source checkpoint, located but not loaded. `offset` is the absolute
    byte offset of its data in a safetensors file, or None for a pickled `.bin` shard."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    file: Path
    offset: int | None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def read_safetensors_header(path: Path) -> list[SourceTensor]:
    """The tensors of one safetensors file, in the order of their data, checked for consistency."""
    size = path.stat().st_size
    header, data_start = safetensors_header(path)
    tensors = []
    for name, info in header.items():
        try:
            dtype = SAFETENSORS_DTYPES[info["dtype"]]
            shape = tuple(int(n) for n in info["shape"])
            begin, end = (int(n) for n in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path}: the header entry of {name!r} is malformed ({info!r}); re-download the file") from None
        tensor = SourceTensor(name, dtype, shape, path, data_start + begin)
        if end - begin != tensor.nbytes or begin < 0 or data_start + end > size:
            raise ValueError(f"{path}: tensor {name!r} {list(shape)} {info['dtype']} does not fit its data range "
                             f"[{begin}, {end}) in a file of {size} bytes; the file is truncated or corrupt")
        tensors.append(tensor)
    return sorted(tensors, key=lambda t: t.offset)


def load_pickled_shard(path: Path) -> dict[str, torch.Tensor]:
    """A `.bin` state dict, unpickled with `weights_only=True` (no code in the file can run)."""
    try:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as error:
            if "mmap" not in str(error):
                raise
            state = torch.load(path, map_location="cpu", weights_only=True)  # legacy (non-zip) format
    except Exception as error:  # pickle and zip errors come in many types
        raise ValueError(f"{path} cannot be read as a weights-only PyTorch state dict ({type(error).__name__}: "
                         f"{str(error).splitlines()[0] if str(error) else ''}); only plain tensors are accepted") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{path} does not hold a flat dict of tensors")
    return state


def _read_index(path: Path) -> dict[str, str]:
    """The weight map of a sharded checkpoint: tensor name -> shard file name."""
    try:
        index = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} is not valid JSON ({error}); the checkpoint index is corrupt: re-download it") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise ValueError(f"{path} has no valid 'weight_map' (tensor name -> shard file); the index is corrupt")
    for shard in set(weight_map.values()):
        if Path(shard).name != shard:
            raise ValueError(f"{path} points outside the checkpoint folder ({shard!r}); the index is corrupt")
    return weight_map


def read_source_tensors(folder: Path) -> tuple[str, list[Path], list[SourceTensor]]:
    """Locate every tensor of the checkpoint in `folder`: (format, shard files, tensors in read order).

    Safetensors are preferred over pickled `.bin` files when both are present.
    """
    if (folder / SAFE_INDEX).is_file() or (folder / SAFE_SINGLE).is_file():
        fmt, index_name, single = "safetensors", SAFE_INDEX, SAFE_SINGLE
    elif (folder / BIN_INDEX).is_file() or (folder / BIN_SINGLE).is_file():
        fmt, index_name, single = "pytorch_bin", BIN_INDEX, BIN_SINGLE
    else:
        raise FileNotFoundError(f"no weights in {folder}: expected {SAFE_INDEX}, {SAFE_SINGLE}, {BIN_INDEX} or {BIN_SINGLE}")

    weight_map = _read_index(folder / index_name) if (folder / index_name).is_file() else None
    files = sorted(set(weight_map.values())) if weight_map else [single]
    for name in files:
        if not (folder / name).is_file():
            raise FileNotFoundError(f"shard {name} listed in {index_name} is missing from {folder}; "
                                    "download the complete checkpoint")
    tensors: list[SourceTensor] = []
    for name in files:
        path = folder / name
        if fmt == "safetensors":
            found = read_safetensors_header(path)
        else:
            state = load_pickled_shard(path)
            found = [SourceTensor(k, v.dtype, tuple(v.shape), path, None) for k, v in state.items()]
            del state
        if weight_map is not None:
            listed = {k for k, v in weight_map.items() if v == name}
            held = {t.name for t in found}
            if listed != held:
                raise ValueError(
                    f"{index_name} does not match {name}: listed but absent {sorted(listed - held)[:5]}, "
                    f"present but not listed {sorted(held - listed)[:5]}; the index is corrupt"
                )
        tensors.extend(found)
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        raise ValueError(f"some tensors appear in more than one file of {folder}; the checkpoint is corrupt")
    return fmt, [folder / name for name in files], tensors


# ----------------------------------------------------------------------------------------------
# The plan

@dataclasses.dataclass(frozen=True)
class OutputTensor:
    """One tensor of the converted checkpoint: copied from `source`, or the constant `value`."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    source: SourceTensor | None = None
    value: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclasses.dataclass
class ConversionPlan:
    source: Path
    source_model_type: str
    source_format: str
    source_files: list[Path]
    config: MHARConfig
    tensors: list[OutputTensor]  # in write order: backbone as read, then the routing tensors
    dropped_tensors: list[str]
    ignored_config_fields: list[str]


def plan_conversion(src: str | os.PathLike, heads: int = 8, num_blocks: int = 8, dtype: str = "keep") -> ConversionPlan:
    """Read and check everything about the source; write nothing. Raises on any unsupported input."""
    from transformers import AutoConfig

    from .modeling_mhar import MHARForCausalLM, MHARRouter

    if dtype not in DTYPE_CHOICES:
        raise ValueError(f"dtype={dtype!r} is not one of {', '.join(DTYPE_CHOICES)}")
    folder = Path(src)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} not found: SRC must be a Hugging Face checkpoint folder")
    try:
        raw = json.loads(config_file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{config_file} is not valid JSON ({error})") from None
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(_unknown_model_type_message(model_type, raw if isinstance(raw, dict) else {}))
    config, ignored = mhar_config_for(AutoConfig.from_pretrained(folder), heads, num_blocks, dtype)

    fmt, files, source_tensors = read_source_tensors(folder)
    with torch.device("meta"):
        expected = {name: tuple(t.shape) for name, t in MHARForCausalLM(config).state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    routing_names = [name for name in expected if is_routing_parameter(name)]

    dropped = [t.name for t in source_tensors if _is_droppable(t.name, config)]
    backbone = [t for t in source_tensors if t.name not in dropped]
    _check_names_and_shapes(backbone, {k: v for k, v in expected.items() if not is_routing_parameter(k)}, model_type)

    by_name = {t.name: t for t in backbone}
    if "model.embed_tokens.weight" not in by_name:
        raise ValueError("the checkpoint has no model.embed_tokens.weight")
    routing_dtype = by_name["model.embed_tokens.weight"].dtype if dtype == "keep" else getattr(torch, dtype)
    outputs = [
        OutputTensor(t.name, t.dtype if dtype == "keep" else routing_dtype, t.shape, source=t) for t in backbone
    ]
    # The init values come from the model's own router, so they follow the model code.
    init = MHARRouter(config, gated=True).state_dict()
    for name in routing_names:
        value = init[name.rsplit(".", 1)[1]].to(routing_dtype)
        outputs.append(OutputTensor(name, routing_dtype, tuple(value.shape), value=value))
    return ConversionPlan(folder.absolute(), model_type, fmt, files, config, outputs, dropped, ignored)


def _is_droppable(name: str, config: MHARConfig) -> bool:
    """Tensors a source may carry that its own model ignores on load: old checkpoints persist the
    RoPE frequencies (recomputed from the config), and a tied head duplicates the embedding."""
    return name.endswith(".rotary_emb.inv_freq") or (config.tie_word_embeddings and name == "lm_head.weight")


def _check_names_and_shapes(tensors: list[SourceTensor], expected: dict[str, tuple], model_type: str) -> None:
    found = {t.name: t for t in tensors}
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"the tensors do not match what config.json describes for a {model_type} model: "
            f"missing {len(missing)} {missing[:6]}, unexpected {len(unexpected)} {unexpected[:6]}"
        )
    wrong = [f"{t.name} is {list(t.shape)}, config implies {list(expected[t.name])}"
             for t in tensors if t.shape != expected[t.name]]
    if wrong:
        raise ValueError(f"{len(wrong)} tensor shape(s) disagree with config.json: " + "; ".join(wrong[:6]))
    not_float = [f"{t.name} ({DTYPE_CODES[t.dtype]})" for t in tensors if t.dtype not in FLOAT_DTYPES]
    if not_float:
        raise ValueError("quantized or integer weights are not supported: " + ", ".join(not_float[:6]))


# ----------------------------------------------------------------------------------------------
# Writing

def parse_size(size: int | str) -> int:
    """Bytes in a size such as `5GB` (10^9) or `4GiB` (2^30), as `save_pretrained` reads it."""
    from transformers.utils.hub import convert_file_size_to_int

    try:
        value = convert_file_size_to_int(size)
    except ValueError:
        raise ValueError(f"max shard size {size!r} is not a size like '5GB', '500MB' or '4GiB'") from None
    if value <= 0:
        raise ValueError(f"max shard size {size!r} must be positive")
    return value


def split_into_shards(tensors: list[OutputTensor], max_bytes: int) -> list[list[OutputTensor]]:
    """Consecutive groups of at most `max_bytes` (a larger single tensor gets a shard of its own)."""
    shards: list[list[OutputTensor]] = [[]]
    size = 0
    for tensor in tensors:
        if shards[-1] and size + tensor.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += tensor.nbytes
    return shards


class _SourceReader:
    """Serves source tensors: raw byte ranges of safetensors files (kept open), or the tensors of
    one pickled shard at a time."""

    def __init__(self):
        self._files: dict[Path, int] = {}
        self._bin_path: Path | None = None
        self._bin_state: dict[str, torch.Tensor] = {}
        self._sendfile = hasattr(os, "sendfile")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for fd in self._files.values():
            os.close(fd)
        self._files.clear()
        self._bin_state = {}

    def _fd(self, path: Path) -> int:
        if path not in self._files:
            self._files[path] = os.open(path, os.O_RDONLY)
        return self._files[path]

    def tensor(self, source: SourceTensor) -> torch.Tensor:
        if source.offset is None:
            if source.file != self._bin_path:
                self._bin_state = {}  # release the previous shard before loading the next
                self._bin_state, self._bin_path = load_pickled_shard(source.file), source.file
            return self._bin_state[source.name]
        data = bytearray(source.nbytes)
        done = 0
        while done < len(data):
            n = os.preadv(self._fd(source.file), [memoryview(data)[done:]], source.offset + done)
            if not n:
                raise ValueError(f"{source.file} ended inside tensor {source.name!r}; the file is truncated")
            done += n
        if not data:
            return torch.empty(source.shape, dtype=source.dtype)
        return torch.frombuffer(data, dtype=source.dtype).reshape(source.shape)

    def copy_bytes(self, source: SourceTensor, out_fd: int) -> None:
        """Append the tensor's raw bytes to `out_fd`: kernel-side with sendfile where the platform
        allows it (as a plain file copy does), else through a buffer."""
        fd, offset, remaining = self._fd(source.file), source.offset, source.nbytes
        while remaining:
            n = self._send(out_fd, fd, offset, remaining)
            if not n:
                raise ValueError(f"{source.file} ended inside tensor {source.name!r}; the file is truncated")
            offset += n
            remaining -= n

    def _send(self, out_fd: int, fd: int, offset: int, count: int) -> int:
        if self._sendfile:
            try:
                return os.sendfile(out_fd, fd, offset, count)
            except OSError as error:
                if error.errno not in (errno.EINVAL, errno.ENOSYS, errno.ENOTSOCK, errno.EOPNOTSUPP):
                    raise
                self._sendfile = False  # e.g. macOS, which sends to sockets only
        chunk = os.pread(fd, min(count, _COPY_BUFFER), offset)
        _write_all(out_fd, chunk)
        return len(chunk)


def _write_all(fd: int, data) -> None:
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view):]


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())


def write_shard(path: Path, tensors: list[OutputTensor], reader: _SourceReader) -> None:
    """Write one safetensors file: header, then each tensor's bytes in order; fsync'd."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": DTYPE_CODES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    with open(path, "wb", buffering=0) as out:
        fd = out.fileno()
        _write_all(fd, struct.pack("<Q", len(encoded)) + encoded)
        for t in tensors:
            start = os.lseek(fd, 0, os.SEEK_CUR)
            if t.source is not None and t.source.offset is not None and t.source.dtype == t.dtype:
                reader.copy_bytes(t.source, fd)  # byte-identical, never materialised
            else:
                value = t.value if t.value is not None else reader.tensor(t.source)
                _write_all(fd, _tensor_bytes(value.to(t.dtype)))
            written = os.lseek(fd, 0, os.SEEK_CUR) - start
            if written != t.nbytes:
                raise RuntimeError(f"wrote {written} bytes for {t.name}, expected {t.nbytes}")
        os.fsync(fd)


def write_weights(plan: ConversionPlan, folder: Path, max_shard_bytes: int, log: Callable[[str], None]) -> list[str]:
    """The converted weights in `folder`: shards (and an index when there are several)."""
    shards = split_into_shards(plan.tensors, max_shard_bytes)
    count = len(shards)
    names = [SAFE_SINGLE] if count == 1 else [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    with _SourceReader() as reader:
        for i, (name, group) in enumerate(zip(names, shards), 1):
            write_shard(folder / name, group, reader)
            log(f"  wrote {name} ({_human_size(sum(t.nbytes for t in group))}, {len(group)} tensors) [{i}/{count}]")
    if count > 1:
        index = {
            "metadata": {"total_size": sum(t.nbytes for t in plan.tensors)},
            "weight_map": {t.name: name for name, group in zip(names, shards) for t in group},
        }
        (folder / SAFE_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return names


def _human_size(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.2f} MB"


def copy_auxiliary_files(src: Path, dst: Path) -> list[str]:
    names = [name for name in AUXILIARY_FILES if (src / name).is_file()]
    names += sorted({p.name for pattern in AUXILIARY_PATTERNS for p in src.glob(pattern) if p.is_file()})
    for name in names:
        shutil.copyfile(src / name, dst / name)
    return names


# ----------------------------------------------------------------------------------------------
# The whole conversion

def resolve_source(src: str | os.PathLike) -> Path:
    """A local checkpoint folder; a hub id (`org/name`) is resolved to a local snapshot when the
    network (or the local hub cache) allows."""
    path = Path(src)
    if path.exists():
        if not path.is_dir():
            raise NotADirectoryError(f"SRC {path} is a file; give the checkpoint folder")
        return path.absolute()
    if re.fullmatch(r"[\w.-]+/[\w.-]+", str(src)):
        from huggingface_hub import snapshot_download

        patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "LICENSE*", "NOTICE*", "USE_POLICY*"]
        try:
            return Path(snapshot_download(str(src), allow_patterns=patterns))
        except Exception as error:  # offline, unknown repo, gated repo: all mean "not available"
            raise FileNotFoundError(f"{src} is not a local folder, and fetching it from the hub failed: {error}") from None
    raise FileNotFoundError(f"SRC {src} does not exist")


def _check_destination(src: Path, dst: Path, overwrite: bool) -> None:
    src, real_dst = src.resolve(), dst.resolve()
    if real_dst == src or src in real_dst.parents or real_dst in src.parents:
        raise ValueError(f"DST {dst} overlaps SRC {src}; write the converted model somewhere else")
    if dst.exists():
        if not dst.is_dir():
            raise FileExistsError(f"DST {dst} exists and is a file")
        if any(dst.iterdir()) and not overwrite:
            raise FileExistsError(f"DST {dst} is not empty; choose a new folder or pass --overwrite to replace it")


def convert_checkpoint(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    heads: int = 8,
    num_blocks: int = 8,
    dtype: str = "keep",
    max_shard_size: int | str = "5GB",
    verify: bool = False,
    overwrite: bool = False,
    log: Callable[[str], None] = print,
) -> Path:
    """Convert the Llama-family checkpoint `src` into an MHAR delta model at `dst`; return `dst`.

    heads, num_blocks: `residual_heads` (must divide hidden_size) and `residual_num_blocks`
        (a model with fewer layers gets a block per layer) of the new model.
    dtype: `keep` copies every tensor's bytes as stored (the routing tensors take the embedding's
        dtype); `bfloat16` or `float32` casts everything.
    max_shard_size: the output shard limit (`5GB` = 5*10^9 bytes, `4GiB` = 4*2^30).
    verify: also run `verify_identity` (fp32 and bf16 logits, greedy generations) before `dst`
        appears; a mismatch raises `IdentityMismatchError` and leaves no `dst`.
    overwrite: replace a non-empty `dst` (swapped out only after the new model is complete).

    Writes the weights (sharded safetensors + index), config.json, the remote-code bundle,
    tokenizer / chat template / generation config files, and `mhar_conversion.json`.
    """
    from . import __version__
    from .remote_code import save_remote_code

    max_shard_bytes = parse_size(max_shard_size)
    source = resolve_source(src)
    dst = Path(dst).absolute()
    _check_destination(source, dst, overwrite)
    plan = plan_conversion(source, heads, num_blocks, dtype)
    routing = sum(t.source is None for t in plan.tensors)
    log(f"converting {plan.source_model_type} checkpoint {source} ({plan.source_format}, {len(plan.source_files)} "
        f"file(s), {len(plan.tensors) - routing} tensors) -> MHAR delta, H={heads}, {num_blocks} blocks, "
        f"+{routing} routing tensors")

    with built_in_place(dst, "converting", log) as tmp:
        shards = write_weights(plan, tmp, max_shard_bytes, log)
        plan.config.save_pretrained(tmp)
        save_remote_code(tmp)
        copied = copy_auxiliary_files(source, tmp)
        verification = None
        if verify:
            from .verify import IdentityMismatchError, verify_identity

            report = verify_identity(source, tmp)
            log(report.summary())
            if not report.ok:
                raise IdentityMismatchError(f"the converted model's outputs differ from the source's; nothing "
                                            f"was written to {dst}\n{report.summary()}")
            verification = report.to_dict()
        ConversionRecord(
            source=str(source),
            source_model_type=plan.source_model_type,
            source_format=plan.source_format,
            source_files=[p.name for p in plan.source_files],
            heads=heads,
            num_blocks=num_blocks,
            dtype=dtype,
            stored_dtypes=sorted({DTYPE_CODES[t.dtype] for t in plan.tensors}),
            max_shard_size=max_shard_size,
            shards=shards,
            routing_tensors=routing,
            dropped_tensors=plan.dropped_tensors,
            ignored_config_fields=plan.ignored_config_fields,
            copied_files=copied,
            verification=verification,
            mhar_hf_version=__version__,
        ).write(tmp)
    log(f"wrote {dst}")
    return dst


__all__ = [
    "ConversionPlan",
    "convert_checkpoint",
    "mhar_config_for",
    "plan_conversion",
    "read_source_tensors",
]
