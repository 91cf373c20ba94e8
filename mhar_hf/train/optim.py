"""Optimisation pieces: the loss with z-loss, AdamW parameter groups, LR schedules, weight EMA.

Everything here works on plain tensors and on FSDP2's sharded DTensor parameters alike.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

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


def _chunks(rows_by_positions: torch.Tensor, chunk_tokens: int):
    """Index pairs (rows, positions) of chunks of about `chunk_tokens` predicted positions of a
    [batch, length, ...] tensor: whole rows together when rows are short, else pieces of one row
    (a row's last position has no target)."""
    batch, predicted = rows_by_positions.shape[0], rows_by_positions.shape[1] - 1
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


LOSSES = ("fused-linear", "chunked")  # mhar train --loss: the first is the default
# Model types whose *ForCausalLM returns its output layer's result as the logits, unchanged: MHAR
# and the types `mhar convert` reads. Others may cap or scale the logits after the output layer
# (Gemma's softcapping, Cohere's and Granite's scales), which the fused loss would skip.
FUSED_LOSS_MODEL_TYPES = ("mhar", "llama", "mistral", "qwen2", "qwen3")


def fused_linear_causal_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, input_ids: torch.Tensor,
                                chunk_tokens: int = LOSS_CHUNK_TOKENS) -> tuple[torch.Tensor, torch.Tensor]:
    """`causal_lm_loss` of the logits `hidden @ weight.T` without ever holding them: `hidden` is
    the final hidden states [batch, length, hidden] (after the model's final norm), `weight` the
    output layer's [vocab, hidden] (tied to the embedding or not). A chunk of `chunk_tokens`
    positions has logits at a time, multiplied in the compute dtype (autocast's when it is on, as
    the model's own output layer would be) and reduced in fp32 (fp64 inputs stay fp64)."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        compute_dtype = torch.get_autocast_dtype(device_type)
    else:
        compute_dtype = torch.promote_types(hidden.dtype, weight.dtype)
    return _FusedLinearCausalLMLoss.apply(hidden, weight, input_ids, chunk_tokens, compute_dtype)


class _FusedLinearCausalLMLoss(torch.autograd.Function):
    """Cross-entropy and z-loss of the logits `hidden @ weight.T`, one chunk of positions at a
    time, in forward and backward alike: no [positions, vocab] tensor of any dtype ever exists
    beyond a chunk.

    The backward recomputes each chunk's logits (one more chunk matmul, 2 x positions x hidden x
    vocab FLOPs: a third more than the output layer's usual forward and backward) rather than the
    forward computing the gradients: the two outputs keep their own upstream gradients exactly
    (grads in the forward would need a weight-gradient accumulator per output, fp32 [vocab,
    hidden] each, 1.2 GB at 152k x 2048, or a z-loss weight fixed before the backward); the
    forward saves nothing the output layer would not (its input and weight) but one fp32
    logsumexp per position, and the weight's gradient is allocated at the start of the backward,
    where the gradients made in the forward would also still be held, so the peak is no higher."""

    @staticmethod
    def forward(ctx, hidden, weight, input_ids, chunk_tokens, compute_dtype):
        batch, length, _ = hidden.shape
        reduce_dtype = torch.promote_types(compute_dtype, torch.float32)
        lse = torch.empty(batch, length - 1, dtype=reduce_dtype, device=hidden.device)
        target_logit = torch.empty_like(lse)
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(compute_dtype)
            for rows, positions in _chunks(hidden, chunk_tokens):
                logits = _chunk_logits(_chunk_hidden(hidden, rows, positions, compute_dtype), w)
                shape = lse[rows, positions].shape
                lse[rows, positions] = torch.logsumexp(logits, dim=-1).view(shape)
                targets = _targets(input_ids, rows, positions).reshape(-1, 1)
                target_logit[rows, positions] = logits.gather(-1, targets).view(shape)
                del logits
        ctx.save_for_backward(hidden, weight, input_ids, lse)
        ctx.chunk_tokens, ctx.compute_dtype = chunk_tokens, compute_dtype
        return (lse - target_logit).mean(), lse.pow(2).mean()

    @staticmethod
    def backward(ctx, grad_cross_entropy, grad_z_loss):
        hidden, weight, input_ids, lse = ctx.saved_tensors
        compute_dtype = ctx.compute_dtype
        want_hidden, want_weight = ctx.needs_input_grad[:2]
        count = lse.numel()
        ce_scale = grad_cross_entropy / count if grad_cross_entropy is not None else 0.0
        z_scale = 2 * grad_z_loss / count if grad_z_loss is not None else 0.0
        grad_hidden = torch.zeros_like(hidden) if want_hidden else None  # the last position predicts nothing
        grad_weight = (torch.zeros(weight.shape, dtype=torch.promote_types(weight.dtype, torch.float32),
                                   device=weight.device) if want_weight else None)
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(compute_dtype)
            for rows, positions in _chunks(hidden, ctx.chunk_tokens):
                chunk_hidden = _chunk_hidden(hidden, rows, positions, compute_dtype)
                chunk_lse = lse[rows, positions].reshape(-1, 1)
                probabilities = _chunk_logits(chunk_hidden, w).sub_(chunk_lse).exp_()
                # d(lse - x_target) = softmax - one-hot; d(lse^2) = 2 lse softmax (as _ChunkedCausalLMLoss)
                grad_logits = probabilities.mul_(ce_scale + z_scale * chunk_lse)
                targets = _targets(input_ids, rows, positions).reshape(-1, 1)
                grad_logits.scatter_add_(-1, targets, torch.full(targets.shape, -1.0, dtype=grad_logits.dtype,
                                                                 device=grad_logits.device) * ce_scale)
                grad_logits = grad_logits.to(compute_dtype)
                del probabilities
                if want_hidden:
                    grad_hidden[rows, positions] = (grad_logits @ w).view(grad_hidden[rows, positions].shape)
                if want_weight:
                    if grad_weight.dtype == compute_dtype:
                        grad_weight.addmm_(grad_logits.T, chunk_hidden)
                    else:  # products in the compute dtype (bf16 under autocast), summed over chunks in fp32
                        grad_weight += grad_logits.T @ chunk_hidden
        if want_weight:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None


def _chunk_hidden(hidden: torch.Tensor, rows: slice, positions: slice, compute_dtype) -> torch.Tensor:
    """A chunk's hidden states [chunk positions, hidden] in `compute_dtype`."""
    return hidden[rows, positions].reshape(-1, hidden.shape[-1]).to(compute_dtype)


