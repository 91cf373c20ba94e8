"""The benchmarks' stand-ins for a training step launch what the model launches."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mhar_hf import MHARForCausalLM
from mhar_hf.ops.routing import depth_sources, fused_route, kernels, launch, launch_config
from mhar_hf.tiny import tiny_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_train import Site, floor_units, record_routing_sites, step_reads  # noqa: E402


@pytest.fixture
def source_launches(monkeypatch):
    """Per source-kernel launch: (reads summed, starts from a partial, sums a partner's terms)."""
    launches = []
    source_grad = depth_sources.source_grad

    def spy(source, records, grad_in, partial, partner):
        launches.append((len(records), partial is not None, partner is not None))
        return source_grad(source, records, grad_in, partial, partner)

    monkeypatch.setattr(depth_sources, "source_grad", spy)
    return launches


def model_step(mode: str, source_launches) -> tuple:
    """A 5-layer tiny model's config, its routing sites and source launches in one step."""
    config = tiny_config(residual_mode=mode, routing_implementation="fused", num_hidden_layers=5)
    model = MHARForCausalLM(config)
    sites = record_routing_sites(model)
    model(torch.randint(0, 384, (1, 6))).logits.sum().backward()
    by_model = list(source_launches)
    source_launches.clear()
    return config, sites, by_model


def test_step_reads_pair_sources_as_the_model_does(source_launches):
    config, sites, by_model = model_step("full", source_launches)
    width = config.hidden_size
    sources = [torch.randn(6, width, requires_grad=True) for _ in range(max(site.sources for site in sites))]
    first, second = [tuple(torch.randn(width, requires_grad=True) for _ in range(2)) for _ in range(2)]
    outs = step_reads(sites, sources, first, second, config.residual_heads)
    torch.autograd.grad(outs, sources + [*first, *second], [torch.randn_like(o) for o in outs])

    assert any(partner for _, _, partner in by_model)  # the comparison means something only with pairs
    assert source_launches == by_model


def test_step_reads_group_reads_as_the_model_does(source_launches):
    """Delta mode: the same grouped reads (one forward launch per group) and the same number of
    reads summed by each source launch."""
    config, sites, by_model = model_step("delta", source_launches)

    width = config.hidden_size
    sources = [torch.randn(6, width, requires_grad=True) for _ in range(max(site.sources for site in sites) - 1)]
    first, second = [tuple(torch.randn(width, requires_grad=True) for _ in range(2)) for _ in range(2)]
    null, gate = torch.randn(width, requires_grad=True), torch.randn(1, requires_grad=True)
    outs = step_reads(sites, sources, first, second, config.residual_heads, null, gate)
    torch.autograd.grad(outs, sources + [*first, null, gate], [torch.randn_like(o) for o in outs])

    roles = [site.role for site in sites]
    # blocks of 3 layers: layer 0's MLP read to layer 3's attention read, then layer 3's MLP read on
    assert roles.count("group") == 2 and roles.count("ahead") == 7
    assert len(outs) == len(sites) and source_launches == by_model


@pytest.fixture
def grouped_launches(monkeypatch) -> list[bool]:
    """Per forward launch, whether it is grouped."""
    grouped = []
    forward = kernels.route_fwd_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                grouped.append(kwargs["GROUPED"])
                return forward[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(kernels, "route_fwd_kernel", Spy())
    return grouped


def two_phase_step(mode: str, grouped_launches) -> tuple[list[Site], list[bool]]:
    """A 5-layer tiny model's routing sites, and whether each forward launch of a step of it and of
    `step_reads` of its sites is grouped (which must agree)."""
    config = tiny_config(residual_mode=mode, routing_implementation="fused", num_hidden_layers=5)
    model = MHARForCausalLM(config)
    sites = record_routing_sites(model)
    model(torch.randint(0, 384, (1, 6))).logits.sum().backward()
    by_model, grouped_launches[:] = list(grouped_launches), []
    width = config.hidden_size
    sources = [torch.randn(6, width, requires_grad=True) for _ in range(max(site.sources for site in sites))]
    first, second = [tuple(torch.randn(width, requires_grad=True) for _ in range(2)) for _ in range(2)]
    outs = step_reads(sites, sources, first, second, config.residual_heads)
    torch.autograd.grad(outs, sources + [*first], [torch.randn_like(o) for o in outs], allow_unused=True)
    assert len(outs) == len(sites) and grouped_launches == by_model
    return sites, by_model


def test_step_reads_make_two_phase_reads_as_the_model_does(grouped_launches):
    """Block mode: each block's reads begun in one grouped launch over its finished blocks, then
    ended one by one; the final read whole."""
    sites, grouped = two_phase_step("block", grouped_launches)
    # blocks of 3 layers: layer 0's MLP read to layer 2's, over the embedding; layer 3's attention
    # read (the blocks alone) to layer 4's MLP read, over the embedding and the first block
    assert sites == [(2, "two-phase", 1)] * 5 + [(2, "two-phase", 2)] + [(3, "two-phase", 2)] * 3 + [(3, "whole", 0)]
    assert grouped.count(True) == 2


def test_step_reads_make_full_mode_groups_as_the_model_does(grouped_launches):
    """Full mode in groups of 2 layers: each group's reads begun in one grouped launch over the
    sources made before it, then each ended with its own newer sources (up to 3); the final read whole."""
    with launch_config(full_group_layers=2):
        sites, grouped = two_phase_step("full", grouped_launches)
    assert [(site.sources - site.begun, site.begun) for site in sites if site.role == "two-phase"] == [
        (1, 1), (2, 1), (3, 1), (0, 5), (1, 5), (2, 5), (3, 5)]
    # the last layer, a group of one, is a split pair
    assert sites[-3:] == [(9, "begin", 0), (10, "end", 0), (11, "whole", 0)] and grouped.count(True) == 2


@pytest.mark.parametrize("layers", [5, 12])
def test_full_mode_floor_follows_its_groups(layers):
    """floor_units of full mode's reads in groups of G layers, against split pairs: a group of G
    layers whose reads begin over k sources moves 2 ((G - 1) k - (G^2 + 3G - 2)) tensors fewer,
    half of them in each pass (docs/kernels.md); a group of one layer is a split pair."""
    def floor(group):
        config = tiny_config(residual_mode="full", routing_implementation="fused", num_hidden_layers=layers)
        with launch_config(full_group_layers=group):
            model = MHARForCausalLM(config)
            sites = record_routing_sites(model)
            with torch.no_grad():
                model(torch.randint(0, 384, (1, 2)))
        return floor_units(sites, gated=False)

    pairs = floor(1)
    for group in (2, 3, 7):
        grouped = floor(group)
        starts = range(0, layers, group)
        saved = sum((g - 1) * (1 + 2 * start) - (g * g + 3 * g - 2) for start in starts
                    for g in [min(group, layers - start)] if g > 1)
        assert (pairs[0] - grouped[0], pairs[1] - grouped[1]) == (saved, saved), group


def test_sweep_field_times_each_value_and_restores_the_default(monkeypatch, capsys):
    import sweep_launch

    seen = []
    monkeypatch.setattr(sweep_launch, "model_sites", lambda preset, mode: [(3, "group"), (3, "ahead")])
    monkeypatch.setattr(sweep_launch, "time_routing", lambda *args: seen.append(launch.current().partials_tile) or
                        {"fwd_bwd_kernels_ms": {"route_partials_kernel": float(len(seen))}})
    default = launch.current()
    sweep_launch.sweep_field(["100M"], "delta", "partials_tile", "{'read': (8, 8), 'group': (4, 4)}",
                             "{'read': (2, 2), 'group': (1, 1)}", bandwidth=1.0)
    assert seen == [{"read": (8, 8), "group": (4, 4)}, {"read": (2, 2), "group": (1, 1)}]
    assert launch.current() is default
    assert capsys.readouterr().out.count("100M partials_tile=") == 2


def test_sweep_field_relaunches_with_each_value_of_a_field_that_shapes_launches(monkeypatch):
    """column_block_kinds decides the launch arguments, which are cached: each swept value must
    reach them (the cache cleared), and the default again afterwards."""
    import sweep_launch

    seen = []
    monkeypatch.setattr(sweep_launch, "model_sites", lambda preset, mode: [(3, "group"), (3, "ahead")])
    monkeypatch.setattr(sweep_launch, "time_routing", lambda *args: seen.append(
        launch.kernel_args("site", 512, 8)["SPLIT"]) or {"fwd_bwd_kernels_ms": {}})
    split = launch.kernel_args("site", 512, 8)["SPLIT"]
    assert split == 2  # one warp of d = 512 (GPU) or the interpreter's launch: two column blocks
    sweep_launch.sweep_field(["100M"], "block", "column_block_kinds", "('site', 'site_few', 'total')", "()",
                             bandwidth=1.0)
    assert seen == [2, 1]
    assert launch.kernel_args("site", 512, 8)["SPLIT"] == 2


def test_launch_sweep_prints_each_choice_as_it_is_measured(monkeypatch, capsys):
    """sweep_launch.main: a line per choice as soon as it is timed (a time limit that cuts the
    sweep keeps what was measured), then the kind's choices best first; the launch config restored."""
    import sweep_launch

    times = iter([3.0, 1.0])
    monkeypatch.setattr(sweep_launch, "copy_bandwidth", lambda: 1.0)
    monkeypatch.setattr(sweep_launch, "model_sites", lambda preset, mode: [(3, "group")])
    monkeypatch.setattr(sweep_launch, "time_routing", lambda *args: {
        "fwd_bwd_kernels_ms": {"route_source_bwd_kernel": next(times)}})
    monkeypatch.setattr(sys, "argv", ["sweep_launch.py", "--presets", "100M", "--mode", "delta", "--kinds", "source",
                                      "--choices", "4,2048,3", "2,1024,3"])
    default = launch.current()
    sweep_launch.main()
    assert capsys.readouterr().out.splitlines() == [
        "100M source (4, 2048, 3): 3.000 ms", "100M source (2, 1024, 3): 1.000 ms",
        "100M source: (2, 1024, 3) 1.000 ms, (4, 2048, 3) 3.000 ms"]
    assert launch.current() is default


def test_sweep_field_rejects_bad_input_before_any_gpu_work():
    from sweep_launch import field_error

    assert "not a field of LaunchConfig" in field_error("NOPE", "1")
    assert "not a field of LaunchConfig" in field_error("tile", "1")  # launch's functions are not fields
    assert "give the values" in field_error("partials_tile")
    assert "not a Python literal" in field_error("partials_tile", "{'read': (8, 8)}", "{bad")
    assert field_error("group_forward_programs_per_sm", "8", "32") is None


def test_routing_launches_split_a_kernels_variants_by_registers(tmp_path):
    """profile_step.routing_launches: per step, each routing kernel's time per (registers, grid,
    block), so two variants of one kernel at one grid are told apart; other kernels left out."""
    from profile_step import routing_launches

    def kernel(name, dur, registers, grid=(132, 1, 1)):
        return {"cat": "kernel", "name": name, "ts": 0, "dur": dur,
                "args": {"registers per thread": registers, "grid": list(grid), "block": [32, 1, 1]}}

    launches = [("route_fwd_kernel", 30.0, 254), ("route_fwd_kernel", 10.0, 211)] * 3
    launches += [("route_site_bwd_kernel", 50.0, 119, (528, 1, 1))] * 2 + [("nvjet_sm90_gemm", 900.0, 168)]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": [kernel(*launch) for launch in launches]
                                 + [{"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5}]}))
    rows = routing_launches(trace, steps=2).splitlines()[1:]
    parsed = [re.fullmatch(r"\s*([\d.]+) ms\s+([\d.]+)x\s+([\d.]+) us \| (.*)", row).groups() for row in rows]
    assert [(float(ms), float(per_step), float(each), key) for ms, per_step, each, key in parsed] == [
        (0.05, 1.0, 50.0, "route_site_bwd_kernel, 119, [528, 1, 1], [32, 1, 1]"),
        (0.045, 1.5, 30.0, "route_fwd_kernel, 254, [132, 1, 1], [32, 1, 1]"),
        (0.015, 1.5, 10.0, "route_fwd_kernel, 211, [132, 1, 1], [32, 1, 1]"),
    ]


def test_kernel_families_sort_names_and_table_the_differences():
    """profile_step.family puts a kernel in the first family whose mark its name holds (routing
    before compiled, the rest in "other eager"); families_table prints each family's ms per model
    and its difference from the first model."""
    from collections import Counter

    from profile_step import FAMILIES, families_table, family

    assert family("route_site_bwd_kernel") == "routing"
    assert family("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0") == "compiled (Inductor)"
    assert family("nvjet_sm90_tst_128x256_64x4_4x2_h_bz_coopA_NTN") == "matmul"
    assert family("cudnn_generated_fort_native_sdpa_sm90_flash_bprop") == "attention"
    assert family("void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add") == "other eager"
    assert family("Memcpy HtoD (Pinned -> Device)") == family("Memset (Device)") == "copies and fills"
    times = {"plain": Counter({"matmul": 10.0, "compiled (Inductor)": 2.0}),
             "MHAR": Counter({"matmul": 10.0, "compiled (Inductor)": 2.5, "routing": 1.25})}
    rows = {line.split("  ")[1].strip(): line.split()[-3:] for line in families_table(times).splitlines()[1:]}
    assert len(rows) == len(FAMILIES)
    assert rows["routing"] == ["0.000", "1.250", "+1.250"]
    assert rows["compiled (Inductor)"] == ["2.000", "2.500", "+0.500"]
    assert rows["matmul"] == ["10.000", "10.000", "+0.000"]


def test_own_memory_takes_what_earlier_configurations_held_off_the_peak():
    """bench_train.own_memory: the peak less the bytes held before the model was built, both in
    GiB; the other figures unchanged."""
    from bench_train import own_memory

    figures = {"step_ms": 40.0, "tokens_per_s": 51200, "peak_mem_gib": 15.52}
    assert own_memory(figures, held=2**30 * 3 // 4) == {"step_ms": 40.0, "tokens_per_s": 51200,
                                                         "peak_mem_gib": 14.77, "held_gib": 0.75}
    assert own_memory(figures, held=0)["peak_mem_gib"] == 15.52


def test_ab_kernels_launches_a_revisions_kernels_then_this_trees(tmp_path, monkeypatch):
    """ab_kernels: inside kernels_of, the fused op launches kernels.py as a git revision holds it
    (a spy on that module's forward kernel sees the launch; same source, same output bits), and
    this tree's kernels come back after the block, after an error too; a revision git cannot
    show is a clear error."""
    import ab_kernels

    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    repo = tmp_path / "repo"
    (repo / ab_kernels.KERNELS).parent.mkdir(parents=True)
    shutil.copy(kernels.__file__, repo / ab_kernels.KERNELS)
    commit = ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "base"]
    for command in (["init", "-q"], ["add", "."], commit):
        subprocess.run(["git", "-C", str(repo), *command], check=True, capture_output=True)
    base = ab_kernels.base_kernels("HEAD", tmp_path, repo)
    assert base is not kernels

    launches = []
    forward = base.route_fwd_kernel

    class Spy:
        def __getitem__(self, grid):
            launches.append(grid)
            return forward[grid]

        def __getattr__(self, name):
            return getattr(forward, name)

    monkeypatch.setattr(base, "route_fwd_kernel", Spy())
    generator = torch.Generator().manual_seed(0)
    sources = [torch.randn(1, 5, 64, generator=generator) for _ in range(3)]
    query, norm_weight = torch.randn(64, generator=generator), 1 + torch.rand(64, generator=generator)
    expected = fused_route(sources, query, norm_weight, 4, 1e-6)
    own = kernels.route_fwd_kernel
    with ab_kernels.kernels_of(base):
        out = fused_route(sources, query, norm_weight, 4, 1e-6)
    assert launches and torch.equal(out, expected)
    assert kernels.route_fwd_kernel is own
    with pytest.raises(RuntimeError, match="inside"), ab_kernels.kernels_of(base):
        raise RuntimeError("inside")
    assert kernels.route_fwd_kernel is own
    with pytest.raises(SystemExit, match="--base no-such-revision: git cannot show"):
        ab_kernels.base_kernels("no-such-revision", tmp_path, repo)


def test_release_frees_the_cublas_workspaces_before_the_cache(monkeypatch):
    """bench_train.release: cuBLAS's per-stream workspaces, which empty_cache leaves allocated, are
    cleared first, so that the cache can hand their memory back."""
    import bench_train

    calls = []
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: calls.append("workspaces"), raising=False)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("cache"))
    bench_train.release()
    assert calls == ["workspaces", "cache"]


def test_markdown_tables_routing_kernels_only_where_a_fused_path_ran():
    """bench_train.markdown: one row per training configuration, and the routing-kernel table
    only with kernel figures (a run of graph paths alone has none: no empty table)."""
    from bench_train import markdown

    report = {"date": "d", "gpu": "g", "commit": "c", "torch": "t", "triton": "tr", "copy_bandwidth_tb_s": 3.0,
              "timed_steps": 8, "warmup_steps": 3, "kernels": [],
              "training": [{"preset": "350M", "path": "compiled+graph", "tokens_per_s": 96804, "peak_mem_gib": 13.9},
                           {"preset": "350M", "label": "delta", "path": "fused+graph", "tokens_per_s": 90974,
                            "peak_mem_gib": 14.0, "ratio_vs_baseline": 0.94, "mem_ratio_vs_baseline": 1.004}]}
    text = markdown(report)
    assert "| 350M | delta | fused+graph | 90,974 | 0.94 | 14.0 | 1.004 |" in text
    assert "Routing kernels" not in text and "% of floor" not in text
    kernel = {"preset": "350M", "mode": "delta", "heads": 8, "sites": 48, "fwd_ms": 0.6, "fwd_floor_ms": 0.3,
              "fwd_pct_of_floor": 50.0, "fwd_bwd_ms": 2.2, "fwd_bwd_floor_ms": 1.0, "fwd_bwd_pct_of_floor": 45.5,
              "fwd_bwd_wall_ms": 2.5}
    text = markdown({**report, "kernels": [kernel]})
    assert "| 350M | delta | 8 | 48 | 0.6 | 0.3 | 50.0 | 2.2 | 1.0 | 45.5 | 2.5 |  |" in text
    text = markdown({**report, "kernels": [{**kernel, "ratio_at_floor": 0.966}]})
    assert "| 350M | delta | 8 | 48 | 0.6 | 0.3 | 50.0 | 2.2 | 1.0 | 45.5 | 2.5 | 0.966 |" in text


def test_ratio_at_floor_swaps_the_kernels_time_for_their_floor_in_the_fastest_fused_step():
    """bench_train.ratio_at_floor: plain step time over (fastest fused step - kernels + floor), in
    seconds per step from tokens/s; other variants and the reference paths are not its step."""
    from bench_train import ratio_at_floor

    tokens = 4096
    kernel = {"preset": "350M", "mode": "block", "heads": 8, "tokens": tokens, "fwd_bwd_ms": 2.2,
              "fwd_bwd_floor_ms": 1.0}
    row = {"preset": "350M", "mode": "block", "heads": 8}
    training = [{**row, "path": "fused", "tokens_per_s": 40000},
                {**row, "path": "fused+graph", "tokens_per_s": 90974},
                {**row, "path": "reference", "tokens_per_s": 95000},
                {**row, "heads": 1, "path": "fused+graph", "tokens_per_s": 95000},
                {**row, "path": "fused+graph", "status": "out of memory"}]
    plain_ms, step_ms = tokens / 96804 * 1e3, tokens / 90974 * 1e3
    expected = plain_ms / (step_ms - 2.2 + 1.0)
    assert ratio_at_floor(kernel, training, {"tokens_per_s": 96804}) == round(expected, 3)
    assert ratio_at_floor(kernel, training[2:4], {"tokens_per_s": 96804}) is None


# The realistic protocol (issue 42), run on the CPU at tiny sizes: the fused reads under the Triton
# interpreter, torch.compile with its `eager` backend (Dynamo's tracing and graph breaks, no Inductor).
TINY_SIZES = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, bos_token_id=None, eos_token_id=0)


