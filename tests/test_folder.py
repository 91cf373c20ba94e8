"""The model-folder contract (mhar_hf.folder): records round-trip through their files, bad files
are refused with errors that name them, newer keys are kept, files are written whole or not at
all, and the library never imports the command line."""

import ast
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from mhar_hf import folder
from mhar_hf.folder import (
    CONVERSION_RECORD,
    EVAL_RESULTS,
    PROBE_FILES,
    TRAINING_RECORD,
    ConversionRecord,
    EvalRecord,
    ProbeRecord,
    TrainingRecord,
    is_router_module,
    is_routing_parameter,
    write_atomically,
)

PACKAGE = Path(folder.__file__).parent
RECORDS = (ConversionRecord, TrainingRecord, EvalRecord, ProbeRecord)


def full(cls):
    """A record of `cls` with every field set, as its writer would."""
    values = {
        ConversionRecord: dict(
            source="/models/llama", source_model_type="llama", source_format="safetensors",
            source_files=["model.safetensors"], heads=8, num_blocks=2, dtype="keep", stored_dtypes=["BF16"],
            max_shard_size="5GB", shards=["model.safetensors"], routing_tensors=12, dropped_tensors=[],
            ignored_config_fields=["pretraining_tp"], copied_files=["tokenizer.json"],
            verification={"ok": True, "prompts": 3, "results": []}, mhar_hf_version="0.1.0"),
        TrainingRecord: dict(
            source_model="/models/converted", steps=40, tokens=81920, data=["/data/train.jsonl"], val_data=[],
            seq_length=256, global_batch_sequences=8, processes=1, distributed_type="NO",
            lr_schedule={"schedule": "cosine", "peak_lr": 4e-4}, weight_decay=0.1, z_loss=0.0, ema_decay=None,
            trainable="all", lora_merged=None, final_train_loss=2.5, final_val_loss=2.75, mixed_precision="no",
            saved_dtype="float32", mhar_hf_version="0.1.0"),
        EvalRecord: dict(
            model="/models/trained", tasks=["gsm8k"],
            primary={"gsm8k": {"metric": "exact_match", "filter": "strict-match"}}, model_type="mhar", limit=4, data_dir=None, max_gen_toks=64, seed=0, batch_size="4",
            mhar_hf_version="0.1.0", lm_eval_version="0.4.13"),
        ProbeRecord: dict(
            model={"residual_mode": "delta", "residual_heads": 8}, data={"tokens": 64, "seq_len": 32},
            settings={"slices": 4, "null_draws": 4, "seed": 0}, summary={"learned_excess": 0.01, "notes": []},
            sites=[{"name": "layers.1.attn"}]),
    }[cls]
    return cls(**values)


@pytest.mark.parametrize("cls", RECORDS, ids=lambda cls: cls.__name__)
def test_records_round_trip(tmp_path, cls):
    record = full(cls)
    path = record.write(tmp_path)
    assert path == tmp_path / cls.FILE
    assert cls.read(tmp_path) == record
    assert cls.read_file(path) == record
    raw = json.loads(path.read_text())
    on_disk = raw["mhar"] if cls is EvalRecord else raw
    names = [f.name for f in dataclasses.fields(cls) if f.name != "extra"]
    assert list(on_disk) == names  # one key per field, in the fields' order
    assert on_disk["date"].endswith("+00:00") and "T" in on_disk["date"]  # utc_now(): UTC, ISO 8601


def test_the_file_names_are_the_contract_s():
    assert (ConversionRecord.FILE, TrainingRecord.FILE) == (CONVERSION_RECORD, TRAINING_RECORD)
    assert (EvalRecord.FILE, ProbeRecord.FILE) == (EVAL_RESULTS, PROBE_FILES[0])
    assert (CONVERSION_RECORD, TRAINING_RECORD, EVAL_RESULTS) == ("mhar_conversion.json", "mhar_training.json",
                                                                   "results.json")


def test_every_record_names_its_date_alike():
    for cls in RECORDS:
        [date] = [f for f in dataclasses.fields(cls) if "date" in f.name]
        assert date.name == "date" and date.default_factory is folder.utc_now


