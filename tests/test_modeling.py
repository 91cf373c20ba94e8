"""The model against independent references: LlamaForCausalLM and a per-mode forward written
here straight from each mode's definition."""

import re
import warnings

import pytest
import torch
from conftest import shrunk_real_config
from test_routing import per_head_route
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM  # noqa: F401
from transformers.masking_utils import create_causal_mask

import mhar_hf
from mhar_hf import MHARConfig, MHARForCausalLM, MHARRouter
from mhar_hf.modeling_mhar import RESIDUAL_STATES
from mhar_hf.ops.routing import launch
from mhar_hf.routing import route_reference
from mhar_hf.tiny import tiny_config

MODES = ["standard", "full", "block", "delta"]
RESIDUAL_FIELDS = ("residual_mode", "residual_heads", "residual_num_blocks", "residual_block_layers",
                   "routing_implementation", "qkv_bias", "qk_norm")


def llama_twin(model: MHARForCausalLM) -> LlamaForCausalLM:
    """A LlamaForCausalLM with the same backbone config and weights."""
    fields = {k: v for k, v in model.config.to_dict().items() if k not in RESIDUAL_FIELDS + ("model_type",)}
    llama = AutoModelForCausalLM.from_config(
        LlamaConfig(**fields), dtype=model.dtype, attn_implementation=model.config._attn_implementation
    )
    backbone = {k: v for k, v in model.state_dict().items() if "_router." not in k}
    llama.load_state_dict(backbone, strict=True)
    return llama.eval()


def randomise_routing(model, scale=1.0):
    """Non-default values for every routing parameter (gates open)."""
    with torch.no_grad():
        for router in model.modules():
            if isinstance(router, MHARRouter):
                router.query.normal_(0, scale)
                router.key_norm_weight.uniform_(0.5, 1.5)
                if router.gated:
                    router.null_source.normal_(0, 1)
                    router.gate.uniform_(0.5, 1.0)
    return model


def build(mode="full", dtype=torch.float32, attn="eager", **overrides):
    config = tiny_config(residual_mode=mode, **overrides)
    return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn).eval()


def ids(batch=2, tokens=11, vocab=384):
    return torch.randint(2, vocab, (batch, tokens))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("mode", ["standard", "delta"])
def test_standard_and_zero_gate_delta_equal_llama_bit_for_bit(mode, attn, dtype):
    model = build(mode, dtype, attn)
    if mode == "delta":  # open queries and null sources: with zero gates they must not matter
        randomise_routing(model)
        with torch.no_grad():
            for router in model.modules():
                if isinstance(router, MHARRouter):
                    router.gate.zero_()
    tokens = ids()
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, llama_twin(model)(tokens).logits)


@pytest.mark.parametrize("name", ["Llama-3.1-8B", "Llama-3.2-1B"])
@pytest.mark.parametrize("mode", ["standard", "delta"])
def test_real_llama_configs_equal_llama_bit_for_bit(name, mode):
    fields = shrunk_real_config(name)
    fields.pop("model_type")
    config = MHARConfig(**fields, residual_mode=mode, residual_heads=4, residual_num_blocks=2)
    model = MHARForCausalLM(config).eval()
    tokens = ids(vocab=config.vocab_size)
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, llama_twin(model)(tokens).logits)
    assert model.config.tie_word_embeddings == fields["tie_word_embeddings"]


