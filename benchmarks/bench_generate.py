"""Generation speed of MHAR against the plain model of the same shape (issue 42): greedy
`model.generate` tokens/s, time to first token and peak memory, dynamic cache (eager) and static
cache with transformers' compiled decoding.

    python benchmarks/bench_generate.py --part 1    # 1B, static cache, compiled decoding
    python benchmarks/bench_generate.py --part 2    # 8B slice, both caches; 1B, dynamic cache
    python benchmarks/bench_generate.py --device cpu --tiny            # dry run: tiny models on a CPU

With no `--part` (nor `--shapes`/`--caches`) every shape runs with both caches in one process:
more than the 10 minutes a command may take on the GPU machine, where the two parts are run as two
commands, each inside it (`--budget-s`: no configuration starts that would end after 8.5 minutes, by
the longest of its kind so far).
Compiling the decoding step is most of part 1: each model is compiled twice, for batch 1 and
for batches above 1 (torch.compile specialises a batch of 1; the second compile makes the batch
dimension dynamic, so batch 64 reuses batch 8's graph). The compile time of each configuration
is recorded (`compile_s`). A configuration left out for time is printed (`skipped (time budget)`);
name it to run it, e.g. `--shapes 1B --caches static --models plain "full H=8" --batches 8 64`.

Shapes: `1B`, the paper's preset (1280 x 36, Qwen3-style blocks with q/k norm, tied
embeddings); `8B-slice`, Llama-3.1-8B's layer (`tests/fixtures/real_configs/Llama-3.1-8B.json`:
hidden 4096, MLP 14336, 32 query and 8 KV heads, its vocabulary) with 8 of its 32 layers, MHAR
made from it by the converter's config mapping; delta's blocks are 4 layers long, as in a
converted 8B (8 blocks over 32 layers). Models: the plain transformers model of the backbone
(`LlamaForCausalLM` for the 8B slice; `Qwen3ForCausalLM` for the 1B preset, whose q/k norm Llama
lacks), MHAR delta H = 8 and MHAR full H = 8, random bf16 weights (routing parameters opened:
non-zero queries and gates), SDPA attention, one process, side by side.

Per shape, cache and batch (1, 8, 64) each model generates from the same random prompt (512
tokens) exactly 256 new tokens, greedy (`min_new_tokens = max_new_tokens`): once to warm up
(for the static cache this compiles), then `--repeats` timed runs, the best kept. Time to first
token (`ttft_ms`): from the call of `generate` to the first token's logits (prefill, synchronised
by a logits processor that stamps its first call). Decode: from there to the end, the other 255
tokens; `tokens_per_s` = 255 x batch / decode seconds. Peak memory: the model's weights plus
what its generation allocated at most beyond what was allocated before it. `ratio_vs_plain`
(and `ttft_ratio_vs_plain`, `mem_ratio_vs_plain`): against the plain model at the same shape,
cache and batch in the same run. The static path runs transformers' own compiled decoding
(`CompileConfig()`: inductor, "reduce-overhead" CUDA graphs; the prefill runs eagerly);
`graph_breaks` and `graphs_compiled` count what dynamo reported while it compiled (MHAR's
routing reads trace into the step's graph: no break). Each row goes to
`results/generate.jsonl` (`results_log.py`) as soon as its configuration is measured.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch
import transformers
from torch._dynamo.utils import counters
from transformers import (
    AutoModelForCausalLM,
    CompileConfig,
    LlamaConfig,
    LogitsProcessor,
    LogitsProcessorList,
    Qwen3Config,
)

from mhar_hf import MHARConfig, MHARRouter
from mhar_hf.convert import mhar_config_for
from results_log import append_result, git_commit, utc_now

REPO = Path(__file__).resolve().parent.parent
LLAMA_8B = REPO / "tests" / "fixtures" / "real_configs" / "Llama-3.1-8B.json"
SHAPES = ("1B", "8B-slice")
SLICE_LAYERS = 8
SLICE_BLOCKS = 2  # delta blocks of 4 layers in the 8-layer slice, as the converted 8B's 8 blocks of 32 layers
MODELS = (  # (label, residual mode, heads); mode None: the plain model
    ("plain", None, None),
    ("delta", "delta", 8),
    ("full H=8", "full", 8),
)
CACHES = ("dynamic", "static")
PARTS = {  # what one command on the GPU machine runs: (shape, cache) pairs
    "1": (("1B", "static"),),
    "2": (("8B-slice", "dynamic"), ("8B-slice", "static"), ("1B", "dynamic")),
}
# --tiny: each shape shrunk to a few milliseconds on a CPU, its kind of backbone kept
TINY_SIZES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=384, bos_token_id=None, eos_token_id=0)
DEFAULTS = dict(batches=(1, 8, 64), prompt=512, new_tokens=256)
TINY_DEFAULTS = dict(batches=(1, 2), prompt=16, new_tokens=8)


def mhar_config(shape: str, mode: str, heads: int, routing: str = "auto", tiny: bool = False) -> MHARConfig:
    """The MHAR config of a shape in `mode` with `heads` routing heads."""
    sizes = TINY_SIZES if tiny else {}
    if shape == "1B":
        return MHARConfig.from_preset("1B", residual_mode=mode, residual_heads=heads,
                                      routing_implementation=routing, **sizes)
    if shape == "8B-slice":
        delta, _ = mhar_config_for(llama_slice_config(tiny), heads=heads, num_blocks=SLICE_BLOCKS)
        return MHARConfig.from_dict({**delta.to_dict(), "residual_mode": mode, "routing_implementation": routing})
    raise ValueError(f"unknown shape {shape!r}; allowed: {', '.join(SHAPES)}")


def llama_slice_config(tiny: bool = False) -> LlamaConfig:
    """Llama-3.1-8B's published config with 8 of its 32 layers (tiny: every size shrunk too)."""
    published = json.loads(LLAMA_8B.read_text())
    sizes = TINY_SIZES if tiny else {}
    return LlamaConfig.from_dict({**published, "num_hidden_layers": SLICE_LAYERS, **sizes})


