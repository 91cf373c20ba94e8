"""The fused linear loss (`mhar train --loss fused-linear`): cross-entropy and z-loss from the
final hidden states and the output layer's weight, one chunk of positions at a time, against an
independent reference (the whole logits in fp64, `F.cross_entropy`, z-loss = mean(logsumexp^2));
in a tiny model (tied embedding, autocast, FSDP2 on two CPU processes); and `mhar train`'s loss
curve with it against the chunked loss on the logits."""

import os

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from train_setup import converted_model_and_corpus, free_port, read_metrics, train_args

from mhar_cli import main as cli
from mhar_hf import MHARForCausalLM
from mhar_hf.tiny import tiny_config
from mhar_hf.train.loop import loss_head
from mhar_hf.train.optim import (
    causal_lm_loss,
    fused_linear_causal_lm_loss,
    fused_loss_head,
    model_loss,
)

WEIGHTS = ((1.0, 0.0), (0.0, 1.0), (1.0, 1e-2))  # (cross-entropy, z-loss) mixes whose gradients are checked


def reference_losses(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor):
    """Cross-entropy and mean(logsumexp^2) over every predicted position, from the whole logits."""
    logits = (hidden @ weight.T)[:, :-1]
    flat = logits.reshape(-1, logits.shape[-1])
    cross_entropy = F.cross_entropy(flat, ids[:, 1:].reshape(-1))
    return cross_entropy, torch.logsumexp(flat, dim=-1).pow(2).mean()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("batch, length, vocab, chunk_tokens", [
    (3, 12, 50, 5),    # chunks split rows unevenly; the vocabulary no multiple of the chunk
    (3, 12, 50, 25),   # two whole rows a chunk, then one
    (2, 7, 13, 1),     # one position a chunk
    (2, 9, 31, 1000),  # the chunk larger than every position
    (4, 2, 17, 3),     # one predicted position a row
])
def test_values_and_gradients_against_the_whole_fp64_logits(dtype, batch, length, vocab, chunk_tokens):
    generator = torch.Generator().manual_seed(0)
    hidden = (torch.randn(batch, length, 24, generator=generator)).to(dtype).requires_grad_()
    weight = (0.5 * torch.randn(vocab, 24, generator=generator)).to(dtype).requires_grad_()
    ids = torch.randint(0, vocab, (batch, length), generator=generator)
    hidden64, weight64 = (t.detach().double().requires_grad_() for t in (hidden, weight))
    expected = reference_losses(hidden64, weight64, ids)
    got = fused_linear_causal_lm_loss(hidden, weight, ids, chunk_tokens=chunk_tokens)
    assert [t.dtype for t in got] == [dtype, dtype]  # reduced in fp32, fp64 kept
    tolerance = 1e-6 if dtype == torch.float32 else 1e-12
    for value, reference in zip(got, expected):
        assert value.item() == pytest.approx(reference.item(), rel=tolerance)
    for mix in WEIGHTS:
        grads = torch.autograd.grad(mix[0] * got[0] + mix[1] * got[1], (hidden, weight), retain_graph=True)
        references = torch.autograd.grad(mix[0] * expected[0] + mix[1] * expected[1], (hidden64, weight64),
                                         retain_graph=True)
        assert torch.equal(grads[0][:, -1], torch.zeros_like(grads[0][:, -1]))  # the last position predicts nothing
        for grad, reference in zip(grads, references):
            assert grad.dtype == dtype
            torch.testing.assert_close(grad.double(), reference, rtol=tolerance * 10,
                                       atol=tolerance * 10 * reference.abs().max().item())


def test_a_frozen_weight_or_frozen_states_get_no_gradient():
    """Routing-only training freezes the output layer; the other side still gets its gradient."""
    generator = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(2, 6, 8, generator=generator), torch.randn(11, 8, generator=generator)
    ids = torch.randint(0, 11, (2, 6), generator=generator)
    for trainable in ("hidden", "weight"):
        h, w = hidden.clone().requires_grad_(trainable == "hidden"), weight.clone().requires_grad_(trainable == "weight")
        h64, w64 = hidden.double().requires_grad_(trainable == "hidden"), weight.double().requires_grad_(trainable == "weight")
        sum(fused_linear_causal_lm_loss(h, w, ids, chunk_tokens=4)).backward()
        sum(reference_losses(h64, w64, ids)).backward()
        (leaf, leaf64), (frozen, _) = ((h, h64), (w, w64)) if trainable == "hidden" else ((w, w64), (h, h64))
        assert frozen.grad is None
        torch.testing.assert_close(leaf.grad.double(), leaf64.grad, rtol=1e-5, atol=1e-6)


