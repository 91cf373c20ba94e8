"""The converter: tiny random checkpoints of every supported architecture, built from the published
configs, saved in several shards, converted, and compared bit for bit with the source model."""

import hashlib
import os
import subprocess
import sys
import json
from pathlib import Path

import pytest
import torch
from conftest import shrunk_real_config
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from mhar_cli import main
import mhar_hf
from mhar_hf import convert as convert_module
from mhar_hf.convert import convert_checkpoint, plan_conversion

SHARD = "60KB"  # a tiny model (~100k parameters) then spans several shards on both sides
ARCHITECTURES = {
    "Llama-3.1-8B": {},  # GQA, llama3 rope scaling, untied head
    "Llama-3.2-1B": {},  # tied embeddings, explicit head_dim
    "Mistral-7B-v0.3": {},
    "Qwen2.5-7B": {"hidden_size": 112},  # 14 query heads must divide the width; q/k/v bias
    "Qwen3-8B": {},  # per-head q/k RMSNorm
}


def source_fields(name):
    fields = shrunk_real_config(name, **ARCHITECTURES[name])
    return fields.pop("model_type"), fields


def save_source(folder: Path, name: str, dtype=torch.bfloat16, **overrides) -> Path:
    """A randomly initialised model of the architecture `name`, saved like a hub checkpoint."""
    model_type, fields = source_fields(name)
    config = AutoConfig.for_model(model_type, **{**fields, **overrides})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # make norms and biases non-trivial, so a dropped or swapped one shows
        for param_name, param in model.named_parameters():
            if param.ndim == 1:
                param.add_(torch.randn_like(param) * 0.1)
    model.to(dtype).save_pretrained(folder, max_shard_size=SHARD)
    (folder / "tokenizer_config.json").unlink(missing_ok=True)
    (folder / "chat_template.jinja").write_text("{{ messages }}")
    return folder


def tensors_of(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def tokens(vocab):
    return torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(1))


def logits(path, dtype, ids, mask=None):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


def expected_routing_names(layers):
    leaves = ("query", "key_norm_weight", "null_source", "gate")
    names = {f"model.layers.{i}.mlp_router.{leaf}" for i in range(layers) for leaf in leaves}
    return names | {f"model.layers.{i}.attn_router.{leaf}" for i in range(1, layers) for leaf in leaves}


def file_hashes(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_conversion_is_bit_exact(tmp_path, name):
    src = save_source(tmp_path / "src", name)
    assert len(list(src.glob("*.safetensors"))) > 2
    dst = convert_checkpoint(src, tmp_path / "dst", heads=4, num_blocks=2, max_shard_size=SHARD, log=lambda s: None)

    # Weights: every source tensor byte-identical, plus the routing tensors at their init values.
    before, after = tensors_of(src), tensors_of(dst)
    layers = json.loads((src / "config.json").read_text())["num_hidden_layers"]
    assert set(after) == set(before) | expected_routing_names(layers)
    for key, value in before.items():
        assert after[key].dtype == value.dtype and torch.equal(after[key], value), key
    for key in expected_routing_names(layers):
        value, leaf = after[key], key.rsplit(".", 1)[1]
        assert value.dtype == torch.bfloat16
        assert value.shape == ((1,) if leaf == "gate" else (before["model.embed_tokens.weight"].shape[1],))
        assert torch.equal(value, torch.full_like(value, 1.0 if leaf == "key_norm_weight" else 0.0)), key

    # Index: several shards, every tensor mapped to the file that holds it, total size right.
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and sorted(p.name for p in dst.glob("*.safetensors")) == files
    for file in files:
        with safe_open(dst / file, framework="pt") as f:
            assert set(f.keys()) == {k for k, v in index["weight_map"].items() if v == file}
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in after.values())

    # Config, side files, provenance.
    config = json.loads((dst / "config.json").read_text())
    source_config = json.loads((src / "config.json").read_text())
    assert config["model_type"] == "mhar" and config["residual_mode"] == "delta"
    assert (config["residual_heads"], config["residual_num_blocks"]) == (4, 2)
    assert config["tie_word_embeddings"] == source_config["tie_word_embeddings"]
    assert ("lm_head.weight" in after) != source_config["tie_word_embeddings"]
    assert config["qkv_bias"] == (source_config["model_type"] == "qwen2")
    assert config["qk_norm"] == (source_config["model_type"] == "qwen3")
    assert config["rope_parameters"] == source_config["rope_parameters"]
    assert "auto_map" in config and (dst / "modeling_mhar.py").is_file()
    for side_file in ("generation_config.json", "chat_template.jinja"):
        assert (dst / side_file).read_bytes() == (src / side_file).read_bytes()
    provenance = json.loads((dst / "mhar_conversion.json").read_text())
    assert provenance["source"] == str(src) and provenance["source_model_type"] == source_config["model_type"]
    assert (provenance["heads"], provenance["num_blocks"], provenance["dtype"]) == (4, 2, "keep")
    assert provenance["mhar_hf_version"] == mhar_hf.__version__ and provenance["date"].endswith("+00:00")

    # Outputs: bit for bit in fp32 and bf16 (with a padded row, so the mask path is exercised too).
    ids = tokens(config["vocab_size"])
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    for dtype in (torch.float32, torch.bfloat16):
        expected, got = logits(src, dtype, ids, mask), logits(dst, dtype, ids, mask)
        assert got.dtype == dtype and torch.equal(got, expected), dtype


