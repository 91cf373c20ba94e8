"""In-process runs of `mhar train` (one process): z-loss, weight EMA, routing-only and LoRA paths,
and bad input failing with a clear message before any training step."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from train_setup import converted_model_and_corpus, read_metrics, train_args

from mhar_cli import main as cli
from mhar_hf.tiny import demo_corpus, tiny_config, train_tokenizer

NOT_LLAMA_FIELDS = ("auto_map", "model_type", "architectures", "qk_norm", "qkv_bias", "transformers_version")


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tokenizer):
    return converted_model_and_corpus(tmp_path_factory.mktemp("run"), tokenizer)


@pytest.fixture(autouse=True)
def _datasets_cache(monkeypatch, tmp_path_factory):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path_factory.getbasetemp() / "datasets-cache"))


def reset_accelerate():
    """Each run in this process starts from a fresh accelerate state (as a new process would)."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


def run(setup, name, *extra, steps=4, output=None):
    root, model, data = setup
    output = output or root / name
    reset_accelerate()
    assert cli(["train", *train_args(model, data, output, "--max-steps", str(steps), "--save-every", "2", *extra)]) == 0
    return output


def weights(folder):
    return load_file(str(folder / "model.safetensors"))


@pytest.fixture(scope="module")
def plain(setup):
    """A run with the default options (and TensorBoard on): the reference of the option tests."""
    return run(setup, "plain", "--report-to", "tensorboard")


def test_z_loss_changes_the_update_not_the_first_forward(setup, plain):
    with_z = run(setup, "zloss", "--z-loss", "0.05")
    a, b = read_metrics(plain), read_metrics(with_z)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(next((plain / "logs").rglob("events.out.tfevents.*")).parent))
    events.Reload()
    assert [e.value for e in events.Scalars("loss")] == pytest.approx([m["loss"] for m in a])
    assert {"lr", "grad_norm", "tokens_per_s", "gate_abs_mean", "val_loss"} <= set(events.Tags()["scalars"])
    assert a[0]["loss"] == b[0]["loss"] and a[0]["z_loss"] == b[0]["z_loss"] > 0
    assert a[1]["loss"] != b[1]["loss"]
    assert json.loads((with_z / "model" / "mhar_training.json").read_text())["z_loss"] == 0.05


def test_activation_checkpointing_and_bf16_paths(setup, plain):
    plain = read_metrics(plain)
    recomputed = read_metrics(run(setup, "checkpointed", "--gradient-checkpointing"))
    assert [m["loss"] for m in recomputed] == pytest.approx([m["loss"] for m in plain], rel=1e-6)
    bf16 = read_metrics(run(setup, "bf16", "--mixed-precision", "bf16"))
    assert [m["loss"] for m in bf16] == pytest.approx([m["loss"] for m in plain], rel=2e-2)
    assert [m["loss"] for m in bf16] != [m["loss"] for m in plain]  # autocast really ran in bf16


def test_ema_model_is_the_average_not_the_last_weights(setup):
    output = run(setup, "ema", "--ema-decay", "0.5")
    saved = weights(output / "model")
    raw = weights(output / "checkpoints" / "step-00000004")
    ema = torch.load(output / "checkpoints" / "step-00000004" / "ema_0.pt", weights_only=True)
    averages = dict(zip(ema["names"], ema["shadow"]))
    assert set(averages) == set(raw) - {"lm_head.weight"}  # lm_head is tied to the embedding
    for name, average in averages.items():
        assert torch.equal(saved[name], average), name
    assert any(not torch.equal(saved[n], raw[n]) for n in averages)
    assert json.loads((output / "model" / "mhar_training.json").read_text())["ema_decay"] == 0.5