@pytest.fixture
def tiny_realistic(monkeypatch):
    """bench_train's realistic protocol with every case's config (the real one: preset, plain class,
    sliced Llama-3.1-8B) shrunk to TINY_SIZES, and micro-batches of 32 and 16 tokens. Returns a
    function running the protocol's cases for the given presets, variants and paths."""
    from argparse import Namespace

    import bench_train

    real = bench_train.case_config

    def tiny(case):
        config = real(case)
        fields = {**config.to_dict(), **TINY_SIZES}
        fields.pop("layer_types", None)  # Qwen3's, one per layer: made again for 3 layers
        return type(config).from_dict(fields)

    monkeypatch.setattr(bench_train, "case_config", tiny)
    monkeypatch.setattr(bench_train, "REALISTIC_BATCH", {"100M": (2, 16), bench_train.SLICE: (1, 16)})

    def run(presets, variants, paths, whole_variants=("delta",), loss="mhar-train", full_group_layers=None,
            block_two_phase=None):
        args = Namespace(presets=presets, variants=variants, realistic_paths=paths, whole_variants=whole_variants,
                         checkpointing=[bench_train.SLICE], loss=loss, warmup=1, steps=1, budget_s=3600,
                         compile_backend="eager", full_group_layers=full_group_layers, block_two_phase=block_two_phase)
        return bench_train.run_realistic(args, torch.device("cpu"))

    return run


