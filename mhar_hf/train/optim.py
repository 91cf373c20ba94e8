"""Optimisation pieces: the loss with z-loss, AdamW parameter groups, LR schedules, weight EMA.

Everything here works on plain tensors and on FSDP2's sharded DTensor parameters alike.
"""

from __future__ import annotations

import math
import torch
from torch import nn

from ..folder import is_routing_parameter

SCHEDULES = ("cosine", "wsd", "1-sqrt", "constant")


LOSS_CHUNK_TOKENS = 2048  # positions whose fp32 logits exist at once (2048 x a 152k vocabulary: 1.2 GB)


def causal_lm_loss(logits: torch.Tensor, input_ids: torch.Tensor,
                   chunk_tokens: int = LOSS_CHUNK_TOKENS) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token cross-entropy and the z-loss term mean(logsumexp(logits)^2), both in fp32,
    averaged over every predicted position (packed rows have no padding). Computed `chunk_tokens`
    positions at a time (`_ChunkedCausalLMLoss`): the logits are never copied to fp32 whole."""
    return _ChunkedCausalLMLoss.apply(logits, input_ids, chunk_tokens)


def _chunks(logits: torch.Tensor, chunk_tokens: int):
    """Index pairs (rows, positions) of chunks of about `chunk_tokens` predicted positions: whole
    rows together when rows are short, else pieces of one row (a row's last position has no
    target)."""
    batch, predicted = logits.shape[0], logits.shape[1] - 1
    rows_at_once = max(1, chunk_tokens // max(predicted, 1))
    for row in range(0, batch, rows_at_once):
        for start in range(0, predicted, chunk_tokens):
            yield slice(row, row + rows_at_once), slice(start, min(start + chunk_tokens, predicted))


def _targets(input_ids: torch.Tensor, rows: slice, positions: slice) -> torch.Tensor:
    """The next tokens of a chunk's positions, [rows, positions, 1]."""
    return input_ids[rows, positions.start + 1:positions.stop + 1, None]


class _ChunkedCausalLMLoss(torch.autograd.Function):
    """Cross-entropy and z-loss over the logits in their own dtype, upcast one chunk at a time.
    The backward recomputes each chunk's softmax from its fp32 logits and the saved logsumexp and
    writes the logits' gradient once, in the logits' dtype: the memory of whole fp32 logits, their
    log-softmax and their fp32 gradient (three copies of a large vocabulary's logits) is never
    needed."""

    @staticmethod
    def forward(ctx, logits, input_ids, chunk_tokens):
        batch, length, _ = logits.shape
        lse = torch.empty(batch, length - 1, dtype=torch.float32, device=logits.device)
        target_logit = torch.empty_like(lse)
        for rows, positions in _chunks(logits, chunk_tokens):
            chunk = logits[rows, positions].float()
            lse[rows, positions] = torch.logsumexp(chunk, dim=-1)
            target_logit[rows, positions] = chunk.gather(-1, _targets(input_ids, rows, positions)).squeeze(-1)
        ctx.save_for_backward(logits, input_ids, lse)
        ctx.chunk_tokens = chunk_tokens
        return (lse - target_logit).mean(), lse.pow(2).mean()

    @staticmethod
    def backward(ctx, grad_cross_entropy, grad_z_loss):
        logits, input_ids, lse = ctx.saved_tensors
        count = lse.numel()
        ce_scale = grad_cross_entropy / count if grad_cross_entropy is not None else 0.0
        z_scale = 2 * grad_z_loss / count if grad_z_loss is not None else 0.0
        grad = torch.empty_like(logits)
        grad[:, -1] = 0  # the last position predicts nothing
        for rows, positions in _chunks(logits, ctx.chunk_tokens):
            chunk_lse = lse[rows, positions, None]
            probabilities = (logits[rows, positions].float() - chunk_lse).exp_()
            # d(lse - x_target) = softmax - one-hot; d(lse^2) = 2 lse softmax
            chunk = probabilities * (ce_scale + z_scale * chunk_lse)
            targets = _targets(input_ids, rows, positions)
            chunk.scatter_add_(-1, targets, torch.full(targets.shape, -1.0, device=chunk.device) * ce_scale)
            grad[rows, positions] = chunk
        return grad, None, None


