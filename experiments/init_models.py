"""Initial model folders for the arms: a fresh model of the plan's shape (with the corpus's
tokenizer), or, for a delta arm, `mhar convert` of a trained plain model with the check that the
converted model starts at exactly the source's validation loss.

    python experiments/init_models.py --corpus DIR --runs DIR [--shape small] ARM...

writes RUNS/ARM/init for each ARM; a delta arm converts RUNS/SOURCE/run/model, SOURCE being the
arm the plan names (its step-0 record goes to RUNS/ARM/step0.json).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plan import ARMS, COMMON, DELTA_BLOCKS, RECIPES, SHAPES  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MHAR = [sys.executable, "-m", "mhar_cli"]  # the `mhar` command, as this interpreter runs it


def model_config(arm_name: str, shape: str, tokenizer):
    import mhar_hf
    from transformers import Qwen3Config

    arm = ARMS[arm_name]
    fields = dict(SHAPES[shape], **COMMON, vocab_size=len(tokenizer), bos_token_id=None,
                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    if arm.mode == "qwen3":  # q/k norm is built into Qwen3
        fields.pop("qk_norm")
        return Qwen3Config(**fields)
    return mhar_hf.MHARConfig(**fields, **arm.residual_fields())


def init_arm(arm_name: str, shape: str, tokenizer_dir: Path, out: Path) -> Path:
    """A freshly initialised model (seeded by the arm's seed) and the tokenizer, in `out`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if (out / "config.json").is_file():
        return out
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(ARMS[arm_name].seed)
    model = AutoModelForCausalLM.from_config(model_config(arm_name, shape, tokenizer))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def validation_loss(model_dir: Path, val_file: Path, shape: str) -> float:
    """The validation loss `mhar train` logs, computed the same way (its rows, its function,
    bf16 autocast on a GPU) for a saved model."""
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import mhar_hf  # noqa: F401
    from mhar_hf.train.data import validation_rows
    from mhar_hf.train.loop import validation_loss as loop_validation_loss

    recipe = RECIPES[shape]
    accelerator = Accelerator(mixed_precision="bf16" if torch.cuda.is_available() else "no")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    val = validation_rows([str(val_file)], tokenizer, recipe["seq_length"], recipe["val_sequences"])
    model = accelerator.prepare(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32))
    loss = loop_validation_loss(model, val, recipe["batch_size"], accelerator)
    del model
    accelerator.free_memory()
    return loss


def convert_arm(arm_name: str, source_model: Path, val_file: Path, shape: str, out: Path) -> dict:
    """`mhar convert --verify` of the trained source into `out`, and both step-0 validation
    losses (written to OUT/step0.json); raises if they differ."""
    record_file = out.parent / "step0.json"
    if (out / "config.json").is_file() and record_file.is_file():
        return json.loads(record_file.read_text())
    arm = ARMS[arm_name]
    subprocess.run([*MHAR, "convert", str(source_model), str(out), "--heads", str(arm.heads),
                    "--num-blocks", str(DELTA_BLOCKS), "--verify", "--overwrite"], check=True, cwd=REPO)
    record = {"source": str(source_model), "source_val_loss": validation_loss(source_model, val_file, shape),
              "converted_val_loss": validation_loss(out, val_file, shape)}
    record["identical"] = record["source_val_loss"] == record["converted_val_loss"]
    record_file.write_text(json.dumps(record, indent=2) + "\n")
    if not record["identical"]:
        raise RuntimeError(f"the converted model's step-0 validation loss differs from its source's: {record}")
    return record


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", type=Path, required=True, help="folder written by build_corpus.py")
    parser.add_argument("--runs", type=Path, required=True, help="the runs folder (train_arms.py's)")
    parser.add_argument("--shape", choices=SHAPES, default="small")
    parser.add_argument("arms", nargs="+", choices=ARMS)
    args = parser.parse_args(argv)
    for arm in args.arms:
        out = args.runs / arm / "init"
        if ARMS[arm].mode == "delta":
            source = args.runs / ARMS[arm].convert_from / "run" / "model"
            print(json.dumps(convert_arm(arm, source, args.corpus / "val.jsonl", args.shape, out)))
        else:
            print(init_arm(arm, args.shape, args.corpus / "tokenizer", out))


if __name__ == "__main__":
    main()