def test_every_field_has_a_docstring():
    tree = ast.parse((PACKAGE / "folder.py").read_text())
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    for cls in (*RECORDS, folder._Record):
        body = classes[cls.__name__].body
        for i, node in enumerate(body):
            if isinstance(node, ast.AnnAssign) and "ClassVar" not in ast.unparse(node.annotation):
                after = body[i + 1] if i + 1 < len(body) else None
                assert isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant), \
                    f"{cls.__name__}.{node.target.id} has no docstring"


def test_eval_record_keeps_the_harness_results_beside_it(tmp_path):
    record = full(EvalRecord)
    harness = {"results": {"gsm8k": {"exact_match,strict-match": 0.5}}, "n-shot": {"gsm8k": 5}}
    record.write(tmp_path, harness, default=str)
    raw = json.loads((tmp_path / EVAL_RESULTS).read_text())
    assert raw["results"] == harness["results"] and raw["mhar"]["model"] == "/models/trained"
    read, rest = EvalRecord.read_run(tmp_path)
    assert read == record and rest == harness
    (tmp_path / EVAL_RESULTS).write_text(json.dumps(harness))
    with pytest.raises(ValueError, match=rf"{EVAL_RESULTS} has no `mhar` block.*`mhar eval`"):
        EvalRecord.read(tmp_path)


def test_a_missing_record_is_an_error_naming_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=rf"{tmp_path / TRAINING_RECORD} not found.*`mhar train`"):
        TrainingRecord.read(tmp_path)
    with pytest.raises(FileNotFoundError, match=rf"{tmp_path / EVAL_RESULTS} not found"):
        EvalRecord.read_run(tmp_path)
    assert ConversionRecord.read_if_present(tmp_path) is None


@pytest.mark.parametrize("text, problem", [
    ("{not json", "is not valid JSON"),
    ("\xff\xfe", "is not valid JSON"),
    ("[1, 2]", "holds a JSON list, not an object"),
    ('{"heads": 8}', "it has no `source`"),
    ('{"source": null}', "`source` is null, not str"),
    ('{"source": "/m", "heads": "eight"}', '`heads` is "eight", not'),
    ('{"source": "/m", "heads": true}', "`heads` is true, not"),
    ('{"source": "/m", "shards": "model.safetensors"}', "`shards` is"),
])
def test_a_malformed_record_is_an_error_naming_the_file(tmp_path, text, problem):
    (tmp_path / CONVERSION_RECORD).write_bytes(text.encode("latin-1"))
    with pytest.raises(ValueError) as error:
        ConversionRecord.read(tmp_path)
    assert str(tmp_path / CONVERSION_RECORD) in str(error.value) and problem in str(error.value)
    with pytest.raises(ValueError, match=CONVERSION_RECORD):  # read_if_present reads a file that is there
        ConversionRecord.read_if_present(tmp_path)


def test_unknown_keys_are_kept_and_written_back(tmp_path):
    raw = {**full(TrainingRecord).to_dict(), "tokens_per_second": 1234.5, "hardware": {"gpu": "H100"}}
    (tmp_path / TRAINING_RECORD).write_text(json.dumps(raw))
    record = TrainingRecord.read(tmp_path)
    assert record.steps == 40 and record.extra == {"tokens_per_second": 1234.5, "hardware": {"gpu": "H100"}}
    assert record.to_dict() == raw
    out = tmp_path / "copy"
    out.mkdir()
    record.write(out)
    assert json.loads((out / TRAINING_RECORD).read_text()) == raw


def test_older_records_read(tmp_path):
    """Keys an older version did not write read as None; a conversion record from before the
    dates were unified says date_utc."""
    (tmp_path / CONVERSION_RECORD).write_text(json.dumps(
        {"source": "meta-llama/Llama-3.2-1B", "heads": 8, "date_utc": "2026-11-30T10:00:00+00:00"}))
    record = ConversionRecord.read(tmp_path)
    assert record.date == "2026-11-30T10:00:00+00:00" and record.heads == 8 and record.shards is None
    assert "date_utc" not in record.to_dict() and not record.extra
    (tmp_path / TRAINING_RECORD).write_text(json.dumps({"source_model": "/m", "steps": 3}))
    assert TrainingRecord.read(tmp_path) == TrainingRecord(source_model="/m", steps=3, date=None)