def parameter_groups(model: nn.Module, lr: float, weight_decay: float, routing_lr_multiplier: float = 1.0) -> list[dict]:
    """AdamW groups: routing (no weight decay, LR x multiplier: decay would pin the gates at 0),
    backbone matrices (weight decay) and the other backbone parameters (norms, biases: none).
    Only trainable parameters; empty groups are left out."""
    groups = {
        "routing": dict(lr=lr * routing_lr_multiplier, weight_decay=0.0),
        "backbone_decay": dict(lr=lr, weight_decay=weight_decay),
        "backbone_no_decay": dict(lr=lr, weight_decay=0.0),
    }
    members: dict[str, list] = {key: [] for key in groups}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if is_routing_parameter(name):
            members["routing"].append(param)
        elif param.ndim >= 2:
            members["backbone_decay"].append(param)
        else:
            members["backbone_no_decay"].append(param)
    return [dict(name=key, params=members[key], **groups[key]) for key in groups if members[key]]


def build_optimizer(model: nn.Module, lr: float, weight_decay: float, routing_lr_multiplier: float = 1.0,
                    betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8) -> torch.optim.AdamW:
    groups = parameter_groups(model, lr, weight_decay, routing_lr_multiplier)
    if not groups:
        raise ValueError("the model has no trainable parameters")
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps)


def lr_multiplier(step: int, total_steps: int, warmup_steps: int, schedule: str, min_ratio: float,
                  decay_fraction: float = 0.2) -> float:
    """The LR at optimizer step `step` (0-based) as a fraction of the peak.

    Linear warm-up from 1/warmup to 1 over `warmup_steps`, then
      cosine    half-cosine from 1 down to `min_ratio` at the last step;
      wsd       constant, then a linear cool-down to `min_ratio` over the last `decay_fraction` of steps;
      1-sqrt    the same, with the 1 - sqrt(progress) cool-down;
      constant  1.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    if schedule == "cosine":
        span = max(total_steps - 1 - warmup_steps, 1)
        progress = min((step - warmup_steps) / span, 1.0)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    decay_steps = max(round(decay_fraction * (total_steps - warmup_steps)), 1)
    decay_start = total_steps - decay_steps
    if step < decay_start:
        return 1.0
    progress = min((step - decay_start + 1) / decay_steps, 1.0)
    shape = progress if schedule == "wsd" else math.sqrt(progress)
    return 1 - (1 - min_ratio) * shape


class ScheduleMultiplier:
    """A picklable LR-lambda (LambdaLR then saves it with its state)."""

    def __init__(self, **settings):
        if settings["schedule"] not in SCHEDULES:
            raise ValueError(f"unknown schedule {settings['schedule']!r}; allowed: {', '.join(SCHEDULES)}")
        self.settings = settings

    def __call__(self, step: int) -> float:
        return lr_multiplier(step, **self.settings)


def build_scheduler(optimizer, total_steps: int, warmup_steps: int, schedule: str, min_ratio: float,
                    decay_fraction: float = 0.2) -> torch.optim.lr_scheduler.LambdaLR:
    fn = ScheduleMultiplier(total_steps=total_steps, warmup_steps=warmup_steps, schedule=schedule,
                            min_ratio=min_ratio, decay_fraction=decay_fraction)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2), or the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class WeightEMA:
    """An fp32 exponential moving average of the trainable parameters: after each optimizer step
    `ema = decay * ema + (1 - decay) * param`. Under FSDP2 every process averages its own shards,
    so `state_dict` is per process."""

    def __init__(self, model: nn.Module, decay: float):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"EMA decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.names = [name for name, p in model.named_parameters() if p.requires_grad]
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.shadow = [_local(p).detach().float().clone() for p in self.params]

    @torch.no_grad()
    def update(self) -> None:
        current = [_local(p).detach().float() for p in self.params]
        torch._foreach_lerp_(self.shadow, current, 1.0 - self.decay)

    @torch.no_grad()
    def swap(self) -> None:
        """Exchange the live weights with the averages (call again to swap back)."""
        for param, shadow in zip(self.params, self.shadow):
            local = _local(param)
            live = local.detach().float().clone()
            local.copy_(shadow.to(local.dtype))
            shadow.copy_(live)

    def state_dict(self) -> dict:
        return {"decay": self.decay, "names": self.names, "shadow": [t.clone() for t in self.shadow]}

    def load_state_dict(self, state: dict) -> None:
        if state["names"] != self.names:
            raise ValueError("the checkpoint's EMA covers other parameters than this run trains")
        for shadow, saved in zip(self.shadow, state["shadow"]):
            shadow.copy_(saved)