def test_realistic_cases_put_the_targets_first_at_16k_tokens_and_the_slice_in_delta_mode():
    """bench_train.realistic_cases: every compiled row (plain class, MHAR standard, variants) before
    any eager one, torch.compile(model) rows last and only for the plain class and the whole
    variants; 16k tokens a micro-batch everywhere; the 8B slice in delta mode alone, checkpointed."""
    from bench_train import REALISTIC_BATCH, REALISTIC_PATHS, SLICE, realistic_cases

    cases = realistic_cases(list(REALISTIC_BATCH), ["full H=8", "block", "delta"], list(REALISTIC_PATHS))
    paths = [c["path"] for c in cases]
    assert paths == sorted(paths, key=REALISTIC_PATHS.index)
    assert all(c["batch"] * c["seq"] == 16384 and c["protocol"] == "realistic" for c in cases)
    assert all(c["checkpointing"] == (c["preset"] == SLICE) for c in cases)
    by_path = {path: [(c["preset"], c["label"]) for c in cases if c["path"] == path] for path in REALISTIC_PATHS}
    assert by_path["compiled"][:5] == [("100M", "plain"), ("100M", "MHAR standard"), ("100M", "full H=8"),
                                       ("100M", "block"), ("100M", "delta")]
    assert [label for preset, label in by_path["compiled"] if preset == SLICE] == ["plain", "MHAR standard", "delta"]
    assert [label for preset, label in by_path["eager"] if preset == SLICE] == ["plain", "delta"]
    assert by_path["compiled-whole"] == [(p, label) for p in REALISTIC_BATCH for label in ("plain", "delta")]
    assert len(by_path["compiled"]) == 18 and len(by_path["eager"]) == 14


