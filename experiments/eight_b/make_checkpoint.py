"""A Llama-3.1-8B checkpoint with random weights, laid out as the Hub ships the real one.

    python experiments/eight_b/make_checkpoint.py OUT [--shape 8b|tiny] [--seed 0] [--threads N]

The real weights cannot be downloaded here, so this builds a stand-in with the same files:
`config.json` (the published one, `tests/fixtures/real_configs/Llama-3.1-8B.json`, llama3 RoPE
scaling included), `generation_config.json` (the published sampling defaults), bf16 safetensors
shards of at most 5 GB (`model-0000N-of-0000M.safetensors`, tensors in the model's state-dict
order, grouped as `save_pretrained` groups them) with `model.safetensors.index.json`, and a
byte-level BPE tokenizer trained here, offline, on local text (Llama 3's special-token names; its
vocabulary is smaller than the embedding's 128256 rows, and the config's bos / eos ids are set to
its ids).

Weights follow Llama's initialisation: every linear and embedding matrix N(0, 0.02²)
(`initializer_range`), every RMSNorm weight 1. Values are generated and written tensor by
tensor, in chunks that worker threads fill in parallel, each chunk from its own generator seeded
by (seed, tensor, chunk): the files depend on --seed alone, never on the thread count, and memory
stays near a few chunks per thread (the page cache holds what is written).

`--shape tiny` keeps every field of the published config and shrinks only the sizes (hidden,
intermediate, layers, heads at the published 4:1 query/kv ratio, vocabulary) and the shard limit,
so the same pipeline runs on a CPU in seconds (tests/test_eight_b.py).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import struct
import sys
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
PUBLISHED_CONFIG = REPO / "tests" / "fixtures" / "real_configs" / "Llama-3.1-8B.json"
# What the Hub's generation_config.json of Llama-3.1-8B says (ids replaced by the tokenizer's).
PUBLISHED_GENERATION = {"_from_model_config": True, "do_sample": True, "temperature": 0.6, "top_p": 0.9,
                        "transformers_version": "4.43.0.dev0"}
SHAPES = {
    "8b": dict(sizes={}, max_shard_size="5GB", tokenizer_vocab=8192),
    "tiny": dict(sizes=dict(hidden_size=64, intermediate_size=224, num_hidden_layers=4, num_attention_heads=8,
                            num_key_value_heads=2, vocab_size=512),
                 max_shard_size="200KB", tokenizer_vocab=512),
}
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
CHUNK_ELEMENTS = 8 * 2**20  # 16 MB of bf16 per generator call
TEXT_SUFFIXES = (".py", ".md", ".txt")


def published_fields(shape: str) -> dict:
    """The published config.json, with the sizes of `shape`."""
    fields = json.loads(PUBLISHED_CONFIG.read_text())
    fields.update(SHAPES[shape]["sizes"])
    return fields


def layout(fields: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor of the Llama that `fields` describes, in state-dict order."""
    from transformers import AutoConfig, AutoModelForCausalLM

    values = dict(fields)
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return [(name, tuple(t.shape)) for name, t in model.state_dict().items()]


def group_into_shards(tensors: list[tuple[str, tuple[int, ...]]], max_bytes: int) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Consecutive groups of at most `max_bytes` of bf16 (a larger tensor gets a shard of its own),
    as `save_pretrained` groups a state dict."""
    shards: list[list] = [[]]
    size = 0
    for name, shape in tensors:
        nbytes = 2 * torch.Size(shape).numel()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    return shards


def chunk_seed(seed: int, name: str, chunk: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}/{chunk}".encode()).digest()[:8], "little") >> 1


def fill_chunk(name: str, count: int, std: float, seed: int, chunk: int) -> memoryview:
    """The bytes of one chunk of tensor `name`: N(0, std²) in bf16, or ones for a norm weight."""
    if name.endswith("norm.weight"):
        values = torch.ones(count, dtype=torch.bfloat16)
    else:
        generator = torch.Generator().manual_seed(chunk_seed(seed, name, chunk))
        values = torch.empty(count, dtype=torch.bfloat16).normal_(0.0, std, generator=generator)
    return memoryview(values.view(torch.uint8).numpy())


def write_all(fd: int, data: memoryview) -> None:
    while data:
        data = data[os.write(fd, data):]


def write_shard(path: Path, shard: list[tuple[str, tuple[int, ...]]], std: float, seed: int, pool, window: int) -> int:
    """One safetensors file: the header, then each tensor's bytes, chunk by chunk in order while
    the pool fills up to `window` chunks ahead. Returns the file's size."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shard:
        nbytes = 2 * torch.Size(shape).numel()
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    jobs = ((name, min(CHUNK_ELEMENTS, count - start), i)
            for name, shape in shard for count in [torch.Size(shape).numel()]
            for i, start in enumerate(range(0, count, CHUNK_ELEMENTS)))
    pending: deque = deque()
    with open(path, "wb", buffering=0) as out:
        fd = out.fileno()
        write_all(fd, memoryview(struct.pack("<Q", len(encoded)) + encoded))
        for name, count, i in jobs:
            pending.append(pool.submit(fill_chunk, name, count, std, seed, i))
            if len(pending) >= window:
                write_all(fd, pending.popleft().result())
        while pending:
            write_all(fd, pending.popleft().result())
    return path.stat().st_size


