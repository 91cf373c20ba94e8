"""The routing probe: its measures against plain fp64 implementations written here, and the whole
probe on tiny models whose routing is set by hand so that the answer is known exactly."""

import json
import math
import re

import pytest
import torch
from transformers import AutoModelForCausalLM

from mhar_cli import main
from mhar_hf.folder import ProbeRecord
from mhar_hf.probe import (
    RoutingProbe,
    find_routers,
    head_deviation,
    matched_norm_queries,
    probe_model,
    read_text,
    token_chunks,
    slice_logits,
    source_collinearity,
    width_disagreement,
    write_outputs,
)
from mhar_hf.routing import routing_keys, routing_weights
from mhar_hf.tiny import demo_corpus, tiny_config
from test_modeling import reference_forward

EPS = 1e-6


# ---------------------------------------------------------------------------------------------
# Plain implementations, token by token in fp64


def plain_width_disagreement(sources, query, norm_weight, heads, slices, eps=EPS, null=None):
    """Mean over slices of KL(a_s || alpha), a_s = softmax(S * slice logit), with explicit loops."""
    sources = ([null.expand_as(sources[0])] if null is not None else []) + list(sources)
    batch, tokens, width = sources[0].shape
    size = width // heads // slices
    out = torch.zeros(batch, tokens, heads, dtype=torch.float64)
    for b in range(batch):
        for t in range(tokens):
            keys = []
            for s in sources:
                v = s[b, t].double()
                keys.append(v / math.sqrt(float((v * v).mean()) + eps) * norm_weight.double())
            for h in range(heads):
                per_slice = []
                for k in range(slices):
                    cols = slice((h * slices + k) * size, (h * slices + k + 1) * size)
                    per_slice.append([float((query.double()[cols] * key[cols]).sum()) for key in keys])
                shared = torch.tensor([sum(col) for col in zip(*per_slice)], dtype=torch.float64).softmax(0)
                kls = []
                for logits in per_slice:
                    alone = (torch.tensor(logits, dtype=torch.float64) * slices).softmax(0)
                    kls.append(float(sum(p * math.log(p / q) for p, q in zip(alone, shared) if p > 0)))
                out[b, t, h] = sum(kls) / slices
    return out


def plain_collinearity(sources):
    batch, tokens, _ = sources[0].shape
    out = torch.zeros(batch, tokens, dtype=torch.float64)
    for b in range(batch):
        for t in range(tokens):
            cosines = []
            for i in range(len(sources)):
                for j in range(i + 1, len(sources)):
                    u, v = sources[i][b, t].double(), sources[j][b, t].double()
                    cosines.append(float(u @ v) / math.sqrt(float(u @ u) * float(v @ v)))
            out[b, t] = sum(cosines) / len(cosines)
    return out


def plain_head_deviation(weights):
    sources, heads = weights.shape
    consensus = [sum(float(weights[n, h]) for h in range(heads)) / heads for n in range(sources)]
    return [0.5 * sum(abs(float(weights[n, h]) - consensus[n]) for n in range(sources)) for h in range(heads)]


def as_tensor(values):
    return torch.tensor(values, dtype=torch.float64)


def random_site(n=5, width=32, dtype=torch.float64):
    sources = [torch.randn(2, 3, width, dtype=dtype) * (i + 1) for i in range(n)]
    return sources, torch.randn(width, dtype=dtype), 1 + 0.3 * torch.randn(width, dtype=dtype)


# ---------------------------------------------------------------------------------------------
# Measures on tensors


@pytest.mark.parametrize("heads,slices,with_null", [(1, 4, False), (2, 4, True), (4, 2, False)])
def test_width_disagreement_matches_a_plain_implementation(heads, slices, with_null):
    sources, query, norm_weight = random_site()
    null = torch.randn(32, dtype=torch.float64) if with_null else None
    got = width_disagreement(sources, query, norm_weight, heads, EPS, slices, null)
    want = plain_width_disagreement(sources, query, norm_weight, heads, slices, null=null)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert (want > 1e-3).all()  # random slices disagree: the comparison is not between zeros


def test_slice_logits_add_up_to_the_models_routing():
    sources, query, norm_weight = random_site(dtype=torch.float32)
    null = torch.randn(32)
    keys = routing_keys(sources, norm_weight, EPS, null)
    assert keys.shape == (6, 2, 3, 32)
    summed = slice_logits(keys, query, 4, 2).sum(-1).softmax(0)
    torch.testing.assert_close(summed, routing_weights(sources, query, norm_weight, 4, EPS, null))


