"""Model-level equivalence of the fused routing kernels and the reference op: a tiny model
trained with each gives the same loss curve; activation checkpointing and FSDP2 keep the
fused gradients exact. On CPU the kernels run under the Triton interpreter."""

import copy
import os
import re
import warnings

import pytest
import torch
from test_routing_kernels import rel_rms

from mhar_hf import MHARForCausalLM
from mhar_hf.ops.routing import group, kernels, tables
from mhar_hf.tiny import tiny_config

DEVICE = "cuda" if os.environ.get("MHAR_TEST_GPU") == "1" and torch.cuda.is_available() else "cpu"


def tiny_model(mode: str, implementation: str) -> MHARForCausalLM:
    torch.manual_seed(0)
    config = tiny_config(residual_mode=mode, num_hidden_layers=3, routing_implementation=implementation)
    return MHARForCausalLM(config).to(DEVICE)


def batches(steps: int, vocab: int = 384):
    g = torch.Generator().manual_seed(1)
    motif = torch.randint(2, vocab, (8,), generator=g)  # a repeated pattern: the loss must fall
    for _ in range(steps):
        noise = torch.randint(2, vocab, (1, 16), generator=g)
        yield torch.where(torch.rand(1, 16, generator=g) < 0.7, motif.repeat(2)[None], noise).to(DEVICE)


