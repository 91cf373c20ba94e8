"""Atomic, resumable checkpoints.

`OUT/checkpoints/step-00000042/` holds accelerate's state (model, optimizer, the registered
scheduler and trainer state, every process's RNG streams), the weight EMA of each process and
`trainer_state.json`. It is written under `.tmp-step-00000042` and renamed only once every
process has finished writing, so a run killed at any moment leaves either a complete
checkpoint or a temporary folder that the next run deletes. Only the newest `keep` are kept.

With a frozen backbone (LoRA, `--train-only-routing`) the model file of a checkpoint holds only
what training changes (`leave_frozen_weights_out`): the frozen weights are the `--model`
folder's, loaded again by every start, so saving them would only copy that folder in fp32 at
every checkpoint (32 GB for an 8B model).
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

PATTERN = re.compile(r"^step-(\d{8})$")
TMP_PREFIX = ".tmp-"


@dataclass
class TrainerState:
    """Where the run is: completed optimizer steps, global sequences consumed, tokens seen."""

    step: int = 0
    position: int = 0
    tokens: int = 0

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)


def checkpoint_root(output: Path) -> Path:
    return Path(output) / "checkpoints"


def list_checkpoints(output: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoint_root(output)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and PATTERN.match(p.name)]
    return sorted(found, key=lambda p: int(PATTERN.match(p.name).group(1)))


def latest_checkpoint(output: Path) -> Path | None:
    found = list_checkpoints(output)
    return found[-1] if found else None


def remove_partial_checkpoints(output: Path) -> None:
    """Delete temporary folders left by a run killed while saving (main process only)."""
    root = checkpoint_root(output)
    if root.is_dir():
        for path in root.iterdir():
            if path.name.startswith(TMP_PREFIX):
                shutil.rmtree(path, ignore_errors=True)


def save_checkpoint(accelerator, output: Path, state: TrainerState, ema=None, keep: int = 2) -> Path:
    """Write the checkpoint for `state.step` atomically; every process must call this."""
    root = checkpoint_root(output)
    name = f"step-{state.step:08d}"
    final, tmp = root / name, root / f"{TMP_PREFIX}{name}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    if ema is not None:
        torch.save(ema.state_dict(), tmp / f"ema_{accelerator.process_index}.pt")
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / "trainer_state.json").write_text(json.dumps(state.state_dict(), indent=2) + "\n")
        if final.exists():  # a resumed run re-saving the step it resumed from
            shutil.rmtree(final)
        tmp.rename(final)
        for old in list_checkpoints(output)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def leave_frozen_weights_out(accelerator, model) -> bool:
    """Make this run's checkpoints hold the prepared `model`'s trainable parameters and buffers
    only, and restore them (checked: every saved name known, every missing one a frozen
    parameter) on resume. Applies on one device and with DDP, where accelerate saves the model
    as one state dict; returns whether it applies (a model with a frozen part, not FSDP or
    DeepSpeed, which save through their own paths)."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM):
        return False
    frozen = {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    if not frozen:
        return False

    def before_save(models, weights, output_dir):
        for i, candidate in enumerate(models):
            if candidate is model:
                weights[i] = {name: tensor for name, tensor in weights[i].items() if name not in frozen}

    def before_load(models, input_dir):
        from safetensors.torch import load_file

        for i, candidate in enumerate(models):
            if candidate is model:
                break
        else:
            return
        del models[i]  # loaded here, not by accelerate (which wants every weight in the file)
        file = Path(input_dir) / ("model.safetensors" if i == 0 else f"model_{i}.safetensors")
        if not file.exists():
            raise ValueError(f"{file} is missing: this checkpoint was not written by this kind of run")
        missing, unexpected = model.load_state_dict(load_file(str(file)), strict=False)
        if unexpected or set(missing) - frozen:
            raise ValueError(f"{file} does not fit the model being trained (unexpected {sorted(unexpected)[:4]}, "
                             f"missing trainable {sorted(set(missing) - frozen)[:4]}): resume with the options "
                             "it was saved with (--lora-rank, --lora-targets, --train-only-routing)")

    accelerator.register_save_state_pre_hook(before_save)
    accelerator.register_load_state_pre_hook(before_load)
    return True


def load_checkpoint(accelerator, path: Path, ema=None) -> None:
    """Restore everything `save_checkpoint` wrote (the trainer state through accelerate)."""
    accelerator.load_state(str(path))
    if ema is not None:
        ema_file = Path(path) / f"ema_{accelerator.process_index}.pt"
        if not ema_file.exists():
            raise ValueError(f"{path} holds no weight EMA for process {accelerator.process_index}: "
                             "resume with the --ema-decay and number of processes it was saved with")
        ema.load_state_dict(torch.load(ema_file, map_location="cpu", weights_only=True))