def test_dtype_cast(tmp_path):
    """--dtype bfloat16 of an fp32 checkpoint equals loading the source in bf16."""
    src = save_source(tmp_path / "src", "Llama-3.1-8B", dtype=torch.float32)
    dst = convert_checkpoint(src, tmp_path / "dst", heads=4, num_blocks=2, dtype="bfloat16", log=lambda s: None)
    before, after = tensors_of(src), tensors_of(dst)
    assert {t.dtype for t in after.values()} == {torch.bfloat16}
    for key, value in before.items():
        assert torch.equal(after[key], value.to(torch.bfloat16)), key
    assert json.loads((dst / "config.json").read_text())["dtype"] == "bfloat16"
    ids = tokens(300)
    assert torch.equal(logits(dst, torch.bfloat16, ids), logits(src, torch.bfloat16, ids))
    assert list(dst.glob("*.safetensors")) == [dst / "model.safetensors"]  # 5GB default: one file


def test_pickled_bin_checkpoint(tmp_path):
    """Sharded `pytorch_model.bin` files (with a persisted RoPE buffer, as old checkpoints have)."""
    src = save_source(tmp_path / "safe", "Llama-3.1-8B", dtype=torch.float32)
    state = tensors_of(src)
    names = sorted(state)
    folder = tmp_path / "bin"
    folder.mkdir()
    (folder / "config.json").write_bytes((src / "config.json").read_bytes())
    halves = {"pytorch_model-00001-of-00002.bin": names[: len(names) // 2],
              "pytorch_model-00002-of-00002.bin": names[len(names) // 2 :]}
    weight_map = {}
    for file, part in halves.items():
        shard = {k: state[k] for k in part}
        if file.startswith("pytorch_model-00001"):
            shard["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
        torch.save(shard, folder / file)
        weight_map.update(dict.fromkeys(shard, file))
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))

    dst = convert_checkpoint(folder, tmp_path / "dst", heads=4, num_blocks=2, log=lambda s: None)
    after = tensors_of(dst)
    for key, value in state.items():
        assert torch.equal(after[key], value), key
    provenance = json.loads((dst / "mhar_conversion.json").read_text())
    assert provenance["source_format"] == "pytorch_bin"
    assert provenance["dropped_tensors"] == ["model.layers.0.self_attn.rotary_emb.inv_freq"]
    ids = tokens(300)
    assert torch.equal(logits(dst, torch.float32, ids), logits(src, torch.float32, ids))


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_pickled_code_is_never_run(tmp_path, capsys):
    src = save_source(tmp_path / "src", "Llama-3.1-8B")
    state = tensors_of(src)
    for file in src.glob("*.safetensors"):
        file.unlink()
    (src / "model.safetensors.index.json").unlink()
    marker = tmp_path / "pwned"
    torch.save({**state, "payload": _RunsCode(marker)}, src / "pytorch_model.bin")
    capsys.readouterr()
    assert main(["convert", str(src), str(tmp_path / "dst"), "--heads", "4", "--num-blocks", "2"]) == 2
    assert not marker.exists() and not (tmp_path / "dst").exists()
    assert "weights-only" in capsys.readouterr().err


def test_interrupted_conversion_leaves_nothing(tmp_path, monkeypatch):
    src = save_source(tmp_path / "src", "Qwen3-8B")
    old = tmp_path / "old"
    old.mkdir()
    (old / "keep.txt").write_text("the previous model")
    before = file_hashes(src)
    real_write = convert_module.write_shard
    calls = []

    def failing_write(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError("disk full (injected)")
        return real_write(*args, **kwargs)

    monkeypatch.setattr(convert_module, "write_shard", failing_write)
    for dst, overwrite in ((tmp_path / "new", False), (old, True)):
        calls.clear()
        with pytest.raises(OSError, match="injected"):
            convert_checkpoint(src, dst, heads=4, num_blocks=2, max_shard_size=SHARD, overwrite=overwrite,
                               log=lambda s: None)
        assert len(calls) == 2
    assert not (tmp_path / "new").exists()
    assert file_hashes(old) == {"keep.txt": hashlib.sha256(b"the previous model").hexdigest()}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old", "src"]  # no temporary folders left
    assert file_hashes(src) == before


def test_a_killed_conversion_is_cleaned_up_by_the_next(tmp_path, capsys):
    """What a killed `mhar convert` left (a staging folder of a process that no longer runs) goes
    with the next conversion to that folder; one of a live process stays; parent folders a
    refused conversion would have needed are not made."""
    from mhar_hf.folder import _this_host

    src = save_source(tmp_path / "src", "Llama-3.2-1B")
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = tmp_path / f".dst.converting-{_this_host()}-{int(finished.stdout)}-x1"
    live = tmp_path / f".dst.converting-{_this_host()}-{os.getpid()}-x2"
    for leftover in (dead, live):
        leftover.mkdir()
        (leftover / "model.safetensors").write_bytes(b"half a shard")
    assert main(["convert", str(src), str(tmp_path / "dst"), "--heads", "4", "--num-blocks", "2"]) == 0
    assert not dead.exists() and live.exists()
    assert f"removed {dead}" in capsys.readouterr().out
    assert main(["convert", str(src), str(tmp_path / "a" / "b" / "dst"), "--heads", "5"]) == 2
    assert not (tmp_path / "a").exists()


def test_the_converted_folder_has_the_umask_mode(tmp_path):
    src = save_source(tmp_path / "src", "Llama-3.2-1B")
    umask = os.umask(0o027)
    try:
        dst = convert_checkpoint(src, tmp_path / "dst", heads=4, num_blocks=2, log=lambda s: None)
    finally:
        os.umask(umask)
    assert dst.stat().st_mode & 0o777 == 0o750  # what mkdir gives under that umask, not mkdtemp's 0700


def test_overwrite(tmp_path, capsys):
    src = save_source(tmp_path / "src", "Mistral-7B-v0.3")
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "stale.txt").write_text("x")
    capsys.readouterr()
    args = ["convert", str(src), str(dst), "--heads", "4", "--num-blocks", "2"]
    assert main(args) == 2
    assert "not empty" in capsys.readouterr().err and (dst / "stale.txt").exists()
    assert main([*args, "--overwrite"]) == 0
    assert not (dst / "stale.txt").exists() and (dst / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst", "src"]
    assert main(["convert", str(src), str(src / "inside"), "--overwrite"]) == 2
    assert "overlaps" in capsys.readouterr().err


def _first_shard(src):
    return sorted(src.glob("model-*.safetensors"))[0]


def _missing_shard(src):
    sorted(src.glob("model-*.safetensors"))[1].unlink()


def _wrong_shape(src):
    shard = sorted(src.glob("model-*.safetensors"))[1]
    state = load_file(shard)
    key = sorted(state)[0]
    state[key] = torch.zeros(state[key].shape[0] + 1, *state[key].shape[1:], dtype=state[key].dtype)
    save_file(state, shard, metadata={"format": "pt"})


def _truncated_shard(src):
    shard = _first_shard(src)
    shard.write_bytes(shard.read_bytes()[:-100])


def _corrupt_index_json(src):
    index = src / "model.safetensors.index.json"
    index.write_text(index.read_text()[:-20])


def _index_points_elsewhere(src):
    index_file = src / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    last = sorted(set(index["weight_map"].values()))[-1]
    key = next(k for k, v in index["weight_map"].items() if v != last)
    index["weight_map"][key] = last
    index_file.write_text(json.dumps(index))


def _edit_config(**changes):
    def edit(src):
        config = json.loads((src / "config.json").read_text())
        config.update(changes)
        (src / "config.json").write_text(json.dumps(config))
    return edit


BAD_INPUTS = {
    "missing shard": ("Llama-3.1-8B", _missing_shard, "is missing"),
    "wrong shape": ("Llama-3.1-8B", _wrong_shape, "disagree with config.json"),
    "truncated shard": ("Llama-3.1-8B", _truncated_shard, "truncated or corrupt"),
    "corrupt index": ("Llama-3.1-8B", _corrupt_index_json, "not valid JSON"),
    "index mismatch": ("Llama-3.1-8B", _index_points_elsewhere, "the index is corrupt"),
    "unknown architecture": ("Llama-3.1-8B", _edit_config(model_type="gpt2"), "not supported"),
    "moe": ("Mistral-7B-v0.3", _edit_config(model_type="mixtral", num_local_experts=8), "mixture-of-experts"),
    "sliding window": ("Mistral-7B-v0.3", _edit_config(sliding_window=4096), "sliding-window attention"),
    "mixed layer types": ("Qwen2.5-7B", _edit_config(use_sliding_window=True, sliding_window=64, max_window_layers=1,
                                                    layer_types=["full_attention"] + ["sliding_attention"] * 2),
                          "sliding_attention"),
    "quantized": ("Qwen3-8B", _edit_config(quantization_config={"quant_method": "gptq"}), "quantization_config"),
    "config mismatch": ("Llama-3.1-8B", _edit_config(intermediate_size=128), "disagree with config.json"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_inputs_are_refused(tmp_path, capsys, case):
    name, damage, message = BAD_INPUTS[case]
    src = save_source(tmp_path / "src", name)
    damage(src)
    before = file_hashes(src)
    capsys.readouterr()
    assert main(["convert", str(src), str(tmp_path / "dst"), "--heads", "4", "--num-blocks", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mhar convert: error:") and message in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"] and file_hashes(src) == before


def test_bad_options_are_refused(tmp_path, capsys):
    src = save_source(tmp_path / "src", "Llama-3.1-8B")
    capsys.readouterr()
    for options, message in ((["--heads", "5"], "residual_heads=5"), (["--num-blocks", "0"], "residual_num_blocks=0"),
                             (["--num-blocks", "2", "--max-shard-size", "5 parsecs"], "not a size")):
        assert main(["convert", str(src), str(tmp_path / "dst"), *options]) == 2
        assert message in capsys.readouterr().err
    assert main(["convert", str(tmp_path / "nowhere"), str(tmp_path / "dst")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert not (tmp_path / "dst").exists()


def test_plan_checks_before_writing(tmp_path):
    """The plan is built from headers alone and matches a model built independently from the config."""
    src = save_source(tmp_path / "src", "Llama-3.2-1B")
    plan = plan_conversion(src, heads=4, num_blocks=3)
    assert plan.config.layers_per_block == 1
    routing = [t for t in plan.tensors if t.source is None]
    assert {t.name for t in routing} == expected_routing_names(3)
    assert [t.name for t in plan.tensors[: -len(routing)]] == [
        t.source.name for t in plan.tensors[: -len(routing)]]
    assert list(tmp_path.iterdir()) == [src]


def test_cli_verify(tmp_path, capsys):
    """`convert --verify` records the check; `verify-identity` exits 1 once a gate is opened."""
    src = save_source(tmp_path / "src", "Llama-3.2-1B")
    dst = tmp_path / "dst"
    assert main(["convert", str(src), str(dst), "--heads", "4", "--num-blocks", "2", "--verify"]) == 0
    verification = json.loads((dst / "mhar_conversion.json").read_text())["verification"]
    assert verification["ok"] and [r["dtype"] for r in verification["results"]] == ["float32", "bfloat16"]
    capsys.readouterr()

    state = load_file(dst / "model.safetensors")
    state["model.layers.2.mlp_router.gate"] = torch.ones(1, dtype=torch.bfloat16)
    save_file(state, dst / "model.safetensors", metadata={"format": "pt"})
    assert main(["verify-identity", str(src), str(dst), "--max-new-tokens", "2", "--dtypes", "float32"]) == 1
    out = capsys.readouterr().out
    assert "MISMATCH" in out and "logits bit-equal: NO" in out


def test_verify_identity_also_compares_a_left_padded_batch(tmp_path, monkeypatch):
    """The prompts run alone and all in one left-padded batch: a model that differs only when it
    runs several sequences at once (other kernels, on a GPU) fails the check."""
    from mhar_hf.modeling_mhar import MHARForCausalLM
    from mhar_hf.verify import left_padded, verify_identity

    batch, mask = left_padded([torch.tensor([[5, 6, 7]]), torch.tensor([[8]])], pad=0)
    assert batch.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]

    src = save_source(tmp_path / "src", "Llama-3.2-1B")
    dst = convert_checkpoint(src, tmp_path / "dst", heads=4, num_blocks=2, log=lambda s: None)
    assert verify_identity(src, dst, dtypes=["float32"], max_new_tokens=2).ok
    forward = MHARForCausalLM.forward

    def differs_in_batches(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        if out.logits.shape[0] > 1:
            out.logits = out.logits + 1e-3
        return out

    monkeypatch.setattr(MHARForCausalLM, "forward", differs_in_batches)
    report = verify_identity(src, dst, dtypes=["float32"], max_new_tokens=2)
    assert not report.ok and not report.results[0].logits_equal


def test_hub_id_offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="not a local folder"):
        convert_module.resolve_source("no-such-org/no-such-model")


def test_demo_steps(tmp_path):
    from mhar_hf.demo.pipeline import DemoContext, step_tokenizer
    from mhar_hf.demo.steps_convert import step_convert, step_train_llama, step_verify_identity

    ctx = DemoContext(workdir=tmp_path)
    step_tokenizer(ctx)
    step_train_llama(ctx, steps=3)
    assert len(list(ctx.artifacts["llama_path"].glob("*.safetensors"))) > 1
    step_convert(ctx)
    assert (ctx.artifacts["converted_path"] / "tokenizer.json").is_file()
    assert "bit-equal" in step_verify_identity(ctx)


def test_copy_without_sendfile(tmp_path, monkeypatch):
    """Where sendfile only sends to sockets (macOS), the bytes go through a buffer, unchanged."""
    import errno
    import os

    def socket_only(*args):
        raise OSError(errno.ENOTSOCK, "not a socket")

    monkeypatch.setattr(os, "sendfile", socket_only)
    monkeypatch.setattr(convert_module, "_COPY_BUFFER", 1000)  # many chunks per tensor
    src = save_source(tmp_path / "src", "Qwen2.5-7B")
    dst = convert_checkpoint(src, tmp_path / "dst", heads=4, num_blocks=2, log=lambda s: None)
    before, after = tensors_of(src), tensors_of(dst)
    for key, value in before.items():
        assert torch.equal(after[key], value), key
