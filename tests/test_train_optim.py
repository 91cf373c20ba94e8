"""Optimisation pieces against independent references: parameter groups, schedules, the loss
with z-loss, and the weight EMA."""

import math
import re

import pytest
import torch

from mhar_hf import MHARForCausalLM
from mhar_hf.tiny import tiny_config
from mhar_hf.train.optim import (
    WeightEMA,
    build_optimizer,
    build_scheduler,
    causal_lm_loss,
    lr_multiplier,
    parameter_groups,
)

ROUTING = re.compile(r"(^|\.)(attn|mlp|final)_router\.(query|key_norm_weight|null_source|gate)$")


def test_groups_routing_without_decay_and_backbone_decay_on_matrices_only():
    model = MHARForCausalLM(tiny_config(residual_mode="delta"))
    groups = {g["name"]: g for g in parameter_groups(model, lr=1e-3, weight_decay=0.1, routing_lr_multiplier=5.0)}
    names = {id(p): n for n, p in model.named_parameters()}
    members = {key: {names[id(p)] for p in g["params"]} for key, g in groups.items()}
    every = {n for n, _ in model.named_parameters()}
    assert members["routing"] == {n for n in every if ROUTING.search(n)}
    assert {n.rsplit(".", 1)[1] for n in members["routing"]} == {"query", "key_norm_weight", "null_source", "gate"}
    assert members["backbone_decay"] == {n for n, p in model.named_parameters() if p.ndim == 2 and not ROUTING.search(n)}
    assert members["backbone_no_decay"] == every - members["routing"] - members["backbone_decay"]
    assert all(n.endswith("norm.weight") for n in members["backbone_no_decay"])
    assert (groups["routing"]["lr"], groups["routing"]["weight_decay"]) == (5e-3, 0.0)
    assert (groups["backbone_decay"]["lr"], groups["backbone_decay"]["weight_decay"]) == (1e-3, 0.1)
    assert groups["backbone_no_decay"]["weight_decay"] == 0.0


def test_routing_parameters_are_not_decayed_in_a_real_step():
    """At step 0 of a converted model only the gates get a gradient; with decay, the key-norm
    weights (ones) would still shrink by lr * wd. Without it they stay exactly one."""
    model = MHARForCausalLM(tiny_config(residual_mode="delta"))
    optimizer = build_optimizer(model, lr=1e-2, weight_decay=0.5)
    ids = torch.randint(0, 384, (2, 16))
    ce, _ = causal_lm_loss(model(input_ids=ids).logits, ids)
    ce.backward()
    router = model.model.layers[1].attn_router
    assert router.key_norm_weight.grad.abs().max() == 0 and router.gate.grad.abs().item() > 0
    before = model.model.layers[0].mlp.up_proj.weight.detach().clone()
    optimizer.step()
    assert torch.equal(router.key_norm_weight, torch.ones_like(router.key_norm_weight))
    assert router.gate.abs().item() == pytest.approx(1e-2, rel=1e-3)  # Adam's first step: lr * sign
    assert not torch.equal(model.model.layers[0].mlp.up_proj.weight, before)


def test_schedules_match_their_formulas():
    total, warm, floor = 100, 10, 0.1
    for schedule in ("cosine", "wsd", "1-sqrt", "constant"):
        values = [lr_multiplier(s, total, warm, schedule, floor, decay_fraction=0.2) for s in range(total)]
        assert values[:warm] == pytest.approx([(s + 1) / warm for s in range(warm)])
        assert values[warm] == pytest.approx(1.0)
    cosine = [lr_multiplier(s, total, warm, "cosine", floor) for s in range(total)]
    assert cosine[-1] == pytest.approx(floor)
    s = 40
    assert cosine[s] == pytest.approx(floor + (1 - floor) * (1 + math.cos(math.pi * (s - warm) / (total - 1 - warm))) / 2)
    for schedule, shape in (("wsd", lambda x: x), ("1-sqrt", math.sqrt)):
        values = [lr_multiplier(s, total, warm, schedule, floor, decay_fraction=0.2) for s in range(total)]
        decay_steps = 18  # 20 % of the 90 post-warm-up steps
        assert values[warm : total - decay_steps] == pytest.approx([1.0] * (total - decay_steps - warm))
        for s in range(total - decay_steps, total):
            progress = (s - (total - decay_steps) + 1) / decay_steps
            assert values[s] == pytest.approx(1 - (1 - floor) * shape(progress))
        assert values[-1] == pytest.approx(floor)

    model = torch.nn.Linear(2, 2)
    optimizer = build_optimizer(model, lr=2.0, weight_decay=0.0)
    scheduler = build_scheduler(optimizer, total, warm, "cosine", floor)
    seen = []
    for _ in range(total):
        seen.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([2.0 * v for v in cosine])


