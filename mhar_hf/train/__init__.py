"""Mid-training of MHAR models with accelerate: `accelerate launch -m mhar_hf.train ...`.

data.py (packing, seeded resumable order), optim.py (loss, parameter groups, schedules, EMA),
checkpoint.py (atomic checkpoints), loop.py (the run), options.py (the options and the command
line generated from them), run_folder.py (the output folder: checks, lock, clean-up),
compile.py (regional torch.compile); hf_trainer.py (transformers' Trainer with MHAR models).
"""

from .compile import compile_regions
from .hf_trainer import no_weight_decay_on_routing
from .loop import train
from .options import TrainOptions, add_arguments, build_parser

__all__ = ["TrainOptions", "add_arguments", "build_parser", "compile_regions", "no_weight_decay_on_routing", "train"]