def loss_curve(model: MHARForCausalLM, steps: int = 30) -> list[float]:
    # routing parameters get a large learning rate so queries, null sources and gates move a lot
    routing = [p for n, p in model.named_parameters() if "router" in n]
    rest = [p for n, p in model.named_parameters() if "router" not in n]
    optimizer = torch.optim.AdamW([{"params": rest, "lr": 3e-3}, {"params": routing, "lr": 3e-2}], weight_decay=0.0)
    curve = []
    for tokens in batches(steps):
        loss = model(tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        curve.append(loss.item())
    return curve


@pytest.mark.parametrize("mode", ["full", "delta"])
def test_fused_training_follows_the_reference_loss_curve(mode, monkeypatch):
    launches = []
    kernel = kernels.route_source_bwd_kernel

    class Spy:
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    monkeypatch.setattr(kernels, "route_source_bwd_kernel", Spy())
    fused_model = tiny_model(mode, "fused")
    fused_curve = loss_curve(fused_model)
    assert launches, "the fused model never launched the routing kernel"
    reference_model = tiny_model(mode, "reference")
    reference_curve = loss_curve(reference_model)
    assert reference_curve[-1] < reference_curve[0] - 1.0  # it learned something
    gaps = [abs(a - b) / b for a, b in zip(fused_curve, reference_curve, strict=True)]
    assert max(gaps) < 1e-2, (fused_curve, reference_curve)  # within bf16 tolerance (fp32 here: far inside)
    moved = [n for n, p in fused_model.named_parameters() if "router" in n and p.abs().max() > 0]
    assert any("query" in n for n in moved) and (mode != "delta" or any("gate" in n for n in moved))


def fused_gradients(model, tokens):
    model.zero_grad()
    model(tokens, labels=tokens).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def randomised(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "router" in name:
                p.copy_(torch.randn_like(p) * 0.5)
    return model


@pytest.mark.parametrize("mode", ["full", "delta"])
def test_activation_checkpointing_keeps_fused_gradients_exact(mode):
    """Recomputation reproduces the kernels bit for bit. Delta mode's reads of a block span, one
    grouped launch without checkpointing, run in each layer's own launches under it (what a layer
    hands on stays alive until the backward): there a source's gradient is summed in another order."""
    model = randomised(tiny_model(mode, "fused")).train()
    tokens = next(batches(1))
    plain = fused_gradients(model, tokens)
    model.activation_checkpointing_enable()
    checkpointed = fused_gradients(model, tokens)
    assert plain.keys() == checkpointed.keys()
    for name, grad in plain.items():
        if mode == "delta":
            assert rel_rms(checkpointed[name], grad) < 1e-5, name
        else:
            assert torch.equal(checkpointed[name], grad), name


@pytest.mark.parametrize("mode", ["full", "block", "delta"])
def test_reentrant_checkpointing_keeps_every_fused_gradient(mode):
    """Reentrant checkpointing recomputes each layer in a backward of its own, from detached
    inputs: a source's reads then reach it layer by layer, summed in another order."""
    model = randomised(tiny_model(mode, "fused")).train()
    tokens = next(batches(1))
    plain = fused_gradients(model, tokens)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
    checkpointed = fused_gradients(model, tokens)
    assert plain.keys() == checkpointed.keys() == {n for n, _ in model.named_parameters()}
    for name, grad in plain.items():
        assert rel_rms(checkpointed[name], grad) < 1e-5, name


@pytest.mark.parametrize("mode", ["full", "block", "delta"])
def test_reads_under_autocast_over_fp32_weights_run_fused(mode):
    """Mixed-precision training as `mhar train`, accelerate and Trainer run it: fp32 weights, bf16
    autocast. The sublayers' outputs come in bf16; a read's sources share one dtype (full and block
    mode's the autocast one, delta's the weights', as its stream), so every read runs on the
    kernels (a mix of dtypes would send it to the reference op, with a warning). Against the same
    model in fp64, the fused loss and every gradient are within twice the reference op's error
    under the same autocast: bf16 rounding sets both, and the fused backward adds some of its own
    where a read takes S from its output as stored in bf16 (docs/kernels.md; 1.6x at most here,
    in block mode, whose reads end begun states)."""
    tokens = next(batches(1))

    def step(implementation, dtype=torch.float32, autocast=True):
        model = randomised(tiny_model(mode, implementation)).to(dtype)
        with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
            loss = model(tokens, labels=tokens).loss
        loss.backward()
        return loss.detach().double(), {n: p.grad.double() for n, p in model.named_parameters()}

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the reference fallback warns
        loss, grads = step("fused")
    reference_loss, reference_grads = step("reference")
    exact_loss, exact_grads = step("reference", torch.float64, autocast=False)
    assert rel_rms(loss, exact_loss) < 1e-3
    for name, exact in exact_grads.items():
        reference_error = rel_rms(reference_grads[name], exact)
        assert reference_error < 0.1, name  # bf16's error, not a broken model
        assert rel_rms(grads[name], exact) < 2 * reference_error + 1e-4, name


def spy_groups(monkeypatch, record) -> None:
    """Calls `record(reads)` at every grouped forward launch (a gated read alone is a group of one)."""
    forward_group = group.forward_group

    def spy(sources, table, reads, *args, **kwargs):
        record(reads)
        return forward_group(sources, table, reads, *args, **kwargs)

    monkeypatch.setattr(group, "forward_group", spy)


def group_sizes(monkeypatch) -> list[int]:
    """Per grouped forward launch, the reads it computes."""
    sizes = []
    spy_groups(monkeypatch, lambda reads: sizes.append(len(reads)))
    return sizes


def assert_sharded_gradients_match(model, tokens, expected, sizes, sizes_seen, variant, store) -> None:
    """`model` sharded with FSDP2 in one process (checkpointed, or layer 1 unsharded early, as
    `variant` says) gives the gradients `expected` holds, its grouped launches (`sizes`, a spy's
    list) reading `sizes_seen`."""
    import torch.distributed as dist

    sizes.clear()
    if variant == "checkpointed":
        model.gradient_checkpointing_enable()
    shard(model, 1, 0, store)
    try:
        if variant == "layer-1-unsharded-early":
            model.model.layers[1].unshard()
        sharded = fused_gradients(model, tokens)
        assert sizes == sizes_seen
        for name, grad in expected.items():
            torch.testing.assert_close(sharded[name].full_tensor(), grad, rtol=1e-5, atol=1e-7, msg=name)
    finally:
        dist.destroy_process_group()


def shard(model, world: int, rank: int, store, **options) -> None:
    """`model` sharded with FSDP2 as the training config does it (each decoder layer a unit; `options`
    for fully_shard), in a gloo process group of `world` processes on CPU."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    for layer in model.model.layers:
        fully_shard(layer, **options)
    fully_shard(model, **options)


@pytest.mark.parametrize("variant, sizes_seen", [
    ("sharded", [4, 1]),
    # layer 0's MLP read; layer 1's two reads together; layer 2's two reads, of different blocks
    # checkpointed layers read for themselves, again as the backward recomputes them, last first
    ("checkpointed", [1, 2, 1, 1] + [1, 1, 2, 1]),
    ("layer-1-unsharded-early", [1, 2, 1, 1]),
])
def test_fsdp2_sharded_fused_model_matches_unsharded(tmp_path, monkeypatch, variant, sizes_seen):
    """Sharded, a layer holds only shards of the later layers' routers: a block's first layer
    gathers them and computes the block's reads together, as unsharded, with the same gradients
    (under activation checkpointing, the training recipe's setting, every layer reads for itself,
    with the same gradients too). A layer unsharded early
    (as by prefetching) frees its whole parameters after its forward, before the group's backward
    would need them: then its routers read in its own forward."""
    if DEVICE != "cpu":
        pytest.skip("the single-process FSDP2 check runs with gloo on CPU")
    model = randomised(tiny_model("delta", "fused")).train()
    twin = copy.deepcopy(model)
    tokens = next(batches(1))
    sizes = group_sizes(monkeypatch)
    expected = fused_gradients(twin, tokens)
    assert sizes == [4, 1]  # blocks of 2 layers: layer 0's MLP read to layer 2's attention read, then layer 2's MLP read
    assert_sharded_gradients_match(model, tokens, expected, sizes, sizes_seen, variant, tmp_path / "store")


def test_fsdp2_grouped_reads_take_the_compute_dtype(tmp_path, monkeypatch):
    """With FSDP2's mixed precision (bf16 compute over fp32 shards) the gathered routers come in
    bf16, as FSDP2 unshards the running layer's, so the block's reads still group."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if DEVICE != "cpu":
        pytest.skip("the single-process FSDP2 check runs with gloo on CPU")
    groups = []
    spy_groups(monkeypatch, lambda reads: groups.append((len(reads), {t.dtype for read in reads for t in read})))
    model = randomised(tiny_model("delta", "fused")).train()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    shard(model, 1, 0, tmp_path / "store", mp_policy=policy)
    try:
        grads = fused_gradients(model, next(batches(1)))
    finally:
        dist.destroy_process_group()
    assert groups == [(4, {torch.bfloat16}), (1, {torch.bfloat16})]
    assert all(torch.isfinite(grad.full_tensor()).all() for grad in grads.values())


def _sharded_rank(rank: int, world: int, folder: str) -> None:
    """One process of test_fsdp2_grouped_reads_average_gradients_over_ranks: its own batch, its
    gradients (gathered whole) saved for the test to compare."""
    model = randomised(tiny_model("delta", "fused")).train()
    shard(model, world, rank, os.path.join(folder, "store"))
    try:
        grads = fused_gradients(model, list(batches(world))[rank])
        torch.save({name: grad.full_tensor() for name, grad in grads.items()}, os.path.join(folder, f"rank{rank}.pt"))
    finally:
        torch.distributed.destroy_process_group()


def test_fsdp2_grouped_reads_average_gradients_over_ranks(tmp_path):
    """Two processes, each its own batch: the gradients of the routers a block's first layer
    gathered (and of every other parameter) are the mean of the two batches' gradients, as FSDP2
    averages its own."""
    if DEVICE != "cpu":
        pytest.skip("the two-process FSDP2 check runs with gloo on CPU")
    world = 2
    model = randomised(tiny_model("delta", "fused")).train()
    per_batch = [fused_gradients(model, tokens) for tokens in batches(world)]
    torch.multiprocessing.spawn(_sharded_rank, args=(world, str(tmp_path)), nprocs=world)
    for rank in range(world):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got.keys() == per_batch[0].keys()
        for name, grad in got.items():
            expected = sum(g[name] for g in per_batch) / world
            torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-7, msg=f"rank {rank}: {name}")


@pytest.mark.parametrize("mode", ["full", "block", "delta"])
def test_training_step_captured_in_a_cuda_graph_matches_eager_steps(mode):
    """A whole training step (forward, backward, optimizer) captured once and replayed: the
    address tables the kernels read must survive the capture (copies recorded, not run)."""
    if DEVICE != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    eager = randomised(tiny_model(mode, "fused")).train()
    graphed = copy.deepcopy(eager)
    tokens = next(batches(1))

    def training_step(model):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True, capturable=True)

        def step():
            loss = model(tokens, labels=tokens).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.detach()

        return step

    eager_step = training_step(eager)
    eager_losses = [eager_step().item() for _ in range(5)]

    step, losses = training_step(graphed), []
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        losses += [step().item() for _ in range(2)]  # warm-up steps, eager on a side stream
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured_loss = step()  # recorded, not run: not a step
    decoy = torch.zeros(1 << 20, device="cuda")
    for buffer in tables.staging_buffers():  # later uploads rewrite the staging buffer: a replay must not read it
        buffer.fill_(decoy.data_ptr())
    for _ in range(3):
        graph.replay()
        losses.append(captured_loss.item())

    torch.testing.assert_close(torch.tensor(losses), torch.tensor(eager_losses), rtol=1e-4, atol=1e-5)
    assert eager_losses[-1] < eager_losses[0]  # the steps trained: a replay that did nothing would fail
    for (name, p), q in zip(eager.named_parameters(), graphed.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5, msg=name)


