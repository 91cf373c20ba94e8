"""Mid-training of MHAR models with accelerate: `accelerate launch -m mhar_hf.train ...`.

data.py (packing, seeded resumable order), optim.py (loss, parameter groups, schedules, EMA),
checkpoint.py (atomic checkpoints), loop.py (the run), args.py (the command line).
"""

from .args import add_arguments, build_parser
from .loop import train

__all__ = ["add_arguments", "build_parser", "train"]