def test_streaming_run_resumes_in_one_process_with_the_same_losses(setup):
    whole = run(setup, "stream", "--streaming", "--shuffle-buffer", "8")
    killed = setup[0] / "stream-killed"  # what a kill after step 3 leaves: checkpoint 2, three logged steps
    shutil.copytree(whole / "checkpoints" / "step-00000002", killed / "checkpoints" / "step-00000002")
    (killed / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in read_metrics(whole)[:3]))
    (killed / "checkpoints" / ".tmp-step-00000004").mkdir()  # a checkpoint cut short
    run(setup, None, "--streaming", "--shuffle-buffer", "8", "--resume", output=killed)
    assert [m["loss"] for m in read_metrics(killed)] == [m["loss"] for m in read_metrics(whole)]
    assert weights(killed / "model").keys() == weights(whole / "model").keys()
    assert all(torch.equal(a, weights(whole / "model")[n]) for n, a in weights(killed / "model").items())


def test_train_only_routing_leaves_the_backbone_untouched(setup):
    output = run(setup, "routing", "--train-only-routing")
    source, trained = weights(setup[1]), weights(output / "model")
    routing = {n for n in trained if "_router." in n}
    assert routing and all(torch.equal(source[n], trained[n]) for n in trained if n not in routing)
    gates = [trained[n].item() for n in routing if n.endswith(".gate")]
    assert all(g != 0 for g in gates)


def test_lora_adapter_keeps_the_routers_and_merging_gives_the_same_model(setup):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter = run(setup, "lora", "--lora-rank", "4")
    merged = run(setup, "lora-merged", "--lora-rank", "4", "--merge-lora")
    assert (adapter / "model" / "adapter_config.json").exists() and (adapter / "model" / "mhar_training.json").exists()
    assert read_metrics(adapter) == [{**m, "tokens_per_s": r["tokens_per_s"]} for m, r in zip(read_metrics(merged), read_metrics(adapter))]

    base = AutoModelForCausalLM.from_pretrained(setup[1])
    source = {n: p.detach().clone() for n, p in base.named_parameters()}
    with_adapter = PeftModel.from_pretrained(base, adapter / "model").merge_and_unload().eval()
    full = AutoModelForCausalLM.from_pretrained(merged / "model").eval()
    assert type(full).__name__ == "MHARForCausalLM" and (merged / "model" / "modeling_mhar.py").exists()
    probe = torch.arange(40).unsqueeze(0)
    with torch.no_grad():
        torch.testing.assert_close(with_adapter(probe).logits, full(probe).logits, rtol=1e-5, atol=1e-5)
    trained = dict(full.named_parameters())
    assert not torch.equal(trained["model.layers.0.self_attn.q_proj.weight"], source["model.layers.0.self_attn.q_proj.weight"])
    assert trained["model.layers.1.attn_router.gate"].item() != 0  # routers trained and kept
    assert torch.equal(trained["model.embed_tokens.weight"], source["model.embed_tokens.weight"])  # not a LoRA target


@pytest.mark.parametrize("mode", [("--lora-rank", "4"), ("--train-only-routing",)], ids=["lora", "routing"])
def test_a_frozen_backbone_stays_out_of_checkpoints_and_resume_is_exact(setup, mode):
    """LoRA and routing-only checkpoints hold what training changes, not an fp32 copy of the frozen
    backbone (32 GB at 8B); a resume from one logs the uninterrupted run's losses and saves its model."""
    name = mode[0].strip("-")
    whole = run(setup, f"frozen-{name}", *mode)
    saved = weights(whole / "checkpoints" / "step-00000002")
    if name == "lora-rank":
        assert saved and all("lora_" in n or "modules_to_save" in n for n in saved), sorted(saved)[:5]
    else:
        assert saved and all("_router." in n for n in saved), sorted(saved)[:5]
    killed = setup[0] / f"frozen-{name}-killed"  # a kill after step 3: checkpoint 2, three logged steps
    shutil.copytree(whole / "checkpoints" / "step-00000002", killed / "checkpoints" / "step-00000002")
    (killed / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in read_metrics(whole)[:3]))
    run(setup, None, *mode, "--resume", output=killed)
    assert [m["loss"] for m in read_metrics(killed)] == [m["loss"] for m in read_metrics(whole)]
    final = "adapter_model.safetensors" if name == "lora-rank" else "model.safetensors"
    a, b = load_file(str(killed / "model" / final)), load_file(str(whole / "model" / final))
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def test_the_model_loads_straight_onto_the_training_device(setup, monkeypatch):
    """One process holds the whole model: it is loaded onto its device in fp32 there (device_map),
    never built whole in host memory first (at 8B a 32 GB fp32 copy, then moved)."""
    from transformers import AutoModelForCausalLM

    calls = []
    real = AutoModelForCausalLM.from_pretrained.__func__

    def spy(cls, *args, **kwargs):
        calls.append(kwargs)
        return real(cls, *args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(spy))
    run(setup, "placed", steps=3)
    (kwargs,) = calls
    assert kwargs["dtype"] == torch.float32 and torch.device(kwargs["device_map"]) == torch.device("cpu")