def _chunk_logits(chunk_hidden: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A chunk's logits [chunk positions, vocab]: multiplied in the compute dtype, then at least fp32."""
    return (chunk_hidden @ w.T).to(torch.promote_types(w.dtype, torch.float32))


def fused_loss_head(model: nn.Module) -> tuple[nn.Linear | None, str | None]:
    """The output layer of `model` (unwrapped from DDP; a PEFT model is fine) that the fused loss
    can stand in for, or None and why not."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in FUSED_LOSS_MODEL_TYPES:
        return None, (f"{model_type} models are not known to return their output layer's result as the logits "
                      f"unchanged (the fused loss covers {', '.join(FUSED_LOSS_MODEL_TYPES)})")
    head = model.get_output_embeddings()
    # nn.Linear's own forward (FSDP2's subclass of a sharded head keeps it): PEFT replaces an
    # lm_head it adapts (LoRA in --lora-targets, modules_to_save) by a wrapper, and quantized
    # layers compute otherwise; their output is not hidden @ weight.T, so they keep the loss on
    # the logits.
    if not isinstance(head, nn.Linear) or type(head).forward is not nn.Linear.forward or head.bias is not None:
        kind = f"{type(head).__module__}.{type(head).__qualname__}"
        return None, f"the output layer is a {kind}, not a torch.nn.Linear without bias"
    return head, None


@contextmanager
def _head_returns_losses(head: nn.Linear, input_ids: torch.Tensor, chunk_tokens: int):
    """While open, `head`'s forward returns the fused loss of its input (the final hidden states)
    as a tensor [cross-entropy, z-loss] in place of the logits. Computed inside the output
    layer's own call, the loss meets the weight as the model's forward does: under autocast, and
    under FSDP2 unsharded by the hooks around that call (whether the head is its own unit or in
    the root's), with the pre-backward hooks registered on what it returns."""

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        return torch.stack(fused_linear_causal_lm_loss(hidden, head.weight, input_ids, chunk_tokens))

    had_own = "forward" in head.__dict__
    own = head.__dict__.get("forward")
    head.forward = forward
    try:
        yield
    finally:
        if had_own:
            head.forward = own
        else:
            del head.forward


def model_loss(model: nn.Module, input_ids: torch.Tensor, head: nn.Linear | None = None,
               chunk_tokens: int = LOSS_CHUNK_TOKENS) -> tuple[torch.Tensor, torch.Tensor]:
    """(cross-entropy, z-loss) of the causal LM `model` (as prepared: DDP, FSDP2, PEFT, autocast)
    on packed rows `input_ids`. With `head` (`fused_loss_head`'s answer for the unwrapped model)
    the fused linear loss, computed in the output layer's forward; the model's logits are never
    made. Without, `causal_lm_loss` on the model's logits."""
    if head is None:
        return causal_lm_loss(model(input_ids=input_ids, use_cache=False).logits, input_ids, chunk_tokens)
    with _head_returns_losses(head, input_ids, chunk_tokens):
        losses = model(input_ids=input_ids, use_cache=False).logits
    if losses.shape != (2,):
        raise RuntimeError(f"{type(model).__name__} did not return its output layer's result as the logits "
                           f"(shape {tuple(losses.shape)}): train it with --loss chunked")
    cross_entropy, z_loss = losses.unbind()
    return cross_entropy, z_loss


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