def reference_forward(model, tokens, seen=None):
    """Each mode's forward written from its definition, routing in fp64 by `per_head_route`:
    the logits, and the hidden states (what each layer's attention starts
    from: the stream, or the attention read; then the final norm's output).
    `seen`, a dict, gets each router's names of the sources it reads, in order."""
    config, inner = model.config, model.model
    heads, mode = config.residual_heads, config.residual_mode
    embeddings = inner.embed_tokens(tokens)
    positions = torch.arange(tokens.shape[1]).unsqueeze(0)
    mask = create_causal_mask(config=config, inputs_embeds=embeddings, attention_mask=None, cache=None,
                              position_ids=positions)
    rope = inner.rotary_emb(embeddings, positions)

    def read(sources, router, names, null=False):
        if seen is not None:
            seen[router] = ["null", *names] if null else list(names)
        if null:
            sources = [router.null_source.expand_as(sources[0]), *sources]
        if len(sources) == 1:
            return sources[0]
        return per_head_route(sources, router.query, router.key_norm_weight, heads, config.rms_norm_eps).float()

    def attn(layer, h):
        return layer.self_attn(layer.input_layernorm(h), position_embeddings=rope, attention_mask=mask)[0]

    def mlp(layer, h):
        return layer.mlp(layer.post_attention_layernorm(h))

    hidden = []
    per_block = config.layers_per_block
    if mode == "full":
        sources, names = [embeddings], ["emb"]
        for i, layer in enumerate(inner.layers):
            hidden.append(read(sources, layer.attn_router, names))
            sources.append(attn(layer, hidden[-1]))
            names.append(f"attn{i}")
            sources.append(mlp(layer, read(sources, layer.mlp_router, names)))
            names.append(f"mlp{i}")
        final = read(sources, inner.final_router, names)
    elif mode == "block":  # block n: the sum of the n-th span of layers (block 0: the embedding)
        blocks, partial = [], embeddings
        names, partial_name = [], "emb"
        for i, layer in enumerate(inner.layers):
            h = partial if not blocks else read(blocks + [partial], layer.attn_router, names + [partial_name])
            hidden.append(h)
            if i % per_block == 0:
                blocks.append(partial)
                names.append(partial_name)
                partial, partial_name = None, f"block{i // per_block + 1}"
            a = attn(layer, h)
            partial = a if partial is None else partial + a
            partial = partial + mlp(layer, read(blocks + [partial], layer.mlp_router, names + [partial_name]))
        final = read(blocks + [partial], inner.final_router, names + [partial_name])
    else:  # delta: entry n > 0 is the stream's change over the n-th span of layers
        stream, blocks, boundary, names = embeddings, [], None, []
        for i, layer in enumerate(inner.layers):
            # Layer 0 reads no block yet; the model gives its attention no router (see modeling_mhar.py).
            hidden.append(stream)
            h = stream
            if blocks:
                h = stream + layer.attn_router.gate * read(blocks, layer.attn_router, names, null=True)
            if i % per_block == 0:
                blocks.append(stream if boundary is None else stream - boundary)
                names.append("emb" if boundary is None else f"block{i // per_block}")
                boundary = stream
            stream = stream + attn(layer, h)
            h = stream + layer.mlp_router.gate * read(blocks, layer.mlp_router, names, null=True)
            stream = stream + mlp(layer, h)
        final = stream
    hidden.append(inner.norm(final))
    return model.lm_head(hidden[-1]), hidden


@pytest.mark.parametrize("mode", ["full", "block", "delta"])
@pytest.mark.parametrize("layers, blocks", [(4, 2), (5, 3)])
def test_modes_match_a_forward_written_from_the_design(mode, layers, blocks):
    model = randomise_routing(build(mode, num_hidden_layers=layers, residual_num_blocks=blocks))
    tokens = ids()
    with torch.no_grad():
        out = model(tokens, output_hidden_states=True)
        expected, expected_hidden = reference_forward(model, tokens)
    got = out.logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert len(out.hidden_states) == layers + 1
    for i, (state, reference) in enumerate(zip(out.hidden_states, expected_hidden, strict=True)):
        torch.testing.assert_close(state, reference, rtol=1e-5, atol=1e-5, msg=f"hidden state {i}")
    with torch.no_grad():  # and routing matters: the same backbone in standard mode differs
        plain = llama_twin(model)(tokens).logits
    assert (got - plain).abs().max() > 1e-3


def source_counts(model, tokens):
    """The number of sources each router receives, by module name (a router read ahead with
    another's, delta mode, receives that router's)."""
    counts, handles = {}, []
    names = {module: name for name, module in model.named_modules() if isinstance(module, MHARRouter)}
    for module in names:
        def hook(module, args, kwargs):
            for router in (module, *kwargs.get("ahead", ())):
                counts[names[router]] = len(args[0])
        handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    with torch.no_grad():
        model(tokens)
    for handle in handles:
        handle.remove()
    return counts