def local_text(paths: list[Path]) -> list[str]:
    """Every .py / .md / .txt file under `paths` (files or folders), in path order."""
    files: list[Path] = []
    for path in paths:
        files += sorted(p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file()) if path.is_dir() else [path]
    texts = []
    for file in files:
        try:
            texts.append(file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError):
            continue
    return texts


def build_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE tokenizer with Llama 3's bos / eos names (ids 0 and 1), adding bos in front
    of every encoded text as Llama 3's tokenizer does; trained offline on `texts`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                             special_tokens=[(BOS, 0), (EOS, 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS)


def make_checkpoint(out: Path, shape: str = "8b", seed: int = 0, threads: int | None = None,
                    max_shard_size: str | None = None, tokenizer_vocab: int | None = None,
                    text: list[Path] | None = None) -> dict:
    """Write the checkpoint into the new folder `out`; return what was written and how long it took."""
    from transformers.utils.hub import convert_file_size_to_int

    started = time.perf_counter()
    spec = SHAPES[shape]
    out.mkdir(parents=True, exist_ok=False)
    texts = local_text(text or [REPO / "mhar_hf"])
    tokenizer = build_tokenizer(texts, tokenizer_vocab or spec["tokenizer_vocab"])
    tokenizer.save_pretrained(out)
    fields = published_fields(shape)
    fields.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    if len(tokenizer) > fields["vocab_size"]:
        raise ValueError(f"the tokenizer has {len(tokenizer)} tokens, more than vocab_size={fields['vocab_size']}")
    (out / "config.json").write_text(json.dumps(fields, indent=2) + "\n")
    generation = {**PUBLISHED_GENERATION, "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    tokenizer_s = time.perf_counter() - started

    tensors = layout(fields)
    shards = group_into_shards(tensors, convert_file_size_to_int(max_shard_size or spec["max_shard_size"]))
    names = [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    threads = threads or os.cpu_count() or 1
    sizes = []
    weights_started = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        for name, shard in zip(names, shards):
            sizes.append(write_shard(out / name, shard, fields["initializer_range"], seed, pool, window=2 * threads))
    weights_s = time.perf_counter() - weights_started
    total = sum(2 * torch.Size(shape).numel() for _, shape in tensors)
    index = {"metadata": {"total_size": total},
             "weight_map": {tensor: name for name, shard in zip(names, shards) for tensor, _ in shard}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return {"shape": shape, "seed": seed, "threads": threads, "parameters": total // 2, "weight_bytes": total,
            "shard_bytes": sizes, "tokenizer_vocab": len(tokenizer), "tokenizer_s": tokenizer_s,
            "weights_s": weights_s, "weights_gb_per_s": total / 1e9 / weights_s,
            "total_s": time.perf_counter() - started,
            "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the folder to write (must not exist)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="generator threads (default: every core)")
    parser.add_argument("--max-shard-size", default=None, help="default: 5GB (8b), 200KB (tiny)")
    parser.add_argument("--tokenizer-vocab", type=int, default=None, help="default: 8192 (8b), 512 (tiny)")
    parser.add_argument("--text", type=Path, nargs="+", default=None,
                        help="files or folders the tokenizer learns from (default: the mhar_hf package)")
    args = parser.parse_args(argv)
    stats = make_checkpoint(args.out, args.shape, args.seed, args.threads, args.max_shard_size,
                            args.tokenizer_vocab, args.text)
    print(json.dumps(stats))


if __name__ == "__main__":
    sys.exit(main())