def plain_config(config: MHARConfig):
    """The transformers config of the same backbone without routing: Llama's, or Qwen3's where
    the blocks have q/k norm (Llama's layers plus those norms, names and shapes as MHAR's)."""
    if config.qkv_bias or config.mlp_bias or config.attention_bias:
        raise ValueError("the generation benchmark's shapes have no biases")
    fields = dict(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim, hidden_act=config.hidden_act,
        max_position_embeddings=config.max_position_embeddings, rms_norm_eps=config.rms_norm_eps,
        tie_word_embeddings=config.tie_word_embeddings, rope_parameters=dict(config.rope_parameters),
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id,
    )
    return Qwen3Config(**fields) if config.qk_norm else LlamaConfig(**fields)


def build(config, device: str, dtype: torch.dtype):
    """A model of `config` with random weights in `dtype` on `device`, SDPA attention; MHAR's
    routing parameters opened (non-zero queries and null sources, gates of 0.1), as after training."""
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    with torch.no_grad():
        for router in model.modules():
            if isinstance(router, MHARRouter):
                router.query.normal_(0, 1)
                if router.gated:
                    router.null_source.normal_(0, 1)
                    router.gate.fill_(0.1)
    return model.eval()


class FirstTokenClock(LogitsProcessor):
    """Stamps the time when the first token's logits exist (the prefill done), on its first call."""

    def __init__(self, sync):
        self.sync, self.stamp = sync, None

    def __call__(self, input_ids, scores):
        if self.stamp is None:
            self.sync()
            self.stamp = time.perf_counter()
        return scores


def synchronizer(device: str):
    return torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)