def test_no_predicted_position_gives_nan_as_the_chunked_loss_and_zero_gradients():
    hidden = torch.randn(2, 1, 8, requires_grad=True)
    weight = torch.randn(11, 8, requires_grad=True)
    ids = torch.randint(0, 11, (2, 1))
    ce, z = fused_linear_causal_lm_loss(hidden, weight, ids, chunk_tokens=4)
    old = causal_lm_loss((hidden @ weight.T).detach(), ids)
    assert all(t.isnan() for t in (ce, z, *old))
    (ce + z).backward()
    assert not hidden.grad.any() and not weight.grad.any()


def tiny_model(tied: bool, dtype=torch.float32) -> MHARForCausalLM:
    torch.manual_seed(0)
    model = MHARForCausalLM(tiny_config(residual_mode="delta", num_hidden_layers=2, tie_word_embeddings=tied))
    with torch.no_grad():  # open gates, so every routing parameter gets a gradient
        for name, param in model.named_parameters():
            if name.endswith(".gate"):
                param.fill_(0.3)
    return model.to(dtype)


def gradients(model) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("tied", [True, False])
def test_in_a_model_against_the_whole_logits_in_fp64(tied):
    """The loss computed in the output layer's forward: the model's values and every parameter's
    gradient, the tied embedding's holding both its uses."""
    model = tiny_model(tied, torch.float64)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    ids = torch.randint(0, 384, (3, 20), generator=torch.Generator().manual_seed(1))
    head = fused_loss_head(model)[0]
    assert head is model.lm_head
    ce, z = model_loss(model, ids, head, chunk_tokens=7)
    (ce + 0.1 * z).backward()
    fused = gradients(model)
    assert "forward" not in model.lm_head.__dict__  # the output layer is itself again
    hidden = model.model(input_ids=ids).last_hidden_state
    expected = reference_losses(hidden, model.lm_head.weight, ids)
    (expected[0] + 0.1 * expected[1]).backward()
    reference = gradients(model)
    assert ce.item() == pytest.approx(expected[0].item(), rel=1e-12)
    assert z.item() == pytest.approx(expected[1].item(), rel=1e-12)
    assert fused.keys() == reference.keys() and ("lm_head.weight" in fused) != tied
    for name, grad in reference.items():
        torch.testing.assert_close(fused[name], grad, rtol=1e-9, atol=1e-12, msg=name)
    # the embedding's gradient holds the output layer's: more than the rows the ids looked up
    if tied:
        assert (fused["model.embed_tokens.weight"].abs().sum(-1) > 0).sum() > len(ids.unique())


def test_under_cpu_autocast_it_matches_the_chunked_loss_on_the_models_logits():
    """bf16 autocast over fp32 weights, as `mhar train --mixed-precision bf16`: the logits are
    multiplied in bf16 either way, so values and gradients agree to bf16's rounding."""
    model = tiny_model(tied=True)
    ids = torch.randint(0, 384, (2, 24), generator=torch.Generator().manual_seed(2))
    results = []
    for head in (fused_loss_head(model)[0], None):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ce, z = model_loss(model, ids, head, chunk_tokens=10)
        (ce + 1e-2 * z).backward()
        results.append((ce.detach(), z.detach(), gradients(model)))
    (ce, z, fused), (old_ce, old_z, old) = results
    assert ce.dtype == torch.float32
    assert ce.item() == pytest.approx(old_ce.item(), rel=1e-3) and z.item() == pytest.approx(old_z.item(), rel=1e-2)
    assert fused.keys() == old.keys()
    for name, grad in old.items():
        torch.testing.assert_close(fused[name], grad, rtol=0.05, atol=0.05 * grad.abs().max().item(), msg=name)


def test_models_the_fused_loss_does_not_cover_keep_the_loss_on_their_logits():
    from peft import LoraConfig, get_peft_model
    from transformers import Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM

    sizes = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=8)
    llama = LlamaForCausalLM(LlamaConfig(**sizes))
    assert fused_loss_head(llama) == (llama.lm_head, None)
    adapted = get_peft_model(tiny_model(tied=False), LoraConfig(r=2, target_modules=["q_proj"]))
    assert fused_loss_head(adapted)[0] is adapted.get_output_embeddings()
    # LoRA on the output layer: its output is no longer hidden @ weight.T
    head, reason = fused_loss_head(get_peft_model(tiny_model(tied=False), LoraConfig(r=2, target_modules=["lm_head"])))
    assert head is None and "peft" in reason
    head, reason = fused_loss_head(Gemma2ForCausalLM(Gemma2Config(**sizes)))  # soft-caps its logits
    assert head is None and "gemma2 models" in reason
    said = []
    assert loss_head(Gemma2ForCausalLM(Gemma2Config(**sizes)), "fused-linear", said.append) is None
    assert "computing the loss from the logits (--loss chunked)" in said[0]
    assert loss_head(llama, "chunked", said.append) is None and len(said) == 1