def test_resuming_with_other_trainable_parameters_is_refused(setup, capsys):
    root, model, data = setup
    output = run(setup, "frozen-mismatch", "--train-only-routing", steps=3)
    reset_accelerate()
    args = train_args(model, data, output, "--max-steps", "4", "--lora-rank", "4", "--resume")
    assert cli(["train", *args]) == 2
    assert "does not fit the model being trained" in capsys.readouterr().err


def expect_error(capsys, setup, name, *extra, match, model=None, data=None):
    root, default_model, default_data = setup
    output = root / name
    args = train_args(model or default_model, data or default_data, output, "--max-steps", "3", *extra)
    reset_accelerate()
    assert cli(["train", *args]) == 2
    message = capsys.readouterr().err
    assert match in message, message
    assert not output.exists()  # a refused run creates nothing


def test_bad_input_fails_before_training(setup, capsys, tmp_path):
    root, model, data = setup
    expect_error(capsys, setup, "bad1", match="missing.jsonl: no such file", data=root / "missing.jsonl")
    (tmp_path / "empty.jsonl").write_text("")
    expect_error(capsys, setup, "bad2", match="empty.jsonl is empty", data=tmp_path / "empty.jsonl")
    (tmp_path / "tiny.jsonl").write_text(json.dumps({"text": "only a few words"}) + "\n")
    expect_error(capsys, setup, "bad3", match="only 0 packed sequences", data=tmp_path / "tiny.jsonl")

    big_vocab = tmp_path / "big-vocab"
    shutil.copytree(model, big_vocab)
    train_tokenizer([demo_corpus()], vocab_size=600).save_pretrained(big_vocab)
    expect_error(capsys, setup, "bad4", match="the tokenizer has 600 tokens but the model's vocabulary has 384", model=big_vocab)

    from mhar_hf import MHARForCausalLM

    short = tmp_path / "short-context"
    MHARForCausalLM(tiny_config(residual_mode="delta", max_position_embeddings=32)).save_pretrained(short)
    train_tokenizer([demo_corpus()]).save_pretrained(short)
    expect_error(capsys, setup, "bad5", match="--seq-length 64 exceeds the model's max_position_embeddings=32", model=short)

    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    assert cli(["train", *train_args(model, data, blocker / "run", "--max-steps", "3")]) == 2
    assert "is not writable" in capsys.readouterr().err
    assert cli(["train", *train_args(model, data, blocker, "--max-steps", "3")]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err

    from mhar_hf.train.__main__ import main as module_main  # `accelerate launch -m mhar_hf.train`

    assert module_main(train_args(model, root / "missing.jsonl", root / "bad7", "--max-steps", "3")) == 2
    assert "mhar train: error: --data" in capsys.readouterr().err

    done = run(setup, "done", steps=3)
    assert cli(["train", *train_args(model, data, done, "--max-steps", "3")]) == 2
    assert "holds a previous run: pass --resume" in capsys.readouterr().err


def test_the_saved_model_keeps_the_source_dtype(setup, tmp_path):
    """Training runs on fp32 master weights; a bf16 source is saved back in bf16 unless asked."""
    from transformers import AutoModelForCausalLM

    root, model, data = setup
    bf16 = tmp_path / "bf16-source"
    AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).save_pretrained(bf16)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model / name, bf16 / name)
    for extra, dtype in (((), torch.bfloat16), (("--save-dtype", "float32"), torch.float32)):
        output = run((root, bf16, data), f"dtype-{dtype}", *extra, steps=3)
        assert {t.dtype for t in weights(output / "model").values()} == {dtype}
        assert json.loads((output / "model" / "config.json").read_text())["dtype"] == str(dtype).split(".")[1]
        assert json.loads((output / "model" / "mhar_training.json").read_text())["saved_dtype"] == str(dtype).split(".")[1]