def test_full_mode_source_counts():
    layers = 5
    counts = source_counts(build("full", num_hidden_layers=layers), ids())
    for l in range(layers):
        if l > 0:  # layer 0's attention reads the embedding alone, so it has no router
            assert counts[f"model.layers.{l}.attn_router"] == 2 * l + 1
        assert counts[f"model.layers.{l}.mlp_router"] == 2 * l + 2
    assert counts["model.final_router"] == 2 * layers + 1
    assert "model.layers.0.attn_router" not in counts


@pytest.mark.parametrize("mode", ["full", "block", "delta"])
def test_under_autocast_full_and_block_sources_take_the_autocast_dtype(mode):
    """fp32 weights under bf16 autocast: full mode's sources (sublayer outputs) and block mode's
    (block sums of them) are bf16, the embedding joining them in bf16 (half the bytes a read
    moves); delta mode's sources stay fp32 beside its stream, which is fp32 as Llama's is."""
    model = build(mode, num_hidden_layers=4)
    dtypes, handles = set(), []
    for module in model.modules():
        if isinstance(module, MHARRouter):
            handles.append(module.register_forward_pre_hook(lambda m, args: dtypes.update(s.dtype for s in args[0])))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(ids())
    for handle in handles:
        handle.remove()
    assert dtypes == {torch.float32 if mode == "delta" else torch.bfloat16}


def test_block_mode_snapshots_at_every_third_layer():
    model = build("block", num_hidden_layers=13, residual_block_layers=3)
    starts = [i for i, layer in enumerate(model.model.layers) if layer.starts_block]
    assert starts == [0, 3, 6, 9, 12]
    counts = source_counts(model, ids())
    snapshots = lambda upto: sum(1 for s in starts if s <= upto)  # noqa: E731
    for i in range(13):
        if i > 0:  # before the snapshot of layer i: finished blocks + the running partial
            assert counts[f"model.layers.{i}.attn_router"] == snapshots(i - 1) + 1
        assert counts[f"model.layers.{i}.mlp_router"] == snapshots(i) + 1
    assert counts["model.final_router"] == 5 + 1


def test_delta_mode_block_entries():
    model = build("delta", num_hidden_layers=5, residual_num_blocks=2)  # ceil(5/2) = 3 layers a block
    counts = source_counts(model, ids())
    assert [counts[f"model.layers.{i}.mlp_router"] for i in range(5)] == [1, 1, 1, 2, 2]
    assert [counts.get(f"model.layers.{i}.attn_router") for i in range(5)] == [None, 1, 1, 1, 2]
    assert not hasattr(model.model, "final_router")


@pytest.mark.parametrize("mode", ["full", "block", "delta"])
@pytest.mark.parametrize("layers, blocks", [(4, 2), (5, 3)])
def test_state_labels_name_what_each_site_reads(mode, layers, blocks):
    """Every site reads the first N sources of its mode's one order; the residual state's labels
    for N name them as the forward written from the definitions does."""
    model = build(mode, num_hidden_layers=layers, residual_num_blocks=blocks)
    counts = source_counts(model, ids())  # by the model
    seen = {}
    with torch.no_grad():
        reference_forward(model, ids(), seen)
    names = {module: name for name, module in model.named_modules()}
    expected = {names[router]: labels for router, labels in seen.items() if router is not None}
    null = int(mode == "delta")
    assert {name: RESIDUAL_STATES[mode].source_labels(n + null) for name, n in counts.items()} == expected
    with pytest.raises(ValueError, match="no routing sites"):
        RESIDUAL_STATES["standard"].source_labels(1)


def random_routers(config, gated, count):
    routers = [MHARRouter(config, gated) for _ in range(count)]
    with torch.no_grad():
        for p in (p for router in routers for p in router.parameters()):
            p.copy_(torch.randn_like(p))
    return routers