def test_the_training_benchmark_takes_the_fused_loss_as_mhar_train_does():
    """benchmarks/bench_train.py --loss fused-linear (its peak memory against --loss mhar-train is
    issue 42's check): one realistic step gives the weights the chunked loss's step gives."""
    import copy
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    import bench_train

    model = tiny_model(tied=True)
    stepped = {}
    for loss in ("mhar-train", "fused-linear"):
        copied = copy.deepcopy(model)
        torch.manual_seed(3)  # the step's random tokens
        bench_train.realistic_step(copied, 2, 16, torch.device("cpu"), loss)()
        stepped[loss] = dict(copied.named_parameters())
    moved = 0
    for name, param in model.named_parameters():
        fused, chunked = stepped["fused-linear"][name], stepped["mhar-train"][name]
        torch.testing.assert_close(fused, chunked, rtol=0, atol=2e-5, msg=name)  # Adam's step: 1e-4 x sign
        moved += not torch.equal(chunked, param)
    assert moved > 0


# mhar train: the same loss curve as the chunked loss on the logits


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tokenizer):
    return converted_model_and_corpus(tmp_path_factory.mktemp("fused-loss"), tokenizer)


@pytest.fixture(autouse=True)
def _datasets_cache(monkeypatch, tmp_path_factory):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path_factory.getbasetemp() / "datasets-cache"))


def run(setup, name, *extra, steps=4):
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(True)  # a fresh accelerate state, as a new process would have
    GradientState._reset_state()
    PartialState._reset_state()
    root, model, data = setup
    output = root / name
    assert cli(["train", *train_args(model, data, output, "--max-steps", str(steps), "--save-every", "100",
                                     "--eval-every", "2", "--z-loss", "0.05", *extra)]) == 0
    return read_metrics(output)


@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_mhar_train_follows_the_chunked_loss_curve(setup, precision):
    fused = run(setup, f"fused-{precision}", "--mixed-precision", precision)  # the default --loss
    chunked = run(setup, f"chunked-{precision}", "--mixed-precision", precision, "--loss", "chunked")
    rel = 1e-5 if precision == "no" else 2e-2
    for key in ("loss", "z_loss", "grad_norm"):
        assert [m[key] for m in fused] == pytest.approx([m[key] for m in chunked], rel=rel), key
    validated = [m["val_loss"] for m in fused if "val_loss" in m]
    assert len(validated) == 2 and validated == pytest.approx([m["val_loss"] for m in chunked if "val_loss" in m], rel=rel)
    assert fused[-1]["loss"] < fused[0]["loss"]


# FSDP2 (plain `fully_shard`, two gloo processes on the CPU), as tests/test_train_fsdp.py


STEPS, WORLD, PER_RANK = 3, 2, 2


def fsdp_train(model, rank: int, world: int, head_unit: bool) -> dict:
    from mhar_hf.train.optim import build_optimizer

    optimizer = build_optimizer(model, lr=1e-2, weight_decay=0.1)
    generator = torch.Generator().manual_seed(1)
    head = fused_loss_head(model)[0]
    assert head is model.lm_head  # also where FSDP2 made it a unit of its own
    losses = []
    for _ in range(STEPS):
        ids = torch.randint(0, 384, (WORLD * PER_RANK, 16), generator=generator)
        mine = ids[rank * PER_RANK : (rank + 1) * PER_RANK] if world > 1 else ids
        cross_entropy, z_loss = model_loss(model, mine, head, chunk_tokens=5)
        (cross_entropy + 1e-2 * z_loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
        loss = cross_entropy.detach()
        if world > 1:
            torch.distributed.all_reduce(loss)
        losses.append(loss.item() / world)
    weights = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
               for n, p in model.named_parameters()}
    return dict(losses=losses, weights=weights)


def _fsdp_worker(rank: int, port: int, result_file: str, tied: bool, head_unit: bool) -> None:
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    model = tiny_model(tied)
    for layer in model.model.layers:
        fully_shard(layer)
    if head_unit:  # the output layer its own unit, resharded after its forward
        fully_shard(model.lm_head)
    fully_shard(model)
    assert hasattr(model.lm_head.weight, "full_tensor")  # sharded outside the forward
    result = fsdp_train(model, rank, WORLD, head_unit)
    if rank == 0:
        torch.save(result, result_file)
    torch.distributed.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("tied, head_unit", [(True, False), (False, True)], ids=["tied-in-root", "own-unit"])
def test_fully_sharded_training_matches_one_process(tmp_path, tied, head_unit):
    result_file = tmp_path / "result.pt"
    mp.spawn(_fsdp_worker, args=(free_port(), str(result_file), tied, head_unit), nprocs=WORLD, join=True)
    sharded = torch.load(result_file, weights_only=True)
    reference = fsdp_train(tiny_model(tied), 0, 1, head_unit)
    assert sharded["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    assert sharded["weights"].keys() == reference["weights"].keys()
    for name, value in reference["weights"].items():  # see tests/test_train_fsdp.py on the tolerance
        torch.testing.assert_close(sharded["weights"][name], value, rtol=0, atol=2e-4, msg=name)
