"""Two-phase reads (issue 43): one grouped pass over the sources that a group of reads shares begins
them all (`reads.fused_begin_group`; block mode: a block's reads over its finished blocks, full
mode: a group of layers' reads over the sources made before it), and each read then folds its own
newer sources into that state (`fused_route(..., prefix=(mix, lse, begun))`). Against the specification
`route_reference` in fp64, on the forward and every gradient, with every kernel output poisoned
with NaN. On CPU the kernels run under the Triton interpreter (conftest), so shapes are tiny;
with MHAR_TEST_GPU=1 the same tests run compiled, plus bf16 and fp16.
"""

import pytest
import torch

import mhar_hf.ops.routing as fused_ops
from mhar_hf.ops.routing import fused_route, kernels, reads, track
from mhar_hf.routing import Read, route_reference, routing_keys
from mhar_hf.tiny import tiny_config
from test_routing_kernels import (DEVICE, DTYPES, EPS, GPU, TOLERANCE, LaunchSpy, configured,  # noqa: F401 (fixtures)
                                  poisoned_outputs)


@pytest.fixture
def spies(monkeypatch):
    """Launch records of the forward, site and source kernels."""
    counters = []
    for name in ("route_fwd_kernel", "route_site_bwd_kernel", "route_source_bwd_kernel"):
        counters.append(LaunchSpy(getattr(kernels, name)))
        monkeypatch.setattr(kernels, name, counters[-1])
    return counters


def rel_rms(actual, expected):
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def block_inputs(blocks, width, tokens, batch, newer, dtype):
    """Finished blocks of varied scale, per read its newer sources (`newer[r]` of them) and its
    own nonzero query and key-norm weight, and an output gradient per read."""
    g = torch.Generator().manual_seed(blocks * 1000 + width + tokens)

    def rows(scale=1.0):
        return (torch.randn(batch, tokens, width, generator=g) * scale).to(DEVICE, dtype)

    sources = [rows(0.5 + i) for i in range(blocks)]
    added = [[rows(1.5) for _ in range(n)] for n in newer]
    params = [((torch.randn(width, generator=g) * 4 / width**0.5).to(DEVICE, dtype),
               (1 + 0.3 * torch.randn(width, generator=g)).to(DEVICE, dtype)) for _ in newer]
    grad_outs = [rows() for _ in newer]
    return sources, added, params, grad_outs


def leaves(sources, added, params, dtype=None):
    """Fresh leaves that need a gradient (in `dtype` when given)."""
    def leaf(t):
        return (t.to(dtype) if dtype is not None else t).detach().clone().requires_grad_()

    return [leaf(s) for s in sources], [[leaf(s) for s in read] for read in added], \
        [tuple(leaf(t) for t in read) for read in params]


def two_phase(sources, added, params, heads, chain=True):
    """The reads as block mode makes them: the blocks marked in a chain and the newer sources
    after them (or, without `chain`, nothing marked: each read marks its own), one begin for all
    reads, then each read's end."""
    if chain:
        marked = []
        for s in sources:
            marked.append(track(s, after=marked[-1] if marked else None))
        sources, newest, later = marked, marked[-1], []
        for read in added:
            later.append([])
            for s in read:
                newest = track(s, after=newest)
                later[-1].append(newest)
        added = later
    states = reads.fused_begin_group(sources, [Read(q, g) for q, g in params], heads, EPS)
    return [fused_route((*sources, *more), q, g, heads, EPS, prefix=(*state, len(sources)))
            for state, more, (q, g) in zip(states, added, params, strict=True)]


def reference(sources, added, params, heads):
    return [route_reference((*sources, *more), q, g, heads, EPS) for more, (q, g) in zip(added, params, strict=True)]


def reads_and_grads(fn, sources, added, params, heads, grad_outs, dtype=None, **kwargs):
    sources, added, params = leaves(sources, added, params, dtype)
    outs = fn(sources, added, params, heads, **kwargs)
    loss = sum((o * g.to(o.dtype)).sum() for o, g in zip(outs, grad_outs, strict=True))
    wrt = [*sources, *(s for read in added for s in read), *(t for read in params for t in read)]
    grads = torch.autograd.grad(loss, wrt, allow_unused=True)  # unused: a read of one source needs no query
    return outs, [g if g is not None else torch.zeros_like(t) for g, t in zip(grads, wrt, strict=True)]