def test_identical_slices_give_zero_disagreement():
    # Every head's query and sources repeat one 4-wide block S = 4 times: all slices see the same logits.
    block = [torch.randn(2, 3, 2, 4, dtype=torch.float64) for _ in range(5)]
    sources = [b.repeat(1, 1, 1, 4).flatten(-2) for b in block]  # width 2 heads x 4 slices x 4
    query = torch.randn(2, 1, 4, dtype=torch.float64).repeat(1, 4, 1).flatten()
    disagreement = width_disagreement(sources, query, torch.ones(32, dtype=torch.float64), 2, EPS, 4)
    torch.testing.assert_close(disagreement, torch.zeros(2, 3, 2, dtype=torch.float64), rtol=0, atol=1e-12)


def test_slices_must_divide_the_head_width():
    sources, query, norm_weight = random_site()
    with pytest.raises(ValueError, match="does not split into 3 equal slices"):
        width_disagreement(sources, query, norm_weight, 2, EPS, 3)


def test_matched_norm_queries_keep_each_heads_norm_and_are_reproducible():
    query = torch.randn(32) * torch.arange(32)
    draws = matched_norm_queries(query, 4, 3, torch.Generator().manual_seed(1))
    assert draws.shape == (3, 32)
    torch.testing.assert_close(draws.view(3, 4, 8).norm(dim=-1), query.view(4, 8).norm(dim=-1).expand(3, 4))
    assert not torch.allclose(draws[0], draws[1])
    assert torch.equal(draws, matched_norm_queries(query, 4, 3, torch.Generator().manual_seed(1)))


def test_head_deviation_matches_a_plain_implementation_and_known_cases():
    weights = torch.rand(6, 4, dtype=torch.float64)
    weights = weights / weights.sum(0)
    torch.testing.assert_close(head_deviation(weights), as_tensor(plain_head_deviation(weights)))
    # Head 0 reads source 0 only, head 1 reads source 1 only: each is half its mass from the consensus.
    torch.testing.assert_close(head_deviation(torch.eye(3, 2, dtype=torch.float64)), as_tensor([0.5, 0.5]))
    assert torch.equal(head_deviation(torch.full((3, 4), 1 / 3)), torch.zeros(4))


def test_source_collinearity_matches_a_plain_implementation():
    sources, _, _ = random_site(n=4)
    torch.testing.assert_close(source_collinearity(sources), plain_collinearity(sources))
    same = source_collinearity([sources[0], 2 * sources[0], 3 * sources[0]])
    torch.testing.assert_close(same, torch.ones_like(same))
    orthogonal = torch.eye(3, dtype=torch.float64).view(3, 1, 1, 3)
    assert torch.equal(source_collinearity(list(orthogonal)), torch.zeros(1, 1, dtype=torch.float64))


# ---------------------------------------------------------------------------------------------
# Tiny models with hand-set routing
#
# Marker coordinates: every embedding row holds `value` there, and every attention and MLP output
# is exactly 0 there (the matching rows of o_proj and down_proj are zero). Key-norm weights are
# zero elsewhere, so a query placed on the markers sees only the embedding: its logit is
# query * value * rms_factor(embedding) and every other source's logit is exactly 0.


def marked_model(mode, heads, markers, query_values, value=1.0):
    model = AutoModelForCausalLM.from_config(tiny_config(residual_mode=mode, residual_heads=heads)).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight[:, markers] = value
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[markers] = 0
            layer.mlp.down_proj.weight[markers] = 0
        for module in model.modules():
            if type(module).__name__ == "MHARRouter":
                module.key_norm_weight.zero_()[markers] = 1
                module.query.zero_()[markers] = torch.tensor(query_values)
                if module.gated:
                    module.gate.fill_(0.5)
    return model