@pytest.mark.parametrize("implementation", ["reference", "fused"])
def test_each_router_read_equals_the_reference_op(implementation):
    config = tiny_config(residual_mode="delta", routing_implementation=implementation)
    heads, eps, width = config.residual_heads, config.rms_norm_eps, config.hidden_size
    if implementation == "reference":  # route_reference itself: bit for bit
        check = lambda got, want: torch.equal(got, want)  # noqa: E731
    else:
        check = lambda got, want: torch.allclose(got, want, rtol=1e-5, atol=1e-6)  # noqa: E731
    sources = [torch.randn(2, 5, width) for _ in range(3)]
    more = [*sources, torch.randn(2, 5, width)]
    stream = torch.randn(2, 5, width)
    first, second = random_routers(config, False, 2)
    gated = random_routers(config, True, 3)

    def reference(router, sources, **gated_args):
        return route_reference(sources, router.query, router.key_norm_weight, heads, eps, **gated_args)

    def reference_gated(router, sources, residual=None):
        return reference(router, sources, null_source=router.null_source, gate=router.gate, residual=residual)

    assert check(first.read(sources), reference(first, sources))
    assert check(gated[0].read(sources), reference_gated(gated[0], sources))
    assert check(gated[0].read(sources, residual=stream), reference_gated(gated[0], sources, residual=stream))
    read, prefix = first.read_and_start(sources, begin=second)
    assert (prefix is None) == (implementation == "reference")  # the fused path begins the next read
    assert check(read, reference(first, sources))
    assert check(second.read(more, prefix=prefix), reference(second, more))
    reads = gated[0].read_group(sources, gated[1:])
    assert len(reads) == 3
    assert all(check(got, reference_gated(router, sources)) for got, router in zip(reads, gated, strict=True))


def test_router_reads_check_their_sites_and_reach_module_hooks():
    """Every read goes through `__call__`: forward pre-hooks (the probe's, the benchmarks') see its sources
    first and the other sites it reads for in its keywords."""
    config = tiny_config(residual_mode="delta")
    (gated, gated_ahead), (ungated, ungated_next) = random_routers(config, True, 2), random_routers(config, False, 2)
    sources = (torch.randn(1, 3, config.hidden_size),) * 2
    with pytest.raises(ValueError, match="gated routers of the same heads"):
        gated.read_group(sources, [gated_ahead, ungated])
    with pytest.raises(ValueError, match="ungated routers of the same heads"):
        gated.read_and_start(sources, begin=ungated)
    with pytest.raises(ValueError, match="use='ahead'"):
        gated(sources, use="ahead")
    calls = []
    for router in (gated, ungated, ungated_next):
        router.register_forward_pre_hook(
            lambda module, args, kwargs: calls.append((module, args[0], kwargs.get("begin"), kwargs.get("ahead"))),
            with_kwargs=True)
    ungated.read(sources)
    ungated.read_and_start(sources, begin=ungated_next)
    reads = gated.read_group(sources, [gated_ahead])
    assert calls == [(ungated, sources, None, None), (ungated, sources, ungated_next, None),
                     (gated, sources, None, (gated_ahead,))]
    assert torch.equal(reads[1], gated_ahead.read(sources))
    assert torch.equal(ungated(sources), ungated.read(sources))  # calling a router is its plain read


def test_delta_gradients():
    model = build("delta").train()
    tokens = ids()
    model(tokens, labels=tokens).loss.backward()
    for name, param in model.named_parameters():
        if "_router." in name:  # at init only the gates learn; the rest waits for a gate to open
            assert (param.grad.abs().sum() > 0) == name.endswith(".gate"), name
    model.zero_grad()
    randomise_routing(model)
    model(tokens, labels=tokens).loss.backward()
    routing = [(n, p) for n, p in model.named_parameters() if "_router." in n]
    assert len(routing) == 4 * (2 * 4 - 1)
    for name, param in routing:
        assert param.grad is not None and param.grad.abs().sum() > 0, name