def test_realistic_configs_are_the_presets_and_llama_3_1_8b_sliced():
    """bench_train.case_config: the slice is Llama-3.1-8B's published config with 8 layers (plain),
    and what `mhar convert --heads 8 --num-blocks 8` makes of it (delta, fused reads); a preset's
    plain side is Qwen3 of the preset's shape."""
    from transformers import LlamaConfig, Qwen3Config

    from bench_train import SLICE, case_config
    from mhar_hf import MHARConfig

    def config(preset, label, mode="delta", heads=8):
        return case_config(dict(preset=preset, label=label, mode=mode, heads=heads))

    plain, delta = config(SLICE, "plain", "standard", None), config(SLICE, "delta")
    assert type(plain) is LlamaConfig and type(delta) is MHARConfig
    for c in (plain, delta):
        assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
                c.vocab_size, c.tie_word_embeddings) == (4096, 14336, 8, 32, 8, 128256, False)
        assert c.rope_parameters["rope_type"] == "llama3"
    assert (delta.residual_mode, delta.residual_heads, delta.layers_per_block, delta.routing_implementation) == (
        "delta", 8, 1, "fused")
    assert config(SLICE, "MHAR standard", "standard", None).residual_mode == "standard"

    preset = MHARConfig.from_preset("1B")
    qwen = config("1B", "plain", "standard", None)
    assert type(qwen) is Qwen3Config and not qwen.use_sliding_window
    assert (qwen.hidden_size, qwen.num_hidden_layers, qwen.head_dim, qwen.vocab_size, qwen.tie_word_embeddings) == (
        preset.hidden_size, preset.num_hidden_layers, 80, preset.vocab_size, True)
    full = config("1B", "full H=8", "full")
    assert (full.residual_mode, full.residual_heads, full.routing_implementation) == ("full", 8, "fused")