def generate_once(model, ids: torch.Tensor, new_tokens: int, cache: str, compile_config, device: str) -> dict:
    """One timed greedy generation of exactly `new_tokens` tokens."""
    sync = synchronizer(device)
    clock = FirstTokenClock(sync)
    eos = model.config.eos_token_id
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                  eos_token_id=eos, pad_token_id=eos if eos is not None else 0,
                  attention_mask=torch.ones_like(ids), logits_processor=LogitsProcessorList([clock]))
    if cache == "static":
        kwargs.update(cache_implementation="static", compile_config=compile_config)
    sync()
    began = time.perf_counter()
    out = model.generate(ids, **kwargs)
    sync()
    ended = time.perf_counter()
    return dict(total_s=ended - began, ttft_s=clock.stamp - began, decode_s=ended - clock.stamp,
                generated=out.shape[1] - ids.shape[1])


def compile_config_for(args) -> CompileConfig:
    """transformers' compiled decoding: its defaults on a GPU; on a CPU (which it skips unless
    told) the backend and mode given."""
    config = CompileConfig(backend=args.compile_backend, mode=args.compile_mode)
    if not args.device.startswith("cuda"):
        config._compile_all_devices = True
    return config


def weight_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in {p.data_ptr(): p for p in model.parameters()}.values())


def measure(model, batch: int, cache: str, args) -> dict:
    """Warm up, then the best of `args.repeats` timed generations: the figures of one configuration."""
    generator = torch.Generator().manual_seed(batch)
    ids = torch.randint(0, model.config.vocab_size, (batch, args.prompt), generator=generator).to(args.device)
    compile_config = compile_config_for(args)
    cuda = args.device.startswith("cuda")
    breaks, graphs = sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]
    # the static cache's length (prompt + new tokens) is in the compiled graph: warm up at full length
    warmup_tokens = args.new_tokens if cache == "static" else min(args.new_tokens, 16)
    warmup = generate_once(model, ids, warmup_tokens, cache, compile_config, args.device)
    runs = []
    for _ in range(args.repeats):
        gc.collect()
        if cuda:
            torch.cuda.synchronize()
            held = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        runs.append(generate_once(model, ids, args.new_tokens, cache, compile_config, args.device))
        if cuda:
            runs[-1]["extra_bytes"] = torch.cuda.max_memory_allocated() - held
    generated = {run["generated"] for run in runs}
    if len(generated) != 1:
        raise RuntimeError(f"the timed runs generated different numbers of tokens: {sorted(generated)}")
    best = min(runs, key=lambda run: run["decode_s"])
    decode_tokens = args.new_tokens - 1  # the first comes with the prefill
    metrics = dict(
        tokens_per_s=round(decode_tokens * batch / best["decode_s"], 1),
        decode_ms_per_token=round(best["decode_s"] / decode_tokens * 1e3, 3),
        ttft_ms=round(min(run["ttft_s"] for run in runs) * 1e3, 2),
        total_s=round(min(run["total_s"] for run in runs), 3),
        new_tokens_generated=generated.pop(),
        weights_gib=round(weight_bytes(model) / 2**30, 3),
        peak_mem_gib=None,
    )
    if cuda:
        extra = max(run["extra_bytes"] for run in runs)
        metrics.update(peak_mem_gib=round((weight_bytes(model) + extra) / 2**30, 3),
                       generate_extra_gib=round(extra / 2**30, 3))
    if cache == "static":
        metrics.update(compile_s=round(max(warmup["total_s"] - best["total_s"], 0.0), 1),
                       graph_breaks=sum(counters["graph_break"].values()) - breaks,
                       graphs_compiled=counters["stats"]["unique_graphs"] - graphs)
    return metrics


def with_ratios(metrics: dict, plain: dict | None) -> dict:
    """`metrics` with its ratios against the plain model's figures at the same configuration."""
    if plain is None or "tokens_per_s" not in plain or "tokens_per_s" not in metrics:
        return metrics
    ratios = dict(ratio_vs_plain=round(metrics["tokens_per_s"] / plain["tokens_per_s"], 3),
                  ttft_ratio_vs_plain=round(metrics["ttft_ms"] / plain["ttft_ms"], 3))
    if metrics.get("peak_mem_gib") and plain.get("peak_mem_gib"):
        ratios["mem_ratio_vs_plain"] = round(metrics["peak_mem_gib"] / plain["peak_mem_gib"], 3)
    return {**metrics, **ratios}