def plain_llama(folder: Path, like: Path) -> Path:
    """A LlamaForCausalLM with the backbone config of the MHAR model `like`, and its tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    fields = {k: v for k, v in json.loads((like / "config.json").read_text()).items()
              if not k.startswith(("residual_", "routing_")) and k not in NOT_LLAMA_FIELDS}
    LlamaForCausalLM(LlamaConfig(**fields)).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(like / name, folder / name)
    return folder


def test_a_plain_model_trains_as_a_control_run_and_says_so(setup, tmp_path, capsys):
    root, model, data = setup
    plain = plain_llama(tmp_path / "plain-llama", model)
    capsys.readouterr()
    run((root, plain, data), "control", steps=3)
    assert "training a plain llama model (no routing parameters): a control run" in capsys.readouterr().out
    run(setup, "delta-says-so", steps=3)
    assert "training an MHAR model: delta mode, H=4" in capsys.readouterr().out


def test_the_record_names_the_source_by_its_full_path(setup, tmp_path, monkeypatch, tokenizer):
    """A record read from another folder still finds the source (the card's Conversion section),
    and the card says so when the source has gone."""
    from mhar_hf.card import build_card
    from mhar_hf.convert import convert_checkpoint

    root, model, data = setup
    source = plain_llama(tmp_path / "llama", model)
    converted = convert_checkpoint(source, tmp_path / "converted", heads=4, num_blocks=2, log=lambda _: None)
    monkeypatch.chdir(tmp_path)
    output = run((root, Path("converted"), data), "relative", steps=3)
    record = json.loads((output / "model" / "mhar_training.json").read_text())
    assert record["source_model"] == str(converted.resolve()) and Path(record["data"][0]).is_absolute()
    monkeypatch.chdir(root)
    notes = []
    assert "## Conversion" in build_card(output / "model", log=notes.append) and not notes
    shutil.rmtree(converted)
    assert "## Conversion" not in build_card(output / "model", log=notes.append)
    assert len(notes) == 1 and "which is not there" in notes[0]


def test_compiled_layers_train_as_the_eager_ones(setup, plain, tmp_path, monkeypatch, capsys):
    """--compile: an MHAR layer compiles its attention and MLP sublayers, a plain Llama each whole
    layer (aot_eager here: the same ops, no C compiler), and the losses are the eager run's."""
    compiled = []
    real_compile = torch.compile

    def spy(target=None, **kwargs):
        compiled.append((getattr(target, "__name__", type(target).__name__), kwargs.get("backend")))
        return real_compile(target, **kwargs)

    monkeypatch.setattr(torch, "compile", spy)
    losses = [m["loss"] for m in read_metrics(run(setup, "compiled", "--compile", "aot_eager"))]
    assert losses == pytest.approx([m["loss"] for m in read_metrics(plain)], rel=1e-5)
    assert sorted(set(compiled)) == [("attention_sublayer", "aot_eager"), ("mlp_sublayer", "aot_eager")]
    layers = json.loads((setup[1] / "config.json").read_text())["num_hidden_layers"]
    assert len(compiled) == 2 * layers

    compiled.clear()
    root, model, data = setup
    run((root, plain_llama(tmp_path / "plain-llama", model), data), "compiled-llama", "--compile", "aot_eager", steps=3)
    assert {backend for _, backend in compiled} == {"aot_eager"} and len(compiled) == layers
    assert "attention_sublayer" not in {name for name, _ in compiled}
    expect_error(capsys, setup, "bad-backend", "--compile", "no-such-backend", match="not a torch.compile backend")