@pytest.mark.parametrize("qk_norm", [True, False])
def test_plain_class_is_the_network_of_standard_mode(qk_norm):
    """bench_train.plain_config_for: transformers' own class (Qwen3 with q/k norm, else Llama) takes
    an MHAR standard model's weights by name and gives its logits bit for bit."""
    from transformers import AutoModelForCausalLM

    from bench_train import plain_config_for

    config = tiny_config(residual_mode="standard", qk_norm=qk_norm, tie_word_embeddings=qk_norm)
    mhar = MHARForCausalLM(config).eval()
    plain = AutoModelForCausalLM.from_config(plain_config_for(config)).eval()
    assert type(plain).__name__ == ("Qwen3ForCausalLM" if qk_norm else "LlamaForCausalLM")
    plain.load_state_dict(mhar.state_dict(), strict=True)
    ids = torch.randint(0, config.vocab_size, (2, 9))
    assert torch.equal(plain(ids).logits, mhar(ids).logits)


def test_realistic_protocol_runs_fp32_weights_under_bf16_autocast_and_records_its_rows(tiny_realistic, monkeypatch,
                                                                                       tmp_path):
    """The 8B slice through every path: each step's matmuls in bf16 over fp32 weights, each row
    timed and compared with the plain class, and written as a train_throughput row that says so."""
    import bench_train
    import results_log

    seen = []
    real_step = bench_train.realistic_step

    def spying_step(model, *args):
        head = getattr(model, "_orig_mod", model).lm_head
        head.register_forward_hook(lambda module, inputs, output: seen.append((module.weight.dtype, output.dtype)))
        return real_step(model, *args)

    monkeypatch.setattr(bench_train, "realistic_step", spying_step)
    records = tiny_realistic([bench_train.SLICE], ["delta"], list(bench_train.REALISTIC_PATHS))
    assert [(r["label"], r["path"], r["model"]) for r in records] == [
        ("plain", "compiled", "LlamaForCausalLM"), ("MHAR standard", "compiled", "MHARForCausalLM"),
        ("delta", "compiled", "MHARForCausalLM"), ("plain", "eager", "LlamaForCausalLM"),
        ("delta", "eager", "MHARForCausalLM"), ("plain", "compiled-whole", "LlamaForCausalLM"),
        ("delta", "compiled-whole", "MHARForCausalLM")]
    assert seen and set(seen) == {(torch.float32, torch.bfloat16)}
    assert all(r["tokens_per_s"] > 0 and r["peak_mem_gib"] is None for r in records)
    # against the fastest plain row (the plain class or MHAR standard), which has no ratio itself
    assert [r["label"] for r in records if "ratio_vs_baseline" not in r] in (["plain"], ["MHAR standard"])
    assert all("ratio_same_path" in r for r in records if r["label"] != "plain")
    # compile_regions leaves the reads outside its graphs; torch.compile(model) traces them into its one
    # graph, as custom ops (ops/routing/traced.py): no break
    assert records[2]["dynamo_graphs"] > 0 and records[2]["graph_breaks"] == 0 and records[6]["graph_breaks"] == 0
    assert records[3]["dynamo_graphs"] == 0

    report = dict(date="2026-12-07T09:00:00+00:00", gpu="cpu", commit="0123abc", torch="t", triton="tr",
                  copy_bandwidth_tb_s=None, warmup_steps=1, timed_steps=1, training=[], kernels=[], realistic=records)
    bench_train.record(report, tmp_path)
    rows = results_log.read_results("train_throughput", tmp_path)
    assert len(rows) == len(records)
    assert rows[2]["config"] == dict(protocol="realistic", preset=bench_train.SLICE, mode="delta", heads=8,
                                     variant="delta", model="MHARForCausalLM", path="compiled", batch=1, seq=16,
                                     weights="float32", autocast="bfloat16", loss="mhar-train", checkpointing=True,
                                     compile_backend="eager", warmup_steps=1, timed_steps=1)
    assert rows[4]["config"]["compile_backend"] is None
    assert "meets_target" in rows[2]["metrics"] and "meets_target" not in rows[4]["metrics"]
    assert "| 8B-slice | 1x16 | delta | compiled |" in bench_train.markdown(report)


