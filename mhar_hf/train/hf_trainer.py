"""transformers' `Trainer` (and trainers built on it, such as TRL's) with MHAR models."""

from __future__ import annotations

from ..folder import is_routing_parameter


def no_weight_decay_on_routing(trainer):
    """Leave the routing parameters out of `trainer`'s weight decay, as `mhar train` does: decay
    would hold a converted model's gates at zero. `Trainer` decays every parameter but biases and
    norms, and asks `get_decay_parameter_names` which those are; this narrows its answer. Call it
    before training (`trainer = no_weight_decay_on_routing(Trainer(...))`); a checkpoint resumed
    later needs the same call, so that the optimizer's groups match."""
    if trainer.optimizer is not None:
        raise ValueError(
            "the trainer already has its optimizer (built, or passed with `optimizers=`): call "
            "no_weight_decay_on_routing(trainer) before trainer.train(), or put the routing parameters "
            "in a group without weight decay yourself (mhar_hf.train.optim.parameter_groups)"
        )
    decay_names = trainer.get_decay_parameter_names
    trainer.get_decay_parameter_names = lambda model: [n for n in decay_names(model) if not is_routing_parameter(n)]
    return trainer