def test_captured_table_copies_wait_for_no_kernel(tmp_path):
    """Under CUDA graph capture the address tables are copied on a side stream that joins the
    capture once: in the graph, no host-to-device copy after the first waits for a kernel (each
    one between two kernels left the GPU idle), and kernels still wait for the copies."""
    if DEVICE != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    model = randomised(tiny_model("full", "fused")).train()
    tokens = next(batches(1))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up, as before any capture
        model(tokens, labels=tokens).loss.backward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph(keep_graph=True)  # kept after instantiation: debug_dump prints it
    graph.enable_debug_mode()
    with torch.cuda.graph(graph):
        model(tokens, labels=tokens).loss.backward()
    graph.debug_dump(str(tmp_path / "graph.dot"))
    dot = (tmp_path / "graph.dot").read_text()

    nodes = re.findall(r'^\s*"?(\w+)"?\s*\[(.*?)\]\s*;?\s*$', dot, re.MULTILINE | re.DOTALL)
    kinds = {name: "TABLE" if "HtoD" in label else "KERNEL" if "KERNEL" in label else "OTHER"
             for name, label in nodes}  # the model's own copies are DtoD
    edges = re.findall(r'"?(\w+)"?\s*->\s*"?(\w+)"?', dot)
    copies = [n for n, kind in kinds.items() if kind == "TABLE"]
    assert len(copies) > 4, f"too few table copies found in the graph's dump; its format may have changed:\n{dot[:2000]}"
    waits_for_kernel = {b for a, b in edges if kinds.get(a) == "KERNEL" and kinds.get(b) == "TABLE"}
    assert len(waits_for_kernel) <= 1, f"{len(waits_for_kernel)} of {len(copies)} table copies wait for a kernel"
    read_by_kernel = {a for a, b in edges if kinds.get(a) == "TABLE" and kinds.get(b) == "KERNEL"}
    assert read_by_kernel, "no kernel waits for a table copy"
