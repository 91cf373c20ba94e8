"""Builders shared by the tests/test_train*.py files: a tiny converted delta model (a shrunken
real Llama config, its weights copied into a delta MHAR model), a jsonl corpus, launchers."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

from conftest import HANG_GUARD_S, shrunk_real_config

CPU_SMOKE_CONFIG = Path(__file__).parents[1] / "training" / "configs" / "cpu_smoke.yaml"
NOT_CONFIG_FIELDS = {"architectures", "model_type", "transformers_version", "torch_dtype"}


def convert_tiny_llama(folder: Path, tokenizer, name: str = "Llama-3.2-1B", seed: int = 0) -> Path:
    """A random tiny Llama with `name`'s published quirks, copied into a delta MHAR model (gates
    at zero) and saved with the tokenizer. Asserts the copy computes the Llama's logits."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from mhar_hf import MHARConfig, MHARForCausalLM

    fields = shrunk_real_config(name, vocab_size=len(tokenizer))
    torch.manual_seed(seed)
    llama = LlamaForCausalLM(LlamaConfig(**fields)).eval()
    config = MHARConfig(**{k: v for k, v in fields.items() if k not in NOT_CONFIG_FIELDS},
                        residual_mode="delta", residual_heads=4, residual_num_blocks=2)
    model = MHARForCausalLM(config).eval()
    missing, unexpected = model.load_state_dict(llama.state_dict(), strict=False)
    assert not unexpected and all("_router." in key for key in missing)
    probe = torch.arange(24).unsqueeze(0)
    with torch.no_grad():
        assert torch.equal(model(probe).logits, llama(probe).logits)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def write_jsonl_corpus(path: Path, text: str) -> Path:
    """One document per paragraph of `text`."""
    paragraphs = [p.strip() for p in text.split("\n\n") if p.strip()]
    path.write_text("".join(json.dumps({"text": p}) + "\n" for p in paragraphs))
    return path


def converted_model_and_corpus(root: Path, tokenizer) -> tuple[Path, Path, Path]:
    """`root`, a tiny converted model in it, and the demo text as a jsonl corpus."""
    from mhar_hf.tiny import demo_corpus

    model = convert_tiny_llama(root / "converted", tokenizer)
    return root, model, write_jsonl_corpus(root / "corpus.jsonl", demo_corpus())


def train_args(model: Path, data: Path, output: Path, *extra: str) -> list[str]:
    """Small settings: 64-token sequences, 2 per micro-batch, tiny validation set."""
    return ["--model", str(model), "--data", str(data), "--output", str(output), "--seq-length", "64",
            "--batch-size", "2", "--val-sequences", "4", "--lr", "3e-3", "--warmup-steps", "2",
            "--report-to", "none", *extra]


def launch_command(args: list[str], datasets_cache: Path, processes: int = 2) -> tuple[list[str], dict]:
    """`accelerate launch` of `-m mhar_hf.train` with training/configs/cpu_smoke.yaml: gloo/DDP
    workers on the CPU."""
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
           "HF_DATASETS_CACHE": str(datasets_cache)}
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CPU_SMOKE_CONFIG),
               "--num_processes", str(processes), "--main_process_port", str(free_port())]
    return [*command, "-m", "mhar_hf.train", *args], env


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_launch(args: list[str], datasets_cache: Path, processes: int = 2, timeout: float = HANG_GUARD_S) -> subprocess.CompletedProcess:
    command, env = launch_command(args, datasets_cache, processes)
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)


def read_metrics(output: Path) -> list[dict]:
    return [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
