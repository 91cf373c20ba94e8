"""FSDP2 safety on the CPU: plain PyTorch `fully_shard` (each decoder layer, then the root) over
two gloo processes, driven by the training pieces (parameter groups, loss with z-loss, clipping,
EMA, gate magnitudes), matches one unsharded process on the whole batch."""

import os

import pytest
import torch
import torch.multiprocessing as mp
from train_setup import free_port

from mhar_hf import MHARForCausalLM
from mhar_hf.tiny import tiny_config
from mhar_hf.train.loop import gate_magnitudes, gate_tensors
from mhar_hf.train.optim import WeightEMA, build_optimizer, causal_lm_loss

pytestmark = pytest.mark.slow
STEPS, WORLD, PER_RANK = 3, 2, 2


def build_model() -> MHARForCausalLM:
    torch.manual_seed(0)
    model = MHARForCausalLM(tiny_config(residual_mode="delta"))
    with torch.no_grad():  # open gates, so every routing parameter gets a gradient
        for name, param in model.named_parameters():
            if name.endswith(".gate"):
                param.fill_(0.3)
    return model


def batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 384, (WORLD * PER_RANK, 16), generator=generator) for _ in range(STEPS)]


def train(model, rank: int, world: int) -> dict:
    optimizer = build_optimizer(model, lr=1e-2, weight_decay=0.1, routing_lr_multiplier=3.0)
    ema = WeightEMA(model, decay=0.8)
    losses, norms = [], []
    for ids in batches():
        mine = ids[rank * PER_RANK * (world > 1) : (rank + 1) * PER_RANK if world > 1 else None]
        cross_entropy, z_loss = causal_lm_loss(model(input_ids=mine).logits, mine)
        (cross_entropy + 1e-2 * z_loss).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        optimizer.step()
        optimizer.zero_grad()
        ema.update()
        loss = cross_entropy.detach()
        if world > 1:
            torch.distributed.all_reduce(loss)
        losses.append(loss.item() / world)

    def full(name_params):
        return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in name_params}

    weights = full(model.named_parameters())
    ema.swap()
    averages = full(model.named_parameters())
    return dict(losses=losses, norms=norms, weights=weights, averages=averages, gates=gate_magnitudes(gate_tensors(model)))


def _worker(rank: int, port: int, result_file: str) -> None:
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    model = build_model()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    assert any(hasattr(p, "full_tensor") for p in model.parameters())  # really sharded
    result = train(model, rank, WORLD)
    if rank == 0:
        torch.save(result, result_file)
    torch.distributed.destroy_process_group()


def test_fully_sharded_training_matches_one_process(tmp_path):
    result_file = tmp_path / "result.pt"
    mp.spawn(_worker, args=(free_port(), str(result_file)), nprocs=WORLD, join=True)
    sharded = torch.load(result_file, weights_only=True)
    reference = train(build_model(), 0, 1)

    assert sharded["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    assert sharded["norms"] == pytest.approx(reference["norms"], rel=1e-4)
    assert sharded["gates"] == pytest.approx(reference["gates"], rel=1e-4)
    # Adam's normalised steps (lr 1e-2 each) turn summation-order noise in tiny gradients into
    # ~1e-5 weight differences; a sharding error (a missing reduction) would move weights by ~lr.
    for key in ("weights", "averages"):
        assert sharded[key].keys() == reference[key].keys()
        for name, value in reference[key].items():
            torch.testing.assert_close(sharded[key][name], value, rtol=0, atol=2e-4, msg=f"{key} {name}")
    start = build_model().state_dict()
    moved = [n for n in ("model.layers.1.attn_router.query", "model.layers.2.mlp_router.null_source") if not torch.equal(reference["weights"][n], start[n])]
    assert len(moved) == 2