def test_realistic_protocol_fails_loudly_when_a_read_falls_back_to_the_reference_op(tiny_realistic, monkeypatch,
                                                                                    tmp_path):
    """A routing read that the fused kernels decline (here all of them) is no measurement: the row
    says it fell back and why, its row is written flagged, and the run exits with an error."""
    import bench_train
    import results_log
    from mhar_hf.ops import routing as fused

    monkeypatch.setattr(fused, "unsupported_reason", lambda *args, **kwargs: "declined by the test")
    records = tiny_realistic(["100M"], ["full H=8"], ["eager"], loss="transformers")  # Trainer's loss, labels=
    assert [(r["label"], r["model"], r.get("status")) for r in records] == [
        ("plain", "Qwen3ForCausalLM", None), ("full H=8", "MHARForCausalLM", "fell back to the reference op")]
    assert "declined by the test" in records[1]["fallback"] and "tokens_per_s" not in records[1]

    report = dict(date="2026-12-07T09:00:00+00:00", gpu="cpu", commit="0123abc", torch="t", triton="tr",
                  copy_bandwidth_tb_s=None, warmup_steps=1, timed_steps=1, training=[], kernels=[], realistic=records)
    bench_train.record(report, tmp_path)
    assert results_log.read_results("train_throughput", tmp_path)[1]["metrics"] == {"fell_back_to_reference": True}
    with pytest.raises(SystemExit, match="100M full H=8 eager: declined by the test"):
        bench_train.check_fallbacks(records)


