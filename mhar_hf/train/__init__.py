"""Mid-training of MHAR models with accelerate: `accelerate launch -m mhar_hf.train ...`.

data.py (packing, seeded resumable order), optim.py (loss, parameter groups, schedules, EMA),
checkpoint.py (atomic checkpoints), loop.py (the run), args.py (the command line);
hf_trainer.py (transformers' Trainer with MHAR models).
"""

from .args import add_arguments, build_parser
from .hf_trainer import no_weight_decay_on_routing
from .loop import train

__all__ = ["add_arguments", "build_parser", "no_weight_decay_on_routing", "train"]