def selection(args) -> list[tuple[str, str]]:
    """The (shape, cache) pairs to run, in order."""
    if args.part:
        return list(PARTS[args.part])
    return [(shape, cache) for shape in args.shapes for cache in args.caches]


def run(args) -> list[dict]:
    """Measure every selected configuration; return the records (also appended as they finish)."""
    torch._dynamo.config.recompile_limit = 64  # every model compiles the same frame (Module.__call__)
    torch._dynamo.config.accumulated_recompile_limit = 1024
    clock = dict(began=time.monotonic(), date=utc_now(), longest={True: 0.0, False: 0.0})
    records = []
    pairs = selection(args)
    for shape in dict.fromkeys(shape for shape, _ in pairs):
        records += run_shape(shape, [cache for s, cache in pairs if s == shape], args, clock)
        gc.collect()
        torch._dynamo.reset()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    print(f"elapsed {time.monotonic() - clock['began']:.0f} s", flush=True)
    return records


def run_shape(shape: str, caches: list[str], args, clock: dict) -> list[dict]:
    """One shape's models, built once and kept side by side, through its caches and batches.

    A configuration starts only if it can end inside `args.budget_s` by the longest one of its
    kind so far (`clock["longest"]`): one that compiles (the static cache, a model's first batch
    of 1 or first batch above 1) or one that does not."""
    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    models = {}
    for label, mode, heads in (m for m in MODELS if m[0] in args.models):
        config = mhar_config(shape, mode or "standard", heads or 8, args.routing, args.tiny)
        models[label] = (build(config if mode else plain_config(config), args.device, args.dtype), mode, heads)
    records, compiled = [], set()  # compiled: (model, batch of 1 or not) a decoding step is compiled for
    for cache in caches:
        for batch in args.batches:
            plain = None
            for label, (model, mode, heads) in models.items():
                record = dict(
                    shape=("tiny-" if args.tiny else "") + shape, model=label, mode=mode or "plain", heads=heads,
                    architecture=type(model).__name__, cache=cache, path="compiled" if cache == "static" else "eager",
                    batch=batch, prompt=args.prompt, new_tokens=args.new_tokens,
                    dtype=str(args.dtype).removeprefix("torch."), attention="sdpa",
                    layers=model.config.num_hidden_layers, hidden=model.config.hidden_size,
                    residual_num_blocks=model.config.residual_num_blocks if mode else None,
                    routing=args.routing if mode else None, repeats=args.repeats,
                    compile=dict(backend=args.compile_backend, mode=args.compile_mode) if cache == "static" else None,
                )
                compiles = cache == "static" and (label, batch == 1) not in compiled
                if time.monotonic() - clock["began"] + clock["longest"][compiles] > args.budget_s:
                    print(f"skipped (time budget): {json.dumps(record)}", flush=True)
                    continue
                started = time.monotonic()
                try:
                    metrics = measure(model, batch, cache, args)
                except torch.OutOfMemoryError:
                    metrics = {"out_of_memory": True}
                clock["longest"][compiles] = max(clock["longest"][compiles], time.monotonic() - started)
                if cache == "static":
                    compiled.add((label, batch == 1))
                if mode is None:
                    plain = metrics
                metrics = with_ratios(metrics, plain)
                records.append(dict(config=record, metrics=metrics))
                append_result("generate", record, metrics, date=clock["date"], folder=args.results,
                              commit=args.commit, gpu=gpu)
                print(json.dumps(records[-1]), flush=True)
                if args.device.startswith("cuda"):
                    torch.cuda.empty_cache()
    return records