def test_realistic_markdown_judges_compiled_variants_against_their_targets():
    """bench_train.meets_target: a compiled variant meets its target with x plain at least the
    figure and peak memory at most 1.05x plain; other rows have none."""
    from bench_train import markdown, meets_target

    row = dict(protocol="realistic", preset="350M", batch=8, seq=2048, mode="block", heads=8, label="block",
               path="compiled", tokens_per_s=95000, peak_mem_gib=40.0, first_step_s=30.5, ratio_vs_baseline=0.95,
               mem_ratio_vs_baseline=1.05, ratio_same_path=0.95)
    assert meets_target(row) is True
    assert meets_target({**row, "ratio_vs_baseline": 0.949}) is False
    assert meets_target({**row, "mem_ratio_vs_baseline": 1.051}) is False
    assert meets_target({**row, "path": "eager"}) is None and meets_target({**row, "label": "plain"}) is None
    assert meets_target({**row, "preset": "8B-slice", "label": "delta", "mode": "delta"}) is False  # 0.97 there
    report = dict(date="d", gpu="g", commit="c", torch="t", triton="tr", copy_bandwidth_tb_s=None, warmup_steps=3,
                  timed_steps=5, training=[], kernels=[],
                  realistic=[row, {**row, "label": "full H=8", "mode": "full", "tokens_per_s": None,
                                   "status": "out of memory"}])
    del report["realistic"][1]["tokens_per_s"]
    text = markdown(report)
    assert "| 350M | 8x2048 | block | compiled | 95,000 | 0.95 | 0.95 | 40.0 | 1.05 | 30.5 | 0.95: met |" in text
    assert "| 350M | 8x2048 | full H=8 | compiled | out of memory |" in text
    assert "copy bandwidth" not in text and "Graph protocol" not in text