def names(blocks, added, count):
    return ([f"block {i}" for i in range(blocks)]
            + [f"read {r} newer source {i}" for r, read in enumerate(added) for i in range(len(read))]
            + [f"read {r} {leaf}" for r in range(count) for leaf in ("query", "key norm weight")])


def rounded_total_errors(sources, more, query, key_norm_weight, grad_out, heads, dtype, expected):
    """The errors (rel. RMS against `expected`, fp64) of a read's query and key-norm weight
    gradients computed in fp64 as the two-phase kernels compute them, with the one rounding their
    design adds (docs/kernels.md): the end's S = <dout, out> taken from its output stored in `dtype`.
    With few tokens this alone comes near 1 % in bf16; the fused gradients are held to it."""
    width = sources[0].shape[-1]
    query, key_norm_weight = query.double().requires_grad_(), key_norm_weight.double().requires_grad_()
    rows = [s.double() for s in (*sources, *more)]
    keys = routing_keys(rows, key_norm_weight, EPS)
    per_head = (*keys.shape[:-1], heads, width // heads)
    logits = (keys.view(per_head) * query.view(heads, -1)).sum(-1)  # [N, ..., H]
    x, dout, begun = torch.stack(rows).view(len(rows), *per_head[1:]), grad_out.double().view(per_head[1:]), len(sources)
    lam = logits[:begun].logsumexp(0)
    p, total_lse = (logits[:begun] - lam).exp(), torch.logaddexp(lam, logits[begun:].logsumexp(0))
    a, w = (lam - total_lse).exp(), (logits[begun:] - total_lse).exp()
    out = a[..., None] * (p[..., None] * x[:begun]).sum(0) + (w[..., None] * x[begun:]).sum(0)
    total = (dout * out.to(dtype).double()).sum(-1)  # S from the stored output
    added = w * ((dout * x[begun:]).sum(-1) - total)  # the newer sources' dlogits
    state = (dout * a[..., None] * x[:begun]).sum(-1)  # P'_j = <a dout, x_j>
    blocks = p * (state - (p * state).sum(0) - added.sum(0))  # p_j (P'_j - S'), S' = <G, m> - g
    grads = torch.autograd.grad((logits * torch.cat([blocks, added]).detach()).sum(), [query, key_norm_weight])
    return [rel_rms(grad.to(dtype), ref) for grad, ref in zip(grads, expected, strict=True)]


SHAPES = [  # (finished blocks, width, heads, tokens, batch, newer sources per read)
    pytest.param(3, 64, 4, 37, 1, (0, 1, 1, 1), id="tokens-not-a-block-multiple"),
    pytest.param(2, 320, 2, 9, 2, (0, 1, 2), id="head-width-160"),
    pytest.param(2, 64, 1, 21, 1, (1, 1, 1), id="H=1"),
    pytest.param(1, 36, 12, 13, 1, (1, 1, 1), id="one-finished-block-H=12"),  # the model's first block
    pytest.param(1, 64, 4, 5, 1, (0, 1), id="one-finished-block-read-alone"),
    pytest.param(4, 200, 2, 7, 3, (1,), id="one-read-head-width-100"),
    # full mode: a group of 3 layers after layer 0 (its first read takes the sources alone, the
    # others 1 to 5 newer ones), and layer 0's group of 2 over the embedding alone
    pytest.param(3, 64, 4, 19, 1, (0, 1, 2, 3, 4, 5), id="full-mode-group-of-3"),
    pytest.param(1, 320, 2, 9, 2, (1, 2, 3), id="full-mode-layer-0-group-head-width-160"),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("blocks, width, heads, tokens, batch, newer", SHAPES)
def test_two_phase_reads_and_every_gradient_match_fp64_reference(spies, blocks, width, heads, tokens, batch, newer,
                                                                  dtype):
    """Every read's output, and the gradients of the blocks, the newer sources and every read's
    query and key-norm weight, against the reads one at a time in fp64; one grouped launch each
    way for the blocks, and one launch each way per read that has newer sources."""
    sources, added, params, grad_outs = block_inputs(blocks, width, tokens, batch, newer, dtype)
    outs, grads = reads_and_grads(two_phase, sources, added, params, heads, grad_outs)
    expected, expected_grads = reads_and_grads(reference, sources, added, params, heads, grad_outs, torch.float64)
    for r, (out, ref) in enumerate(zip(outs, expected, strict=True)):
        assert out.dtype == dtype and torch.isfinite(out).all(), f"read {r}"
        assert rel_rms(out, ref) < TOLERANCE[dtype], f"read {r}"
    expected_by_name = dict(zip(names(blocks, added, len(newer)), expected_grads, strict=True))
    tolerance = dict.fromkeys(expected_by_name, TOLERANCE[dtype])
    for r, (more, (q, g), grad_out) in enumerate(zip(added, params, grad_outs, strict=True)):
        if more and dtype != torch.float32:  # an end's parameters: within 1.5x of what S's rounding gives
            wanted = [expected_by_name[f"read {r} {leaf}"] for leaf in ("query", "key norm weight")]
            for leaf, error in zip(("query", "key norm weight"),
                                   rounded_total_errors(sources, more, q, g, grad_out, heads, dtype, wanted), strict=True):
                tolerance[f"read {r} {leaf}"] = max(TOLERANCE[dtype], 1.5 * error)
    # a gradient that is exactly zero in exact arithmetic is held to fp32 summation noise at the scale
    # of the reads' parameter gradients (their sums over tokens run in fp32)
    scale = max(ref.abs().max().item() for name, ref in expected_by_name.items() if name.startswith("read ")
                and "newer" not in name)
    for name, grad, ref in zip(tolerance, grads, expected_grads, strict=True):
        assert grad.dtype == dtype and grad.shape == ref.shape, name
        assert torch.isfinite(grad).all(), f"{name}: unwritten (NaN) gradient elements"
        if ref.abs().max() == 0:  # a read of one source: its weight is 1 whatever its query
            assert grad.abs().max() <= TOLERANCE[torch.float32] * scale, name
        else:
            assert rel_rms(grad, ref) < tolerance[name], name
    forward, site, _ = spies
    ended = sum(1 for n in newer if n)
    assert (forward.count("GROUPED"), site.count("GROUPED")) == (1, 1)
    assert (forward.count("HAS_INIT"), forward.launches, site.launches) == (ended, 1 + ended, 1 + ended)
    assert site.count("HAS_LSE_GRAD") == 1  # the blocks' site pass takes the states' lse gradients


def test_sources_not_marked_in_a_chain():
    """Reads of sources the caller did not mark: each read marks its own, correct all the same."""
    sources, added, params, grad_outs = block_inputs(2, 64, 11, 1, (0, 1, 2), torch.float32)
    _, grads = reads_and_grads(two_phase, sources, added, params, 4, grad_outs, chain=False)
    _, expected = reads_and_grads(reference, sources, added, params, 4, grad_outs, torch.float64)
    for name, grad, ref in zip(names(2, added, 3), grads, expected, strict=True):
        assert rel_rms(grad, ref) < 1e-5, name


def test_reads_whose_outputs_get_no_gradient():
    """A read whose output the loss does not use gives its state no gradient (autograd passes
    None): the others' gradients are still exact."""
    sources, added, params, grad_outs = block_inputs(2, 64, 9, 1, (0, 1, 1), torch.float32)
    grad_outs[1] = torch.zeros_like(grad_outs[1])

    def first_and_last(fn):
        def picked(*args, **kwargs):
            outs = fn(*args, **kwargs)
            return [outs[0], outs[2]]
        return picked

    _, grads = reads_and_grads(first_and_last(two_phase), sources, added, params, 4, grad_outs[::2])
    _, expected = reads_and_grads(first_and_last(reference), sources, added, params, 4, grad_outs[::2], torch.float64)
    for name, grad, ref in zip(names(2, added, 3), grads, expected, strict=True):
        if ref.abs().max() == 0:
            assert grad.abs().max() == 0, name
        else:
            assert rel_rms(grad, ref) < 1e-5, name


def test_zero_finished_blocks_begin_nothing():
    """With no finished blocks there is nothing to begin over: the reads run whole."""
    assert reads.fused_begin_group([], [Read(torch.ones(8), torch.ones(8))], 2, EPS) is None


def test_dispatch_begins_the_reads_on_the_fused_path_only():
    """`routing.route_begin_group` begins the reads where the kernels run; elsewhere None (each read
    then runs whole), and `route(..., prefix=)` ends a begun read."""
    from mhar_hf.routing import route, route_begin_group

    sources, added, params, _ = block_inputs(2, 64, 5, 1, (1,), torch.float32)
    begun = [Read(*params[0])]
    assert route_begin_group(sources, begun, 4, EPS, "reference") is None
    assert route_begin_group([], begun, 4, EPS, "fused") is None
    (state,) = route_begin_group(sources, begun, 4, EPS, "fused")
    out = route((*sources, *added[0]), *params[0], 4, EPS, implementation="fused", prefix=(*state, 2))
    assert rel_rms(out, route_reference((*sources, *added[0]), *params[0], 4, EPS)) < 1e-5


def test_inference_matches_the_training_forward():
    sources, added, params, _ = block_inputs(3, 64, 13, 2, (0, 1, 1), torch.float32)
    with torch.no_grad():
        inference = two_phase(sources, added, params, 4, chain=False)
    training = two_phase(*leaves(sources, added, params), 4)
    for a, b in zip(inference, training, strict=True):
        assert torch.equal(a, b.detach())


@pytest.mark.parametrize("dtype", DTYPES[-1:] if GPU else [torch.float32], ids=str)
def test_repeated_backward_is_bitwise_identical(dtype):
    sources, added, params, grad_outs = block_inputs(3, 64, 45, 2, (0, 1, 1, 1), dtype)
    first = reads_and_grads(two_phase, sources, added, params, 4, grad_outs)[1]
    second = reads_and_grads(two_phase, sources, added, params, 4, grad_outs)[1]
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def test_a_state_ends_with_the_sources_it_began_with():
    sources, added, params, _ = block_inputs(2, 64, 5, 1, (1,), torch.float32)
    (state,) = reads.fused_begin_group(sources, [Read(*params[0])], 4, EPS)
    with pytest.raises(ValueError, match="begun read ends"):
        fused_route(sources[:1], *params[0], 4, EPS, prefix=(*state, 2))
    with pytest.raises(ValueError, match="begun read ends"):
        fused_route((*sources, *added[0]), *params[0], 2, EPS, prefix=(*state, 2))  # another H
    with pytest.raises(ValueError, match="ungated"):
        reads.fused_begin_group(sources, [Read(*params[0], torch.zeros(64), torch.ones(1))], 4, EPS)


# the whole model ---------------------------------------------------------------------------------

def block_model(implementation, layers=5, seed=0, mode="block"):
    """A tiny block-mode model (blocks of 3 layers: a block of 3 and one of 2), or one of another
    `mode`, with nonzero queries, so that every read weighs its sources unevenly."""
    from mhar_hf import MHARForCausalLM

    torch.manual_seed(seed)
    model = MHARForCausalLM(tiny_config(residual_mode=mode, routing_implementation=implementation,
                                        num_hidden_layers=layers)).to(DEVICE)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("query"):
                p.normal_(0, 0.5, generator=torch.Generator(DEVICE).manual_seed(len(name)))
    return model


def loss_and_grads(model, ids, checkpointing=None):
    if checkpointing is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(use_reentrant=checkpointing))
        model.train()
    loss = model(ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss, {name: p.grad for name, p in model.named_parameters()}


def assert_matches_fp64_reference(mode, checkpointing=None):
    """The loss and every parameter's gradient of a tiny `mode` model on the fused path against
    the same model in fp64 with the reference op."""
    model = block_model("fused", mode=mode)
    reference = block_model("reference", mode=mode)
    reference.load_state_dict(model.state_dict())
    reference.double()
    ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    loss, grads = loss_and_grads(model, ids, checkpointing)
    expected_loss, expected = loss_and_grads(reference, ids, checkpointing)
    assert abs(loss.item() - expected_loss.item()) < 1e-5
    for name, grad in grads.items():
        assert torch.isfinite(grad).all(), f"{name}: unwritten (NaN) gradient elements"
        assert rel_rms(grad, expected[name]) < 1e-4, name


def begun_sizes(monkeypatch) -> list[int]:
    """The reads each `fused_begin_group` call begins, in call order."""
    sizes = []
    begin = reads.fused_begin_group
    monkeypatch.setattr(fused_ops, "fused_begin_group", lambda sources, reads, *a: sizes.append(len(reads)) or
                        begin(sources, reads, *a))
    return sizes


@pytest.mark.parametrize("checkpointing", [None, True, False], ids=["plain", "checkpointed-reentrant",
                                                                     "checkpointed-non-reentrant"])
def test_block_model_matches_the_fp64_reference_model(monkeypatch, checkpointing):
    """The loss and every parameter's gradient of a block-mode model on the fused path (each
    block's reads begun together) against the same model in fp64 with the reference op, with
    and without activation checkpointing (where every read runs whole: a checkpoint would keep
    each state a layer hands on until the backward)."""
    begun = begun_sizes(monkeypatch)
    assert_matches_fp64_reference("block", checkpointing)
    # layer 0 begins its MLP read and layers 1-2's reads; layer 3 its own two and layer 4's
    assert begun == ([5, 4] if checkpointing is None else [])


def test_block_model_with_whole_reads_matches_the_fp64_reference_model(monkeypatch, configured, spies):
    """`LaunchConfig.block_two_phase=False`: no read begun, every read whole over its sources in
    one launch (none starts from a state), and the loss and every gradient still the fp64
    reference model's."""
    begun = begun_sizes(monkeypatch)
    configured(block_two_phase=False)
    assert_matches_fp64_reference("block")
    forward, _, _ = spies
    assert begun == [] and forward.count("HAS_INIT") == forward.count("GROUPED") == 0
    assert forward.launches == 10  # layer 0's MLP read, both reads of layers 1-4, the final read


def test_block_model_backward_is_bitwise_identical():
    ids = torch.randint(0, 384, (2, 9), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    first = loss_and_grads(block_model("fused"), ids)[1]
    second = loss_and_grads(block_model("fused"), ids)[1]
    assert all(torch.equal(grad, second[name]) for name, grad in first.items())


def test_block_model_inference_matches_the_reference_model():
    model, reference = block_model("fused"), block_model("reference")
    ids = torch.randint(0, 384, (1, 6), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=1e-5, atol=1e-5)


# the reads each group begins of the 3-layer model, per mode: blocks of 2 layers (layer 0's MLP read
# and layer 1's; layer 2's two reads), full mode in groups of 2 layers (the same first group; layer
# 2, a group of one, a split pair)
SHARDED_SIZES = {"block": [3, 2], "full": [3]}


@pytest.mark.parametrize("mode", ["block", "full"])
@pytest.mark.parametrize("variant", ["sharded", "checkpointed", "layer-1-unsharded-early"])
def test_fsdp2_sharded_model_matches_unsharded(tmp_path, monkeypatch, configured, mode, variant):
    """FSDP2 (as tests/test_fused_convergence.py shards delta mode): a group's first layer (a
    block's; in full mode, groups of 2 layers) gathers the later layers' routers and begins the
    group's reads together, with the same gradients as unsharded (under activation checkpointing
    no group begins, with the same gradients too); a layer unsharded early (as by prefetching)
    frees its whole parameters before the group's backward: then its group's reads run whole
    (full mode: as split pairs)."""
    import copy

    from test_fused_convergence import assert_sharded_gradients_match, batches, fused_gradients, randomised, tiny_model

    if DEVICE != "cpu":
        pytest.skip("the single-process FSDP2 check runs with gloo on CPU")
    sizes = []
    begin = reads.fused_begin_group
    monkeypatch.setattr(fused_ops, "fused_begin_group", lambda sources, reads, *a: sizes.append(len(reads)) or
                        begin(sources, reads, *a))
    configured(full_group_layers=2)
    model = randomised(tiny_model(mode, "fused")).train()
    twin = copy.deepcopy(model)
    tokens = next(batches(1))
    expected = fused_gradients(twin, tokens)
    assert sizes == SHARDED_SIZES[mode]
    # checkpointed layers read whole; layer 1 unsharded early leaves layer 0's group to read whole
    sizes_seen = {"sharded": sizes, "checkpointed": [], "layer-1-unsharded-early": sizes[1:]}[variant]
    assert_sharded_gradients_match(model, tokens, expected, sizes, list(sizes_seen), variant, tmp_path / "store")


# full mode's groups of layers -------------------------------------------------------------------

# (layers per group, the reads each group of a 5-layer model begins, the ends that fold in newer
# sources: every begun read but a group's first attention read, which takes the sources alone, the
# split pairs left: a group of one layer, the last of 5 in groups of 2)
FULL_GROUPS = [
    pytest.param(2, [3, 4], 6, 1, id="G=2-not-dividing-5-layers"),
    pytest.param(3, [5, 4], 8, 0, id="G=3"),
    pytest.param(7, [9], 9, 0, id="G=7-more-than-the-layers"),
]


@pytest.mark.parametrize("group, sizes, ends, pairs", FULL_GROUPS)
def test_full_model_groups_match_the_fp64_reference_model(monkeypatch, configured, spies, group, sizes, ends, pairs):
    """Full mode with groups of `group` layers (`LaunchConfig.full_group_layers`): the loss and every
    parameter's gradient against the same model in fp64 with the reference op; each group's reads
    begun in one grouped launch each way (its lse gradients in that site pass), every other read
    with newer sources ended by a launch that starts from its state, and a group of one layer left
    a split pair."""
    configured(full_group_layers=group)
    begun = begun_sizes(monkeypatch)
    assert_matches_fp64_reference("full")
    assert begun == sizes
    forward, site, _ = spies
    assert (forward.count("GROUPED"), site.count("GROUPED"), site.count("HAS_LSE_GRAD")) == \
        (len(sizes), len(sizes), len(sizes))
    assert (forward.count("HAS_INIT"), forward.count("HAS_SECOND")) == (ends + pairs, pairs)
    assert forward.launches == len(sizes) + ends + 2 * pairs + 1  # the final read runs whole
    assert site.count("HAS_SECOND") == pairs


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_checkpointed_full_model_groups_run_as_split_pairs(monkeypatch, configured, spies, reentrant):
    """Under activation checkpointing a group's first layer begins no reads (a checkpoint would
    keep every state it hands on until the backward): the model in groups of 2 layers launches
    exactly what the split pairs' path (groups of one) launches, and its loss and every gradient
    match the fp64 reference model."""
    forward, site, _ = spies
    ids = torch.randint(0, 384, (2, 7), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    loss_and_grads(block_model("fused", mode="full"), ids, reentrant)
    pairs = list(forward.flags), list(site.flags)
    forward.flags.clear(), site.flags.clear()
    configured(full_group_layers=2)
    begun = begun_sizes(monkeypatch)
    loss_and_grads(block_model("fused", mode="full"), ids, reentrant)
    assert begun == [] and (list(forward.flags), list(site.flags)) == pairs
    assert_matches_fp64_reference("full", reentrant)


def test_full_model_in_groups_of_one_layer_runs_the_split_pairs(configured, spies):
    """`full_group_layers=1` (the default) is the split pairs' path, bit for bit: no read begun in a
    group, and the same loss and gradients as the model run under the default config."""
    ids = torch.randint(0, 384, (2, 7), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    default_loss, default = loss_and_grads(block_model("fused", mode="full"), ids)
    forward, site, _ = spies
    launches = list(forward.flags), list(site.flags)
    forward.flags.clear(), site.flags.clear()
    configured(full_group_layers=1)
    loss, grads = loss_and_grads(block_model("fused", mode="full"), ids)
    assert (forward.count("GROUPED"), forward.count("HAS_SECOND"), forward.count("HAS_INIT")) == (0, 4, 4)
    assert (list(forward.flags), list(site.flags)) == launches
    assert torch.equal(loss, default_loss)
    assert all(torch.equal(grad, default[name]) for name, grad in grads.items())


def test_full_model_groups_backward_is_bitwise_identical(configured):
    configured(full_group_layers=2)
    ids = torch.randint(0, 384, (2, 9), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    first = loss_and_grads(block_model("fused", layers=3, mode="full"), ids)[1]
    second = loss_and_grads(block_model("fused", layers=3, mode="full"), ids)[1]
    assert all(torch.equal(grad, second[name]) for name, grad in first.items())


def test_full_model_groups_generate_with_a_kv_cache(monkeypatch, configured):
    """Generation with a cache, a token a step, begins each group's reads without autograd: the
    same tokens as the reference model's greedy decoding, whose logits it matches."""
    configured(full_group_layers=2)
    begun = begun_sizes(monkeypatch)
    model, reference = block_model("fused", mode="full").eval(), block_model("reference", mode="full").eval()
    ids = torch.randint(2, 384, (1, 5), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=1e-5, atol=1e-5)
        settings = dict(max_new_tokens=2, do_sample=False, min_new_tokens=2)
        assert torch.equal(model.generate(ids, **settings), reference.generate(ids, **settings))
    assert begun == [3, 4] * 3  # the logits' forward, the prompt, then the second new token