def test_init_values_and_zero_query_uniform_routing():
    model = build("delta")
    routers = [m for m in model.modules() if isinstance(m, MHARRouter)]
    assert routers
    for router in routers:
        assert torch.equal(router.query, torch.zeros_like(router.query))
        assert torch.equal(router.key_norm_weight, torch.ones_like(router.key_norm_weight))
        assert torch.equal(router.null_source, torch.zeros_like(router.null_source))
        assert router.gate.shape == (1,) and router.gate.item() == 0.0
    assert model.model.layers[1].self_attn.q_proj.weight.std() > 0.01  # the backbone is initialised


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_activation_checkpointing_gives_the_same_gradients(mode, reentrant):
    """Reentrant checkpointing (Trainer's and DeepSpeed's common setting) follows gradients only
    through a layer's positional tensor arguments: every parameter must still get its gradient."""
    model = randomise_routing(build(mode)).train()
    tokens = ids()

    def gradients():
        model.zero_grad(set_to_none=True)
        model(tokens, labels=tokens).loss.backward()
        return {n: p.grad for n, p in model.named_parameters()}

    plain = gradients()
    assert all(grad is not None for grad in plain.values())
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # torch warns when no checkpointed input needs a gradient
        checkpointed = gradients()
    assert model.model.layers[0].gradient_checkpointing
    for name, grad in plain.items():
        assert checkpointed[name] is not None, f"{name}: no gradient under checkpointing"
        torch.testing.assert_close(checkpointed[name], grad, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("mode", ["full", "block", "delta"])
def test_checkpointed_layers_receive_no_reads_made_ahead(mode):
    """Under activation checkpointing a layer keeps the tensors it receives until the backward.
    Reads made ahead for later layers (delta mode's grouped reads of a block span, block and full
    mode's two-phase states) would all stay alive through the forward, a stream-sized tensor per
    site: so checkpointed layers receive only the residual state, each layer's new stream or
    running sum plus the mode's history, which the last layer returns whole."""
    torch.manual_seed(0)
    config = tiny_config(residual_mode=mode, num_hidden_layers=8, residual_num_blocks=2, routing_implementation="fused")
    model = MHARForCausalLM(config).train()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    received, returned = set(), set()
    for layer in model.model.layers:
        layer.register_forward_pre_hook(lambda module, args: received.update(t.untyped_storage().data_ptr() for t in args))
    model.model.layers[-1].register_forward_hook(
        lambda module, args, out: returned.update(t.untyped_storage().data_ptr() for t in out[1:]))
    batch = torch.randint(2, 384, (1, 16))
    with launch.launch_config(block_two_phase=True, full_group_layers=4):  # every mode makes reads ahead
        model(batch, labels=batch).loss.backward()
    assert len(received) <= config.num_hidden_layers + len(returned), (len(received), len(returned))


def test_standard_hidden_states_equal_llama():
    model = build("standard")
    tokens = ids()
    with torch.no_grad():
        ours = model(tokens, output_hidden_states=True).hidden_states
        llama = llama_twin(model)(tokens, output_hidden_states=True).hidden_states
    assert len(ours) == len(llama) == model.config.num_hidden_layers + 1
    for mine, theirs in zip(ours, llama, strict=True):
        assert torch.equal(mine, theirs)


@pytest.mark.parametrize("mode", MODES)
def test_hidden_states_by_index_and_from_the_config(mode):
    model = randomise_routing(build(mode))
    tokens = ids()
    with torch.no_grad():
        every = model(tokens, output_hidden_states=True).hidden_states
        chosen = model(tokens, output_hidden_states=[0, -1]).hidden_states
        assert model(tokens).hidden_states is None
        model.config.output_hidden_states = True
        from_config = model(tokens).hidden_states
    assert [h is None for h in chosen] == [False] + [True] * (len(every) - 2) + [False]
    assert torch.equal(chosen[0], every[0]) and torch.equal(chosen[-1], every[-1])
    assert all(torch.equal(a, b) for a, b in zip(from_config, every, strict=True))
    assert torch.equal(every[0], model.model.embed_tokens(tokens))


@pytest.mark.parametrize("mode", MODES)
def test_the_legacy_cache_keyword_is_the_cache(mode):
    """`past_key_values=` (the name before transformers 5.24) must reach the cache, with a
    deprecation warning, not vanish into **kwargs and give logits computed without it."""
    model = randomise_routing(build(mode))
    tokens = ids(tokens=10)
    with torch.no_grad():
        full = model(tokens).logits
        first = model(tokens[:, :6], use_cache=True)
        with pytest.warns(FutureWarning, match="past_key_values"):
            rest = model(tokens[:, 6:], past_key_values=first.cache, use_cache=True).logits
    torch.testing.assert_close(rest, full[:, 6:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_eager_and_sdpa_agree(mode):
    torch.manual_seed(1)
    eager = randomise_routing(build(mode, attn="eager"))
    sdpa = build(mode, attn="sdpa")
    sdpa.load_state_dict(eager.state_dict())
    tokens = ids()
    mask = torch.ones_like(tokens)
    mask[0, :3] = 0  # left padding exercises the masked paths of both kernels
    with torch.no_grad():
        a, b = eager(tokens, attention_mask=mask).logits, sdpa(tokens, attention_mask=mask).logits
    torch.testing.assert_close(a[:, 3:], b[:, 3:], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", MODES)
def test_save_load_round_trip_keeps_routing_values(mode, tmp_path):
    model = randomise_routing(build(mode))
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()  # sharded
    assert not list(tmp_path.glob("*.bin"))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert isinstance(loaded, MHARForCausalLM) and loaded.config.residual_mode == mode
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    tokens = ids()
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, loaded(tokens).logits)


def test_auto_classes_are_registered():
    config = tiny_config()
    from transformers import AutoConfig, AutoModel

    fields = {k: v for k, v in config.to_dict().items() if k != "model_type"}
    assert isinstance(AutoConfig.for_model("mhar", **fields), MHARConfig)
    assert isinstance(AutoModel.from_config(config), mhar_hf.MHARModel)


def test_lora_targets_llama_names():
    from peft import LoraConfig, get_peft_model

    model = randomise_routing(build("full")).train()
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "gate_proj"]))
    tokens = ids()
    peft_model(input_ids=tokens, labels=tokens).loss.backward()
    lora = [n for n, p in peft_model.named_parameters() if "lora_" in n and p.grad is not None]
    assert len(lora) == 2 * 3 * model.config.num_hidden_layers


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_every_tensor_parallel_plan_key_names_parameters(mode, qk_norm):
    model = build(mode, qk_norm=qk_norm)
    names = [name for name, _ in model.named_parameters()]
    for key in model.tp_plan:
        pattern = re.compile(re.escape(key).replace(r"\*", r"\d+") + r"\.")
        assert any(pattern.match(name) for name in names), f"tp plan key {key} names no parameter"
    assert ("model.layers.*.self_attn.q_norm" in model.tp_plan) == qk_norm