def test_full_group_layers_run_full_mode_once_per_group_and_record_it(tiny_realistic, monkeypatch, tmp_path):
    """--full-group-layers: full H=8 runs once per G, with that G in effect (its groups begin their
    reads together), each row recording it in its config and its label; other variants keep theirs."""
    import bench_train
    import results_log
    from mhar_hf.ops import routing as fused

    begun = []
    begin = fused.fused_begin_group
    monkeypatch.setattr(fused, "fused_begin_group", lambda *args: begun.append(launch.current().full_group_layers)
                        or begin(*args))
    records = tiny_realistic(["100M"], ["full H=8"], ["eager"], full_group_layers=[1, 3])
    assert [(r["label"], r.get("full_group_layers")) for r in records] == [
        ("plain", None), ("full H=8", 1), ("full H=8", 3)]
    assert begun and set(begun) == {3}  # groups of one layer are split pairs
    assert launch.current().full_group_layers == 1  # restored

    report = dict(date="2026-12-07T09:00:00+00:00", gpu="cpu", commit="0123abc", torch="t", triton="tr",
                  copy_bandwidth_tb_s=None, warmup_steps=1, timed_steps=1, training=[], kernels=[], realistic=records)
    bench_train.record(report, tmp_path)
    rows = results_log.read_results("train_throughput", tmp_path)
    assert [row["config"].get("full_group_layers") for row in rows] == [None, 1, 3]
    assert "| 100M | 2x16 | full H=8 G=3 | eager |" in bench_train.markdown(report)


def test_block_two_phase_runs_block_mode_once_per_value_and_records_it(tiny_realistic, monkeypatch, tmp_path):
    """--block-two-phase on off: block runs twice, its reads begun together in the first run only,
    each row recording the value in its config and label; the launch config is restored after."""
    import bench_train
    import results_log
    from mhar_hf.ops import routing as fused

    begun = []
    begin = fused.fused_begin_group
    monkeypatch.setattr(fused, "fused_begin_group", lambda *args: begun.append(launch.current().block_two_phase)
                        or begin(*args))
    records = tiny_realistic(["100M"], ["block"], ["eager"], block_two_phase=[True, False])
    assert [(r["label"], r.get("block_two_phase")) for r in records] == [
        ("plain", None), ("block", True), ("block", False)]
    assert begun and set(begun) == {True}
    assert launch.current().block_two_phase is True  # restored

    report = dict(date="2026-12-07T09:00:00+00:00", gpu="cpu", commit="0123abc", torch="t", triton="tr",
                  copy_bandwidth_tb_s=None, warmup_steps=1, timed_steps=1, training=[], kernels=[], realistic=records)
    bench_train.record(report, tmp_path)
    rows = results_log.read_results("train_throughput", tmp_path)
    assert [row["config"].get("block_two_phase") for row in rows] == [None, True, False]
    text = bench_train.markdown(report)
    assert "| 100M | 2x16 | block two-phase | eager |" in text and "| 100M | 2x16 | block whole reads | eager |" in text


def test_graph_rows_and_kernel_rows_record_their_full_group_layers():
    """The graph protocol's rows: each full-mode row's G in its config, label and kernel table, and
    a kernel row's ratio at floor taken from the training step of the same G."""
    from bench_train import markdown, ratio_at_floor, result_rows, schedules

    assert schedules("full H=8", "full", [2, 4]) == [{"full_group_layers": 2}, {"full_group_layers": 4}]
    assert schedules("full H=1", "full", [2, 4]) == schedules("full H=8", "full") == [{"full_group_layers": 1}]
    assert schedules("block", "block", [2]) == [{"block_two_phase": True}] and schedules("delta", "delta", [2]) == [{}]
    assert schedules("block", "block", None, [False]) == [{"block_two_phase": False}]
    row = dict(preset="350M", mode="full", heads=8, label="full H=8", path="fused", peak_mem_gib=9.0)
    training = [dict(row, full_group_layers=1, tokens_per_s=80000), dict(row, full_group_layers=4, tokens_per_s=90000)]
    kernel = dict(preset="350M", mode="full", heads=8, tokens=4096, sites=48, fwd_ms=0.6, fwd_floor_ms=0.3,
                  fwd_pct_of_floor=50.0, fwd_bwd_ms=2.2, fwd_bwd_floor_ms=1.0, fwd_bwd_pct_of_floor=45.5,
                  fwd_bwd_wall_ms=2.5, full_group_layers=4)
    step_ms = 4096 / 90000 * 1e3
    assert ratio_at_floor(kernel, training, {"tokens_per_s": 96804}) == round(4096 / 96804 * 1e3 / (step_ms - 1.2), 3)
    report = dict(date="d", gpu="g", commit="c", torch="t", triton="tr", copy_bandwidth_tb_s=3.0, warmup_steps=3,
                  timed_steps=8, training=training, kernels=[kernel], realistic=[])
    rows = result_rows(report)
    assert [config.get("full_group_layers") for _, config, _ in rows] == [1, 4, 4]
    text = markdown(report)
    assert "| 350M | full H=8 G=4 | fused | 90,000 |" in text and "| 350M | full G=4 | 8 | 48 | 0.6 |" in text