def markdown(records: list[dict]) -> str:
    lines = ["| shape | cache | batch | model | tokens/s | x plain | TTFT ms | x plain | peak GiB | x plain "
             "| compile s | graph breaks |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        c, m = r["config"], r["metrics"]
        if m.get("out_of_memory"):
            lines.append(f"| {c['shape']} | {c['cache']} | {c['batch']} | {c['model']} | out of memory |||||||")
            continue
        cells = [c["shape"], c["cache"], c["batch"], c["model"], f"{m['tokens_per_s']:,}", m.get("ratio_vs_plain", ""),
                 m["ttft_ms"], m.get("ttft_ratio_vs_plain", ""), m.get("peak_mem_gib") or "",
                 m.get("mem_ratio_vs_plain", ""), m.get("compile_s", ""), m.get("graph_breaks", "")]
        lines.append("| " + " | ".join(str(cell) for cell in cells) + " |")
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=sorted(PARTS), help="one GPU command's share: " + "; ".join(
        f"{name}: " + ", ".join(f"{s} {c}" for s, c in pairs) for name, pairs in PARTS.items()))
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=SHAPES)
    parser.add_argument("--caches", nargs="+", default=list(CACHES), choices=CACHES)
    parser.add_argument("--models", nargs="+", default=[m[0] for m in MODELS], choices=[m[0] for m in MODELS])
    parser.add_argument("--batches", nargs="+", type=int, help=f"default {DEFAULTS['batches']}")
    parser.add_argument("--prompt", type=int, help=f"prompt tokens (default {DEFAULTS['prompt']})")
    parser.add_argument("--new-tokens", type=int, help=f"tokens generated (default {DEFAULTS['new_tokens']})")
    parser.add_argument("--repeats", type=int, default=2, help="timed generations per configuration, best kept")
    parser.add_argument("--routing", default="auto", choices=["auto", "fused", "reference"],
                        help="MHAR's routing_implementation (under compiled decoding 'auto' traces the reference op, "
                        "'fused' the kernels' custom ops)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--tiny", action="store_true", help="each shape shrunk to a tiny model (a dry run)")
    parser.add_argument("--compile-backend", help="compiled decoding's backend (default: inductor on a GPU, "
                        "aot_eager on a CPU)")
    parser.add_argument("--compile-mode", help="compiled decoding's mode (default: reduce-overhead on a GPU, none "
                        "on a CPU)")
    parser.add_argument("--budget-s", type=float, default=510,
                        help="start no configuration that the longest of its kind so far says would end after this "
                        "long (the GPU machine stops a command at 600 s, imports and start-up included)")
    parser.add_argument("--commit", help="the commit measured (default: $MHAR_COMMIT, else git's HEAD here)")
    parser.add_argument("--results", type=Path, help="the results folder (default: $MHAR_RESULTS_DIR, else "
                        "benchmarks/results)")
    args = parser.parse_args(argv)
    if args.part and (argv_has(argv, "--shapes") or argv_has(argv, "--caches")):
        parser.error("--part picks the shapes and caches: give either it or --shapes/--caches")
    for key, value in (TINY_DEFAULTS if args.tiny else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    on_gpu = args.device.startswith("cuda")
    args.compile_backend = args.compile_backend or ("inductor" if on_gpu else "aot_eager")
    args.compile_mode = args.compile_mode or ("reduce-overhead" if on_gpu else None)
    args.dtype = getattr(torch, args.dtype)
    args.commit = args.commit or git_commit()
    if args.new_tokens < 2:
        parser.error("--new-tokens must be at least 2 (the first token comes with the prefill)")
    if on_gpu and not torch.cuda.is_available():
        parser.error("no CUDA GPU here: run with --device cpu (and --tiny for a dry run)")
    return args


def argv_has(argv, flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in (sys.argv[1:] if argv is None else argv))


def main(argv=None):
    args = parse_args(argv)
    records = run(args)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, commit {args.commit}")
    print(markdown(records))


if __name__ == "__main__":
    main()