def test_the_committed_experiment_records_read():
    records = sorted((PACKAGE.parent / "experiments" / "results").glob("*/training.json"))
    for path in records:
        assert TrainingRecord.read_file(path).steps > 0


# ------------------------------------------------------------------------------------- writer

@pytest.mark.parametrize("fail_at", ["fsync", "replace"])
def test_a_failed_write_leaves_the_old_file_and_no_partial_one(tmp_path, monkeypatch, fail_at):
    target = tmp_path / "record.json"
    target.write_text("old\n")

    def fail(*args):
        partials = [p for p in tmp_path.iterdir() if p != target]
        assert len(partials) == 1 and partials[0].read_text() == "new, and longer\n"  # written aside
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(folder.os, fail_at, fail)
    with pytest.raises(OSError, match="No space left"):
        write_atomically(target, "new, and longer\n")
    assert target.read_text() == "old\n"
    assert sorted(tmp_path.iterdir()) == [target]


def test_a_record_write_that_fails_leaves_the_old_record(tmp_path, monkeypatch):
    full(ConversionRecord).write(tmp_path)
    before = (tmp_path / CONVERSION_RECORD).read_bytes()
    monkeypatch.setattr(folder.os, "replace", lambda *args: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        dataclasses.replace(full(ConversionRecord), heads=4).write(tmp_path)
    assert (tmp_path / CONVERSION_RECORD).read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == [CONVERSION_RECORD]


def test_write_atomically_replaces_text_and_bytes(tmp_path):
    target = tmp_path / "file"
    write_atomically(target, "héllo\n")
    assert target.read_bytes() == "héllo\n".encode()
    write_atomically(target, b"\x89PNG")
    assert target.read_bytes() == b"\x89PNG" and [p.name for p in tmp_path.iterdir()] == ["file"]


# ------------------------------------------------------------------------------------ routing

def test_routing_parameters_and_modules():
    for name in ("model.layers.3.attn_router.query", "model.layers.0.mlp_router.gate",
                 "model.final_router.key_norm_weight",
                 "base_model.model.model.layers.1.attn_router.modules_to_save.default.null_source"):
        assert is_routing_parameter(name), name
    for name in ("model.layers.3.self_attn.q_proj.weight", "model.norm.weight", "lm_head.weight", "router.weight",
                 "model.layers.0.attn_router"):
        assert not is_routing_parameter(name), name
    assert is_router_module("model.layers.3.attn_router") and is_router_module("final_router")
    assert not is_router_module("model.layers.3.attn_router.query") and not is_router_module("model.norm")


# ---------------------------------------------------------------------------- package layering

def imported_modules(path: Path) -> set[str]:
    """The modules a source file imports (absolute names; relative imports as `.name`)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.add("." * node.level + (node.module or ""))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args and isinstance(node.args[0], ast.Constant)):
            names.add(str(node.args[0].value))
    return names


def test_the_library_never_imports_the_command_line():
    offenders = {str(path.relative_to(PACKAGE.parent)): sorted(m for m in imported_modules(path)
                                                               if m.split(".")[0] == "mhar_cli")
                 for path in sorted(PACKAGE.rglob("*.py"))}
    assert len(offenders) > 20  # the scan saw the package
    assert {path: names for path, names in offenders.items() if names} == {}


def test_the_contract_needs_only_the_standard_library():
    """`mhar info` loads folder.py on its own (mhar_cli.folder_module), without torch."""
    outside = {m for m in imported_modules(PACKAGE / "folder.py")
               if m.startswith(".") or m.split(".")[0] not in sys.stdlib_module_names and m != "__future__"}
    assert outside == set()
    script = ("import sys\nfrom mhar_cli import folder_module\ncontract = folder_module()\n"
              "assert contract.TrainingRecord(source_model='x').source_model == 'x'\n"
              "print(sorted(m for m in ('torch', 'transformers', 'mhar_hf') if m in sys.modules))\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_folder_module_is_the_library_s_once_it_is_imported():
    from mhar_cli import folder_module

    assert folder_module() is folder