def test_loss_and_z_loss_against_fp64_references():
    model = MHARForCausalLM(tiny_config(residual_mode="full"))
    ids = torch.randint(0, 384, (3, 20))
    out = model(input_ids=ids, labels=ids)
    ce, z = causal_lm_loss(out.logits, ids)
    assert ce.item() == pytest.approx(out.loss.item(), rel=1e-5)  # the model's own loss
    logits = out.logits.double()[:, :-1]
    targets = ids[:, 1:]
    lse = torch.stack([torch.stack([torch.log(torch.exp(row).sum()) for row in seq]) for seq in logits])
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    assert ce.item() == pytest.approx((lse - picked).mean().item(), rel=1e-6)
    assert z.item() == pytest.approx((lse**2).mean().item(), rel=1e-6)


@pytest.mark.parametrize("dtype, chunk_tokens", [(torch.float32, 3), (torch.float32, 11), (torch.float32, 25),
                                                 (torch.float32, 64), (torch.bfloat16, 5)])
def test_chunked_loss_and_its_gradient_against_fp64_autograd(dtype, chunk_tokens):
    """The loss is computed a chunk of positions at a time and its backward writes the logits'
    gradient itself: chunks that split rows unevenly (3 or 5 positions of a 12-token row) and
    chunks of whole rows give the value and the gradient of plain fp64 autograd through the
    same formula, for the cross-entropy, the z-loss and a mix of both; rows of 11 predicted
    positions taken one (11), two (25) or all three (64) at a time."""
    generator = torch.Generator().manual_seed(0)
    logits = (4 * torch.randn(3, 12, 50, generator=generator)).to(dtype).requires_grad_()
    ids = torch.randint(0, 50, (3, 12), generator=generator)
    reference = logits.detach().double().requires_grad_()
    lse = torch.logsumexp(reference[:, :-1], dim=-1)
    picked = reference[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    expected = ((lse - picked).mean(), lse.pow(2).mean())
    ce, z = causal_lm_loss(logits, ids, chunk_tokens=chunk_tokens)
    assert ce.dtype == z.dtype == torch.float32
    assert ce.item() == pytest.approx(expected[0].item(), rel=1e-6)
    assert z.item() == pytest.approx(expected[1].item(), rel=1e-6)
    for weights in ((1.0, 0.0), (0.0, 1.0), (1.0, 1e-2)):
        (grad,) = torch.autograd.grad(weights[0] * ce + weights[1] * z, logits, retain_graph=True)
        (reference_grad,) = torch.autograd.grad(weights[0] * expected[0] + weights[1] * expected[1], reference,
                                                retain_graph=True)
        assert grad.dtype == dtype
        assert torch.equal(grad[:, -1], torch.zeros_like(grad[:, -1]))  # the last position predicts nothing
        tolerance = 1e-6 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(grad.double(), reference_grad, rtol=tolerance, atol=tolerance * reference_grad.abs().max().item())


def test_weight_ema_follows_its_recurrence_and_swaps_back():
    model = MHARForCausalLM(tiny_config(residual_mode="delta"))
    model.model.embed_tokens.weight.requires_grad_(False)  # frozen parameters are not averaged
    optimizer = build_optimizer(model, lr=1e-2, weight_decay=0.0)
    ema = WeightEMA(model, decay=0.9)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    reference = {n: p.detach().double().clone() for n, p in trainable.items()}
    for _ in range(4):
        ids = torch.randint(0, 384, (2, 12))
        causal_lm_loss(model(input_ids=ids).logits, ids)[0].backward()
        optimizer.step()
        optimizer.zero_grad()
        ema.update()
        for n, p in trainable.items():
            reference[n] = 0.9 * reference[n] + 0.1 * p.detach().double()
    assert "model.embed_tokens.weight" not in ema.names
    live = {n: p.detach().clone() for n, p in trainable.items()}
    ema.swap()
    for n, p in trainable.items():
        torch.testing.assert_close(p.double(), reference[n], rtol=1e-5, atol=1e-6)
    ema.swap()
    assert all(torch.equal(p, live[n]) for n, p in trainable.items())
    restored = WeightEMA(model, decay=0.9)
    restored.load_state_dict(ema.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(restored.shadow, ema.shadow))