def tokens(n=40):
    return torch.randint(2, 384, (n,), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("mode", ["full", "block", "delta"])
def test_a_query_on_the_embedding_puts_all_weight_there(mode):
    model = marked_model(mode, heads=4, markers=[0, 16, 32, 48], query_values=[1000.0] * 4)
    report = probe_model(model, tokens(), seq_len=16)
    embedding = 1 if mode == "delta" else 0  # delta's source 0 is the null source
    for site in report["sites"]:
        assert site["sources"][embedding] == "emb"
        weights = as_tensor(site["weights"])
        expected = torch.zeros_like(weights)
        expected[embedding] = 1
        torch.testing.assert_close(weights, expected, rtol=0, atol=1e-6)
        assert site["head_deviation"] == pytest.approx([0.0] * 4, abs=1e-6)  # all heads agree


def test_two_heads_reading_different_sources_deviate_by_half():
    # Head 0 is drawn to the embedding, head 1 pushed away from it (uniform over the others).
    model = marked_model("full", heads=2, markers=[0, 32], query_values=[1000.0, -1000.0])
    report = probe_model(model, tokens(), seq_len=16)
    for site in report["sites"]:
        weights = as_tensor(site["weights"])
        n = len(weights)
        torch.testing.assert_close(weights[:, 0], torch.eye(n, dtype=torch.float64)[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(weights[1:, 1], torch.full((n - 1,), 1 / (n - 1), dtype=torch.float64))
        assert site["head_deviation"] == pytest.approx([0.5, 0.5], abs=1e-6)
    assert report["summary"]["mean_head_deviation"] == pytest.approx(0.5, abs=1e-6)


def test_two_slices_reading_different_sources_give_the_known_disagreement():
    # One head, S = 2: slice 0 reads only the embedding, slice 1 everything but it. Their logits cancel,
    # so the shared distribution is uniform: KL = (log N + log(N / (N - 1))) / 2 at a site with N sources.
    model = marked_model("full", heads=1, markers=[0, 32], query_values=[1000.0, -1000.0])
    report = probe_model(model, tokens(), seq_len=16, slices=2)
    for site in report["sites"]:
        n = len(site["weights"])
        torch.testing.assert_close(as_tensor(site["weights"])[:, 0], torch.full((n,), 1 / n, dtype=torch.float64))
        assert site["width_disagreement"][0] == pytest.approx((math.log(n) + math.log(n / (n - 1))) / 2, rel=1e-5)
        assert site["head_deviation"] is None
    assert any("single-head" in note for note in report["summary"]["notes"])


def test_identical_slices_in_a_model_give_zero_disagreement_and_the_null_does_not():
    model = marked_model("full", heads=1, markers=[0, 16, 32, 48], query_values=[0.3] * 4)
    summary = probe_model(model, tokens(), seq_len=16, slices=4)["summary"]
    assert summary["width_disagreement"] == pytest.approx(0.0, abs=1e-6)
    assert summary["null_disagreement"] > 0.01
    assert summary["learned_excess"] == pytest.approx(-summary["null_disagreement"], abs=1e-6)


@pytest.mark.parametrize("count,seq_len,batch_size", [(40, 16, 8), (40, 64, 8), (64, 16, 3), (16, 16, 1)])
def test_token_chunks_cover_every_token_once_in_order(count, seq_len, batch_size):
    ids = torch.arange(count)
    chunks = list(token_chunks(ids, seq_len, batch_size))
    assert all(c.dim() == 2 and 0 < c.shape[0] <= batch_size and 0 < c.shape[1] <= seq_len for c in chunks)
    assert torch.equal(torch.cat([c.flatten() for c in chunks]), ids)


def randomly_routed(mode):
    model = AutoModelForCausalLM.from_config(tiny_config(residual_mode=mode)).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "_router." in name:
                parameter.normal_(0.5 if name.endswith("gate") else 0.0, 0.5)
    return model


@pytest.mark.parametrize("mode", ["full", "block", "delta"])
def test_the_probe_leaves_logits_unchanged_and_removes_its_hooks(mode):
    model = randomly_routed(mode)
    ids = tokens(24).view(2, 12)
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        with RoutingProbe(model) as probe:
            probed = model(input_ids=ids).logits
    assert torch.equal(plain, probed)
    assert all(not router._forward_pre_hooks for _, router in probe.routers)
    assert all(site["weights"] for site in probe.sites())


@pytest.mark.parametrize("mode", ["full", "block", "delta"])
def test_every_site_sees_the_sources_its_mode_gives_it(mode):
    config = tiny_config(residual_mode=mode)
    layers, per_block = config.num_hidden_layers, config.layers_per_block
    expected = {}
    for i in range(layers):
        blocks_before, blocks_through = -(-i // per_block), i // per_block + 1
        if mode == "full":
            attn, mlp = 2 * i + 1, 2 * i + 2
        elif mode == "block":
            attn, mlp = blocks_before + 1, blocks_through + 1
        else:  # delta: the null source and the block entries
            attn, mlp = 1 + blocks_before, 1 + blocks_through
        if i > 0:  # layer 0's attention has no router
            expected[f"layers.{i}.attn"] = attn
        expected[f"layers.{i}.mlp"] = mlp
    if mode != "delta":
        expected["final"] = 2 * layers + 1 if mode == "full" else -(-layers // per_block) + 1
    report = probe_model(randomly_routed(mode), tokens(), seq_len=16)
    assert {s["name"]: len(s["weights"]) for s in report["sites"]} == expected
    assert [s["name"] for s in report["sites"]] == list(expected)  # forward order


@pytest.mark.parametrize("mode", ["full", "block", "delta"])
def test_every_site_names_its_sources_as_the_definition_does(mode):
    """The labels come from the residual state: each site's equal the sources that the forward
    written from the definitions (test_modeling.reference_forward) reads there."""
    model = randomly_routed(mode)
    seen = {}
    with torch.no_grad():
        reference_forward(model, tokens(16).view(1, 16), seen)
    site = {router: name for name, router in find_routers(model)}
    report = probe_model(model, tokens(), seq_len=16)
    assert {s["name"]: s["sources"] for s in report["sites"]} == {site[r]: seen[r] for r in site}


def test_a_just_converted_delta_model_routes_uniformly_and_says_so():
    model = AutoModelForCausalLM.from_config(tiny_config(residual_mode="delta")).eval()  # zero queries, zero gates
    report = probe_model(model, tokens(), seq_len=16)
    for site in report["sites"]:
        n = len(site["weights"])
        torch.testing.assert_close(as_tensor(site["weights"]), torch.full((n, 4), 1 / n, dtype=torch.float64))
        assert site["gate"] == 0 and site["width_disagreement"] == [0.0] * 4 and site["null_disagreement"] == [0.0] * 4
    summary = report["summary"]
    assert summary["zero_queries"] and summary["zero_gates"]
    assert any("every query is zero" in note for note in summary["notes"])
    assert any("every gate is 0" in note for note in summary["notes"])


def test_a_model_without_routers_is_refused():
    model = AutoModelForCausalLM.from_config(tiny_config(residual_mode="standard"))
    with pytest.raises(ValueError, match="no MHAR routing sites"):
        RoutingProbe(model)


# ---------------------------------------------------------------------------------------------
# Files and the command line


@pytest.fixture
def saved_model(tmp_path, tokenizer):
    path = tmp_path / "model"
    randomly_routed("full").save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_mhar_probe_writes_the_json_and_pictures(saved_model, tmp_path, capsys):
    data = tmp_path / "text.txt"
    data.write_text(demo_corpus()[:4000])
    assert main(["probe", str(saved_model), "--data", str(data), "--tokens", "80", "--seq-len", "32"]) == 0
    out = saved_model / "probe"
    report = json.loads((out / "probe.json").read_text())
    assert report["data"]["tokens"] == 80 and len(report["sites"]) == 8
    record = ProbeRecord.read(out)  # the folder contract's reader takes what the probe writes
    assert record.sites == report["sites"] and record.date == report["date"]
    for picture in ("routing_heatmap.png", "head_deviation.png"):
        assert (out / picture).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in out.iterdir()) == ["head_deviation.png", "probe.json", "routing_heatmap.png"]
    printed = capsys.readouterr().out
    assert "layers.3.mlp" in printed and "width disagreement" in printed and "learned excess" in printed


def test_single_head_pictures_are_written(tmp_path):
    report = probe_model(marked_model("block", 1, [0], [1.0]), tokens(), seq_len=16)
    paths = write_outputs(report, tmp_path / "out")
    assert [p.name for p in paths] == ["probe.json", "routing_heatmap.png", "head_deviation.png"]


def test_jsonl_data_is_read_from_its_text_field(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"text": "first"}) + "\n\n" + json.dumps({"text": "second", "id": 2}) + "\n")
    assert read_text(data) == "first\n\nsecond"
    data.write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(ValueError, match="line 1 has no string field 'text'"):
        read_text(data)


def test_bad_input_gets_a_clear_error(saved_model, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text(demo_corpus()[:2000])
    short = tmp_path / "short.txt"
    short.write_text("Ada has")
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"model_type": "llama"}))
    standard = tmp_path / "standard"
    tiny_config(residual_mode="standard").save_pretrained(standard)
    untokenized = tmp_path / "untokenized"
    randomly_routed("block").save_pretrained(untokenized)
    cases = [
        ([str(saved_model), "--data", str(tmp_path / "missing.txt")], "data file .* not found"),
        ([str(tmp_path / "nowhere"), "--data", str(text)], "config.json not found"),
        ([str(llama), "--data", str(text)], "holds a 'llama' model"),
        ([str(standard), "--data", str(text)], "residual_mode='standard'"),
        ([str(untokenized), "--data", str(text)], "no tokenizer"),
        ([str(saved_model), "--data", str(short)], "holds only [0-9]+ tokens"),
        ([str(saved_model), "--data", str(text), "--tokens", "3"], "too few"),
    ]
    for args, message in cases:
        assert main(["probe", *args]) == 2
        error = capsys.readouterr().err
        assert re.search(message, error), (args, error)
    assert not (saved_model / "probe").exists()  # nothing half-written


def test_the_head_deviation_legend_stands_clear_of_the_data():
    from mhar_hf.probe import head_deviation_figure

    report = probe_model(randomly_routed("full"), tokens(), seq_len=16)
    figure = head_deviation_figure(report)
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    renderer = FigureCanvasAgg(figure).get_renderer()
    figure.draw(renderer)
    (legend,) = figure.legends
    plot = figure.axes[0].get_window_extent(renderer)
    assert not legend.get_window_extent(renderer).overlaps(plot)
    assert len(legend.get_texts()) == len(report["summary"]["head_deviation"])