@pytest.mark.parametrize("head", ["SequenceClassification", "QuestionAnswering", "TokenClassification"])
def test_task_heads_in_standard_mode_equal_llamas(head):
    import transformers

    config = tiny_config(residual_mode="standard", num_labels=3, pad_token_id=1)
    ours = getattr(transformers, f"AutoModelFor{head}").from_config(config).eval()
    assert type(ours).__name__ == f"MHARFor{head}"
    fields = {k: v for k, v in config.to_dict().items() if k not in RESIDUAL_FIELDS + ("model_type",)}
    llama = getattr(transformers, f"LlamaFor{head}")(LlamaConfig(**fields)).eval()
    llama.load_state_dict(ours.state_dict(), strict=True)
    tokens = ids()
    with torch.no_grad():
        mine, theirs = ours(tokens), llama(tokens)
    for key in theirs.keys():
        if torch.is_tensor(theirs[key]):
            assert torch.equal(mine[key], theirs[key]), key


@pytest.mark.parametrize("mode", ["full", "block", "delta"])
def test_task_heads_train_in_every_mode(mode):
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_config(
        tiny_config(residual_mode=mode, num_labels=3, pad_token_id=1))
    randomise_routing(model)
    out = model(ids(), labels=torch.tensor([0, 2]))
    out.loss.backward()
    assert torch.isfinite(out.loss) and model.model.layers[1].attn_router.query.grad.abs().sum() > 0
